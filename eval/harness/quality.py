"""``python -m eval.quality``: podkit's local long-context tasks without lm-eval.

Tasks (the same generators as the lm-eval YAML tasks in eval/tasks):

* ``passkey``: synthetic filler haystack; ``passkey_text``: real-text haystack (Moby Dick);
* ``needle``: needle-in-a-haystack QA in Pride and Prejudice;
* ``ppl``: perplexity on held-out windows of Emma.

Unlike a plain lm-eval run, each scheme acts in its own phase (eval.runner): retrieval questions are
fed through the decode path after a prefill of the haystack, and perplexity is reported for the
prefill part and for the last ``--decode-tokens`` tokens scored one decode step at a time.

    python -m eval.quality passkey ppl --model default --settings dense tidal@128 quest@128 \\
        --lengths 2048 4096 --depths 10 --out outputs/quality.json

Imports neither lm-eval nor datasets nor deepspeed: runs on the GPU image as is.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from eval.harness.kv_cache_options import add_kv_cache_arguments, cache_override, check_kv_cache_arguments
from eval.models import load_model, load_tokenizer
from eval.runner import apply_overrides, retrieval_generate, window_perplexity
from eval.schemes import Setting, parse_setting, setting_forms
from eval.tasks.needle import needle_correct, needle_grid
from eval.tasks.passkey import passkey_correct, passkey_grid
from eval.tasks.perplexity import perplexity_windows

RETRIEVAL_TASKS = ("passkey", "passkey_text", "needle")
TASKS = RETRIEVAL_TASKS + ("ppl",)
ANSWER_ROOM = 16  # tokens left for the answer so that context + question + answer fits the length


def retrieval_samples(task: str, tokenizer, lengths: list[int], num_depths: int, samples_per_cell: int = 1,
                      seed: int = 0) -> list:
    """The samples of a retrieval task; ``lengths`` count context + question + ANSWER_ROOM tokens."""
    sized = [length - ANSWER_ROOM for length in lengths]
    if task == "passkey":
        return passkey_grid(tokenizer, sized, num_depths, haystack="filler", samples_per_cell=samples_per_cell, seed=seed)
    if task == "passkey_text":
        return passkey_grid(tokenizer, sized, num_depths, haystack="moby_dick", samples_per_cell=samples_per_cell,
                            seed=seed)
    if task == "needle":
        return needle_grid(tokenizer, sized, num_depths, samples_per_cell=samples_per_cell, seed=seed)
    raise ValueError(f"task={task!r} is not a retrieval task: expected one of {', '.join(RETRIEVAL_TASKS)}")


def run_retrieval(model, tokenizer, task: str, samples: list, setting: Setting,
                  done: set | None = None, emit: Callable[[dict], None] = lambda record: None,
                  question_in_decode: bool = True) -> list[dict]:
    """Answer every sample under the current scheme; one record per sample.

    ``question_in_decode=False`` prefills the question with the context (TidalDecode's and RULER's
    needle protocol: only the answer is decoded) instead of feeding it through the decode path.
    """
    correct = needle_correct if task == "needle" else passkey_correct
    records = []
    for sample in samples:
        key = (task, setting.label, sample.target_tokens + ANSWER_ROOM, sample.depth, sample.seed)
        if done is not None and key in done:
            continue
        start = time.perf_counter()
        generation = retrieval_generate(model, tokenizer, sample.context, sample.question,
                                        question_in_decode=question_in_decode)
        record = {"task": task, "setting": setting.label, "method": setting.method, "budget": setting.budget,
                  "coverage": setting.coverage, "length": sample.target_tokens + ANSWER_ROOM,
                  "depth": sample.depth, "seed": sample.seed, "num_tokens": sample.num_tokens,
                  "expected": sample.passkey, "generation": generation.text,
                  "correct": bool(correct(generation.text, sample.passkey)),
                  "question_phase": "decode" if question_in_decode else "prefill",
                  "token_sparsity": generation.token_sparsity, "seconds": round(time.perf_counter() - start, 3)}
        records.append(record)
        emit(record)
    return records


def run_perplexity(model, tokenizer, setting: Setting, lengths: list[int], num_windows: int, decode_tokens: int,
                   text: str | None = None, done: set | None = None,
                   emit: Callable[[dict], None] = lambda record: None) -> list[dict]:
    """Perplexity records (one per window) under the current scheme; see eval.runner.window_perplexity."""

    records = []
    for length in lengths:
        for index, ids in enumerate(perplexity_windows(tokenizer, length, num_windows, text=text)):
            if done is not None and ("ppl", setting.label, length, index) in done:
                continue
            start = time.perf_counter()
            nll = window_perplexity(model, ids, decode_tokens=min(decode_tokens, length - 2))
            record = {"task": "ppl", "setting": setting.label, "method": setting.method, "budget": setting.budget,
                      "coverage": setting.coverage, "length": length, "window": index,
                      "prefill_nll": nll.prefill_nll, "prefill_tokens": nll.prefill_tokens,
                      "decode_nll": nll.decode_nll, "decode_tokens": nll.decode_tokens,
                      "token_sparsity": nll.token_sparsity, "seconds": round(time.perf_counter() - start, 3)}
            records.append(record)
            emit(record)
    return records


def record_key(record: dict) -> tuple:
    if record["task"] == "ppl":
        return ("ppl", record["setting"], record["length"], record["window"])
    return (record["task"], record["setting"], record["length"], record["depth"], record["seed"])


def summarise(records: Iterable[dict]) -> dict[str, Any]:
    """Per (task, setting, length): accuracy for retrieval, token-weighted perplexities for ppl."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["task"], record["setting"], record["length"])].append(record)
    summary: dict[str, Any] = {}
    for (task, setting, length), rows in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1], item[0][2])):
        entry: dict[str, Any] = {"n": len(rows)}
        if task == "ppl":
            prefill_tokens = sum(r["prefill_tokens"] for r in rows)
            decode_tokens = sum(r["decode_tokens"] for r in rows)
            entry["prefill_ppl"] = math.exp(sum(r["prefill_nll"] for r in rows) / prefill_tokens) if prefill_tokens else None
            entry["decode_ppl"] = math.exp(sum(r["decode_nll"] for r in rows) / decode_tokens) if decode_tokens else None
            entry["decode_tokens"] = decode_tokens
        else:
            entry["accuracy"] = sum(r["correct"] for r in rows) / len(rows)
        sparsities = [r["token_sparsity"] for r in rows if r.get("token_sparsity") is not None]
        if sparsities:
            entry["token_sparsity"] = sum(sparsities) / len(sparsities)
        summary.setdefault(task, {}).setdefault(setting, {})[str(length)] = entry
    return summary


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m eval.quality`` (every option documented)."""
    parser = argparse.ArgumentParser(
        prog="python -m eval.quality", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="podkit's local long-context tasks without lm-eval: retrieval accuracy and perplexity "
                    "per scheme setting, each scheme in its own phase (see eval/runner.py).",
        epilog="example:\n  python -m eval.quality passkey ppl --model default --settings dense tidal@128 "
               "quest@128 \\\n      --lengths 2048 4096 --depths 10 --out outputs/quality.json")
    parser.add_argument("tasks", nargs="+", choices=TASKS, metavar="TASK",
                        help=f"one or more of {', '.join(TASKS)}: passkey (synthetic filler haystack), passkey_text "
                             f"(Moby Dick haystack), needle (QA in Pride and Prejudice), ppl (held-out Emma)")
    parser.add_argument("--model", default="default",
                        help="'default' (the embedded SmolLM2-135M-Instruct) or a checkpoint folder")
    parser.add_argument("--settings", nargs="+", default=["dense"], metavar="SETTING",
                        help=f"scheme settings to compare: {' | '.join(setting_forms())} (B: token budget, TAU: "
                             f"coverage); default: dense")
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192], metavar="TOKENS",
                        help="prompt lengths in tokens (context + question + answer room); default: 2048 4096 8192")
    parser.add_argument("--depths", type=int, default=10,
                        help="needle / pass-key depths per length, evenly spaced from 0%% to 100%% (default: 10)")
    parser.add_argument("--samples-per-cell", type=int, default=1,
                        help="retrieval samples per (length, depth) cell, each with its own key (default: 1)")
    parser.add_argument("--ppl-windows", type=int, default=1,
                        help="held-out windows per length for the ppl task (default: 1)")
    parser.add_argument("--decode-tokens", type=int, default=256,
                        help="last tokens of each ppl window scored one decode step at a time (default: 256)")
    parser.add_argument("--pod-blocks", default=None, metavar="JSON",
                        help="POD blocks JSON (an exploration's blocks.json) for the 'pod' setting")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when a GPU is visible)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16")
    add_kv_cache_arguments(parser, "every setting's")
    parser.add_argument("--out", default=None, metavar="JSON",
                        help="also write every record and the summary to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_kv_cache_arguments(parser, args)
    settings = [parse_setting(label, **({"pod_blocks_file": args.pod_blocks} if label.startswith("pod") and
                                        "@" not in label else {})) for label in args.settings]
    model = load_model(args.model, device=args.device, dtype=args.dtype, **cache_override(args))
    tokenizer = load_tokenizer(args.model)
    base = model.sparse_config
    records: list[dict] = []
    for setting in settings:
        apply_overrides(model, base, setting.overrides)
        for task in args.tasks:
            if task == "ppl":
                records += run_perplexity(model, tokenizer, setting, args.lengths, args.ppl_windows, args.decode_tokens,
                                          emit=lambda r: print(json.dumps(r)))
            else:
                samples = retrieval_samples(task, tokenizer, args.lengths, args.depths, args.samples_per_cell)
                records += run_retrieval(model, tokenizer, task, samples, setting, emit=lambda r: print(json.dumps(r)))
    result = {"model": args.model, "device": args.device, "kv_cache_dtype": base.kv_cache_dtype,
              "kv_cache_recent_keys": base.kv_cache_recent_keys, "records": records,
              "summary": summarise(records)}
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
