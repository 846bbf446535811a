"""Issue 32: RULER with a bf16 cache, plain FP8 KV and FP8 KV with the newest 64 keys in bf16
(``kv_cache_recent_keys=64``) on the same test samples (seed 7919, 13 tasks x 20 at 2K), for dense, TidalDecode @1/8
and Quest @1/8 on SmolLM2-135M-Instruct (this folder; one H200, 2026-12-06, `benchmarks/plans/issue32_recent_keys.sh
ruler`, three processes side by side with three trainings). The 4K pass was stopped by the script's 540 s limit
after 2-5 samples per task, so only 2K is summarised.
Per setting and cache: the RULER average and the paired difference against the bf16 cache on the same samples,
with a 95% bootstrap interval (samples resampled within each task, 2000 draws, fixed seed).
    python3 benchmarks/h200_2026-12-06/issue32_ruler/summarise.py  ->  summary.json"""
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "h100_2026-12-06" / "issue31_placement"))
import summarise as placement  # noqa: E402  (RULER average and the paired bootstrap interval of issue 31's boards)

CACHES = ("bf16", "fp8", "fp8_recent64")
SETTINGS = ("dense", "tidal@1/8", "quest@1/8")
LENGTH = 2048


def scores(cache: str) -> dict[str, dict[str, dict[int, float]]]:
    """setting -> task -> index -> score at LENGTH."""
    out = defaultdict(lambda: defaultdict(dict))
    with gzip.open(HERE / f"board_{cache}" / "records.jsonl.gz", "rt") as f:
        for line in f:
            r = json.loads(line)
            if int(r["length"]) == LENGTH:
                out[r["setting"]][r["task"]][int(r["index"])] = float(r["score"])
    return out


def main() -> dict:
    by_cache = {cache: scores(cache) for cache in CACHES}
    summary = {"length": LENGTH, "samples_per_row": 260, "rows": {}}
    for setting in SETTINGS:
        base = by_cache["bf16"][setting]
        row = {"bf16": round(placement.ruler_average(base), 2)}
        for cache in CACHES[1:]:
            row[cache] = round(placement.ruler_average(by_cache[cache][setting]), 2)
            row[f"{cache}_minus_bf16"] = list(placement.paired_interval(by_cache[cache][setting], base))
        summary["rows"][setting] = row
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for setting, row in summary["rows"].items():
        print(setting, row)
    return summary


if __name__ == "__main__":
    main()
