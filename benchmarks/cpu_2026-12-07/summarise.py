"""FP8 KV + the newest 64 keys in the model's dtype against the unquantised cache, at 1K on 12 held-out Emma windows
(the 2026-12-05 study's first 3 and 9 more), per scheme: ``*.jsonl`` here, written by ``WINDOWS=12 ROWS_OUT=FILE
python benchmarks/cpu_2026-12-05/fp8_recent_keys.py 1024 SCHEME/model_dtype SCHEME/fp8+recent64``. For each scheme
with both rows: the decode-perplexity change over all 12 windows, over the first 3 (the earlier study's cell), and
the per-window log-ratio mean with its standard error. Prints and writes summary.json.
    python3 benchmarks/cpu_2026-12-07/summarise.py"""
import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def change_over(first: list[float], second: list[float], n: int) -> float:
    """% change of the decode perplexity over the first n windows (each window weighs the same: 256 tokens)."""
    mean_log = [sum(map(math.log, values[:n])) / n for values in (first, second)]
    return round(100 * (math.exp(mean_log[1] - mean_log[0]) - 1), 2)


def main() -> dict:
    rows = {}
    for path in sorted(HERE.glob("*.jsonl")):
        for r in map(json.loads, path.read_text().splitlines()):
            rows[(r["scheme"], r["cache"])] = r
    summary = {"length": 1024, "schemes": {}}
    for scheme in sorted({s for s, _ in rows}):
        base, fp8 = rows.get((scheme, "model_dtype")), rows.get((scheme, "fp8+recent64"))
        if not (base and fp8):
            continue
        logs = [100 * (math.log(b) - math.log(a)) for a, b in zip(base["per_window"], fp8["per_window"])]
        summary["schemes"][scheme] = {
            "windows": len(logs),
            "ppl": {"model_dtype": round(base["decode_ppl"], 3), "fp8+recent64": round(fp8["decode_ppl"], 3)},
            "change_pct_all_windows": round(100 * (fp8["decode_ppl"] / base["decode_ppl"] - 1), 2),
            "change_pct_first_3_windows": change_over(base["per_window"], fp8["per_window"], 3),
            "per_window_log_change_pct": {"mean": round(statistics.mean(logs), 3),
                                          "standard_error": round(statistics.stdev(logs) / math.sqrt(len(logs)), 3),
                                          "values": [round(x, 2) for x in logs]}}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for scheme, cell in summary["schemes"].items():
        print(scheme, cell["ppl"], cell["change_pct_all_windows"], cell["change_pct_first_3_windows"],
              cell["per_window_log_change_pct"]["standard_error"])
    return summary


if __name__ == "__main__":
    main()
