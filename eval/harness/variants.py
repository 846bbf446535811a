"""RULER sweep of each method's variants and the documented pick, stored in an export's config (BENCHMARKS.md,
"TidalDecode and Token Sparse variants on RULER").

Grids (:func:`tidal_grid`, :func:`token_sparse_grid`): a label and flat overrides each (sparse_models/config.py
``with_overrides``), one factor at a time from today's default plus a few combinations; TidalDecode's are crossed
with budget fractions of the context (``budget_label``). The default ``--grid staged`` then runs a second
TidalDecode stage (:func:`second_stage`): the re-selection layer moved through the middle third at the granularity
the first stage picked, because the layer that builds the shared list matters as much as how it is merged
(BENCHMARKS.md "Why calibrated TidalDecode stays below Quest" and the placement sweep after it). Every variant is validated by the config before any
model loads (:func:`validate`), so an option the config does not know fails with the config's own error.

The runner scores them with the leaderboard's own functions (eval/harness/leaderboard.py: ``load_samples``,
``run_setting_engine`` / ``run_setting``, the ``RecordFile`` resume) on one seed, dense always on the same samples.

Pick rule (:func:`pick`), written into variants.json / .md with the protocol:
* TidalDecode: the highest mean RULER over the swept lengths and budgets (the budget is the user's knob, not part of
  the pick); ties -> the cheaper (fewer selection layers, query_head / kv_group before the unions, no correction).
* Token Sparse: the highest mean RULER among variants that compress at least as much as the default: achieved token
  sparsity >= the default's where the records carry it, else coverage tau >= the default's, so the pick cannot buy
  accuracy by not compressing.

The sweep refuses the reported test seed (train/long_context_eval/protocol.py ``TEST_SEED``) unless allowed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from eval.harness import leaderboard as lb
from eval.harness import leaderboard_records as lr
from eval.models import load_model, load_tokenizer
from eval.runner import apply_overrides
from eval.schemes import Setting, dense
from sparse_models.config import SparseAttentionConfig
from sparse_models.schemes.tidal import default_reselection_layer
from sparse_models.smollm2 import default_model_path
from train.long_context_eval import ruler
from train.long_context_eval.protocol import TEST_SEED

FRACTIONS = ["1/4", "1/8"]
SELECTION_RANK = {"query_head": 0, "kv_group": 1, "group_union": 2, "all_union": 3}
CALIBRATION_KEY = "podkit_calibration"   # top-level config.json key: transformers keeps it, podkit ignores it


@dataclass(frozen=True)
class Variant:
    """One variant: ``label``, ``method`` (tidal / token_sparse) and the flat ``overrides`` beyond the method's."""

    label: str
    method: str
    overrides: dict[str, Any] = field(default_factory=dict)

    def cost(self) -> tuple:
        """Tie-break key, cheaper first: selection layers, granularity, correction, recent share."""
        o = self.overrides
        layers = o.get("tidal_selection_layers")
        return (len(layers) if layers else 2, SELECTION_RANK.get(o.get("tidal_selection", "query_head"), 0),
                o.get("tidal_correction_period") is not None, o.get("tidal_recent_share", 0.0))


def check_seed(seed: int, allow_test_seed: bool) -> None:
    """Refuse the reported test seed: a choice made on it would have seen the reported instances."""
    if seed == TEST_SEED and not allow_test_seed:
        raise SystemExit(f"--seed {seed} is the reported test seed (train/long_context_eval/protocol.py TEST_SEED): "
                         f"calibrate on the dev seed, or pass --allow-test-seed knowingly")


def calibrated_layer(path: str | None) -> int | None:
    """The re-selection layer ``eval.calibrate tidal`` wrote (tidal_reselection.json), or None."""
    if not path:
        return None
    return json.loads(Path(path).read_text())["reselection_layer"]


def tidal_grid(num_layers: int, calibration: str | None = None, grid: str = "full") -> list[Variant]:
    """~14 TidalDecode variants: granularity x selection layers (1-3, placement, the calibrated one) x recent share
    x correction period. Layer 2 is the first selection layer after the dense layers 0-1 (paper §3.2)."""
    mid, third = num_layers // 2, num_layers // 3
    v = [Variant("default", "tidal", {}), Variant("kv_group", "tidal", {"tidal_selection": "kv_group"}),
         Variant("one_selection", "tidal", {"tidal_selection_layers": [2]}),
         Variant("recent_0.125", "tidal", {"tidal_recent_share": 0.125})]
    layer = calibrated_layer(calibration)
    if layer is not None:
        v.append(Variant(f"calibrated[2,{layer}]", "tidal", {"tidal_selection_layers": [2, layer]}))
    if grid == "small":
        return v
    v += [Variant("group_union", "tidal", {"tidal_selection": "group_union"}),
          Variant("all_union", "tidal", {"tidal_selection": "all_union"}),
          Variant(f"sel[2,{third}]", "tidal", {"tidal_selection_layers": [2, third]}),
          Variant(f"sel[2,{mid}]", "tidal", {"tidal_selection_layers": [2, mid]}),
          Variant(f"sel[2,{third},{2 * third}]", "tidal", {"tidal_selection_layers": [2, third, 2 * third]}),
          Variant("recent_0.25", "tidal", {"tidal_recent_share": 0.25}),
          Variant("correction_32", "tidal", {"tidal_correction_period": 32}),
          Variant("kv_group+recent_0.125", "tidal", {"tidal_selection": "kv_group", "tidal_recent_share": 0.125}),
          Variant(f"sel[2,{third},{2 * third}]+kv_group", "tidal",
                  {"tidal_selection_layers": [2, third, 2 * third], "tidal_selection": "kv_group"})]
    return v


def placement_grid(num_layers: int, selection: str = "all_union") -> list[Variant]:
    """The second sweep, once granularity is chosen: ``selection`` (the first sweep's pick, BENCHMARKS.md "TidalDecode
    and Token Sparse variants on RULER") with the re-selection layer moved through the middle third of the model, and
    one three-layer plan. The needle-mass study ("Why calibrated TidalDecode stays below Quest") found the layer that
    builds the shared list matters more than how the lists are merged, and that the all-heads calibration
    (sparse_models/calibration/tidal_reselection.py) does not see the retrieval heads: so the layer is chosen here by
    RULER on the dev seed, not by attention mass. The variant named ``selection`` alone is it at today's layers; the
    per-head default is left out (the first sweep measured it)."""
    today = default_reselection_layer(num_layers)
    third = num_layers // 3
    v = [Variant(selection, "tidal", {"tidal_selection": selection})]
    for layer in range(third, 2 * third, 2):
        if layer != today:
            v.append(Variant(f"{selection}+sel[2,{layer}]", "tidal",
                             {"tidal_selection": selection, "tidal_selection_layers": [2, layer]}))
    v.append(Variant(f"{selection}+sel[2,{today},{2 * third}]", "tidal",
                     {"tidal_selection": selection, "tidal_selection_layers": [2, today, 2 * third]}))
    return v


def configured(variant: Variant | Setting) -> dict:
    """The full scheme config a variant or setting sets up (two with the same one score the same)."""
    return SparseAttentionConfig().with_overrides(**variant.overrides).to_dict()


def second_stage(first: list[Variant], best: Variant | None, num_layers: int) -> list[Variant]:
    """The staged grid's second TidalDecode stage: the selection layers of :func:`placement_grid` applied to the
    first stage's pick ``best`` (its granularity and other options kept), less every variant that configures a
    scheme the first stage (or the default) already scored. Empty when the first stage picked nothing."""
    if best is None:
        return []
    selection = best.overrides.get("tidal_selection", SparseAttentionConfig().tidal.selection)
    # the pick's other options (a recent share, a correction period) stay; only the layers move
    carried = {k: v for k, v in best.overrides.items() if k != "tidal_selection_layers"}
    stem = selection if "tidal_selection_layers" in best.overrides else best.label
    seen = [configured(v) for v in first] + [configured(Variant("default", "tidal", {}))]
    out = []
    for variant in placement_grid(num_layers, selection):
        layers = variant.overrides.get("tidal_selection_layers")
        if layers is None:   # the pick's granularity at today's layers
            continue
        moved = Variant(f"{stem}+sel[{','.join(map(str, layers))}]", "tidal",
                        {**carried, "tidal_selection_layers": layers})
        if configured(moved) not in seen:
            out.append(moved)
    return out


def token_sparse_grid(num_layers: int, drift: str | None = None, grid: str = "full") -> list[Variant]:
    """~12 Token Sparse variants: sparse layers (drift calibration / second half / all but the first two), tau,
    scoring window, sink tokens, keep_window, the max ranking (score_reduce)."""
    v = [Variant("default", "token_sparse", {}),
         Variant("tau_0.001", "token_sparse", {"token_sparse_coverage": 0.001}),
         Variant("tau_0.01", "token_sparse", {"token_sparse_coverage": 0.01}),
         Variant("second_half", "token_sparse", {"token_sparse_sparse_layers": list(range(num_layers // 2, num_layers))})]
    if drift:
        layers = json.loads(Path(drift).read_text())["sparse_layers"]
        v.append(Variant("drift_layers", "token_sparse", {"token_sparse_sparse_layers": layers}))
    if grid == "small":
        return v
    v += [Variant("after_two", "token_sparse", {"token_sparse_sparse_layers": list(range(2, num_layers))}),
          Variant("window_32", "token_sparse", {"token_sparse_window": 32}),
          Variant("window_256", "token_sparse", {"token_sparse_window": 256}),
          Variant("sink_4", "token_sparse", {"token_sparse_sink_tokens": 4}),
          Variant("sink_64", "token_sparse", {"token_sparse_sink_tokens": 64}),
          Variant("window_competes", "token_sparse", {"token_sparse_keep_window": False}),
          Variant("score_max", "token_sparse", {"token_sparse_score_reduce": "max"})]
    return v


def settings(variant: Variant, length: int, fractions: list[str]) -> list[Setting]:
    """The leaderboard settings of ``variant`` at ``length``: one per budget fraction (TidalDecode) or one."""
    if variant.method == "token_sparse":
        return [Setting(f"token_sparse[{variant.label}]", "token_sparse",
                        {"prefill_scheme": "token_sparse"} | variant.overrides)]
    out = []
    for fraction in fractions:
        budget = int(Fraction(fraction) * length)
        out.append(Setting(lb.budget_label(f"tidal[{variant.label}]", fraction), "tidal",
                           {"decode_scheme": "tidal", "tidal_budget": budget} | variant.overrides, budget=budget))
    return out


def validate(variants: list[Variant], lengths: list[int], fractions: list[str]) -> None:
    """Build every setting's config: a bad variant raises the config's ConfigError before any model loads, and a
    variant whose config equals its method's default (an option set to its default value) is refused: it would cost
    a sweep's time and read as "the option makes no difference"."""
    for variant in variants:
        for length in lengths:
            for setting in settings(variant, length, fractions):
                SparseAttentionConfig().with_overrides(**setting.overrides)
    defaults = {v.method: v for v in variants if v.label == "default"}
    for variant in variants:
        default = defaults.get(variant.method)
        if variant.label == "default" or default is None:
            continue
        for length in lengths:
            mine, theirs = settings(variant, length, fractions), settings(default, length, fractions)
            same = [a.label for a, b in zip(mine, theirs) if configured(a) == configured(b)]
            if same:
                raise ValueError(f"variant {variant.label!r} ({variant.overrides}) configures the same scheme as "
                                 f"{variant.method}'s default ({', '.join(same)}): its options are the defaults; "
                                 "set them to values that differ")


# ---------------------------------------------------------------------------------------------- run

def run_sweep(model, tokenizer, variants: list[Variant], samples: dict[int, list], out: Path, fractions: list[str], *,
              engine: bool, deadline: float = float("inf"), **options) -> bool:
    """Score dense and every variant's settings on ``samples[length]`` into ``out/records.jsonl`` (resumable from
    every ``records*.jsonl`` in ``out``);
    False if ``deadline`` came first. ``options``: run_setting's chat / max_new_tokens / device_name / model_name."""
    run = lb.run_setting_engine if engine else lb.run_setting
    records, base, finished = lr.RecordFile(out / "records.jsonl"), model.sparse_config, True
    # per-length sweeps merged into one folder (records_<length>.jsonl) count as done too: the pass that
    # picks over them must not score them again
    records.done |= {lr.record_key(r) for r in lr.load_all(out)}
    for length, batch in samples.items():
        todo = [dense()] + [s for v in variants for s in settings(v, length, fractions)]
        for setting in todo:
            apply_overrides(model, base, setting.overrides)
            finished &= run(model, tokenizer, setting, batch, records, deadline=deadline, **options)
    apply_overrides(model, base, {})
    return finished


# ---------------------------------------------------------------------------------------------- pick

def summarise(records: list[dict], variants: list[Variant]) -> dict[str, dict]:
    """Per variant: RULER mean per ``<length>@<fraction>`` (tidal) or length, per category, the mean over them,
    its distance from dense on the same lengths, and Token Sparse's mean achieved token sparsity (None if unknown)."""
    summary = lr.summarise(records)
    out: dict[str, dict] = {}
    for variant in variants:
        prefix = f"{variant.method}[{variant.label}]"
        cells, categories, sparsity, gaps = {}, {}, [], []
        for setting, lengths in summary.items():
            if setting.split("@")[0] != prefix:
                continue
            fraction = setting.partition("@")[2]
            for length, entry in lengths.items():
                cells[f"{length}@{fraction}" if fraction else length] = entry["average"]
                for name, value in entry["categories"].items():
                    categories.setdefault(name, []).append(value)
                if "dense" in summary and length in summary["dense"]:
                    gaps.append(entry["average"] - summary["dense"][length]["average"])
        for r in records:
            if r["setting"] == prefix and r.get("token_sparsity") is not None:
                sparsity.append(r["token_sparsity"])
        out[variant.label] = {
            "method": variant.method, "overrides": variant.overrides, "ruler": cells,
            "mean": sum(cells.values()) / len(cells) if cells else None,
            "categories": {k: sum(v) / len(v) for k, v in categories.items()},
            "vs_dense": sum(gaps) / len(gaps) if gaps else None,
            "token_sparsity": sum(sparsity) / len(sparsity) if sparsity else None}
    return out


def pick(summary: dict[str, dict], variants: list[Variant]) -> tuple[Variant | None, str]:
    """The rule of the module docstring; (variant, the sentence saying which rule applied)."""
    scored = [v for v in variants if summary.get(v.label, {}).get("mean") is not None]
    if not scored:
        return None, "no variant scored"
    rule = "highest mean RULER over lengths and budgets; ties -> fewer selection layers, no union, no correction"
    if scored[0].method == "token_sparse":
        default = summary.get("default", {})
        known = default.get("token_sparsity") is not None and all(
            summary[v.label]["token_sparsity"] is not None for v in scored)
        if known:
            scored = [v for v in scored if summary[v.label]["token_sparsity"] >= default["token_sparsity"]]
            rule = "highest mean RULER among variants with achieved token sparsity >= the default's"
        else:
            tau = SparseAttentionConfig().token_sparse.coverage
            scored = [v for v in scored if v.overrides.get("token_sparse_coverage", tau) >= tau]
            rule = f"highest mean RULER among variants with coverage >= the default's {tau:g} (sparsity not recorded)"
    best = min(scored, key=lambda v: (-round(summary[v.label]["mean"], 6), v.cost()))
    return best, rule


# ---------------------------------------------------------------------------------------------- export

def write_pick(export: str | Path, variant: Variant, protocol: dict) -> dict:
    """Merge ``variant``'s overrides into ``export/config.json``'s ``sparse_attention`` tidal / token_sparse
    sub-dict (validated by SparseAttentionConfig), record the calibration under :data:`CALIBRATION_KEY`, and
    replace the file atomically (a temp file in the same folder, os.replace)."""
    path = Path(export) / "config.json"
    config = json.loads(path.read_text())
    current = SparseAttentionConfig.from_dict(config.get("sparse_attention"))
    merged = current.with_overrides(**variant.overrides).to_dict()   # raises ConfigError on a bad field
    stored = dict(config.get("sparse_attention") or {})
    stored[variant.method] = merged[variant.method]
    SparseAttentionConfig.from_dict(stored)
    config["sparse_attention"] = stored
    config.setdefault(CALIBRATION_KEY, {})[variant.method] = {
        "variant": variant.label, "overrides": variant.overrides, "protocol": protocol,
        "date": time.strftime("%Y-%m-%d")}
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=".config.", suffix=".json")
    with os.fdopen(handle, "w") as file:
        json.dump(config, file, indent=2)
    os.replace(temp, path)
    return config


def write_outputs(out: Path, result: dict) -> None:
    """variants.json, variants.md and (matplotlib permitting) variants.png."""
    (out / "variants.json").write_text(json.dumps(result, indent=1))
    lines = [f"Protocol: `{json.dumps(result['protocol'])}`", ""]
    for method, block in result["methods"].items():
        lines += [f"## {method}", "", f"Rule: {block['rule']}. Pick: **{block['pick']}**.", "",
                  "| variant | mean | vs dense | token sparsity | cells |", "|---|---|---|---|---|"]
        for label, e in block["summary"].items():
            fmt = lambda x: "" if x is None else f"{x:.3f}" if abs(x) < 1 else f"{x:.1f}"  # noqa: E731
            cells = ", ".join(f"{k} {v:.1f}" for k, v in e["ruler"].items())
            lines.append(f"| {label} | {fmt(e['mean'])} | {fmt(e['vs_dense'])} | {fmt(e['token_sparsity'])} | {cells} |")
        lines.append("")
    (out / "variants.md").write_text("\n".join(lines))
    try:
        import matplotlib  # lazy: matplotlib is optional (plots only)
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)

    fig, axes = plt.subplots(1, len(result["methods"]), figsize=(7 * len(result["methods"]), 4.5), squeeze=False)
    for ax, (method, block) in zip(axes[0], result["methods"].items()):
        labels = [k for k, e in block["summary"].items() if e["mean"] is not None]
        ax.barh(labels, [block["summary"][k]["mean"] for k in labels])
        if block.get("dense") is not None:
            ax.axvline(block["dense"], color="black", linestyle=":", label="dense")
            ax.legend()
        ax.set_title(f"{method}: mean RULER per variant")
    fig.tight_layout()
    fig.savefig(out / "variants.png")


def num_layers(model: str) -> int:
    """The checkpoint's layer count from its config.json, without loading weights."""
    folder = default_model_path() if model == "default" else Path(model)
    return json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]


def sweep(args) -> dict:
    """``python -m eval.calibrate variants``: check the seed, build and validate the grids, score them, pick, write
    the outputs and (``--export``) the export's config."""
    check_seed(args.seed, args.allow_test_seed)
    methods = ["tidal", "token_sparse"] if args.method == "both" else [args.method]
    layers = num_layers(args.model)
    if args.grid == "placement" and args.method != "tidal":
        raise SystemExit(f"--grid placement sweeps TidalDecode's selection layers: it needs --method tidal, "
                         f"got --method {args.method}")
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size {args.batch_size} is invalid: expected an integer >= 1")
    first_grid = "full" if args.grid == "staged" else args.grid
    tidal = (placement_grid(layers) if args.grid == "placement"
             else tidal_grid(layers, args.tidal_calibration, first_grid))
    grids = {"tidal": tidal, "token_sparse": token_sparse_grid(layers, args.drift_calibration, first_grid)}
    variants = [v for m in methods for v in grids[m]]
    validate(variants, args.lengths, args.fractions)   # before the model loads: a bad grid costs no device time
    staged = args.grid == "staged" and "tidal" in methods
    if staged:   # every second stage the first one could lead to (one per possible pick), checked now too
        for candidate in tidal:
            validate(second_stage(tidal, candidate, layers), args.lengths, args.fractions)
    model = load_model(args.model, device=args.device)
    tokenizer, out = load_tokenizer(args.model), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples = {n: lb.load_samples(Path(args.samples_dir), n, args.tasks, args.samples, args.seed, args.model,
                                  tokenizer) for n in args.lengths}
    engine = args.device.startswith("cuda")
    batching = {"batch_size": args.batch_size} if engine else {}   # the CPU path answers one prompt at a time
    deadline = time.time() + args.time_limit if args.time_limit else float("inf")

    def score(todo: list[Variant]) -> bool:
        return run_sweep(model, tokenizer, todo, samples, out, args.fractions, engine=engine, deadline=deadline,
                         chat=True, max_new_tokens=args.max_new_tokens, device_name=lb.device_name(args.device),
                         model_name=args.model, **batching)

    finished = score(variants)
    if staged and finished:   # stage 2: the re-selection layer moved, at the granularity stage 1 picked
        first_pick, _ = pick(summarise(lr.load_all(out), tidal), tidal)
        extra = second_stage(tidal, first_pick, layers)
        print(f"staged grid: stage 1 picked {first_pick and first_pick.label}; stage 2 scores "
              f"{', '.join(v.label for v in extra) or 'nothing new'}", flush=True)
        finished = score(extra)
        grids["tidal"] = tidal + extra
    elif staged:
        print("staged grid: stage 1 is not finished (time limit): rerun the same command to continue", flush=True)
    protocol = {"seed": args.seed, "tasks": args.tasks, "samples_per_task": args.samples, "lengths": args.lengths,
                "fractions": args.fractions, "grid": args.grid, "model": args.model, "finished": finished}
    records = lr.load_all(out)
    dense_mean = lr.summarise(records).get("dense", {})
    result = {"protocol": protocol, "methods": {}}
    for method in methods:
        summary = summarise(records, grids[method])
        best, rule = pick(summary, grids[method])
        result["methods"][method] = {"summary": summary, "rule": rule, "pick": best and best.label,
                                     "pick_overrides": best and best.overrides,
                                     "dense": (sum(e["average"] for e in dense_mean.values()) / len(dense_mean))
                                     if dense_mean else None}
        if args.export and best is not None and finished:
            write_pick(args.export, best, protocol | {"rule": rule})
    write_outputs(out, result)
    return result


def add_arguments(parser) -> None:
    """The ``variants`` subcommand's options (eval/harness/calibrate.py)."""
    parser.add_argument("--method", default="both", choices=["tidal", "token_sparse", "both"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--seed", type=int, default=None, help="variants: the dev seed (protocol.DEV_SEED)")
    parser.add_argument("--allow-test-seed", action="store_true")
    parser.add_argument("--tasks", nargs="+", default=list(ruler.TASKS), choices=list(ruler.TASKS))
    parser.add_argument("--fractions", nargs="+", default=FRACTIONS)
    parser.add_argument("--samples-dir", default=None, help="variants: folder with samples_<length>.json")
    parser.add_argument("--out", default="outputs/variants")
    parser.add_argument("--export", default=None, help="variants: write the pick into this export's config.json")
    parser.add_argument("--grid", default="staged", choices=["staged", "full", "small", "placement"],
                        help="variants: staged (the full grid, then TidalDecode's re-selection layer moved at the "
                             "granularity it picked), full / small one-factor grids, or placement (the all-heads "
                             "union with the re-selection layer moved; --method tidal)")
    parser.add_argument("--tidal-calibration", default=None, help="variants: a tidal_reselection.json")
    parser.add_argument("--drift-calibration", default=None, help="variants: a token_sparse_drift.json")
    parser.add_argument("--time-limit", type=float, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="variants: prompts per engine batch on a GPU (a smaller batch shares the GPU with other "
                             "processes)")
