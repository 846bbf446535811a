"""Paired differences behind this folder's two RULER measurements (one H100, 2026-12-07, fourth session):

- issue31_ts_sweep/: Token Sparse's full grid on the dev seed (104729, 13 tasks x 10 at 2048 / 4096): every variant
  against the default on the same 130 samples per length;
- issue32_4k/: the test board at 4096 (seed 7919, 13 tasks x 20) with a bf16, an FP8 and an FP8 + recent-keys cache:
  each FP8 row against the bf16 row of the same scheme on the same 260 samples.

A difference is the RULER average (each task weighs the same) of mine - theirs on their common samples, with a 95%
bootstrap interval that resamples the samples within each task (2000 draws, fixed seed), as
../h100_2026-12-06/issue31_placement/summarise.py does.
    python3 benchmarks/h100_2026-12-07d/summarise.py  ->  summary.json, issue32_4k.png"""
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))
from eval.harness import leaderboard_records as lr  # noqa: E402  (the record format; standard library only)

_spec = importlib.util.spec_from_file_location("placement", HERE.parent / "h100_2026-12-06" / "issue31_placement" /
                                               "summarise.py")
placement = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(placement)   # its paired_interval: one bootstrap for both studies

CACHES = ["bf16", "fp8", "fp8_recent64"]
SCHEMES = ["dense", "tidal@1/8", "quest@1/8"]


def by_task(records: list[dict], setting: str, length: int) -> dict[str, dict[int, float]]:
    tasks = defaultdict(dict)
    for r in records:
        if r["setting"] == setting and int(r["length"]) == length:
            tasks[r["task"]][int(r["index"])] = float(r["score"])
    return tasks


def paired_interval(mine: dict, theirs: dict) -> dict[str, float]:
    """The placement study's paired bootstrap (same draws, same seed), with the sample count."""
    point, low, high = placement.paired_interval(mine, theirs)
    return {"difference": point, "low": low, "high": high,
            "samples": sum(len(set(mine[t]) & set(theirs[t])) for t in mine if t in theirs)}


def average(tasks: dict[str, dict[int, float]]) -> float:
    return round(100 * sum(sum(s.values()) / len(s) for s in tasks.values()) / len(tasks), 2)


def token_sparse_sweep() -> dict:
    out = {}
    for length in (2048, 4096):
        records = lr.load(HERE / "issue31_ts_sweep" / f"records_{length}.jsonl")
        settings = sorted({r["setting"] for r in records})
        default = by_task(records, "token_sparse[default]", length)
        cells = {}
        for setting in settings:
            tasks = by_task(records, setting, length)
            cells[setting] = {"ruler": average(tasks)}
            if setting not in ("dense", "token_sparse[default]"):
                cells[setting]["minus_default"] = paired_interval(tasks, default)
        out[str(length)] = cells
    return out


def fp8_at_4k() -> dict:
    records = {cache: lr.load(HERE / "issue32_4k" / cache / "records.jsonl") for cache in CACHES}
    out = {}
    for scheme in SCHEMES:
        bf16 = by_task(records["bf16"], scheme, 4096)
        out[scheme] = {"bf16": average(bf16)}
        for cache in CACHES[1:]:
            tasks = by_task(records[cache], scheme, 4096)
            out[scheme][cache] = average(tasks)
            out[scheme][f"{cache}_minus_bf16"] = paired_interval(tasks, bf16)
    return out


def plot(fp8: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, cache in enumerate(CACHES[1:]):
        cells = [fp8[s][f"{cache}_minus_bf16"] for s in SCHEMES]
        x = [i + (k - 0.5) * 0.3 for i in range(len(SCHEMES))]
        ax.errorbar(x, [c["difference"] for c in cells], fmt="o", capsize=4, label=cache.replace("_", " + "),
                    yerr=[[c["difference"] - c["low"] for c in cells], [c["high"] - c["difference"] for c in cells]])
    ax.axhspan(-1, 1, color="green", alpha=0.12, label="target: within 1 point")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(SCHEMES)), SCHEMES)
    ax.set_ylabel("RULER avg minus bf16 KV (points)")
    ax.set_title("FP8 KV at 4K, test seed, 260 paired samples per row (H100, 2026-12-07)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    summary = {"token_sparse_sweep": token_sparse_sweep(), "fp8_4k": fp8_at_4k()}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary["fp8_4k"], HERE / "issue32_4k.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
