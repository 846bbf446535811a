"""On a GPU: TidalDecode's union lists built from each head's top-k (kernels/reference.py ``_union_from_top_k``) against
the same lists from sorting all N slots of every head (``_union_order``), at the Llama-3-8B shape (32 query heads,
8 KV heads), 128K slots x batch 1 and 4, budget 2048: equal lists, and each one's time (CUDA events, median of 20
after 3 warm-ups; eager, and replayed from one CUDA graph as in the engine). Writes JSON to the path given (default:
union_gpu_check.json), with, for batch 1 and ``all_union``, each route's ten costliest GPU entries under
torch.profiler (where a route's time goes; the e2e decode pays the batch-1 route twice per token).

    python3 benchmarks/plans/union_gpu_check.py $OUT/union_gpu_check.json
"""
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.bench.kernels_decode import _bench_graph  # noqa: E402
from kernels import reference  # noqa: E402

HEADS, KV_HEADS, BUDGET, N = 32, 8, 2048, 131072


def median_ms(fn, repeats=20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_median_ms(fn) -> float | None:
    """fn replayed from one CUDA graph, as the engine's decode step runs it (eval/bench/kernels_decode.py: no launch
    overhead, which the eager times above include for a route of many small ops), in ms; None if capture fails."""
    try:
        return _bench_graph(fn) / 1e3
    except Exception as error:  # noqa: BLE001  (a diagnostic: report it, keep the other rows)
        print(f"capture failed: {error!r}", flush=True)
        return None


def kernel_times(fn, repeats=10) -> list[dict]:
    """The ten profiler entries (torch ops and their CUDA kernels) with the most GPU time over ``repeats`` calls of
    fn (after a warm-up): name, GPU ms and launches per call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:10]
    return [{"kernel": e.key[:100], "ms_per_call": round(e.device_time_total / 1e3 / repeats, 4),
             "launches_per_call": e.count / repeats} for e in events]


rows, profiles = [], {}
for batch in (1, 4):
    scores = (torch.randn(batch, HEADS, N, device="cuda") * 3).to(torch.bfloat16).float()
    seq_lens = torch.full((batch,), N, device="cuda")
    older = torch.arange(N, device="cuda")[None, :] < (seq_lens[:, None] - 1)
    k = BUDGET - 1
    for mode, per_list in (("all_union", HEADS), ("group_union", HEADS // KV_HEADS)):
        def before():
            return reference._union_from_sort(scores, seq_lens, older, k, per_list)

        def after():
            return reference._union_from_top_k(scores, seq_lens, older, k, per_list)

        equal = bool(torch.equal(before(), after()))
        t_before, t_after = median_ms(before), median_ms(after)
        g_before, g_after = graph_median_ms(before), graph_median_ms(after)
        rows.append({"mode": mode, "batch": batch, "slots": N, "equal": equal, "sort_every_slot_ms": round(t_before, 3),
                     "top_k_candidates_ms": round(t_after, 3), "ratio": round(t_after / t_before, 3),
                     "graph_sort_every_slot_ms": g_before and round(g_before, 3),
                     "graph_top_k_candidates_ms": g_after and round(g_after, 3)})
        print(rows[-1], flush=True)
        if batch == 1 and mode == "all_union":
            try:  # a diagnostic: a profiler failure must not lose the timed rows
                profiles = {"sort_every_slot": kernel_times(before), "top_k_candidates": kernel_times(after)}
            except Exception as error:  # noqa: BLE001
                profiles = {"error": repr(error)}
            print(json.dumps(profiles)[:1500], flush=True)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "union_gpu_check.json")
out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                          "profiles_batch1_all_union": profiles},
                          indent=1) + "\n")
