"""An adapted POD checkpoint through the whole serving chain, measured.

    python -m eval.chain EXPORT_DIR --out outputs/chain [--held-out podkit:heldout-indomain] [--windows 8]
        [--lengths 2048 4096] [--skip-lm-eval] [--lm-eval-runs pod adapted_dense original_dense] [--update-card]

1. **Engine vs pipeline.** Held-out perplexity of the export as the pipeline scores it (one POD prefill
   per window, ``train.evaluate.perplexity``) and as the engine serves it: the first token prefilled,
   every later token fed by a teacher-forced POD decode step (static cache, CUDA graphs on CUDA),
   log-probabilities read from the engine's logits. The two must agree within ``--tolerance`` (0.5%).
2. **Plain transformers.** The export loaded with ``AutoModelForCausalLM.from_pretrained(...,
   trust_remote_code=True)`` (its self-contained ``modeling_podkit.py``), perplexity on the same windows.
3. **lm-eval.** ``python -m eval.lm_eval`` with the podkit model on the passkey and needle tasks at
   ``--lengths`` x 10 depths: the export with POD, the same weights run densely, and the original dense
   model (``pretrained=default`` unless ``--dense-model`` names another).

Writes ``chain.json`` (and ``--update-card``: copies it into the export and re-renders the model card).
Exit status 1 when a check fails (engine/pipeline disagreement, remote-code load error).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparse_models import PodkitLlamaForCausalLM  # noqa: F401  (registers the podkit classes)
from sparse_models.engine import GenerationEngine
from train.data import token_windows
from train.evaluate import perplexity
from train.export import write_model_card
from train.models import public_model_name
from train.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]


LM_EVAL_RUNS = ("pod", "adapted_dense", "original_dense")  # the export with POD, its weights run densely, the base


@torch.no_grad()
def engine_perplexity(model, windows: torch.Tensor, *, use_cuda_graphs: bool | None = None) -> dict:
    """Teacher-forced perplexity through :class:`GenerationEngine`: ``windows [W, S]`` scored from token 1 on.

    All windows decode together (batch W): prefill token 0, then S - 1 decode steps feeding the true tokens."""
    batch, length = windows.shape
    engine = GenerationEngine(model, max_batch_size=batch, max_seq_len=length + 1,
                              **({} if use_cuda_graphs is None else {"use_cuda_graphs": use_cuda_graphs}))
    device = engine.cache.device
    ids = windows.to(device)
    started = time.perf_counter()
    logits = engine.prefill([[int(t)] for t in ids[:, 0].tolist()])
    nll = torch.zeros(batch, dtype=torch.float64, device=device)
    for t in range(1, length):
        nll -= torch.log_softmax(logits.float(), dim=-1).gather(1, ids[:, t:t + 1]).squeeze(1).double()
        if t < length - 1:
            logits = engine.step(batch, ids[:, t])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tokens = batch * (length - 1)
    mean = float(nll.sum()) / tokens
    return {"ppl": math.exp(mean), "nll": mean, "tokens": tokens, "seconds": time.perf_counter() - started,
            "cuda_graphs": bool(getattr(engine, "use_cuda_graphs", False))}


def remote_code_perplexity(export: Path, windows: torch.Tensor, device: str, dtype: str) -> dict:
    """Perplexity of the export loaded through ``trust_remote_code`` in a process where the repository
    is not importable (so the export's own ``modeling_podkit.py`` runs)."""
    script = r"""
import json, math, sys, time, torch
from transformers import AutoModelForCausalLM
export, device, dtype, path = sys.argv[1:5]
windows = torch.load(path)
model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=getattr(torch, dtype)).to(device).eval()
total, count, start = 0.0, 0, time.perf_counter()
with torch.no_grad():
    for row in windows:
        ids = row[None].to(device)
        logits = model(input_ids=ids).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
print(json.dumps({"ppl": math.exp(total / count), "tokens": count, "seconds": time.perf_counter() - start,
                  "class": type(model).__module__ + "." + type(model).__name__}))
"""
    export = Path(export).resolve()  # the child runs in "/" so that the repository is not importable
    tensor_path = export / ".chain_windows.pt"
    torch.save(windows.cpu(), tensor_path)
    try:
        env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, "-c", script, str(export), device, dtype, str(tensor_path)],
                              capture_output=True, text=True, cwd="/", env=env, timeout=1800)
    finally:
        tensor_path.unlink(missing_ok=True)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def lm_eval_scores(pretrained: str, model_args: str, tasks: str, lengths: list[int], out_dir: Path,
                   device: str) -> dict:
    """Run the podkit lm-eval wrapper; returns {task: acc} (and the output folder)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "eval.harness.lm_eval", "--model", "podkit", "--model_args",
            f"pretrained={pretrained}" + (f",{model_args}" if model_args else ""), "--tasks", tasks,
            "--metadata", json.dumps({"lengths": lengths, "num_depths": 10}), "--batch_size", "1",
            "--device", device, "--output_path", str(out_dir),
            "--log_samples"]  # per-sample answers: which lengths and depths fail, and what the model said
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=3600)
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    results = sorted(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    data = json.loads(results[-1].read_text())["results"]
    return {task: values.get("acc,none") for task, values in data.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.chain", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="an exported POD checkpoint (train/pod.py's export folder)")
    parser.add_argument("--out", type=Path, required=True, help="folder for chain.json and the lm-eval outputs")
    parser.add_argument("--held-out", default="podkit:heldout-indomain", help="held-out source for the perplexities")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows (decoded together by the engine)")
    parser.add_argument("--length", type=int, default=None, help="tokens per window (default: the recipe's context)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="passkey / needle lengths")
    parser.add_argument("--dense-model", default="default", help="the original dense model for lm-eval")
    parser.add_argument("--tolerance", type=float, default=0.005, help="allowed engine/pipeline perplexity ratio - 1")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-lm-eval", action="store_true")
    parser.add_argument("--lm-eval-runs", nargs="+", choices=LM_EVAL_RUNS, default=list(LM_EVAL_RUNS),
                        help="which models lm-eval scores (a sweep of exports scores original_dense once)")
    parser.add_argument("--update-card", action="store_true", help="copy chain.json into the export, re-render the card")
    args = parser.parse_args(argv)
    if not (args.export / "config.json").is_file():
        parser.error(f"export={str(args.export)!r}: no config.json there; pass a folder written by train/pod.py")
    if args.windows < 1:
        parser.error(f"--windows={args.windows}: expected an integer >= 1")

    recipe_path = args.export / "recipe.yaml"
    recipe = load_recipe(recipe_path, check_environment=False) if recipe_path.is_file() else None
    length = args.length or (recipe.eval_context_length if recipe else 2048)
    tokenizer = AutoTokenizer.from_pretrained(args.export)
    windows = token_windows(args.held_out, tokenizer, length, args.windows * length,
                            token_cache=recipe.data.token_cache if recipe else None)
    model = AutoModelForCausalLM.from_pretrained(args.export, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    report: dict = {"export": str(args.export), "held_out": f"{args.held_out}, {windows.shape[0]} x {length} tokens",
                    "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "dtype": args.dtype, "decode_scheme": model.sparse_config.decode_scheme}
    report["pipeline"] = perplexity(model, windows)
    report["engine"] = engine_perplexity(model, windows)
    ratio = report["engine"]["ppl"] / report["pipeline"]["ppl"] - 1
    report["engine_vs_pipeline"] = ratio
    print(f"[chain] pipeline ppl {report['pipeline']['ppl']:.3f}, engine ({report['decode_scheme']} decode, CUDA graphs "
          f"{report['engine']['cuda_graphs']}) {report['engine']['ppl']:.3f} ({100 * ratio:+.2f}%)")
    del model
    report["remote_code"] = remote_code_perplexity(args.export, windows, args.device, args.dtype)
    print(f"[chain] trust_remote_code load: {report['remote_code']}")
    if not args.skip_lm_eval:
        tasks = "podkit_passkey,podkit_needle"
        runs = {"pod": (str(args.export.resolve()), ""),
                "adapted_dense": (str(args.export.resolve()), "prefill_scheme=dense,decode_scheme=dense"),
                "original_dense": (args.dense_model, "prefill_scheme=dense,decode_scheme=dense")}
        report["lm_eval"] = {}
        for name, (pretrained, extra) in runs.items():
            if name not in args.lm_eval_runs:
                continue
            report["lm_eval"][name] = lm_eval_scores(pretrained, extra, tasks, args.lengths, args.out / f"lm_eval_{name}",
                                                     args.device)
            print(f"[chain] lm-eval {name}: {report['lm_eval'][name]}")
    ok = abs(ratio) <= args.tolerance and "error" not in report["remote_code"]
    report["ok"] = ok
    report["summary"] = _summary(report, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chain.json").write_text(json.dumps(report, indent=1))
    if args.update_card and recipe is not None:
        _update_card(args.export, recipe, report)
    print("\n".join("[chain] " + line for line in report["summary"]))
    return 0 if ok else 1


def _summary(report: dict, args) -> list[str]:
    lines = [f"Held-out perplexity ({report['held_out']}, {report['dtype']}, {report['device']}): pipeline "
             f"{report['pipeline']['ppl']:.3f}, engine with {report['decode_scheme']} decode "
             f"{report['engine']['ppl']:.3f} ({100 * report['engine_vs_pipeline']:+.2f}%)"]
    remote = report["remote_code"]
    lines.append("`trust_remote_code=True` load: " + (f"perplexity {remote['ppl']:.3f}" if "ppl" in remote
                                                      else "FAILED"))
    for name, scores in (report.get("lm_eval") or {}).items():
        if "error" in scores:
            lines.append(f"lm-eval {name}: FAILED")
        else:
            lines.append(f"lm-eval {name} ({', '.join(map(str, args.lengths))} tokens x 10 depths): " + ", ".join(
                f"{task} {100 * acc:.0f}%" for task, acc in scores.items() if acc is not None))
    return lines


def _update_card(export: Path, recipe, report: dict) -> None:
    (export / "chain.json").write_text(json.dumps({k: v for k, v in report.items() if k != "export"}, indent=1))
    blocks = json.loads((export / "pod_blocks.json").read_text())["anchor_layers"]
    results_path = export / "eval_results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else None
    write_model_card(export, recipe, blocks, base_model=public_model_name(recipe), results=results)


if __name__ == "__main__":
    sys.exit(main())
