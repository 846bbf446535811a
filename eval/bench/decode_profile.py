"""Where the time of one decode step goes: a kernel-level profile of the engine's step.

BENCHMARKS.md, "Where the dense decode step's time goes", has its first run.

    python -m eval.bench decode-profile --rows 32768x1 131072x1 --out outputs/bench/decode_profile.json
    python -m eval.bench decode-profile --schemes podkit-dense tidal pod pod+tidal --decode-kernels standard fused
    python -m eval.bench decode-profile --tiny --out /tmp/decode_profile.json      # CPU smoke test of the code path

The model and cache are the ones ``eval.bench e2e`` times (random-init Llama-3-8B shape, bf16, the engine's
static cache filled with random K/V, one CUDA graph per batch size with compiled layers). Per row it reports:

* ``step_ms``: the median of CUDA-event timings of single steps, as ``e2e`` measures them;
* ``busy_ms``: the summed duration of the GPU kernels of one step (torch.profiler over ``--profile-steps``
  steps, divided by the step count), and ``gap_ms = step_ms - busy_ms``: time the GPU does no work inside the
  step (launch latency between graph nodes, host work between graph replays);
* ``categories``: the busy time split by kernel kind (matrix products, attention, norms, RoPE, KV-cache
  writes, fused elementwise, embedding / sampling, other) with kernel counts per step; the top kernels;
* the floors: weight bytes / copy bandwidth for the matrix products, KV bytes / copy bandwidth for the
  attention (copy bandwidth measured in this run, as in ``e2e``), and each category's ratio to its floor. The
  floors are the *dense* step's bytes: a sparse scheme's attention below 1x reads fewer bytes than dense.

Every (scheme, decode kernels, mode) of ``--schemes`` x ``--decode-kernels`` x (graph[, eager]) is one entry of a
row, labelled ``"<scheme> <kernels> <mode>"``.

So "dense is above its floor" splits into: how much is the matrix products above their bytes, how much is
the attention above its KV bytes, how much is the small kernels, and how much is idle. ``--eager`` adds the
same profile without CUDA graphs (host launch cost shows up as gap). JSON is rewritten after every row; a PNG
(stacked bars per row, floors marked) is written next to it when matplotlib is present.
On CPU (``--tiny``) the ops' self CPU time stands in for kernel time, so only the code path is tested there.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from eval.bench.e2e import (
    SHAPES,
    TINY,
    build_model,
    decode_weight_bytes,
    dense_kv_bytes,
    free_memory,
    parse_rows,
    scheme_overrides,
)
from eval.bench.kernels_decode import copy_bandwidth
from kernels import skipping_value_checks
from sparse_models.engine import GenerationEngine

# First match wins: attention before "topk"-like names elsewhere, matrix products before generic names, norms
# (Inductor fuses rsqrt/mean into reductions) before fused elementwise.
CATEGORIES = (
    # podkit's own non-attention decode kernels first (their names contain "decode"); anchored, since Inductor names
    # the kernels it fuses around a custom op after it (triton_red_fused_..._decode_linear_mean_..._rsqrt is a norm)
    ("matrix products", r"^_decode_linear_kernel"),
    ("kv cache write", r"^_append_kv_kernel"),
    ("norms", r"^triton_.*rsqrt"),  # an Inductor reduction with rsqrt is an RMSNorm, whatever op names it carries
    # podkit's kernels (kernels/*.py: _decode_split_kernel, _merge_splits_kernel, _hist_pass_kernel, _count_kernel,
    # _write_kernel, _topk_rows_kernel, _group_probability_kernel, _quest_page_scores_kernel, ...) and torch's
    ("attention", r"decode|attn|attention|_split_kernel|merge_splits|flash|sdpa|topk|_hist_pass|_count_kernel|"
                  r"_write_kernel|group_probability|quest_page|expand_pages|sparse|pod_"),
    ("matrix products", r"gemm|gemv|cutlass|xmma|nvjet|cublas|matmul|\bmm\b|aten::mm|addmm|linear|bmm|sm90_|sm80_"),
    ("norms", r"rsqrt|rms|norm|mean"),
    ("rope", r"rotary|rope|_cos|_sin|\bcos\b|\bsin\b"),
    ("kv cache write", r"index_copy|index_put|scatter|cache|copy_"),
    ("embedding / sampling", r"embedding|index_?select|argmax|gather|softmax"),
    ("fused elementwise", r"triton_|elementwise|vectorized|silu|mul|add|cat|reduce"),
)
# which categories have a byte floor in this benchmark (the rest should be close to zero)
FLOORED = {"matrix products": "weights", "attention": "kv"}


def categorize(name: str) -> str:
    lowered = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


def kernel_times(prof, steps: int, on_gpu: bool) -> list[dict]:
    """Per distinct kernel (GPU) or op (CPU, self time): ``{name, ms_per_step, calls_per_step, category}``."""
    totals: dict[str, list[float]] = {}
    if on_gpu:
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                entry = totals.setdefault(event.name, [0.0, 0])
                entry[0] += event.time_range.elapsed_us()
                entry[1] += 1
    else:
        for event in prof.key_averages():
            if event.self_cpu_time_total > 0:
                totals[event.key] = [event.self_cpu_time_total, event.count]
    rows = [{"name": name, "ms_per_step": us / 1000 / steps, "calls_per_step": count / steps,
             "category": categorize(name)} for name, (us, count) in totals.items()]
    return sorted(rows, key=lambda row: -row["ms_per_step"])


def summarize(kernels: list[dict], step_ms: float, floors_ms: dict) -> dict:
    """Busy / gap and the per-category split of one profiled step (see the module docstring)."""
    busy = sum(k["ms_per_step"] for k in kernels)
    categories: dict[str, dict] = {}
    for k in kernels:
        entry = categories.setdefault(k["category"], {"ms": 0.0, "kernels_per_step": 0.0})
        entry["ms"] += k["ms_per_step"]
        entry["kernels_per_step"] += k["calls_per_step"]
    for name, entry in categories.items():
        entry["share_of_step"] = entry["ms"] / step_ms if step_ms else None
        floor = floors_ms.get(FLOORED.get(name, ""), None)
        if floor:
            entry["floor_ms"] = floor
            entry["ratio_to_floor"] = entry["ms"] / floor
    return {"step_ms": step_ms, "busy_ms": busy, "gap_ms": step_ms - busy,
            "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
            "categories": dict(sorted(categories.items(), key=lambda item: -item[1]["ms"])),
            "top_kernels": kernels[:15]}


def profile_row(model, context: int, batch: int, overrides: dict, *, use_graphs: bool, compile_layers: bool,
                timed_steps: int, profile_steps: int) -> tuple[float, list[dict]]:
    """(median step ms, per-kernel times) of the engine's decode step with a full random cache."""

    device = next(model.parameters()).device
    on_gpu = device.type == "cuda"
    engine = GenerationEngine(model, max_batch_size=batch, max_seq_len=context + timed_steps + profile_steps + 8,
                              use_cuda_graphs=use_graphs, compile_layers=compile_layers, **overrides)
    try:
        engine.cache.fill_random(torch.full((batch,), context, dtype=torch.long, device=device))
        token = torch.zeros(batch, dtype=torch.long, device=device)
        for _ in range(3):  # capture / compile, then warm
            token = engine.step(batch, token).argmax(-1)
        times = []
        for _ in range(timed_steps):
            if on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                token = engine.step(batch, token).argmax(-1)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                token = engine.step(batch, token).argmax(-1)
                times.append(1000 * (time.perf_counter() - t))
        times.sort()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            for _ in range(profile_steps):
                token = engine.step(batch, token).argmax(-1)
            if on_gpu:
                torch.cuda.synchronize()
        return times[len(times) // 2], kernel_times(prof, profile_steps, on_gpu)
    finally:
        del engine
        free_memory()


def plot(result: dict, path: Path) -> str | None:
    try:
        import matplotlib  # lazy: matplotlib is optional (plots only)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)
    except ImportError:
        return None
    bars = [(f"{key} {label}", summary) for key, row in result["rows"].items() for label, summary in row.items()]
    if not bars:
        return None
    names = list(dict.fromkeys(name for name, _ in CATEGORIES)) + ["other"]
    colors = dict(zip(names + ["gap (idle)"], plt.cm.tab10.colors))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(bars)))
    for i, (label, summary) in enumerate(bars):
        left = 0.0
        for name in names:
            ms = summary["categories"].get(name, {}).get("ms", 0.0)
            if ms:
                ax.barh(i, ms, left=left, color=colors[name], label=name if i == 0 else None)
                left += ms
        gap = max(summary["gap_ms"], 0.0)
        ax.barh(i, gap, left=left, color="lightgrey", hatch="//", label="gap (idle)" if i == 0 else None)
        floor = summary.get("floor_ms")
        if floor:
            ax.plot([floor, floor], [i - 0.4, i + 0.4], color="black", linewidth=2,
                    label="floor (bytes / copy bandwidth)" if i == 0 else None)
    ax.set_yticks(range(len(bars)), [label for label, _ in bars])
    ax.set_xlabel("ms per decode step")
    ax.set_title(f"decode step breakdown ({result['model']}, {result['device']})", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}` — {result['date']}, {result['device']}, torch {result['torch']}, "
             f"{result['model']}; copy bandwidth {result['copy_bandwidth_TBps']} TB/s", "",
             "| row | scheme, kernels, mode | step ms | floor ms | busy ms | gap ms | kernels/step | largest categories "
             "(ms, x floor) |", "|---|---|---|---|---|---|---|---|"]
    for key, row in result["rows"].items():
        for label, s in row.items():
            cats = "; ".join(f"{name} {c['ms']:.2f}" + (f" ({c['ratio_to_floor']:.2f}x)" if "ratio_to_floor" in c else "")
                             for name, c in list(s["categories"].items())[:5])
            floor = f"{s['floor_ms']:.2f}" if s.get("floor_ms") else "–"
            lines.append(f"| {key} | {label} | {s['step_ms']:.2f} | {floor} | {s['busy_ms']:.2f} | {s['gap_ms']:.2f} | "
                         f"{s['kernels_per_step']:.0f} | {cats} |")
    return "\n".join(lines) + "\n"


@skipping_value_checks
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.bench decode-profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/bench/decode_profile.json")
    ap.add_argument("--rows", nargs="+", default=["32768x1", "131072x1"], help="CONTEXTxBATCH")
    ap.add_argument("--schemes", nargs="+", default=["podkit-dense"],
                    help="podkit-dense and / or registered decode schemes (tidal, pod, pod+tidal, quest, ...)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--timed-steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="also profile without CUDA graphs")
    ap.add_argument("--no-compile", action="store_true", help="plain eager modules inside the graph")
    ap.add_argument("--decode-kernels", nargs="+", choices=["auto", "standard", "fused"], default=["auto"],
                    help="the engine's decode step: auto (fused on CUDA for batches <= 64), standard (cuBLAS projections + "
                         "indexed cache writes), and / or fused (grouped matrix-vector launches + one-launch KV "
                         "append)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and contexts: exercises the code on CPU")
    args = ap.parse_args(argv)
    for name in ("timed_steps", "profile_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected an integer >= 1")
    rows = parse_rows(args.rows)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and not args.tiny:
        ap.error("no CUDA device: the profile is a GPU benchmark; use --tiny to exercise the code on CPU")
    shape_name, shape = ("tiny Llama", TINY) if args.tiny else SHAPES[args.shape]
    if args.tiny:
        rows = [(min(c, 256), b) for c, b in rows]
    variants = [(scheme, kernels, scheme_overrides(scheme, shape["num_hidden_layers"], shape["num_key_value_heads"],
                                                   args.budget, args.tiny) | {"decode_kernels": kernels})
                for scheme in args.schemes for kernels in args.decode_kernels]  # a bad scheme fails before any work
    # PODKIT_SKIP_VALUE_CHECKS=1 for the whole run (skipping_value_checks): no host syncs in the profiled steps
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = build_model(shape, device, dtype)
    bw = None
    if device == "cuda":
        bw = copy_bandwidth(torch.device(device))
    result = {"benchmark": "decode-profile", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "python -m eval.bench decode-profile " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "model": "random-init " + shape_name, "schemes": args.schemes, "dtype": str(dtype).replace("torch.", ""),
              "decode_kernels": args.decode_kernels,
              "copy_bandwidth_TBps": round(bw / 1e12, 3) if bw else None, "rows": {}, "errors": []}
    elt = torch.empty((), dtype=dtype).element_size()
    modes = [("graph", True)] + ([("eager", False)] if args.eager else [])
    for context, batch in rows:
        key = f"{context}x{batch}"
        floors = {}
        if bw:
            floors = {"weights": 1000 * decode_weight_bytes(model) / bw,
                      "kv": 1000 * dense_kv_bytes(shape, context, batch, elt) / bw}
        for (scheme, kernels, overrides), (mode, use_graphs) in itertools.product(variants, modes):
            label = f"{scheme} {kernels} {mode}"
            try:
                step_ms, kernels_run = profile_row(model, context, batch, overrides,
                                                   use_graphs=use_graphs and device == "cuda",
                                                   compile_layers=not args.no_compile and device == "cuda",
                                                   timed_steps=args.timed_steps, profile_steps=args.profile_steps)
                summary = summarize(kernels_run, step_ms, floors)
                if floors:
                    summary["floor_ms"] = floors["weights"] + floors["kv"]
                    summary["floors_ms"] = floors
                result["rows"].setdefault(key, {})[label] = summary
                print(f"{key} {label}: step {step_ms:.3f} ms, busy {summary['busy_ms']:.3f}, gap "
                      f"{summary['gap_ms']:.3f} ms, {summary['kernels_per_step']:.0f} kernels/step; "
                      + ", ".join(f"{n} {c['ms']:.3f}" for n, c in list(summary["categories"].items())[:6]), flush=True)
            except Exception as err:  # noqa: BLE001 - one failed entry must not lose the others
                result["errors"].append(f"{key} {label}: {type(err).__name__}: {err}")
                print(f"{key} {label}: {type(err).__name__}: {err}", flush=True)
            out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    png = plot(result, out.with_suffix(".png"))
    print(f"wrote {out}" + (f", {png}" if png else ""), flush=True)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
