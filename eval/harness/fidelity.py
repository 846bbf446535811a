"""``python -m eval.fidelity``: the fidelity sweep on SmolLM2-135M-Instruct (BENCHMARKS.md, "Fidelity on SmolLM2-135M").

What it measures, for dense, every budgeted decode scheme of the registry (``eval.schemes.budget_sweep_methods``:
TidalDecode, Quest, StreamingLLM, ...) at budgets 32/64/128/256, Token
Sparse at coverage tau 0.005 and 0.01 (with the token sparsity it achieved) and POD zero-shot:

* passkey accuracy (synthetic filler haystack) at 2K / 4K / 8K tokens x 10 needle depths, with the
  question and the answer in the decode phase (eval.runner.retrieval_generate);
* perplexity on held-out Emma at 2K / 4K / 8K (TidalDecode also at budget 1024): the last
  ``--decode-tokens`` tokens of each window are scored one decode step at a time after a prefill of
  the rest (decode-phase perplexity, where decode schemes act and where a prefill scheme's KV cache
  is read), and the prefill part gives the prefill-phase perplexity (eval.runner.window_perplexity).

Before the sweep it runs the calibration analyses on another book (Persuasion), on the same model,
and uses their results: POD blocks (sparse_models.calibration.pod_similarity; POD zero-shot = those
blocks with 16 sink + 240 recent tokens, the smollm2 recipe's window, no training), Token Sparse
sparse layers (token_sparse_drift) and the TidalDecode re-selection layer (tidal_reselection).
``--no-calibrate`` keeps the config defaults instead.

Outputs in ``--out``: ``records.jsonl`` (one line per sample/window, appended as it goes; a rerun
with the same ``--out`` resumes), ``fidelity.json`` (settings, calibration, summary),
``passkey_grid.png``, ``perplexity.png``, ``fidelity.md`` (tables + the issue's targets) and
``calibration/*.json|png`` (PNGs only where matplotlib is installed; ``--replot`` redraws them from
``records.jsonl`` and the JSONs on a machine that has it).

    python -m eval.fidelity --out outputs/fidelity                # full sweep (use a GPU)
    python -m eval.fidelity --reduced --out outputs/fidelity_reduced   # minutes on CPU (make eval)
    python -m eval.fidelity --settings dense tidal@128 --lengths 2048 --out outputs/f   # a slice

Runs on CUDA or CPU; imports neither deepspeed nor lm-eval nor datasets. The model runs in fp32 by
default (a fidelity measurement: bf16 rounding would blur sub-percent perplexity differences).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eval import schemes
from eval.harness import plots
from eval.harness.quality import record_key, retrieval_samples, run_perplexity, run_retrieval, summarise
from eval.models import load_model, load_tokenizer
from eval.runner import apply_overrides
from eval.tasks.perplexity import perplexity_windows
from sparse_models import capture_attention_inputs
from sparse_models.calibration import pod_similarity, tidal_reselection, token_sparse_drift

CALIBRATION_TEXT = "persuasion"   # not Emma (the perplexity text), not the passkey filler
POD_SINK, POD_RECENT = 16, 240    # recipes/smollm2_135m.yaml


@dataclass
class SweepPlan:
    passkey_lengths: list[int]
    ppl_lengths: list[int]
    depths: int
    budgets: list[int]
    coverages: list[float]
    ppl_only_tidal_budgets: list[int]
    ppl_windows: int
    decode_tokens: int
    calibration_samples: int
    calibration_length: int
    methods: list[str] | None = None  # None: every budgeted scheme, eval.schemes.budget_sweep_methods() at build time


FULL = SweepPlan(passkey_lengths=[2048, 4096, 8192], ppl_lengths=[2048, 4096, 8192], depths=10,
                 budgets=[32, 64, 128, 256], coverages=[0.005, 0.01], ppl_only_tidal_budgets=[1024], ppl_windows=1,
                 decode_tokens=256, calibration_samples=4, calibration_length=2048)
# Reduced: passkey at 1K (Token Sparse is dense there: 1K <= min_tokens + window), perplexity at 2K
# (where Token Sparse acts), one budget per decode method; about 6 minutes on an idle 2-core CPU.
REDUCED = SweepPlan(passkey_lengths=[1024], ppl_lengths=[2048], depths=3, budgets=[64], coverages=[0.005],
                    ppl_only_tidal_budgets=[], ppl_windows=1, decode_tokens=32, calibration_samples=1,
                    calibration_length=1024)


def build_settings(plan: SweepPlan, calibration: dict[str, Any], *,
                   extra: list[schemes.Setting] | None = None) -> tuple[list[schemes.Setting], list[schemes.Setting]]:
    """(settings for passkey and perplexity, settings for perplexity only); ``extra`` (variants such
    as ``tidal@128[2,16]``) are run on both tasks after the plan's settings."""
    tidal_extra = {"tidal_selection_layers": calibration["tidal_selection_layers"]} \
        if calibration.get("tidal_selection_layers") else {}
    sparse_extra = {"token_sparse_sparse_layers": calibration["token_sparse_layers"]} \
        if calibration.get("token_sparse_layers") else {}
    both = [schemes.dense()]
    for method in plan.methods if plan.methods is not None else schemes.budget_sweep_methods():
        for budget in plan.budgets:
            both.append(schemes.budgeted(method, budget, **(tidal_extra if method == "tidal" else {})))
    for coverage in plan.coverages:
        both.append(schemes.token_sparse(coverage, **sparse_extra))
    pod_extra = {"pod_sink_tokens": POD_SINK, "pod_recent_window": POD_RECENT}
    both.append(schemes.pod_zero_shot(calibration.get("pod_blocks_file"), **pod_extra))
    both.extend(extra or [])
    ppl_only = [schemes.budgeted("tidal", budget, **tidal_extra) for budget in plan.ppl_only_tidal_budgets]
    return both, ppl_only


def tidal_ablation_settings(specs: list[str] | None, num_layers: int, full_layers: list[int],
                            budget: int = 128) -> list[schemes.Setting]:
    """``--tidal-ablation 2 2,12 all`` -> TidalDecode@``budget`` variants with those selection layers
    (``all`` = every layer that is not a full layer), labelled ``tidal@128[2,12]``: how many
    re-selections the position-persistence premise needs on this model. Selection layers attend
    densely, so ``all`` is dense attention: the ablation's ceiling, not a sparse setting."""
    settings = []
    for spec in specs or []:
        if spec == "all":
            layers = [layer for layer in range(num_layers) if layer not in full_layers]
            settings.append(schemes.variant(schemes.budgeted("tidal", budget), "all", tidal_selection_layers=layers))
            continue
        try:
            layers = [int(part) for part in spec.split(",")]
        except ValueError:
            raise SystemExit(f"--tidal-ablation {spec!r} is invalid: expected comma-separated layer indices or 'all'")
        bad = [layer for layer in layers if not 0 <= layer < num_layers or layer in full_layers]
        if bad or not layers:
            raise SystemExit(f"--tidal-ablation {spec!r} is invalid: layers must be in [0, {num_layers}) and not "
                             f"in the full layers {full_layers}")
        settings.append(schemes.variant(schemes.budgeted("tidal", budget), ",".join(map(str, layers)),
                                        tidal_selection_layers=layers))
    return settings


def variant_settings(specs: list[str] | None, model, base) -> list[schemes.Setting]:
    """``--variants quest@128:quest_page_size=1 ...``, each checked against the model now (before any
    heavy work) so a bad key or value fails with the config's own message."""
    settings = []
    for spec in specs or []:
        try:
            setting = schemes.parse_variant(spec)
            overrides = {k: v for k, v in setting.overrides.items() if k != "pod_blocks_file"}
            model.set_sparse_attention(base, **overrides)
        except ValueError as error:
            raise SystemExit(f"--variants {spec!r} is invalid: {error}")
        settings.append(setting)
    model.set_sparse_attention(base)
    return settings


def calibrate(model, tokenizer, plan: SweepPlan, out: Path) -> dict[str, Any]:
    """Run the three calibration analyses on the dense model; return what the settings need."""
    device = next(model.parameters()).device
    windows = perplexity_windows(tokenizer, plan.calibration_length, plan.calibration_samples, text=CALIBRATION_TEXT)
    batches = [torch.tensor([w], device=device) for w in windows]
    num_layers = model.config.num_hidden_layers
    folder = out / "calibration"
    meta = {"text": CALIBRATION_TEXT, "length": plan.calibration_length}

    pod = pod_similarity.explore(batches, lambda ids: capture_attention_inputs(model, ids), num_layers=num_layers,
                                 num_kv_heads=model.config.num_key_value_heads, last_queries=64, delta=0.5)
    blocks_file = pod_similarity.write_blocks_json(folder / "pod" / "blocks.json", pod["anchor_layers"],
                                                   pod["similarity"], delta=0.5, compare_with="anchor",
                                                   calibration_samples=pod["samples"], last_queries=64, **meta)
    plot_if_possible(pod_similarity.plot_similarity_heatmap, pod["similarity"], pod["anchor_layers"],
                     folder / "pod" / "similarity.png")

    drift = token_sparse_drift.calibrate(model, batches)
    token_sparse_drift.write_drift_json(folder / "token_sparse_drift.json", drift, **meta)
    plot_if_possible(token_sparse_drift.plot_drift, drift, folder / "token_sparse_drift.png")

    tidal = tidal_reselection.analyse(batches, lambda ids: capture_attention_inputs(model, ids), num_layers=num_layers,
                                      budget=128, last_queries=32)
    tidal_reselection.write_reselection_json(folder / "tidal_reselection.json", tidal, **meta)
    plot_if_possible(tidal_reselection.plot_reselection, tidal, folder / "tidal_reselection.png")
    return {"pod_blocks_file": str(blocks_file), "pod_anchor_fraction": json.loads(blocks_file.read_text())["anchor_fraction"],
            "token_sparse_layers": drift["sparse_layers"], "tidal_selection_layers": tidal["selection_layers"],
            "tidal_recall_with_reselection": tidal["scores"][tidal["reselection_layer"]],
            "tidal_recall_without_reselection": tidal["scores"][None]}


def plot_if_possible(plot, *args) -> None:
    """Call a plotting function unless matplotlib is missing (the H200 image has none): JSON and
    markdown are the results; PNGs can be drawn later from ``records.jsonl`` on another machine."""
    try:
        import matplotlib  # noqa: F401  lazy: probes for the optional matplotlib
    except ImportError:
        print(f"matplotlib is not installed: skipping {args[-1]}")
        return
    plot(*args)


def load_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_targets(summary: dict) -> list[str]:
    """The fidelity targets (BENCHMARKS.md's status table), each as a line saying met / missed and by how much (only
    where measured)."""
    lines: list[str] = []
    passkey, ppl = summary.get("passkey", {}), summary.get("ppl", {})

    def accuracy(setting: str) -> float | None:
        cells = passkey.get(setting)
        if not cells:
            return None
        total = sum(c["n"] for c in cells.values())
        return sum(c["accuracy"] * c["n"] for c in cells.values()) / total

    def decode_ppl(setting: str) -> dict[str, float]:
        return {n: c["decode_ppl"] for n, c in ppl.get(setting, {}).items() if c.get("decode_ppl")}

    dense = accuracy("dense")
    tidal128 = accuracy("tidal@128")
    if dense is not None and tidal128 is not None:
        gap = 100 * (dense - tidal128)
        lines.append(f"- TidalDecode@128 passkey within 5 points of dense: {'met' if gap <= 5 else 'MISSED'} "
                     f"(dense {100 * dense:.0f}%, tidal@128 {100 * tidal128:.0f}%, gap {gap:+.0f} points)")
    for budget in (32, 64, 128):
        tidal, quest = accuracy(f"tidal@{budget}"), accuracy(f"quest@{budget}")
        if tidal is not None and quest is not None:
            lines.append(f"- TidalDecode >= Quest at budget {budget}: {'met' if tidal >= quest else 'MISSED'} "
                         f"({100 * tidal:.0f}% vs {100 * quest:.0f}%)")
    for budget in (32, 64, 128, 256):
        streaming, tidal, quest = accuracy(f"streaming@{budget}"), accuracy(f"tidal@{budget}"), accuracy(f"quest@{budget}")
        if streaming is not None and tidal is not None and quest is not None:
            below = streaming < min(tidal, quest) - 0.1
            lines.append(f"- StreamingLLM clearly below both at budget {budget}: {'met' if below else 'MISSED'} "
                         f"(streaming {100 * streaming:.0f}%, tidal {100 * tidal:.0f}%, quest {100 * quest:.0f}%)")
    dense_ppl = decode_ppl("dense")
    for setting, limit in (("token_sparse@0.005", 1.0), ("tidal@1024", 2.0)):
        values = decode_ppl(setting)
        for length in sorted(values, key=int):
            if length in dense_ppl:
                change = 100 * (values[length] / dense_ppl[length] - 1)
                lines.append(f"- {setting} decode-phase perplexity within {limit:g}% of dense at {length}: "
                             f"{'met' if abs(change) <= limit else 'MISSED'} ({values[length]:.3f} vs "
                             f"{dense_ppl[length]:.3f}, {change:+.2f}%)")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.fidelity", description="podkit fidelity sweep (passkey + perplexity) on SmolLM2-135M")
    parser.add_argument("--reduced", action="store_true", help="the `make eval` sweep: minutes on CPU")
    parser.add_argument("--out", default="outputs/fidelity")
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--settings", nargs="*", default=None, help="run only these labels (e.g. dense tidal@128)")
    parser.add_argument("--tasks", nargs="+", default=["passkey", "ppl"], choices=["passkey", "ppl"])
    parser.add_argument("--lengths", nargs="*", type=int, default=None, help="override passkey and ppl lengths")
    parser.add_argument("--ppl-lengths", nargs="*", type=int, default=None, help="override the ppl lengths only")
    parser.add_argument("--depths", type=int, default=None)
    parser.add_argument("--decode-tokens", type=int, default=None)
    parser.add_argument("--ppl-windows", type=int, default=None,
                        help="windows per perplexity length (windows are a fixed prefix: a rerun with more adds some)")
    parser.add_argument("--question-phase", choices=["decode", "prefill"], default="decode",
                        help="passkey: feed the question through the decode path (default, every query that must "
                             "find the needle is sparse) or prefill it with the context (only the answer is decoded)")
    parser.add_argument("--tidal-ablation", nargs="*", default=None, metavar="LAYERS",
                        help="extra TidalDecode@128 settings with these selection layers, e.g. 2 2,12 2,8,16,24 all")
    parser.add_argument("--variants", nargs="*", default=None, metavar="SETTING:KEY=VALUE",
                        help="extra settings: a setting plus flat overrides joined by '+', e.g. "
                             "quest@128:quest_page_size=1 (exact per-head top-128) tidal@128:tidal_selection=kv_group")
    parser.add_argument("--calibration-length", type=int, default=None)
    parser.add_argument("--calibration-samples", type=int, default=None)
    parser.add_argument("--no-calibrate", action="store_true", help="use config defaults instead of calibrating")
    parser.add_argument("--pod-blocks", default=None, help="POD blocks JSON (skips the POD calibration's use)")
    parser.add_argument("--replot", action="store_true", help="only redraw PNGs / tables from --out (no model)")
    return parser


def sweep_plan(args: argparse.Namespace) -> SweepPlan:
    """The reduced or full plan with the command line's overrides."""
    plan = copy.deepcopy(REDUCED if args.reduced else FULL)
    if args.lengths:
        plan.passkey_lengths = plan.ppl_lengths = list(args.lengths)
    if args.ppl_lengths:
        plan.ppl_lengths = list(args.ppl_lengths)
    if args.depths:
        plan.depths = args.depths
    if args.decode_tokens is not None:
        plan.decode_tokens = args.decode_tokens
    if args.ppl_windows:
        plan.ppl_windows = args.ppl_windows
    if args.calibration_length:
        plan.calibration_length = args.calibration_length
    if args.calibration_samples:
        plan.calibration_samples = args.calibration_samples
    return plan


def check_question_phase(out: Path, question_phase: str) -> None:
    """A resumed sweep keeps the question phase of the passkey records already in ``out``."""
    earlier = {r.get("question_phase", "decode") for r in load_records(out / "records.jsonl") if r["task"] == "passkey"}
    if earlier - {question_phase}:
        raise SystemExit(f"--question-phase {question_phase} differs from the passkey records already in {out} "
                         f"({', '.join(sorted(earlier))}): use another --out")


def sweep_calibration(args: argparse.Namespace, model, tokenizer, plan: SweepPlan, out: Path, base) -> dict[str, Any]:
    """The calibration the settings use: none (``--no-calibrate``), ``out``'s cached one, or a fresh one (cached)."""
    calibration_path = out / "calibration" / "summary.json"
    if args.no_calibrate:
        calibration: dict[str, Any] = {}
    elif calibration_path.exists():
        calibration = json.loads(calibration_path.read_text())
    else:
        apply_overrides(model, base, {})
        calibration = calibrate(model, tokenizer, plan, out)
        calibration_path.write_text(json.dumps(calibration, indent=1))
    if args.pod_blocks:
        calibration["pod_blocks_file"] = args.pod_blocks
    return calibration


def sweep_settings(plan: SweepPlan, calibration: dict[str, Any], extra: list, wanted: list[str] | None):
    """(passkey + ppl settings, ppl-only settings), only the ``wanted`` labels if given."""
    both, ppl_only = build_settings(plan, calibration, extra=extra)
    if wanted:
        wanted = set(wanted)
        both = [s for s in both if s.label in wanted]
        ppl_only = [s for s in ppl_only if s.label in wanted]
    return both, ppl_only


def record_writer(records: list[dict], records_path: Path, device_name: str, started: float):
    """``emit(record)``: tag it with the device, keep it, append it to ``records_path`` and print one line."""

    def emit(record: dict) -> None:
        record["device"] = device_name   # a resumed sweep may finish on another machine
        records.append(record)
        with open(records_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        label = "ok" if record.get("correct") else "--" if "correct" in record else f"{record['decode_nll'] / max(record['decode_tokens'], 1):.3f}"
        print(f"[{time.time() - started:7.0f}s] {record['task']:8s} {record['setting']:20s} {record['length']:5d} "
              f"{record.get('depth', record.get('window'))} {label} ({record['seconds']:.1f}s)", flush=True)

    return emit


def run_settings(model, tokenizer, base, settings: tuple[list, list], samples: list, plan: SweepPlan,
                 args: argparse.Namespace, done: set, emit) -> dict[str, str]:
    """Every setting's passkey and perplexity records; a setting that fails is kept as its traceback."""
    both, ppl_only = settings
    failures: dict[str, str] = {}
    for setting in both + ppl_only:
        # One setting that breaks (a kernel error, out of memory) must not cost the rest of a long
        # sweep: its traceback is printed and kept in fidelity.json, the others run, the exit code is 1.
        try:
            apply_overrides(model, base, setting.overrides)
            if setting in both and samples:
                run_retrieval(model, tokenizer, "passkey", samples, setting, done=done, emit=emit,
                              question_in_decode=args.question_phase == "decode")
            if "ppl" in args.tasks:
                run_perplexity(model, tokenizer, setting, plan.ppl_lengths, plan.ppl_windows, plan.decode_tokens,
                               done=done, emit=emit)
        except Exception:  # noqa: BLE001 - reported below and in fidelity.json
            failures[setting.label] = traceback.format_exc()
            print(f"setting {setting.label} FAILED:\n{failures[setting.label]}", file=sys.stderr, flush=True)
    return failures


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        return replot(Path(args.out))

    plan = sweep_plan(args)
    out = Path(args.out)
    check_question_phase(out, args.question_phase)
    out.mkdir(parents=True, exist_ok=True)

    started = time.time()
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    base = model.sparse_config
    extra = tidal_ablation_settings(args.tidal_ablation, model.config.num_hidden_layers, base.tidal.full_layers)
    extra += variant_settings(args.variants, model, base)
    calibration = sweep_calibration(args, model, tokenizer, plan, out, base)
    print("calibration:", json.dumps(calibration))

    both, ppl_only = sweep_settings(plan, calibration, extra, args.settings)
    records_path = out / "records.jsonl"
    records = load_records(records_path)
    done = {record_key(r) for r in records}

    device_name = _device_name(args.device)
    emit = record_writer(records, records_path, device_name, started)

    samples = retrieval_samples("passkey", tokenizer, plan.passkey_lengths, plan.depths) if "passkey" in args.tasks else []
    failures = run_settings(model, tokenizer, base, (both, ppl_only), samples, plan, args, done, emit)
    apply_overrides(model, base, {})

    command = "python -m eval.fidelity " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"model": args.model, "device": args.device, "device_name": device_name, "dtype": args.dtype,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "reduced": args.reduced,
            "plan": plan.__dict__, "calibration": calibration, "command": command,
            "question_phase": args.question_phase,
            "settings": {s.label: s.overrides for s in both + ppl_only}, "seconds": round(time.time() - started, 1)}
    if failures:
        meta["failures"] = failures
    result = write_outputs(out, records, meta)
    if failures:
        raise SystemExit(f"{len(failures)} setting(s) failed: {', '.join(failures)} (tracebacks above and in "
                         f"{out / 'fidelity.json'})")
    return result


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def write_outputs(out: Path, records: list[dict], meta: dict) -> dict:
    """fidelity.json, fidelity.md and the sweep PNGs from the records (and the run's metadata)."""
    summary = summarise(records)
    targets = check_targets(summary)
    result = meta | {"summary": summary, "targets": targets}
    (out / "fidelity.json").write_text(json.dumps(result, indent=1))
    plot_if_possible(plots.plot_passkey_grid, records, out / "passkey_grid.png")
    plot_if_possible(plots.plot_perplexity, summary, out / "perplexity.png")
    markdown = (f"Command: `{meta.get('command', '')}`  \nDate: {meta.get('date')}, device: {meta.get('device')} "
                f"({meta.get('device_name')}), dtype {meta.get('dtype')}, torch {meta.get('torch')}, "
                f"{meta.get('seconds', 0):.0f} s\n\nCalibration: {json.dumps(meta.get('calibration', {}))}\n\n"
                + _provenance(records) + plots.markdown_tables(summary)
                + "\n**Targets (issue 6):**\n\n" + ("\n".join(targets) or "- (not measured in this run)") + "\n")
    (out / "fidelity.md").write_text(markdown)
    print(markdown)
    return result


def _provenance(records: list[dict]) -> str:
    """Which device produced which settings' records, when a sweep was resumed on another machine."""
    by_device: dict[str, list[str]] = {}
    for record in records:
        by_device.setdefault(record.get("device", "unrecorded"), []).append(record["setting"])
    if len(by_device) < 2:
        return ""
    lines = [f"- {device}: {len(settings)} records ({', '.join(sorted(set(settings)))})"
             for device, settings in by_device.items()]
    return "Records by device (the sweep was resumed on another machine):\n\n" + "\n".join(lines) + "\n\n"


def replot(out: Path) -> dict:
    """Redraw every PNG and rewrite fidelity.md/json from ``out``'s records and JSONs (no model needed)."""
    folder = out / "calibration"
    if (folder / "pod" / "blocks.json").exists():
        data = json.loads((folder / "pod" / "blocks.json").read_text())
        pod_similarity.plot_similarity_heatmap(torch.tensor(data["similarity"]), data["anchor_layers"],
                                               folder / "pod" / "similarity.png")
    if (folder / "token_sparse_drift.json").exists():
        token_sparse_drift.plot_drift(token_sparse_drift.result_from_json(folder / "token_sparse_drift.json"),
                                      folder / "token_sparse_drift.png")
    if (folder / "tidal_reselection.json").exists():
        tidal_reselection.plot_reselection(tidal_reselection.result_from_json(folder / "tidal_reselection.json"),
                                           folder / "tidal_reselection.png")
    meta = json.loads((out / "fidelity.json").read_text()) if (out / "fidelity.json").exists() else {}
    meta = {k: v for k, v in meta.items() if k not in ("summary", "targets")}
    return write_outputs(out, load_records(out / "records.jsonl"), meta)


if __name__ == "__main__":
    main()
