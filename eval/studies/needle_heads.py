"""Per-head needle analysis: does TidalDecode's selection keep the pass key for the heads that read it?

The fidelity sweep finds TidalDecode @128 losing the pass key on SmolLM2-135M while exact per-head top-128
attention keeps most of dense's accuracy (BENCHMARKS.md, "Fidelity on SmolLM2-135M"). This command tests the
explanation head by head.

For each passkey prompt, one dense teacher-forced forward over ``context + question + answer[:-1]``
gives the post-RoPE queries and keys of every layer. The *answer queries* are the positions that
predict the answer tokens (the question's last token and each answer token but the last). For every
layer m, query head h and answer query:

* **needle mass**: dense attention probability on the pass-key tokens (both mentions of the key in
  the needle sentence);
* **kept by TidalDecode**: the part of that mass on the positions head h selected at m's selection
  layer (top-(k-1) of the selection layer's logits for the same query; the layer plan of a
  ``decode_scheme="tidal"`` model says which layer that is). Full and selection layers attend to
  every key and keep all of it;
* **kept by own top-k**: the part on head h's own top-(k-1) at layer m (all of it in the full
  layers): exact per-head top-k, the oracle that ``quest@k:quest_page_size=1`` runs in the fidelity
  sweep;
* more selections at the same selection layers: ``kv_group`` (``tidal.selection="kv_group"``,
  one list per KV head from its query heads' summed probabilities); ``group_union`` and ``all_union``
  (``tidal.selection="group_union"`` / ``"all_union"``: the budgeted rank-unions of a KV group's / all
  heads' lists, k positions per list, chosen by ``kernels.select_topk_positions`` itself, the code the
  scheme runs); and, as a diagnostic that reads up to Hq times more keys, the *unbudgeted* union of all
  heads' lists. If the union keeps the needle where the per-head lists do not, the selection layer does
  see the needle, in other heads than the reader.
* **needle tokens kept**: per selection and budget, the share of (head, answer query) pairs whose list
  holds at least one pass-key token (``any``) and the mean share of the pass-key tokens it holds
  (``tokens``), pooled over the retrieval heads, over every head of the layers that read a selection,
  and over the retrieval heads of those layers; layers that read every key count as keeping all of them.
  Unweighted by mass: a pair whose head does not read the key at that query counts too.

Aggregates are ratios of sums over prompts and answer queries. *Retrieval heads* are the (layer, head)
pairs whose mean dense needle mass is at least ``--head-threshold``. The states are dense ones, the
most favourable case for TidalDecode: in a real sparse decode the queries drift as well.

    python -m eval.needle_heads --lengths 2048 4096 --depths 10 --budgets 32 64 128 256 \\
        --out benchmarks/results/fidelity_smollm2/needle_heads

Writes ``<out>.json`` (format ``podkit.needle_heads/1``; ``group_union``, ``all_union`` and
``needle_tokens_kept`` are additions that older readers ignore) and ``<out>.png`` (heatmaps over layers x
heads). Shapes: ``Hq`` query heads, ``A`` answer queries, ``S`` keys, ``L`` layers.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.models import load_model, load_tokenizer
from eval.tasks.haystack import check_haystack
from eval.tasks.passkey import NEEDLE, passkey_grid
from kernels.reference import select_topk_positions
from sparse_models.calibration.outputs import save_figure, write_json
from sparse_models.calibration.tidal_reselection import last_query_logits, topk_mask
from sparse_models.config import SparseAttentionConfig
from sparse_models.plan import build_plan, model_family

NEEDLE_HEADS_FORMAT = "podkit.needle_heads/1"


@dataclass(frozen=True)
class TeacherForcedPrompt:
    """Token ids of one passkey prompt with its answer, and where the key and the answer queries are."""

    input_ids: list[int]          # context + question + answer[:-1]
    answer_ids: list[int]         # the tokens the answer queries must predict
    key_positions: list[int]      # positions of the pass-key tokens inside the needle
    depth: float
    length: int
    passkey: str

    @property
    def num_answer_queries(self) -> int:
        return len(self.answer_ids)


def key_token_positions(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Indices of the tokens whose character range ``[start, end)`` overlaps any of ``spans``."""
    return [i for i, (start, end) in enumerate(offsets)
            if end > start and any(start < span_end and end > span_start for span_start, span_end in spans)]


def teacher_forced_prompt(tokenizer, sample) -> TeacherForcedPrompt:
    """Tokenise a :class:`eval.tasks.passkey.PasskeySample` as ``retrieval_generate`` does (context
    with the tokenizer's special tokens, question and answer without) and locate the key tokens."""

    encoded = tokenizer(sample.context, return_offsets_mapping=True)
    needle = NEEDLE.format(key=sample.passkey)
    needle_start = sample.context.find(needle)
    if needle_start < 0:
        raise ValueError(f"the needle of the depth-{sample.depth} sample is not in its context")
    spans, search_from = [], needle_start
    while (found := sample.context.find(sample.passkey, search_from, needle_start + len(needle))) >= 0:
        spans.append((found, found + len(sample.passkey)))
        search_from = found + 1
    positions = key_token_positions([tuple(o) for o in encoded["offset_mapping"]], spans)
    if not positions:
        raise ValueError(f"no token of the pass key {sample.passkey} found in the depth-{sample.depth} sample")
    question = tokenizer(sample.question, add_special_tokens=False)["input_ids"]
    answer = tokenizer(sample.answer, add_special_tokens=False)["input_ids"]
    ids = list(encoded["input_ids"]) + list(question) + list(answer)
    return TeacherForcedPrompt(input_ids=ids[:-1], answer_ids=list(answer), key_positions=positions,
                               depth=sample.depth, length=sample.target_tokens, passkey=sample.passkey)


def selection_sources(model, selection_layers: list[int], full_layers: list[int]) -> list[int | None]:
    """Per layer: the TidalDecode selection layer whose positions it reads, or None for layers that
    attend to every key (full and selection layers). Taken from the model's own layer plan."""
    config = SparseAttentionConfig.from_dict({"decode_scheme": "tidal",
                                              "tidal": {"selection_layers": selection_layers,
                                                        "full_layers": full_layers}})
    plan = build_plan(config, model.config.num_hidden_layers, model.config.num_key_value_heads,
                      model_family(model.config))
    return [row.selection_source if row.decode == "sparse-over-selected" else None for row in plan]


SELECTIONS = ("query_head", "kv_group", "group_union", "all_union", "union_of_heads", "own_topk")
SELECTION_LABELS = {"query_head": "TidalDecode (each query head its own list, the paper's)",
                    "kv_group": "TidalDecode, tidal.selection=kv_group (one list per KV head)",
                    "group_union": "TidalDecode, tidal.selection=group_union (budgeted rank-union of a KV "
                                   "group's lists, k per KV head)",
                    "all_union": "TidalDecode, tidal.selection=all_union (budgeted rank-union of all heads' "
                                 "lists, k for the layer)",
                    "union_of_heads": "union of all heads' lists at the selection layer (diagnostic, unbudgeted: "
                                      "up to Hq x k keys)",
                    "own_topk": "own top-k at the reading layer (exact per-head oracle)"}
SCHEME_MODES = ("group_union", "all_union")  # rows chosen by kernels.select_topk_positions(mode=...) itself


def scheme_selection_mask(logits: torch.Tensor, budget: int, group_size: int, mode: str,
                          current: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[1,Hq,A,S]``: the past positions ``kernels.select_topk_positions(mode=mode)`` keeps for each
    answer query, run as a one-token decode step per query (the scheme's selection code, recent = 1).

    ``logits``: causal ``[1,Hq,A,S]`` (-inf at and after each query, :func:`last_query_logits`); the
    current token (query a sits at ``S - A + a``) is always in the list and left out of the mask, as
    the needle masses leave it out. ``current``: ``[1,Hq,A]`` its logits, which enter the summed
    probabilities the union modes break ties with; None puts it at -1e4 (no share of the softmax).
    """
    _, num_heads, queries, keys = logits.shape
    scores = logits[0].transpose(0, 1).clone()  # [A,Hq,S]: one decode step per answer query
    positions = torch.arange(keys - queries, keys, device=logits.device)
    fill = current[0].transpose(0, 1) if current is not None else torch.full_like(scores[..., 0], -1e4)
    scores[torch.arange(queries), :, positions] = fill.to(scores.dtype)
    index = select_topk_positions(scores, positions + 1, budget, group_size=group_size, mode=mode)  # [A,Hs,k]
    index = torch.where((index >= 0) & (index != positions[:, None, None]), index, torch.full_like(index, keys))
    mask = torch.zeros(queries, index.shape[1], keys + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(-1, index, True)
    mask = mask[..., :keys].repeat_interleave(num_heads // index.shape[1], dim=1)  # Hs -> Hq
    return mask.transpose(0, 1).unsqueeze(0)


def selection_masks(logits: torch.Tensor, budget: int, group_size: int,
                    current: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Bool ``[1,Hq,A,S]`` masks of the positions each selection keeps from one layer's logits.

    ``query_head``: each head's top-(k-1) (TidalDecode, paper). ``kv_group``: top-(k-1) of the summed
    softmax of the G query heads of each KV head (``tidal.selection="kv_group"``, up to the current
    token's share of each head's normalisation). ``group_union`` / ``all_union``: the scheme's budgeted
    rank-unions (:func:`scheme_selection_mask`; ``current`` as there). ``union_of_heads``: any head's
    top-(k-1), unbudgeted.
    """

    own = topk_mask(logits, budget - 1)
    batch, num_heads, queries, keys = logits.shape
    summed = torch.softmax(logits, dim=-1).view(batch, num_heads // group_size, group_size, queries, keys).sum(2)
    summed = summed.masked_fill(~torch.isfinite(logits[:, ::group_size]), float("-inf"))
    grouped = topk_mask(summed, budget - 1).repeat_interleave(group_size, dim=1)
    union = own.any(dim=1, keepdim=True).expand_as(own)
    masks = {"query_head": own, "kv_group": grouped, "union_of_heads": union}
    for mode in SCHEME_MODES:
        masks[mode] = scheme_selection_mask(logits, budget, group_size, mode, current)
    return masks


class NeedleMassAccumulator:
    """Running sums over prompts and answer queries, per (layer, query head): the dense needle mass
    and, per selection and budget, the part of it on the kept positions."""

    def __init__(self, num_layers: int, num_heads: int, budgets: list[int], group_size: int,
                 full_layers: list[int] = ()) -> None:
        shape = (num_layers, num_heads)
        self.budgets, self.group_size, self.full_layers = list(budgets), group_size, set(full_layers)
        self.needle = torch.zeros(shape, dtype=torch.float64)
        self.kept = {name: {b: torch.zeros(shape, dtype=torch.float64) for b in self.budgets} for name in SELECTIONS}
        # answer queries whose list holds >= 1 pass-key token, and the summed share of the key tokens held
        self.hits = {name: {b: torch.zeros(shape, dtype=torch.float64) for b in self.budgets} for name in SELECTIONS}
        self.key_share = {name: {b: torch.zeros(shape, dtype=torch.float64) for b in self.budgets}
                          for name in SELECTIONS}
        self.queries = 0

    def add(self, logits: list[torch.Tensor], key_positions: list[int], sources: list[int | None],
            current: list[torch.Tensor] | None = None) -> dict:
        """``logits[l]``: ``[1,Hq,A,S]`` causal logits of the answer queries at layer l (-inf at and
        after each query); ``sources[l]``: the selection layer layer l reads, None if it reads every
        key; ``current[l]``: ``[1,Hq,A]`` each query's logit on itself (see :func:`scheme_selection_mask`).
        Returns this prompt's totals (for the per-prompt records)."""
        key_mask = torch.zeros(logits[0].shape[-1], dtype=torch.bool, device=logits[0].device)
        key_mask[key_positions] = True
        on_key = [torch.softmax(x, dim=-1) * key_mask for x in logits]  # [1,Hq,A,S] each
        masks = {b: {} for b in self.budgets}  # budget -> layer -> selection -> mask, built on demand

        def mask(budget: int, layer: int, name: str) -> torch.Tensor:
            if layer not in masks[budget]:
                masks[budget][layer] = selection_masks(logits[layer], budget, self.group_size,
                                                       None if current is None else current[layer])
            return masks[budget][layer][name]

        prompt = {"needle": 0.0, **{name: {b: 0.0 for b in self.budgets} for name in SELECTIONS}}
        for layer, source in enumerate(sources):
            mass = on_key[layer].sum(-1)[0].double()                    # [Hq,A]
            self.needle[layer] += mass.sum(-1).cpu()
            prompt["needle"] += float(mass.sum())
            for b in self.budgets:
                for name in SELECTIONS:
                    if name == "own_topk" and layer not in self.full_layers:
                        chosen = mask(b, layer, "query_head")
                    elif source is None:
                        chosen = None
                    else:
                        chosen = mask(b, source, name)
                    if chosen is None:  # reads every key
                        kept, held = mass, torch.ones_like(mass)
                    else:
                        kept = (on_key[layer] * chosen).sum(-1)[0].double()
                        held = (chosen & key_mask).sum(-1)[0].double() / len(key_positions)  # [Hq,A]
                    self.kept[name][b][layer] += kept.sum(-1).cpu()
                    self.hits[name][b][layer] += (held > 0).double().sum(-1).cpu()
                    self.key_share[name][b][layer] += held.sum(-1).cpu()
                    prompt[name][b] += float(kept.sum())
        self.queries += logits[0].shape[2]
        return prompt

    def mean_needle_mass(self) -> torch.Tensor:
        return self.needle / max(self.queries, 1)

    def kept_fraction(self, name: str, budget: int) -> torch.Tensor:
        return self.kept[name][budget] / self.needle.clamp_min(1e-12)


def current_token_logits(q_last: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[B,Hq,Q]`` fp32: each of the last Q queries' logit on its own key (what
    :func:`last_query_logits` masks), scaled as there; query heads ``kv * G + g`` read KV head ``kv``."""
    queries, group = q_last.shape[2], q_last.shape[1] // k.shape[1]
    own_keys = k[:, :, -queries:].float().repeat_interleave(group, dim=1)
    return (q_last.float() * own_keys).sum(-1) * q_last.shape[-1] ** -0.5


@torch.no_grad()
def analyse_prompts(model, prompts: list[TeacherForcedPrompt], *, budgets: list[int], selection_layers: list[int],
                    full_layers: list[int], head_threshold: float = 0.1, progress: bool = True) -> dict:
    """Run the analysis; returns matrices (tensors), retrieval heads and per-prompt records."""

    if not prompts:
        raise ValueError("no prompts to analyse")
    bad = [b for b in budgets if b < 2]
    if bad:
        raise ValueError(f"budgets={budgets} is invalid: each budget must be >= 2 (the current token plus one)")
    sources = selection_sources(model, selection_layers, full_layers)
    num_layers, num_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    acc = NeedleMassAccumulator(num_layers, num_heads, budgets, num_heads // model.config.num_key_value_heads,
                                full_layers)
    device = next(model.parameters()).device
    records = []
    for prompt in tqdm(prompts, desc="needle heads", disable=not progress, file=sys.stderr):
        ids = torch.tensor([prompt.input_ids], device=device)
        captured: dict = {}
        out = model(input_ids=ids, use_cache=False, capture=captured, logits_to_keep=prompt.num_answer_queries)
        predicted = out.logits[0].argmax(-1).tolist()
        queries = prompt.num_answer_queries
        logits = [last_query_logits(captured[layer][0][:, :, -queries:], captured[layer][1])
                  for layer in range(num_layers)]
        current = [current_token_logits(captured[layer][0][:, :, -queries:], captured[layer][1])
                   for layer in range(num_layers)]
        del captured
        totals = acc.add(logits, prompt.key_positions, sources, current)
        needle = max(totals["needle"], 1e-12)
        records.append({"length": prompt.length, "depth": prompt.depth, "tokens": len(prompt.input_ids),
                         "passkey": prompt.passkey, "key_tokens": len(prompt.key_positions),
                         "dense_teacher_forced_correct": predicted == prompt.answer_ids,
                         "needle_mass_per_query_and_head": totals["needle"] / (queries * num_layers * num_heads),
                         "kept": {name: {str(b): round(totals[name][b] / needle, 5) for b in budgets}
                                  for name in SELECTIONS}})
    mean_mass = acc.mean_needle_mass()
    heads = [(layer, head) for layer in range(num_layers) for head in range(num_heads)
             if mean_mass[layer, head] >= head_threshold]
    retrieval = [{"layer": layer, "head": head, "needle_mass": round(float(mean_mass[layer, head]), 5),
                  "reads_selection_of": sources[layer],
                  "kept": {name: {str(b): round(float(acc.kept_fraction(name, b)[layer, head]), 5) for b in budgets}
                           for name in SELECTIONS}}
                 for layer, head in sorted(heads, key=lambda lh: -float(mean_mass[lh]))]
    total = sum(float(acc.needle[lh]) for lh in heads)

    def pooled(name: str, budget: int) -> float:
        """Kept share of the retrieval heads' summed needle mass."""
        return sum(float(acc.kept[name][budget][lh]) for lh in heads) / total if total else float("nan")

    def tokens_kept(counts: dict, name: str, budget: int, where: list) -> float:
        """Per (head, answer query) pair of ``where``, pooled: the share counted in ``counts``."""
        pairs = len(where) * acc.queries
        return sum(float(counts[name][budget][lh]) for lh in where) / pairs if pairs else float("nan")

    sparse_heads = [(layer, head) for layer in range(num_layers) if sources[layer] is not None
                    for head in range(num_heads)]
    needle_tokens = {group: {measure: {name: {b: tokens_kept(counts, name, b, where) for b in budgets}
                                       for name in SELECTIONS}
                             for measure, counts in (("any", acc.hits), ("tokens", acc.key_share))}
                     for group, where in (("retrieval_heads", heads), ("sparse_layer_heads", sparse_heads),
                                          ("sparse_layer_retrieval_heads", [lh for lh in heads if lh in sparse_heads]))}

    return {"needle_mass": mean_mass, "kept": {name: {b: acc.kept_fraction(name, b) for b in budgets}
                                               for name in SELECTIONS},
            "sources": sources, "retrieval_heads": retrieval, "head_threshold": head_threshold,
            "budgets": list(budgets), "selection_layers": list(selection_layers), "full_layers": list(full_layers),
            "retrieval_kept": {name: {b: pooled(name, b) for b in budgets} for name in SELECTIONS},
            "needle_tokens_kept": needle_tokens,
            "answer_queries": acc.queries, "prompts": records}


def write_needle_heads_json(path: str | Path, result: dict, **metadata) -> Path:
    def matrix(x: torch.Tensor) -> list[list[float]]:
        return [[round(float(v), 5) for v in row] for row in x]

    payload = {
        "format": NEEDLE_HEADS_FORMAT,
        **metadata,
        "budgets": result["budgets"], "selection_layers": result["selection_layers"],
        "full_layers": result["full_layers"], "selection_source_per_layer": result["sources"],
        "head_threshold": result["head_threshold"], "answer_queries": result["answer_queries"],
        "selections": SELECTION_LABELS,
        "retrieval_heads_kept": {name: {str(b): round(v, 5) for b, v in per.items()}
                                 for name, per in result["retrieval_kept"].items()},
        "needle_tokens_kept": {
            "description": "share of (head, answer query) pairs whose list holds >= 1 pass-key token ('any') and "
                           "the mean share of the pass-key tokens it holds ('tokens'), over the retrieval heads, "
                           "over every head of the layers that read a selection, and over the retrieval heads "
                           "of those layers; layers that read every key count as keeping every key token",
            **{group: {measure: {name: {str(b): round(v, 5) for b, v in per.items()} for name, per in by_name.items()}
                       for measure, by_name in by_measure.items()}
               for group, by_measure in result["needle_tokens_kept"].items()}},
        "retrieval_heads": result["retrieval_heads"],
        "needle_mass": matrix(result["needle_mass"]),
        "kept": {name: {str(b): matrix(x) for b, x in per.items()} for name, per in result["kept"].items()},
        "prompts": result["prompts"],
    }

    return write_json(path, payload)


def result_from_json(path: str | Path) -> dict:
    """The parts of :func:`analyse_prompts`'s result that :func:`plot_needle_heads` draws, from its JSON."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != NEEDLE_HEADS_FORMAT:
        raise ValueError(f"{path}: not a needle-heads file (format {data.get('format')!r}, expected {NEEDLE_HEADS_FORMAT})")
    budgets = [int(b) for b in data["budgets"]]
    return {"needle_mass": torch.tensor(data["needle_mass"]), "budgets": budgets,
            "kept": {name: {b: torch.tensor(per[str(b)]) for b in budgets} for name, per in data["kept"].items()},
            "retrieval_kept": {name: {b: per[str(b)] for b in budgets}
                               for name, per in data["retrieval_heads_kept"].items()},
            "retrieval_heads": data["retrieval_heads"], "selection_layers": data["selection_layers"],
            "head_threshold": data["head_threshold"]}


def plot_needle_heads(result: dict, path: str | Path, budget: int = 128) -> Path:
    """Three layer x head heatmaps (dense needle mass; share kept by TidalDecode and by own top-k at
    ``budget``, retrieval heads outlined) and the retrieval heads' kept share against the budget."""
    import matplotlib  # lazy: matplotlib is optional (plots only)

    matplotlib.use("Agg")
    # lazy: matplotlib is optional, and pyplot must come after the backend is chosen
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle


    if budget not in result["budgets"]:
        budget = result["budgets"][len(result["budgets"]) // 2]
    fig, axes = plt.subplots(1, 4, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1, 1, 1, 1.2]})
    panels = [(result["needle_mass"], "dense attention on the pass key", None),
              (result["kept"]["query_head"][budget], f"share kept by TidalDecode @{budget}", (0, 1)),
              (result["kept"]["own_topk"][budget], f"share kept by own top-{budget}", (0, 1))]
    for ax, (values, title, limits) in zip(axes, panels):
        kwargs = {"vmin": limits[0], "vmax": limits[1]} if limits else {}
        image = ax.imshow(values.numpy(), aspect="auto", origin="lower", cmap="viridis", **kwargs)
        for head in result["retrieval_heads"]:
            ax.add_patch(Rectangle((head["head"] - 0.5, head["layer"] - 0.5), 1, 1, fill=False, edgecolor="red",
                                   linewidth=1.2))
        for layer in result["selection_layers"]:
            ax.axhline(layer, color="white", linewidth=0.6, linestyle=":")
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    curve = axes[3]
    budgets = result["budgets"]
    for name, label, marker in (("query_head", "TidalDecode (per query head)", "o"),
                                ("kv_group", "TidalDecode, kv_group", "^"),
                                ("group_union", "TidalDecode, group_union", "<"),
                                ("all_union", "TidalDecode, all_union", ">"),
                                ("union_of_heads", "union of heads' lists (diagnostic, unbudgeted)", "v"),
                                ("own_topk", "own top-k (exact oracle)", "s")):
        if name not in result["retrieval_kept"]:  # files written before the row existed
            continue
        curve.plot(budgets, [100 * result["retrieval_kept"][name][b] for b in budgets], marker=marker, label=label)
    curve.set_xscale("log", base=2)
    curve.set_xticks(budgets, [str(b) for b in budgets])
    curve.set_ylim(0, 102)
    curve.set_xlabel("budget k")
    curve.set_ylabel("% of retrieval heads' needle mass kept")
    curve.set_title(f"{len(result['retrieval_heads'])} retrieval heads (dense needle mass "
                    f">= {result['head_threshold']})", fontsize=9)
    curve.legend(fontsize=8)
    curve.grid(alpha=0.3)
    fig.suptitle(f"Needle attention per head, answer queries of the passkey prompts (red: retrieval heads; dotted: "
                 f"selection layers {result['selection_layers']})", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m eval.needle_heads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2) or a checkpoint folder")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--depths", type=int, default=10, help="needle depths per length")
    parser.add_argument("--haystack", default="filler")
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--selection-layers", type=int, nargs="+", default=[2, 12])
    parser.add_argument("--full-layers", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--head-threshold", type=float, default=0.1,
                        help="mean dense needle mass from which a head counts as a retrieval head")
    parser.add_argument("--plot-budget", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="outputs/needle_heads", help="output path without suffix")
    parser.add_argument("--replot", action="store_true", help="redraw <out>.png from <out>.json and exit")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        result = result_from_json(out.with_suffix(".json"))
        print(f"wrote {plot_needle_heads(result, out.with_suffix('.png'), args.plot_budget)}")
        return result
    for name, values, low in (("--lengths", args.lengths, 16), ("--budgets", args.budgets, 2)):
        bad = [v for v in values if v < low]
        if bad:
            parser.error(f"{name} {values} is invalid: every value must be >= {low}")
    if not 0.0 < args.head_threshold <= 1.0:
        parser.error(f"--head-threshold {args.head_threshold} is invalid: expected a number in (0, 1]")

    try:
        check_haystack(args.haystack)
    except ValueError as error:
        parser.error(str(error))

    model = load_model(args.model, device=args.device)
    tokenizer = load_tokenizer(args.model)
    try:
        selection_sources(model, args.selection_layers, args.full_layers)  # validates the layers before any forward
    except ValueError as error:  # ConfigError: names the field, the value and what is allowed
        parser.error(str(error))
    samples = passkey_grid(tokenizer, args.lengths, args.depths, haystack=args.haystack)
    prompts = [teacher_forced_prompt(tokenizer, sample) for sample in samples]
    result = analyse_prompts(model, prompts, budgets=args.budgets, selection_layers=args.selection_layers,
                             full_layers=args.full_layers, head_threshold=args.head_threshold)
    json_path = write_needle_heads_json(out.with_suffix(".json"), result, model=args.model, lengths=args.lengths,
                                        depths=args.depths, haystack=args.haystack, device=str(args.device))
    png_path = plot_needle_heads(result, out.with_suffix(".png"), args.plot_budget)
    kept = "; ".join(f"@{b}: " + ", ".join(f"{name} {100 * result['retrieval_kept'][name][b]:.0f}%" for name in SELECTIONS)
                     for b in args.budgets)
    print(f"{len(result['retrieval_heads'])} retrieval heads; their needle mass kept {kept}; wrote {json_path} "
          f"and {png_path}")
    return result


if __name__ == "__main__":
    main()
