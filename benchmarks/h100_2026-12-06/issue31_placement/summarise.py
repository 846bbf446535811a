"""Issue 31's placement sweep and test board (this folder, one H100, 2026-12-06) beside the earlier boards on the same
test samples (seed 7919, 13 tasks x 20 per length): ../../h200_2026-12-03/issue31/board/records.tgz (dense, Quest @1/8,
the first calibrated pick `all_union` at layers 2 and 12, @1/8 and @1/4) and ../../h200_2026-12-04/c5/issue31/board
(Quest @1/4 and @1/2, `all_union` @1/2); those ran on an H200.

Per row and length: the RULER average (each task weighs the same), the mean KV fraction read, and for the new pick the
paired difference against Quest at the same budget on the same 260 samples, with a 95% bootstrap interval that
resamples the samples within each task (2000 draws, fixed seed).
    python3 benchmarks/h100_2026-12-06/issue31_placement/summarise.py  ->  board_summary.json, board.png"""
import json
import random
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
from eval.harness import leaderboard_records as lr  # noqa: E402  (the record format; standard library only)

FIRST_BOARD = ROOT / "benchmarks" / "h200_2026-12-03" / "issue31" / "board" / "records.tgz"
SECOND_BOARD = ROOT / "benchmarks" / "h200_2026-12-04" / "c5" / "issue31" / "board"
LENGTHS = [2048, 4096, 8192]
FRACTIONS = ["1/8", "1/4", "1/2"]
NEW = "all_union, layers 2 + 14 (this board, H100)"
OLD = "all_union, layers 2 + 12 (first pick, H200)"


def earlier_records() -> list[dict]:
    records = []
    with tarfile.open(FIRST_BOARD) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".jsonl") and "fp8" not in member.name:   # the FP8-KV rows reuse the labels
                text = tar.extractfile(member).read().decode()
                records += [json.loads(line) for line in text.splitlines() if line.strip()]
    for folder in ("quest_1_4", "quest_1_2", "tidal_calibrated_1_2"):
        records += lr.load(SECOND_BOARD / folder / "records.jsonl")
    return [r for r in records if r["setting"] in {"dense", *(f"quest@{f}" for f in FRACTIONS),
                                                   *(f"tidal_calibrated@{f}" for f in FRACTIONS)}]


def rows() -> dict[str, list[dict]]:
    """row label -> its records: dense, Quest per budget, the first and the new calibrated pick per budget."""
    out = defaultdict(list)
    for r in earlier_records():
        label = r["setting"].replace("tidal_calibrated", OLD).replace("quest", "Quest")
        out[label].append(r)
    for folder in sorted((HERE / "board").glob("board_tidal_calibrated_*")):
        for r in lr.load(folder / "records.jsonl"):
            out[r["setting"].replace("tidal_calibrated", NEW)].append(r)
    return out


def by_task(records: list[dict], length: int) -> dict[str, dict[int, float]]:
    tasks = defaultdict(dict)
    for r in records:
        if int(r["length"]) == length:
            tasks[r["task"]][int(r["index"])] = float(r["score"])
    return tasks


def ruler_average(tasks: dict[str, dict[int, float]]) -> float:
    return 100 * sum(sum(s.values()) / len(s) for s in tasks.values()) / len(tasks)


def paired_interval(mine: dict, theirs: dict, draws: int = 2000) -> tuple[float, float, float]:
    """The RULER-average difference mine - theirs on their common samples, and its 95% bootstrap interval (the
    samples resampled within each task, the same draw for both rows)."""
    rng = random.Random(0)
    common = {t: sorted(set(mine[t]) & set(theirs[t])) for t in mine if t in theirs}
    diffs = {t: [mine[t][i] - theirs[t][i] for i in idx] for t, idx in common.items() if idx}
    point = 100 * sum(sum(d) / len(d) for d in diffs.values()) / len(diffs)
    boots = sorted(100 * sum(sum(rng.choices(d, k=len(d))) / len(d) for d in diffs.values()) / len(diffs)
                   for _ in range(draws))
    return round(point, 2), round(boots[int(0.025 * draws)], 2), round(boots[int(0.975 * draws)], 2)


def main():
    table = rows()
    summary = {"protocol": {"test": "seed 7919, 13 tasks x 20 samples at 2048 / 4096 / 8192, every row on the same "
                                    "260 samples per length", "dev": "the sweep: seed 104729, 13 tasks x 10 at 2048 / "
                                                                     "4096, budgets 1/4 and 1/8 (placement/)"},
               "rows": {}, "new_minus_quest": {}}
    for label, records in sorted(table.items()):
        cells = {}
        for length in LENGTHS:
            tasks = by_task(records, length)
            if not tasks:
                continue
            n = sum(len(s) for s in tasks.values())
            kv_read = [float(r["kv_read"]) for r in records if int(r["length"]) == length and r.get("kv_read")]
            cells[str(length)] = {"ruler": round(ruler_average(tasks), 2), "samples": n,
                                  "kv_read": round(sum(kv_read) / len(kv_read), 3) if kv_read else None}
        summary["rows"][label] = cells
    dense = summary["rows"]["dense"]
    for cells in summary["rows"].values():
        for length, cell in cells.items():
            cell["of_dense"] = round(cell["ruler"] / dense[length]["ruler"], 3)
    for fraction in FRACTIONS:
        mine, theirs = table.get(f"{NEW}@{fraction}"), table.get(f"Quest@{fraction}")
        if mine and theirs:
            summary["new_minus_quest"][fraction] = {
                str(n): dict(zip(("difference", "low", "high"),
                                 paired_interval(by_task(mine, n), by_task(theirs, n)))) for n in LENGTHS}
    (HERE / "board_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary)
    for label, cells in summary["rows"].items():
        print(f"| {label} | " + " | ".join(f"{c['ruler']:.1f} ({100 * c['of_dense']:.0f}%)" for c in cells.values()))
    print(json.dumps(summary["new_minus_quest"], indent=1))


def plot(summary: dict) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, fraction in zip(axes, ["1/8", "1/4"]):
        for label, style in (("dense", "k--"), (f"Quest@{fraction}", "s-"), (f"{OLD}@{fraction}", "^:"),
                             (f"{NEW}@{fraction}", "o-")):
            cells = summary["rows"].get(label)
            if cells:
                xs = [int(n) for n in cells]
                ax.plot(xs, [c["ruler"] for c in cells.values()], style, label=label.replace(f"@{fraction}", ""))
        ax.set_xscale("log", base=2)
        ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"budget {fraction} of the context", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("RULER average, test seed (13 tasks x 20)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Calibrated TidalDecode with the re-selection layer at 14 against Quest (SmolLM2-135M-Instruct)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "board.png", dpi=120)


if __name__ == "__main__":
    main()
