"""TidalDecode's union selection (``all_union`` / ``group_union``) on CPU: the list built from each head's top-k
(kernels/reference.py ``_union_from_top_k``, 2026-12-07) against the same list from sorting all N slots of every
head (``_union_order``, how it was built before), on one selection layer's logits of the Llama-3-8B shape
(32 query heads, 8 KV heads) at 32K and 128K, budget 2048 (one recent slot). Checks the two lists are equal, then
times each (median of REPEATS, after one warm-up). CPU only: GPU times come from ``eval.bench e2e``.

    python benchmarks/cpu_2026-12-07/union_selection_time.py      # -> union_selection_time.json beside this file
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from kernels import reference  # noqa: E402

REPEATS, HEADS, KV_HEADS, BUDGET = 5, 32, 8, 2048


def median_seconds(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> dict:
    torch.manual_seed(0)
    rows = []
    for n in (32768, 131072):
        scores = (torch.randn(1, HEADS, n) * 3).to(torch.bfloat16).float()  # bf16-rounded: ties as in a bf16 model
        seq_lens = torch.tensor([n])
        older = torch.arange(n)[None, :] < n - 1
        k = BUDGET - 1
        for mode, per_list in (("all_union", HEADS), ("group_union", HEADS // KV_HEADS)):
            def before():
                return reference._union_from_sort(scores, seq_lens, older, k, per_list)

            def after():
                return reference._union_from_top_k(scores, seq_lens, older, k, per_list)

            assert torch.equal(before(), after()), (mode, n)
            t_before, t_after = median_seconds(before), median_seconds(after)
            rows.append({"mode": mode, "slots": n, "budget": BUDGET, "sort_every_slot_ms": round(1e3 * t_before, 1),
                         "top_k_candidates_ms": round(1e3 * t_after, 1), "ratio": round(t_after / t_before, 3)})
            print(rows[-1], flush=True)
    result = {"device": "CPU, 2 cores", "torch": torch.__version__, "threads": torch.get_num_threads(),
              "repeats": REPEATS, "heads": HEADS, "kv_heads": KV_HEADS, "rows": rows}
    (HERE / "union_selection_time.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
