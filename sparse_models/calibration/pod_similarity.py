"""POD stage 1: inter-layer attention similarity and greedy layer grouping (arXiv 2412.02252, §2.1).

The base model runs on N calibration samples. For the last ``q`` queries of each sample, every
layer's attention rows (softmax over the causal prefix) are compared between layers with the
Jensen-Shannon divergence, per query head; similarity = 1 - JSD with log base 2, so it lies in
[0, 1] (METHODS.md A.2: the paper does not state the base; base 2 is the reading that makes the
similarity a [0, 1] score, as the paper says it is). Because keys are what POD shares, blocks are
per **KV head**: the similarity of a KV head is the mean over its G query heads (METHODS.md A.2,
"AMBIGUITY (GQA)"), over the q queries and over the N samples.

Grouping (Algorithm 1, reconstructed): per KV head, walk up the layers; layer l joins the current
block when sim(anchor, l) >= delta, where anchor is the block's lowest layer (``compare_with=
"anchor"``, the recommended reading: the anchor's keys are the ones l will use) or the previous
layer l-1 (``compare_with="previous"``); otherwise l starts a new block and becomes its anchor.

Outputs: ``anchor_layers[layer][kv_head]`` (the format of ``PodConfig.anchor_layers``), a blocks
JSON (``write_blocks_json``; ``PodConfig.blocks_file`` / a recipe's ``pod.blocks_file`` reuse it)
and a heatmap PNG of the per-KV-head similarity matrices (``plot_similarity_heatmap``).

Shapes: ``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``G = Hq // Hkv``, ``Q`` last queries,
``S`` sequence length, ``L`` layers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterable

import torch

from .outputs import save_figure, write_json

BLOCKS_FORMAT = "podkit.pod_blocks/1"


def attention_rows(q_last: torch.Tensor, k: torch.Tensor, seq_lens: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Softmax attention rows of the last queries: ``probs[B,Hq,Q,S]`` fp32.

    q_last: ``[B,Hq,Q,D]``, the queries at positions ``seq_lens[b]-Q .. seq_lens[b]-1`` (post-RoPE).
    k: ``[B,Hkv,S,D]`` post-RoPE keys at slots = positions. seq_lens: ``[B]`` (default: all S).
    Query i sees keys ``j <= seq_lens[b]-Q+i``; other entries are exactly 0.
    """
    batch, num_heads, num_queries, head_dim = q_last.shape
    kb, num_kv_heads, seq, kd = k.shape
    if kb != batch or kd != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q_last {tuple(q_last.shape)} and k {tuple(k.shape)}: expected [B,Hq,Q,D] and [B,Hkv,S,D] "
                         f"with Hq a multiple of Hkv")
    if seq_lens is None:
        seq_lens = torch.full((batch,), seq, dtype=torch.long, device=k.device)
    seq_lens = seq_lens.to(device=k.device, dtype=torch.long)
    if bool((seq_lens < num_queries).any()) or bool((seq_lens > seq).any()):
        raise ValueError(f"seq_lens={seq_lens.tolist()}: every length must lie in [Q={num_queries}, S={seq}]")
    scale = head_dim ** -0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    qf = q_last.float().reshape(batch, num_kv_heads, group * num_queries, head_dim)
    logits = (qf @ k.float().transpose(-1, -2)).view(batch, num_heads, num_queries, seq) * scale
    positions = seq_lens[:, None] - num_queries + torch.arange(num_queries, device=k.device)[None, :]  # [B,Q]
    keys = torch.arange(seq, device=k.device)
    visible = keys[None, None, :] <= positions[:, :, None]                                            # [B,Q,S]
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def _entropy_bits(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits over the last dim, with 0 log 0 = 0 (``xlogy``: one pass, no clamp)."""
    return torch.special.xlogy(p, p).sum(-1).mul_(-1.0 / math.log(2.0))


def js_similarity(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """1 - JSD_2(p, r) over the last dim (distributions), in [0, 1]; broadcasting like ``p + r``."""
    m = 0.5 * (p + r)
    jsd = _entropy_bits(m) - 0.5 * (_entropy_bits(p) + _entropy_bits(r))
    return (1.0 - jsd).clamp(0.0, 1.0)


class LayerSimilarityAccumulator:
    """Running mean of the per-KV-head layer-by-layer similarity over calibration samples.

    ``add(rows)`` takes one forward's attention rows, ``rows[layer] = probs[B,Hq,Q,S]``, and adds the
    B samples. ``similarity()`` returns ``sim[Hkv, L, L]`` (symmetric, ones on the diagonal).
    """

    def __init__(self, num_layers: int, num_kv_heads: int):
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.total = torch.zeros(num_kv_heads, num_layers, num_layers, dtype=torch.float64)
        self.samples = 0

    # elements of one batched mixture tensor m [K, B, Hq, Q, S]: bounds the memory of add()
    CHUNK_ELEMENTS = 64 * 2 ** 20

    def add(self, rows: list[torch.Tensor]) -> None:
        if len(rows) != self.num_layers:
            raise ValueError(f"rows has {len(rows)} layers: expected {self.num_layers}")
        batch, num_heads = rows[0].shape[:2]
        if num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of num_kv_heads={self.num_kv_heads}")
        group = num_heads // self.num_kv_heads
        entropies = torch.stack([_entropy_bits(r) for r in rows])    # [L,B,Hq,Q]
        per_layer = rows[0].numel()
        chunk = max(1, self.CHUNK_ELEMENTS // per_layer)
        for a in range(self.num_layers - 1):
            # all layers b > a at once (chunked): the pairwise loop in Python was 5x slower on CPU
            for first in range(a + 1, self.num_layers, chunk):
                last = min(self.num_layers, first + chunk)
                others = torch.stack(rows[first:last])               # [K,B,Hq,Q,S]
                m = others.add_(rows[a]).mul_(0.5)
                jsd = _entropy_bits(m) - 0.5 * (entropies[a] + entropies[first:last])
                sim = (1.0 - jsd).clamp(0.0, 1.0)                    # [K,B,Hq,Q]
                per_kv = sim.view(last - first, batch, self.num_kv_heads, group, -1).mean(dim=(3, 4)).sum(1)
                per_kv = per_kv.double().cpu().T                     # [Hkv, K], summed over B
                self.total[:, a, first:last] += per_kv
                self.total[:, first:last, a] += per_kv
        diagonal = torch.arange(self.num_layers)
        self.total[:, diagonal, diagonal] += batch
        self.samples += batch

    def similarity(self) -> torch.Tensor:
        if self.samples == 0:
            raise ValueError("no calibration sample was added")
        return (self.total / self.samples).float()


def greedy_blocks(similarity: torch.Tensor, delta: float, compare_with: str = "anchor") -> list[list[int]]:
    """Greedy bottom-up grouping per KV head: ``anchor_layers[layer][kv_head]``.

    similarity: ``[Hkv, L, L]``. delta in [0, 1]. compare_with: "anchor" or "previous".
    """
    if not 0.0 <= delta <= 1.0:
        raise ValueError(f"delta={delta}: expected a number in [0, 1]")
    if compare_with not in ("anchor", "previous"):
        raise ValueError(f"compare_with={compare_with!r}: expected 'anchor' or 'previous'")
    if similarity.dim() != 3 or similarity.shape[1] != similarity.shape[2]:
        raise ValueError(f"similarity shape {tuple(similarity.shape)}: expected [Hkv, L, L]")
    num_kv_heads, num_layers = similarity.shape[0], similarity.shape[1]
    anchors = [[0] * num_kv_heads for _ in range(num_layers)]
    for head in range(num_kv_heads):
        anchor = 0
        for layer in range(1, num_layers):
            reference = anchor if compare_with == "anchor" else layer - 1
            if float(similarity[head, reference, layer]) < delta:
                anchor = layer
            anchors[layer][head] = anchor
    return anchors


def blocks_per_head(anchor_layers: list[list[int]]) -> list[list[list[int]]]:
    """Per KV head, the blocks as ``[first_layer, last_layer]`` pairs (inclusive)."""
    num_layers, num_kv_heads = len(anchor_layers), len(anchor_layers[0])
    out = []
    for head in range(num_kv_heads):
        blocks: list[list[int]] = []
        for layer in range(num_layers):
            if anchor_layers[layer][head] == layer:
                blocks.append([layer, layer])
            else:
                blocks[-1][1] = layer
        out.append(blocks)
    return out


def split_block(anchor_layers: list[list[int]], layer: int, head: int) -> list[list[int]]:
    """``anchor_layers`` with KV head ``head``'s block split at ``layer``: ``layer`` becomes an anchor (it keeps
    its own distant keys) and the later layers of its old block take ``layer`` as their anchor, so blocks stay
    runs of consecutive layers, as POD requires (Ma et al. 2024, §3.2)."""
    if anchor_layers[layer][head] == layer:
        raise ValueError(f"unit (layer {layer}, KV head {head}) is already an anchor: nothing to split")
    old = anchor_layers[layer][head]
    out = [list(row) for row in anchor_layers]
    for later in range(layer, len(out)):
        if out[later][head] != old:
            break
        out[later][head] = layer
    return out


def shared_units(anchor_layers: list[list[int]]) -> list[tuple[int, int]]:
    """(layer, KV head) pairs that read their block anchor's keys for distant tokens."""
    return [(layer, head) for layer, row in enumerate(anchor_layers) for head, a in enumerate(row) if a != layer]


def protect_units(anchor_layers: list[list[int]], units) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Make each (layer, KV head) of ``units`` an anchor (``split_block``), in order: a unit that must keep its
    own distant keys, e.g. one that pass-key retrieval depends on (``eval/retrieval_units.py`` ranks them).

    Returns ``(new anchor map, units that were already anchors)``; the latter are left as they are.
    Raises ``ValueError`` naming the unit when it is outside the map."""
    num_layers, num_kv_heads = len(anchor_layers), len(anchor_layers[0])
    out, skipped = [list(row) for row in anchor_layers], []
    for layer, head in units:
        if not (0 <= layer < num_layers and 0 <= head < num_kv_heads):
            raise ValueError(f"unit (layer {layer}, KV head {head}) is outside the block map: expected layer in "
                             f"[0, {num_layers - 1}] and KV head in [0, {num_kv_heads - 1}]")
        if out[layer][head] == layer:
            skipped.append((layer, head))
        else:
            out = split_block(out, layer, head)
    return out, skipped


def kv_saving_fraction(anchor_layers: list[list[int]], seq_len: int, sink: int, recent: int) -> float:
    """Fraction of dense KV bytes that POD's cache does not store at length ``seq_len``.

    Each (layer, KV head) stores values for all tokens; anchors store every key, other units only
    the keys of ``min(seq_len, sink + recent)`` proximal slots (METHODS.md A.4; ceiling 50%).
    """
    units = [a == layer for layer, row in enumerate(anchor_layers) for a in row]
    proximal = min(seq_len, sink + recent)
    dense = 2 * seq_len * len(units)
    pod = sum(2 * seq_len if is_anchor else seq_len + proximal for is_anchor in units)
    return 1.0 - pod / dense


def max_kv_saving(num_layers: int, seq_len: int, sink: int, recent: int) -> float:
    """The most ``kv_saving_fraction`` can reach: every unit but layer 0's (always an anchor) shared."""
    proximal = min(seq_len, sink + recent)
    return (num_layers - 1) / num_layers * (seq_len - proximal) / (2 * seq_len)


def delta_for_kv_saving(similarity: torch.Tensor, target: float, *, seq_len: int, sink: int, recent: int,
                        start_delta: float, compare_with: str = "anchor", protect=()) -> tuple[float, list[list[int]]]:
    """The largest similarity threshold ``delta <= start_delta`` whose greedy map (``greedy_blocks``, then
    ``protect`` made anchors with ``protect_units``) saves at least ``target`` of the dense KV bytes at
    ``seq_len`` (``kv_saving_fraction``).

    POD's paper fixes delta (Ma et al. 2024, §3.2); a user usually fixes the memory budget instead. Lowering
    delta shares the next most similar (layer, KV head) pairs first, so the map that meets the budget keeps the
    most dissimilar layers apart. Candidates are ``start_delta`` and every similarity value below it (a pair
    with similarity exactly ``delta`` is shared), tried from the top.

    similarity: ``[Hkv, L, L]``. Returns ``(delta, anchor map)``; raises ``ValueError`` with the best saving
    reachable when no threshold meets ``target`` (e.g. too many protected units).
    """
    values = sorted({v for v in similarity.flatten().tolist() if v < start_delta}, reverse=True)
    best = (-1.0, None)
    for delta in [start_delta, *values]:
        anchors, _ = protect_units(greedy_blocks(similarity, max(0.0, min(1.0, delta)), compare_with), protect)
        saving = kv_saving_fraction(anchors, seq_len, sink, recent)
        if saving >= target:
            return delta, anchors
        best = max(best, (saving, delta), key=lambda item: item[0])
    raise ValueError(f"no similarity threshold <= {start_delta} saves {target:.1%} of the KV cache at {seq_len} tokens "
                     f"with {len(list(protect))} protected unit(s): the most is {best[0]:.1%} (delta {best[1]})")


def explore(samples: Iterable[torch.Tensor], capture: Callable[[torch.Tensor], dict], *, num_layers: int,
            num_kv_heads: int, last_queries: int, delta: float, compare_with: str = "anchor") -> dict:
    """Run the exploration: similarity over samples, then greedy blocks.

    samples: batches of token ids ``[B, S]`` (S >= last_queries). capture(ids) returns
    ``{layer: (q[B,Hq,S,D], k[B,Hkv,S,D])}`` post-RoPE (``sparse_models.capture_attention_inputs``).
    Returns ``{"similarity": [Hkv,L,L] tensor, "anchor_layers": [[...]], "samples": n}``.
    """
    acc = LayerSimilarityAccumulator(num_layers, num_kv_heads)
    for ids in samples:
        if ids.shape[1] < last_queries:
            raise ValueError(f"calibration sample of {ids.shape[1]} tokens is shorter than last_queries={last_queries}")
        captured = capture(ids)
        rows = []
        for layer in range(num_layers):
            q, k = captured[layer]
            rows.append(attention_rows(q[:, :, -last_queries:], k))
        del captured
        acc.add(rows)
    similarity = acc.similarity()
    return {"similarity": similarity, "anchor_layers": greedy_blocks(similarity, delta, compare_with),
            "samples": acc.samples}


def write_blocks_json(path: str | Path, anchor_layers: list[list[int]], similarity: torch.Tensor | None = None,
                      **metadata) -> Path:
    """Write the blocks JSON: anchor map, blocks per KV head, similarity matrices and ``metadata``
    (delta, compare_with, calibration settings, model name ...)."""
    path = Path(path)
    payload = {
        "format": BLOCKS_FORMAT,
        "num_layers": len(anchor_layers),
        "num_kv_heads": len(anchor_layers[0]),
        "anchor_layers": anchor_layers,
        "blocks": blocks_per_head(anchor_layers),
        "anchor_fraction": sum(a == l for l, row in enumerate(anchor_layers) for a in row)
        / (len(anchor_layers) * len(anchor_layers[0])),
        **metadata,
    }
    if similarity is not None:
        payload["similarity"] = [[[round(float(x), 6) for x in row] for row in head] for head in similarity]
    return write_json(path, payload)


def read_blocks_json(path: str | Path) -> dict:
    """Read a blocks JSON; checks its anchor map (consecutive blocks anchored at their lowest layer)."""
    from sparse_models.schemes.pod import validate_anchor_layers

    data = json.loads(Path(path).read_text())
    if "anchor_layers" not in data:
        raise ValueError(f"{path}: not a POD blocks file (no 'anchor_layers' key)")
    validate_anchor_layers(data["anchor_layers"])
    return data


def plot_similarity_heatmap(similarity: torch.Tensor, anchor_layers: list[list[int]], path: str | Path,
                            title: str = "POD inter-layer attention similarity (1 - JSD)") -> Path:
    """One heatmap per KV head of ``similarity[Hkv, L, L]``, block boundaries outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    num_kv_heads = similarity.shape[0]
    cols = min(num_kv_heads, 4)
    rows = math.ceil(num_kv_heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.3 * rows), squeeze=False)
    blocks = blocks_per_head(anchor_layers)
    for head in range(rows * cols):
        ax = axes[head // cols][head % cols]
        if head >= num_kv_heads:
            ax.axis("off")
            continue
        image = ax.imshow(similarity[head].numpy(), vmin=0.0, vmax=1.0, cmap="viridis", origin="lower")
        for first, last in blocks[head]:
            ax.add_patch(Rectangle((first - 0.5, first - 0.5), last - first + 1, last - first + 1,
                                   fill=False, edgecolor="red", linewidth=1.2))
        ax.set_title(f"KV head {head}: {len(blocks[head])} blocks", fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
