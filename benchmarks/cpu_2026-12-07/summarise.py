"""Quest @256 at 1K with FP8 KV + the newest 64 keys in the model's dtype, against the unquantised cache, on 12
held-out Emma windows (the 2026-12-05 study's first 3 and 9 more; fp8_recent_keys_quest_12windows.jsonl, written by
``WINDOWS=12 ROWS_OUT=... python benchmarks/cpu_2026-12-05/fp8_recent_keys.py 1024 quest@256/model_dtype
quest@256/fp8+recent64``). Prints and writes summary.json: the decode-perplexity change over all 12 windows, over the
first 3 (the earlier row), and the per-window log-ratio mean with its standard error.
    python3 benchmarks/cpu_2026-12-07/summarise.py"""
import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def main() -> dict:
    rows = {r["cache"]: r for r in map(json.loads, (HERE / "fp8_recent_keys_quest_12windows.jsonl").read_text().splitlines())}
    base, fp8 = rows["model_dtype"], rows["fp8+recent64"]
    logs = [100 * (math.log(b) - math.log(a)) for a, b in zip(base["per_window"], fp8["per_window"])]

    def change(n: int) -> float:
        mean_log = lambda values: sum(map(math.log, values[:n])) / n  # noqa: E731
        return round(100 * (math.exp(mean_log(fp8["per_window"]) - mean_log(base["per_window"])) - 1), 2)

    summary = {"scheme": "quest@256", "length": 1024, "windows": len(logs),
               "ppl": {"model_dtype": round(base["decode_ppl"], 3), "fp8+recent64": round(fp8["decode_ppl"], 3)},
               "change_pct_all_windows": round(100 * (fp8["decode_ppl"] / base["decode_ppl"] - 1), 2),
               "change_pct_first_3_windows": change(3),
               "per_window_log_change_pct": {"mean": round(statistics.mean(logs), 3),
                                             "standard_error": round(statistics.stdev(logs) / math.sqrt(len(logs)), 3),
                                             "values": [round(x, 2) for x in logs]}}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
