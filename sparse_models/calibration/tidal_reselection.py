"""TidalDecode re-selection layer analysis (arXiv 2410.05076, §3.2 and the re-selection ablation).

TidalDecode selects the top-k positions at a selection layer (full attention) and reuses them in
the following layers; a re-selection layer c selects again for the layers above it. How good a
reuse is, is measured here as in the paper's ablation: the **recall** of the true top-k positions
of layer m by the set selected at layer l,

    recall[l, m] = |S_l ∩ T_m| / |T_m|,   S_l = T_l = top-(k-1) past positions of layer l's logits,

per query head (each head reuses its own list, the paper's choice), averaged over heads, queries
and calibration samples. The current token is always in the set and is left out of both sides.
``mass[l, m]`` is the share of layer m's attention probability that falls on S_l (what the sparse
layer actually keeps). Decode queries are stood in for by the last ``Q`` queries of each
calibration sample (each sees its causal prefix).

Choosing c: with full layers ``full_layers`` (0, 1) and the first selection at layer s0 (2), every
sparse layer m reads S_{s0} if m < c and S_c if m > c; ``score(c)`` is the mean recall over the
sparse layers, and the re-selection layer is the argmax. ``score(None)`` is the no-re-selection
baseline (every sparse layer reads S_{s0}). The JSON's ``selection_layers`` ([s0, c]) is what
``TidalConfig.selection_layers`` takes.

Command line (in eval/, which loads the model and the calibration text):

    python -m eval.calibrate tidal --model default --budget 128 --length 4096 --samples 2 \\
        --out-dir outputs/calibration

Shapes: ``B`` batch, ``Hq``/``Hkv`` query/KV heads, ``Q`` last queries, ``S`` keys, ``L`` layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import torch

from .outputs import save_figure, write_json

RESELECTION_FORMAT = "podkit.tidal_reselection/1"


def last_query_logits(q_last: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal logits ``[B,Hq,Q,S]`` fp32 of the last Q queries (query i at position S-Q+i); -inf for
    keys at or after the query position (the current token is excluded: it is always selected)."""
    batch, num_heads, num_queries, head_dim = q_last.shape
    if k.dim() != 4 or k.shape[0] != batch or k.shape[3] != head_dim or num_heads % k.shape[1]:
        raise ValueError(f"q_last {tuple(q_last.shape)} and k {tuple(k.shape)}: expected [B,Hq,Q,D] and [B,Hkv,S,D]")
    seq = k.shape[2]
    if num_queries >= seq:
        raise ValueError(f"Q={num_queries} last queries need more than Q keys, got S={seq}")
    group = num_heads // k.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    qf = q_last.float().reshape(batch, k.shape[1], group * num_queries, head_dim)
    logits = (qf @ k.float().transpose(-1, -2)).view(batch, num_heads, num_queries, seq) * scale
    positions = seq - num_queries + torch.arange(num_queries, device=k.device)
    past = torch.arange(seq, device=k.device)[None, :] < positions[:, None]  # [Q,S]
    return logits.masked_fill(~past, float("-inf"))


def topk_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Bool ``[B,Hq,Q,S]``: the top-k finite entries of each row (all finite entries if fewer)."""
    finite = torch.isfinite(logits)
    k = min(k, logits.shape[-1])
    index = logits.topk(k, dim=-1).indices
    mask = torch.zeros_like(finite).scatter_(-1, index, True)
    return mask & finite


class RecallAccumulator:
    """Running sums of recall[l, m] and mass[l, m] over calibration forwards."""

    def __init__(self, num_layers: int, budget: int) -> None:
        if budget < 2:
            raise ValueError(f"budget={budget} is invalid: expected >= 2 (the current token plus at least one)")
        self.num_layers, self.budget = num_layers, budget
        self.recall_sum = torch.zeros(num_layers, num_layers, dtype=torch.float64)
        self.mass_sum = torch.zeros(num_layers, num_layers, dtype=torch.float64)
        self.rows = 0
        self.samples = 0

    def add(self, logits: list[torch.Tensor]) -> None:
        """``logits[l]``: ``[B,Hq,Q,S]`` from :func:`last_query_logits` for layer l (same queries)."""
        if len(logits) != self.num_layers:
            raise ValueError(f"got logits for {len(logits)} layers, expected {self.num_layers}")
        masks = [topk_mask(x, self.budget - 1) for x in logits]
        probs = [torch.softmax(x, dim=-1) for x in logits]
        rows = masks[0][..., 0].numel()
        for m in range(self.num_layers):
            true_count = masks[m].sum(-1).clamp_min(1).double()  # [B,Hq,Q]
            for l in range(self.num_layers):
                overlap = (masks[l] & masks[m]).sum(-1).double()
                # .item(): the sums live on the CPU whatever device the captured logits are on
                self.recall_sum[l, m] += (overlap / true_count).sum().item()
                self.mass_sum[l, m] += (probs[m] * masks[l]).sum(-1).double().sum().item()
        self.rows += rows
        self.samples += logits[0].shape[0]

    def recall(self) -> torch.Tensor:
        return self.recall_sum / self.rows

    def mass(self) -> torch.Tensor:
        return self.mass_sum / self.rows


def reselection_scores(recall: torch.Tensor, full_layers: list[int], first_selection: int) -> dict:
    """``{c: mean recall over sparse layers with re-selection at c}`` plus ``None``: no re-selection."""
    num_layers = recall.shape[0]
    if not 0 <= first_selection < num_layers - 1:
        raise ValueError(f"first_selection={first_selection} is invalid for {num_layers} layers")

    def score(reselect: int | None) -> float:
        values = []
        for m in range(first_selection + 1, num_layers):
            if m in full_layers or m == reselect:
                continue
            source = reselect if reselect is not None and m > reselect else first_selection
            values.append(float(recall[source, m]))
        return sum(values) / len(values) if values else float("nan")

    scores: dict = {None: score(None)}
    for c in range(first_selection + 1, num_layers):
        if c not in full_layers:
            scores[c] = score(c)
    return scores


def analyse(samples: Iterable[torch.Tensor], capture: Callable[[torch.Tensor], dict], *, num_layers: int,
            budget: int, last_queries: int = 32, full_layers: list[int] | None = None,
            first_selection: int = 2) -> dict:
    """Recall/mass matrices over ``samples`` and the best re-selection layer.

    capture(ids) returns ``{layer: (q[B,Hq,S,D], k[B,Hkv,S,D])}`` post-RoPE
    (``sparse_models.capture_attention_inputs``).
    """
    full_layers = [0, 1] if full_layers is None else list(full_layers)
    acc = RecallAccumulator(num_layers, budget)
    for ids in samples:
        captured = capture(ids)
        acc.add([last_query_logits(captured[l][0][:, :, -last_queries:], captured[l][1]) for l in range(num_layers)])
        del captured
    recall = acc.recall()
    scores = reselection_scores(recall, full_layers, first_selection)
    best = max((c for c in scores if c is not None), key=lambda c: scores[c])
    return {"recall": recall, "mass": acc.mass(), "scores": scores, "reselection_layer": best,
            "selection_layers": [first_selection, best], "full_layers": full_layers,
            "first_selection": first_selection, "budget": budget, "last_queries": last_queries,
            "samples": acc.samples}


def write_reselection_json(path: str | Path, result: dict, **metadata) -> Path:
    def matrix(x: torch.Tensor) -> list[list[float]]:
        return [[round(float(v), 5) for v in row] for row in x]

    payload = {
        "format": RESELECTION_FORMAT,
        "num_layers": result["recall"].shape[0],
        "budget": result["budget"],
        "full_layers": result["full_layers"],
        "first_selection_layer": result["first_selection"],
        "reselection_layer": result["reselection_layer"],
        "selection_layers": result["selection_layers"],
        "score_without_reselection": round(result["scores"][None], 5),
        "scores": {str(c): round(v, 5) for c, v in result["scores"].items() if c is not None},
        "last_queries": result["last_queries"],
        "samples": result["samples"],
        "recall": matrix(result["recall"]),
        "mass": matrix(result["mass"]),
        **metadata,
    }
    return write_json(path, payload)


def read_selection_layers(path: str | Path) -> list[int]:
    """The ``selection_layers`` ([first, re-selection]) of a JSON written by :func:`write_reselection_json`."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != RESELECTION_FORMAT:
        raise ValueError(f"{path}: not a TidalDecode re-selection file (format {data.get('format')!r}, "
                         f"expected {RESELECTION_FORMAT})")
    return [int(x) for x in data["selection_layers"]]


def result_from_json(path: str | Path) -> dict:
    """The :func:`analyse` result (tensors included) back from a re-selection JSON, e.g. to redraw its PNG."""
    data = json.loads(Path(path).read_text())
    scores: dict = {int(c): v for c, v in data["scores"].items()}
    scores[None] = data["score_without_reselection"]
    return {"recall": torch.tensor(data["recall"], dtype=torch.float64),
            "mass": torch.tensor(data["mass"], dtype=torch.float64), "scores": scores,
            "reselection_layer": data["reselection_layer"], "selection_layers": data["selection_layers"],
            "full_layers": data["full_layers"], "first_selection": data["first_selection_layer"],
            "budget": data["budget"], "last_queries": data["last_queries"], "samples": data["samples"]}


def plot_reselection(result: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recall = result["recall"].numpy()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [1.1, 1]})
    image = left.imshow(recall, vmin=0.0, vmax=1.0, cmap="viridis", origin="lower")
    left.set_xlabel("reusing layer m")
    left.set_ylabel("selecting layer l")
    left.set_title(f"recall of layer m's top-{result['budget'] - 1} by layer l's", fontsize=9)
    fig.colorbar(image, ax=left, shrink=0.85)
    candidates = [c for c in result["scores"] if c is not None]
    right.plot(candidates, [result["scores"][c] for c in candidates], marker="o", markersize=3)
    right.axhline(result["scores"][None], color="tab:gray", linestyle="--", linewidth=1, label="no re-selection")
    right.axvline(result["reselection_layer"], color="tab:red", linestyle=":", linewidth=1,
                  label=f"best: layer {result['reselection_layer']}")
    right.set_xlabel("re-selection layer c")
    right.set_ylabel("mean recall over sparse layers")
    right.legend(fontsize=8)
    fig.suptitle(f"TidalDecode re-selection analysis (budget {result['budget']}, first selection at layer "
                 f"{result['first_selection']})", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit("this command moved to eval/ (sparse_models imports nothing above it): "
                     "python -m eval.calibrate tidal --help")
