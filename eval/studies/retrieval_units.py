"""Which POD key-sharing units break retrieval: a causal ablation over the block map.

POD (Ma et al. 2024, "Compressing KV cache for long-context LLM inference with inter-layer attention
similarity", §3) lets every (layer, KV head) unit inside a block attend to distant tokens through the
block anchor's keys. Perplexity survives that; pass-key retrieval on SmolLM2-135M does not
(BENCHMARKS.md, "Why passkey collapses under POD"), and keeping the units of the heads that *attend* to the
needle as anchors did not help. This tool asks the causal question instead: for each shared unit, how much
of the answer's log-probability comes back when the block is split there (the unit and the rest of its block
get their own keys from that layer on: ``split_block``), and how few splits restore retrieval.

    python -m eval.retrieval_units --model EXPORT [--blocks BLOCKS.json] --lengths 2048 --depths 5 --out DIR
        [--tasks passkey needle]

Score of a block map: the answer's tokens teacher-forced after the prompt (``--tasks``: the pass key,
``eval/tasks/passkey.py``, and / or the needle's word, ``eval/tasks/needle.py``), one
POD prefill per prompt: mean log-probability per answer token and the fraction of prompts whose every answer
token is the argmax (a teacher-forced stand-in for greedy accuracy). Output ``DIR/retrieval_units.json``:
dense / POD / per-split scores, the greedy curve (splits in order of their gain, re-scored cumulatively) and a
``blocks_protected.json`` with the fewest splits reaching ``--target`` of dense's exact-match fraction, usable
as ``pod.blocks_file`` for adaptation, and the same units as a list for the recipe's ``pod.protect_units``
(which applies them to whatever map the exploration finds); ``retrieval_units.png``: the per-unit gains as a layer x KV head map.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eval.models import load_model, load_tokenizer
from eval.runner import apply_overrides
from eval.schemes import dense, pod_zero_shot
from eval.tasks.needle import needle_grid
from eval.tasks.passkey import passkey_grid
from sparse_models.calibration.pod_similarity import (
    protect_units,
    read_blocks_json,
    shared_units,
    split_block,
    write_blocks_json,
)

TASK_GRIDS = {"passkey": (passkey_grid, "filler"), "needle": (needle_grid, "pride_and_prejudice")}


def task_samples(task: str, tokenizer, lengths: list[int], depths: int, haystack: str | None = None) -> list:
    """The ``task``'s prompts (``PasskeySample``: ``prompt``, ``answer``) over lengths x depths, on ``haystack`` or
    the task's own default one."""
    grid, default_haystack = TASK_GRIDS[task]
    return grid(tokenizer, lengths, depths, haystack=haystack or default_haystack)


def answer_scores(model, prompts: list[torch.Tensor], answers: list[torch.Tensor]) -> dict:
    """Teacher-forced answer scores: ``prompts[i] [P]``, ``answers[i] [A]`` token ids.

    Returns ``{"logprob": mean log-prob per answer token, "exact": fraction of samples whose answer tokens are
    all the argmax}``."""
    total, count, exact = 0.0, 0, 0
    device = next(model.parameters()).device
    for prompt, answer in zip(prompts, answers):
        ids = torch.cat([prompt, answer]).unsqueeze(0).to(device)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, prompt.numel() - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = answer.to(device)
        total += float(logp.gather(1, target[:, None]).sum())
        count += answer.numel()
        exact += int(bool((logits.argmax(-1) == target).all()))
    return {"logprob": total / max(count, 1), "exact": exact / max(len(prompts), 1)}


def greedy_order(gains: dict[tuple[int, int], float]) -> list[tuple[int, int]]:
    """Units by decreasing gain (ties: lower layer first, then head)."""
    return sorted(gains, key=lambda unit: (-gains[unit], unit))


def curve_points(num_units: int) -> list[int]:
    """Cumulative split counts to score: 1, 2, 4, 8, ... and ``num_units``."""
    points, k = [], 1
    while k < num_units:
        points.append(k)
        k *= 2
    return points + [num_units]


def plot_gains(gains: dict[tuple[int, int], float], num_layers: int, num_kv_heads: int, path: Path) -> Path:
    import matplotlib  # lazy: plotting only (an optional dependency), after the scoring

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)

    grid = torch.full((num_kv_heads, num_layers), float("nan"))
    for (layer, head), gain in gains.items():
        grid[head, layer] = gain
    from matplotlib.colors import TwoSlopeNorm  # lazy: matplotlib is optional (plots only)

    fig, ax = plt.subplots(figsize=(max(6, num_layers * 0.3), 1.6 + 0.5 * num_kv_heads))
    finite = grid[~grid.isnan()]
    bound = max(float(finite.abs().max()) if finite.numel() else 1.0, 1e-6)
    # diverging around 0: a split can also hurt (it re-anchors the rest of its block at the split layer)
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="RdBu", norm=TwoSlopeNorm(0.0, -bound, bound),
                      interpolation="nearest")
    ax.set_yticks(range(num_kv_heads))
    ax.set_xticks(range(0, num_layers, max(1, num_layers // 15)))
    ax.set_xlabel("layer")
    ax.set_ylabel("KV head")
    ax.set_title("answer log-prob gained by splitting the POD block at each shared unit (blank: anchor)")
    fig.colorbar(image, ax=ax, label="Δ log-prob per answer token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.retrieval_units", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a POD export (train/pod.py's export folder) or 'default'")
    parser.add_argument("--blocks", default=None, help="blocks JSON (default: the export's pod_blocks.json)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--depths", type=int, default=5, help="needle depths per length")
    parser.add_argument("--tasks", nargs="+", default=["passkey"], choices=list(TASK_GRIDS),
                        help="whose answers score a block map: the pass key (a number in filler text), the needle (a "
                             "word in a novel: eval/tasks/needle.py), or both (their prompts pooled; the log-prob is per answer token)")
    parser.add_argument("--haystack", default=None,
                        help="haystack for every task (default: filler for passkey, pride_and_prejudice for needle)")
    parser.add_argument("--target", type=float, default=0.9,
                        help="protected map: the fewest splits reaching this fraction of dense's exact-match score")
    parser.add_argument("--sink-tokens", type=int, default=None,
                        help="POD's sink tokens (default: the model's config; an export carries its recipe's)")
    parser.add_argument("--recent-window", type=int, default=None,
                        help="POD's recent window (default: the model's config). Set both to rank the units of an "
                             "un-adapted model at the recipe's window, e.g. 16 and 240 at 2K")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True)
    return parser


def parse_args(argv: list[str] | None, parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Path | None]:
    """The arguments, checked (``parser.error`` on a bad one), and the blocks file if one was given."""
    args = parser.parse_args(argv)
    if args.sink_tokens is not None and args.sink_tokens < 0:
        parser.error(f"--sink-tokens {args.sink_tokens} is invalid: expected an integer >= 0")
    if args.recent_window is not None and args.recent_window < 1:
        parser.error(f"--recent-window {args.recent_window} is invalid: expected an integer >= 1")
    if not 0 < args.target <= 1:
        parser.error(f"--target {args.target} is invalid: expected a fraction in (0, 1]")
    blocks_path = Path(args.blocks) if args.blocks else None
    if blocks_path is not None and not blocks_path.is_file():
        parser.error(f"--blocks {blocks_path} does not exist: expected a POD blocks JSON (train/pod.py writes one)")
    return args, blocks_path


def split_gains(score, anchors: list[list[int]], pod_logprob: float) -> dict[tuple[int, int], float]:
    """Each shared unit's answer log-prob gain over POD when its block is split there alone."""
    gains = {}
    for layer, head in tqdm(shared_units(anchors), desc="split each shared unit"):
        result = score(split_block(anchors, layer, head))
        gains[(layer, head)] = result["logprob"] - pod_logprob
    return gains


def cumulative_curve(score, anchors: list[list[int]], order: list[tuple[int, int]], target_exact: float):
    """The scores of protecting the first k units of ``order`` (k = ``curve_points``), and the first (k, map) whose
    exact match reaches ``target_exact`` (None if none does)."""
    curve, chosen = [], None
    for k in tqdm(curve_points(len(order)), desc="cumulative splits"):
        current, _ = protect_units(anchors, order[:k])
        result = score(current)
        curve.append({"splits": k, "shared_units": len(shared_units(current)), **result,
                      "units": [list(unit) for unit in order[:k]],  # usable as the recipe's pod.protect_units
                      "anchor_layers": current})  # every point usable as a block map (write_blocks_json)
        if chosen is None and result["exact"] >= target_exact:
            chosen = (k, current)
    return curve, chosen


def write_report(args: argparse.Namespace, report: dict, gains: dict, anchors: list[list[int]], order: list,
                 chosen, blocks_path: Path | None) -> None:
    """``retrieval_units.json``, the protected map (if one reached the target), the gains plot, and the summary."""
    curve = report["curve"]
    dense_exact = report["dense"]["exact"]
    args.out.mkdir(parents=True, exist_ok=True)
    if chosen is not None:
        k, protected = chosen
        write_blocks_json(args.out / "blocks_protected.json", protected, source_blocks=str(blocks_path or args.model),
                          protected_by="eval.retrieval_units", splits=[list(u) for u in order[:k]])
        report["protected"] = {"splits": k, "shared_units": len(shared_units(protected)),
                               "units": [list(unit) for unit in order[:k]],
                               "file": str(args.out / "blocks_protected.json")}
    (args.out / "retrieval_units.json").write_text(json.dumps(report, indent=1))
    plot_gains(gains, len(anchors), len(anchors[0]), args.out / "retrieval_units.png")
    for point in curve:
        print(f"[units] {point['splits']:>3} splits ({point['shared_units']} shared): log-prob "
              f"{point['logprob']:.3f}, exact {100 * point['exact']:.0f}%")
    print(f"[units] dense exact {100 * dense_exact:.0f}%; protected map: "
          f"{report.get('protected', 'none reaches the target')} -> {args.out}")
    if "protected" in report:  # the re-adaptation step: train/pod.py RECIPE pod.protect_units=... (README, POD)
        print(f"[units] re-adapt with: pod.protect_units={json.dumps(report['protected']['units'], separators=(',', ':'))}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, blocks_path = parse_args(argv, parser)

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    if blocks_path is not None:
        anchors = read_blocks_json(blocks_path)["anchor_layers"]
    else:  # an export carries its block map in its sparse-attention config
        anchors = model.sparse_config.pod.anchor_layers
        if not anchors:
            parser.error(f"--model {args.model} has no POD block map in its config: pass --blocks BLOCKS.json")
        anchors = [list(row) for row in anchors]
    samples = [sample for task in args.tasks for sample in task_samples(task, tokenizer, args.lengths, args.depths,
                                                                         args.haystack)]
    prompts = [torch.tensor(tokenizer(s.prompt, add_special_tokens=False)["input_ids"]) for s in samples]
    answers = [torch.tensor(tokenizer(s.answer, add_special_tokens=False)["input_ids"]) for s in samples]
    start = time.time()

    base = model.sparse_config
    window = {key: value for key, value in (("pod_sink_tokens", args.sink_tokens),
                                             ("pod_recent_window", args.recent_window)) if value is not None}
    proximal = window.get("pod_sink_tokens", base.pod.sink_tokens) + window.get("pod_recent_window",
                                                                                base.pod.recent_window)
    if proximal >= min(args.lengths):  # every key would be proximal: POD would equal dense, nothing to rank
        parser.error(f"POD's proximal window ({proximal} tokens: sink + recent) covers the whole {min(args.lengths)}-"
                     f"token prompt: pass --sink-tokens / --recent-window below the length (e.g. 16 and 240 at 2K)")

    def score(anchor_layers):  # None: dense; else POD with this block map (the shared scheme settings)
        overrides = (dense().overrides if anchor_layers is None
                     else pod_zero_shot(None, **window).overrides | {"pod_anchor_layers": anchor_layers})
        apply_overrides(model, base, overrides)
        return answer_scores(model, prompts, answers)

    report: dict = {"model": str(args.model), "blocks": str(blocks_path or "the model's config"), "lengths": args.lengths,
                    "depths": args.depths, "tasks": args.tasks, "samples": len(samples), "proximal": proximal,
                    "device": args.device, "dtype": args.dtype}
    report["dense"] = score(None)
    report["pod"] = score(anchors)
    print(f"[units] dense {report['dense']}, POD {report['pod']}, {len(shared_units(anchors))} shared units")
    gains = split_gains(score, anchors, report["pod"]["logprob"])
    report["splits"] = [{"layer": l, "kv_head": h, "gain": g} for (l, h), g in sorted(gains.items())]
    order = greedy_order(gains)
    curve, chosen = cumulative_curve(score, anchors, order, args.target * report["dense"]["exact"])
    report["curve"] = curve
    report["seconds"] = time.time() - start
    write_report(args, report, gains, anchors, order, chosen, blocks_path)
    return 0 if all(math.isfinite(p["logprob"]) for p in curve) else 1


if __name__ == "__main__":
    sys.exit(main())
