"""``generate()`` against the engine on pass-key prompts of varied length.

    python -m eval.bench generate-vs-engine --out outputs/bench/generate_vs_engine.json      # GPU, < 3 min
    python -m eval.bench generate-vs-engine --tiny --out /tmp/gve.json                       # CPU smoke test

A user on a GPU found ``PodkitLlamaForCausalLM.generate()`` (the model loaded as is, fp32 for the embedded
default) unable to finish 40 pass-key prompts of 2K-4K tokens with 8 new tokens each within 250 s, while the
engine did them in seconds. This benchmark measures where that time goes, per prompt, for each path:

* ``generate default``: ``PodkitLlamaForCausalLM.from_pretrained(model)`` with no dtype (the checkpoint's own:
  float32 for the embedded default), ``model.generate()`` greedy, one prompt at a time (dense schemes);
* ``generate bf16``: the same loaded with ``dtype=torch.bfloat16``;
* ``engine bf16`` / ``engine default``: :class:`sparse_models.engine.GenerationEngine` on the same model, one
  engine for all prompts (``max_batch_size=1``, capacity = the longest prompt + new tokens), its defaults as
  ``python -m sparse_models.generate`` uses them (CUDA graphs on CUDA), no warm-up: the first prompt pays the
  compiles.

Prompts: ``--prompts`` pass-key prompts (``eval.tasks.passkey``) with lengths spread evenly over
``--min-tokens`` .. ``--max-tokens`` (every length new) and depths cycling over 5 depths, ``--new-tokens`` new
tokens each (end-of-sequence does not stop a row, so every path does the same work). Each path runs in its own
process (``--no-isolate``: in this one), so that no path inherits another's Triton autotuning or compiled
kernels; its limit (``--generate-time-limit`` / ``--engine-time-limit``, and what is left of
``--total-time-limit``) ends it between prompts, ``generate(max_time=...)`` inside a prompt, and a hard kill
(``limit + --load-allowance``) if one call never returns; the pass over the prompts gets 3/4 of the limit, the
repeat pass (below) the rest. Recorded per prompt: seconds (synchronised), the
tokens generated, the pass key found or not, and what the call added to the process's Triton JIT kernels,
Triton autotuning results and torch.compile graphs (``compiles``: a new prompt length that compiles or
autotunes shows there). After the pass, the first ``--repeat`` prompts it finished run again (lengths already
seen): per-length costs disappear there, the path's own cost does not. Per path: prompts finished of those asked,
first prompt vs the median / mean of the later ones, the repeat median; across paths, whether greedy tokens
agree. The JSON is rewritten after every prompt of a path (a killed path keeps what it measured).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from eval.models import is_default_model, load_tokenizer, podkit_class
from eval.tasks.passkey import make_passkey_sample, passkey_correct

PATHS = ("generate default", "generate bf16", "engine bf16", "engine default")
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
REPEAT_SHARE = 0.75  # of a path's limit for the pass over every prompt; the rest for the repeat pass
REPO = Path(__file__).resolve().parents[2]


def prompt_lengths(count: int, low: int, high: int) -> list[int]:
    """``count`` target lengths spread evenly over [low, high] (all distinct when the range allows)."""
    if count < 1 or low < 16 or high < low:
        raise SystemExit(f"--prompts {count} --min-tokens {low} --max-tokens {high}: expected prompts >= 1 and "
                         f"16 <= min-tokens <= max-tokens")
    if count == 1:
        return [low]
    return [round(low + (high - low) * i / (count - 1)) for i in range(count)]


def build_prompts(args) -> list[dict]:
    """``{"index", "target", "ids", "passkey", "depth"}`` per prompt (token ids, so every path reads the same)."""
    lengths = prompt_lengths(args.prompts, args.min_tokens, args.max_tokens)
    if args.tiny:
        generator = torch.Generator().manual_seed(0)
        return [{"index": i, "target": n, "ids": torch.randint(3, TINY["vocab_size"], (n,), generator=generator).tolist(),
                 "passkey": None, "depth": None} for i, n in enumerate(lengths)]
    tokenizer = load_tokenizer(args.model)
    prompts = []
    for i, n in enumerate(lengths):
        sample = make_passkey_sample(tokenizer, n, DEPTHS[i % len(DEPTHS)], seed=i)
        ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        prompts.append({"index": i, "target": n, "ids": ids, "passkey": sample.passkey, "depth": sample.depth})
    return prompts


# -- what a call compiled -------------------------------------------------------------------------------

def _podkit_kernel_objects():
    """podkit's Triton kernels (autotuners and the JIT functions under them), from the loaded kernels modules."""
    try:
        from triton.runtime.autotuner import Autotuner  # lazy: Triton (CUDA benchmarks)
        from triton.runtime.jit import JITFunction  # lazy: Triton (CUDA benchmarks)
    except Exception:  # no triton: nothing compiles
        return [], []
    tuners, jits, seen = [], [], set()
    for name, module in list(sys.modules.items()):
        if not (name == "kernels" or name.startswith("kernels.")) or module is None:
            continue
        for value in list(vars(module).values()):
            obj = value
            while obj is not None and id(obj) not in seen:
                seen.add(id(obj))
                if isinstance(obj, Autotuner):
                    tuners.append(obj)
                if isinstance(obj, JITFunction):
                    jits.append(obj)
                    break
                obj = getattr(obj, "fn", None) if hasattr(obj, "fn") and not isinstance(obj, type) else None
    return tuners, jits


def compile_counts() -> dict:
    """Process-wide totals: Triton kernels compiled (per specialisation), autotuning results kept, and
    torch.compile graphs; a call's difference is what it compiled."""
    tuners, jits = _podkit_kernel_objects()
    triton_kernels = 0
    for fn in jits:
        try:
            triton_kernels += sum(len(entry[0]) for entry in fn.device_caches.values())
        except Exception:
            pass
    autotuned = sum(len(getattr(t, "cache", {}) or {}) for t in tuners)
    graphs = 0
    try:
        from torch._dynamo.utils import counters  # lazy: torch._dynamo imports slowly; only for this count

        graphs = int(counters["stats"].get("unique_graphs", 0))
    except Exception:
        pass
    return {"triton_kernels": triton_kernels, "autotuned": autotuned, "compiled_graphs": graphs}


def _difference(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- one path --------------------------------------------------------------------------------------------

def load_for(path: str, args, device: torch.device):
    """The model as the path's user loads it: no dtype ("default") or bf16; dense schemes; eval mode."""
    dense = {"prefill_scheme": "dense", "decode_scheme": "dense"}
    bf16 = path.endswith("bf16")
    if args.tiny:
        # lazy: the parent that isolates each path loads no podkit kernels
        from sparse_models import PodkitLlamaForCausalLM

        torch.manual_seed(0)
        model = PodkitLlamaForCausalLM(PodkitLlamaForCausalLM.config_class(**TINY, sparse_attention=dense))
        model = model.to(torch.bfloat16) if bf16 else model
    else:
        if is_default_model(args.model):
            from sparse_models.smollm2 import default_model_path  # lazy: the parent loads no podkit kernels

            folder = default_model_path()
        else:
            folder = Path(args.model)
        model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type", "")
        kwargs = {"dtype": torch.bfloat16} if bf16 else {}
        model = podkit_class(model_type).from_pretrained(str(folder), **kwargs, **dense)
    return model.to(device).eval()


def _record_call(prompt: dict, seconds: float, tokens: list[int], new_tokens: int, compiled: dict, decode) -> dict:
    row = {"index": prompt["index"], "tokens": len(prompt["ids"]), "seconds": seconds, "new_tokens": len(tokens),
           "finished": len(tokens) >= new_tokens, "output_ids": tokens, "compiles": compiled}
    if prompt.get("passkey") and decode is not None:
        row["correct"] = passkey_correct(decode(tokens), prompt["passkey"])
    return row


def run_path(path: str, prompts: list[dict], args, limit_s: float, write=None) -> dict:
    """Every prompt through ``path`` within ``limit_s`` seconds (``write(result)`` after each prompt)."""
    device = torch.device(args.device)
    started = time.perf_counter()
    model = load_for(path, args, device)
    result = {"path": path, "kind": path.split()[0], "dtype": str(model.dtype).replace("torch.", ""),
              "device": str(device), "time_limit_s": limit_s, "per_prompt": [], "repeat": [],
              "asked": len(prompts)}
    decode = None
    if not args.tiny:
        tokenizer = load_tokenizer(args.model)
        decode = tokenizer.decode
    new = args.new_tokens
    if result["kind"] == "engine":
        from sparse_models.engine import GenerationEngine  # lazy: the parent loads no podkit kernels

        engine = GenerationEngine(model, max_batch_size=1, max_seq_len=max(len(p["ids"]) for p in prompts) + new)
        result.update(use_cuda_graphs=engine.use_cuda_graphs, decode_kernels=engine.decode_kernels)

        def call(ids, remaining):
            out = engine.generate([ids], max_new_tokens=new)
            return out.tokens[0], {k: out.timings.get(k) for k in ("prefill_s", "first_step_ms", "steady_ms_per_step")}
    else:
        base_config = copy.deepcopy(model.generation_config)
        pad = getattr(model.config, "pad_token_id", None)
        base_config.update(eos_token_id=None, pad_token_id=0 if pad is None else pad,  # exactly `new` tokens
                           max_new_tokens=new, do_sample=False)

        def call(ids, remaining):
            config = copy.deepcopy(base_config)
            config.max_time = max(remaining, 0.001)  # the limit also ends a prompt that is under way
            input_ids = torch.tensor([ids], device=device)
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                     generation_config=config)
            return out[0, len(ids):].tolist(), {}
    _sync(device)
    result["load_s"] = time.perf_counter() - started
    start = time.perf_counter()
    deadline = start + limit_s
    # the repeat pass keeps a quarter of the limit, so a path cut short by its limit still shows whether a length
    # it has seen runs faster the second time
    pass_deadline = start + limit_s * (REPEAT_SHARE if args.repeat else 1.0)

    def timed(prompt, until):
        before = compile_counts()
        _sync(device)
        t0 = time.perf_counter()
        tokens, extra = call(prompt["ids"], until - t0)
        _sync(device)
        row = _record_call(prompt, time.perf_counter() - t0, tokens, new, _difference(compile_counts(), before), decode)
        row.update(extra)
        return row

    for prompt in prompts:
        if time.perf_counter() >= pass_deadline:
            break
        result["per_prompt"].append(timed(prompt, pass_deadline))
        summarize_path(result)
        if write:
            write(result)
    finished = [prompts[r["index"]] for r in result["per_prompt"] if r["finished"]]
    for prompt in finished[:args.repeat]:
        if time.perf_counter() >= deadline:
            break
        result["repeat"].append(timed(prompt, deadline))
    summarize_path(result)
    result["wall_s"] = time.perf_counter() - started
    if write:
        write(result)
    model = None  # the closures above hold it too; released with them
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def summarize_path(result: dict) -> dict:
    rows = [r for r in result["per_prompt"] if r["finished"]]
    seconds = [r["seconds"] for r in rows]
    later = seconds[1:]
    repeat = [r["seconds"] for r in result.get("repeat", []) if r["finished"]]
    summary = {"finished": len(rows), "of": result["asked"],
               "total_s": sum(r["seconds"] for r in result["per_prompt"]),
               "first_s": seconds[0] if seconds else None,
               "later_median_s": statistics.median(later) if later else None,
               "later_mean_s": statistics.fmean(later) if later else None,
               "repeat_median_s": statistics.median(repeat) if repeat else None,
               "compiles": {k: sum(r["compiles"][k] for r in result["per_prompt"]) for k in
                            ("triton_kernels", "autotuned", "compiled_graphs")},
               "later_prompts_that_compiled": sum(1 for r in result["per_prompt"][1:] if any(r["compiles"].values()))}
    if "correct" in (result["per_prompt"] or [{}])[0]:
        summary["passkey_correct"] = sum(1 for r in rows if r.get("correct"))
    if summary["first_s"] and summary["later_median_s"]:
        summary["first_over_later_median"] = summary["first_s"] / summary["later_median_s"]
    if summary["repeat_median_s"] and summary["later_median_s"]:
        summary["later_over_repeat_median"] = summary["later_median_s"] / summary["repeat_median_s"]
    first_time = {r["index"]: r["seconds"] for r in rows}
    again = [(r["index"], first_time[r["index"]] / r["seconds"]) for r in result.get("repeat", [])
             if r["finished"] and r["index"] in first_time and r["seconds"] > 0]
    if again:  # >1: the prompt was slower the first time (one-time or per-length work)
        summary["first_time_over_repeat"] = {str(i): ratio for i, ratio in again}
    result["summary"] = summary
    return summary


def agreement(paths: dict) -> dict:
    """Per pair of paths: prompts both finished, and how many gave the same greedy tokens."""
    out = {}
    names = [n for n in PATHS if n in paths]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            rows_a = {r["index"]: r["output_ids"] for r in paths[a].get("per_prompt", []) if r["finished"]}
            rows_b = {r["index"]: r["output_ids"] for r in paths[b].get("per_prompt", []) if r["finished"]}
            both = sorted(set(rows_a) & set(rows_b))
            out[f"{a} | {b}"] = {"prompts": len(both), "same_tokens": sum(rows_a[k] == rows_b[k] for k in both)}
    return out


# -- the parent: every path, each in its own process ------------------------------------------------------

def _limit(path: str, args) -> float:
    return args.engine_time_limit if path.startswith("engine") else args.generate_time_limit


def _child_command(path: str, args, prompts_file: Path, result_file: Path, limit: float) -> list[str]:
    command = [sys.executable, "-m", "eval.bench.generate_vs_engine", "--child", path, "--prompts-file",
               str(prompts_file), "--child-result", str(result_file), "--child-limit", str(limit),
               "--model", args.model, "--device", args.device, "--new-tokens", str(args.new_tokens),
               "--repeat", str(args.repeat)]
    return command + (["--tiny"] if args.tiny else [])


def run_isolated(path: str, args, prompts_file: Path, limit: float, workdir: Path) -> dict:
    result_file = workdir / (path.replace(" ", "_") + ".json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))
    started = time.perf_counter()
    try:
        done = subprocess.run(_child_command(path, args, prompts_file, result_file, limit), env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=limit + args.load_allowance)
        status = {"returncode": done.returncode}
        if done.returncode != 0:
            status["stderr_tail"] = done.stderr[-3000:]
    except subprocess.TimeoutExpired:
        status = {"killed_after_s": limit + args.load_allowance}
    result = json.loads(result_file.read_text()) if result_file.is_file() else {
        "path": path, "per_prompt": [], "repeat": [], "asked": args.prompts}
    result.update(process=status, process_wall_s=time.perf_counter() - started)
    summarize_path(result)
    return result


def _environment(args) -> dict:
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    try:
        import triton  # lazy: Triton (CUDA benchmarks)

        info["triton"] = triton.__version__
    except Exception:
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench generate-vs-engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="'default' (the embedded SmolLM2-135M) or a folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, metavar="PATH",
                        help=f"any of: {', '.join(repr(p) for p in PATHS)}")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--min-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="first prompts run again after the pass")
    parser.add_argument("--generate-time-limit", type=float, default=40.0, help="seconds per generate() path")
    parser.add_argument("--engine-time-limit", type=float, default=25.0, help="seconds per engine path")
    parser.add_argument("--total-time-limit", type=float, default=170.0,
                        help="seconds for everything; a later path gets what is left")
    parser.add_argument("--load-allowance", type=float, default=30.0,
                        help="seconds a path's process may take beyond its limit (imports, loading) before a kill")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false", help="every path in this process")
    parser.add_argument("--tiny", action="store_true",
                        help="random-init tiny Llama, random-token prompts (CPU test of the code path)")
    parser.add_argument("--out", default="outputs/bench/generate_vs_engine.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-limit", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error(f"--new-tokens {args.new_tokens}: expected >= 1")
    if args.tiny and args.max_tokens > TINY["max_position_embeddings"] - args.new_tokens:
        args.min_tokens, args.max_tokens = min(args.min_tokens, 48), min(args.max_tokens, 96)

    if args.child:  # one path, in a process of its own
        prompts = json.loads(Path(args.prompts_file).read_text())
        out = Path(args.child_result)
        write = lambda result: out.write_text(json.dumps(result, indent=1))  # noqa: E731
        run_path(args.child, prompts, args, args.child_limit, write=write)
        return 0

    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(args)
    report = {"benchmark": "generate-vs-engine", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "model": "tiny random-init Llama" if args.tiny else args.model, "environment": _environment(args),
              "new_tokens": args.new_tokens, "isolated": args.isolate,
              "limits_s": {"generate": args.generate_time_limit, "engine": args.engine_time_limit,
                           "total": args.total_time_limit, "load_allowance": args.load_allowance},
              "prompts": [{k: p[k] for k in ("index", "target", "passkey", "depth")} | {"tokens": len(p["ids"])}
                          for p in prompts], "paths": {}}

    def write():
        report["agreement"] = agreement(report["paths"])
        report["wall_s"] = time.perf_counter() - started
        out.write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="podkit_gve_") as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        for path in args.paths:
            left = args.total_time_limit - (time.perf_counter() - started) - (args.load_allowance if args.isolate else 0)
            limit = min(_limit(path, args), left)
            if limit <= 0:
                report["paths"][path] = {"path": path, "skipped": "no time left of --total-time-limit"}
                write()
                continue
            if args.isolate:
                result = run_isolated(path, args, prompts_file, limit, Path(tmp))
            else:
                def partial(result, path=path):
                    report["paths"][path] = result
                    write()

                result = run_path(path, prompts, args, limit, write=partial)
            report["paths"][path] = result
            write()
            s = result["summary"]
            print(f"[generate-vs-engine] {path} ({result.get('dtype', '?')}): {s['finished']}/{s['of']} prompts in "
                  f"{s['total_s']:.1f}s; first {_fmt(s['first_s'])}, later median {_fmt(s['later_median_s'])}, "
                  f"repeat median {_fmt(s['repeat_median_s'])}; compiled {s['compiles']}", flush=True)
    write()
    print(f"[generate-vs-engine] {out} ({time.perf_counter() - started:.0f}s)")
    return 0


def _fmt(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.3f}s"


if __name__ == "__main__":
    sys.exit(main())
