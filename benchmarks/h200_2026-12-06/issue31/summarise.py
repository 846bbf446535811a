"""Issue 31's test-board rows of 2026-12-06's fourth session (this folder, one H200), beside the earlier boards on the
same test samples (seed 7919, 13 tasks x 20 per length; ../../h100_2026-12-06/issue31_placement/summarise.py reads
them):
  * the calibrated TidalDecode (the all-heads union, re-selection layer 14, picked on the dev seed) at 1/2, against
    Quest @1/2 and the first pick (layer 12) @1/2;
  * Token Sparse (today's tau 0.005 and the calibrated variant) with the question prefilled together with the
    context (``eval.leaderboard --question-phase prefill``, the Token Sparse paper's setting), each against dense
    scored the same way, beside the decode-protocol rows of 2026-12-03;
  * POD + TidalDecode on an adapted POD export (the 8K recipe's score-sharing export of the same session,
    ../issue29_round6/train/pod_8k_scores): the export alone and with today's and the calibrated TidalDecode @1/8.
Paired differences come with a 95% bootstrap interval that resamples samples within each task (2000 draws).
    python3 benchmarks/h200_2026-12-06/issue31/summarise.py  ->  summary.json, board.png"""
import gzip
import json
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
PLACEMENT = ROOT / "benchmarks" / "h100_2026-12-06" / "issue31_placement"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(PLACEMENT))
import summarise as placement  # noqa: E402  (earlier boards, per-task scores, paired intervals)

LENGTHS = [2048, 4096, 8192]


def load(folder: str) -> list[dict]:
    """A board folder's per-sample records (records.jsonl, kept here gzipped)."""
    with gzip.open(HERE / folder / "records.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def cells(records: list[dict]) -> dict[str, dict]:
    out = {}
    for length in LENGTHS:
        tasks = placement.by_task(records, length)
        if tasks:
            out[str(length)] = {"ruler": round(placement.ruler_average(tasks), 2),
                                "samples": sum(len(s) for s in tasks.values())}
    return out


def by_setting(records: list[dict]) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for r in records:
        out[r["setting"]].append(r)
    return out


def paired(mine: list[dict], theirs: list[dict]) -> dict[str, dict]:
    return {str(n): dict(zip(("difference", "low", "high"),
                             placement.paired_interval(placement.by_task(mine, n), placement.by_task(theirs, n))))
            for n in LENGTHS}


def main() -> dict:
    earlier = by_setting(placement.earlier_records())
    earlier_ts = by_setting(r for name in ("records_token_sparse_0.005.jsonl", "records_token_sparse_calibrated.jsonl")
                            for r in placement_records(name))
    half = load("board_tidal_calibrated_1_2")
    prefill = by_setting(load("board_prefill_token_sparse"))
    pod = by_setting(load("board_pod_tidal"))
    summary = {"protocol": "test seed 7919, 13 tasks x 20 samples per length; every pick made on the dev seed 104729",
               "half": {"dense (decode protocol, 2026-12-03)": cells(earlier["dense"]),
                        "Quest @1/2 (2026-12-04)": cells(earlier["quest@1/2"]),
                        "calibrated, layer 12 @1/2 (2026-12-04)": cells(earlier["tidal_calibrated@1/2"]),
                        "calibrated, layer 14 @1/2 (this board)": cells(half)},
               "half_minus_quest": paired(half, earlier["quest@1/2"]),
               "token_sparse": {}, "pod_tidal": {}}
    for setting in ("dense", "token_sparse@0.005", "token_sparse_calibrated"):
        summary["token_sparse"][f"{setting}, question prefilled"] = cells(prefill[setting])
        decode = earlier["dense"] if setting == "dense" else earlier_ts[setting]
        summary["token_sparse"][f"{setting}, question decoded (2026-12-03)"] = cells(decode)
    for protocol in ("prefilled", "decoded (2026-12-03)"):
        base = summary["token_sparse"][f"dense, question {protocol}"]
        for setting in ("token_sparse@0.005", "token_sparse_calibrated"):
            row = summary["token_sparse"][f"{setting}, question {protocol}"]
            for n, cell in row.items():
                cell["of_dense"] = round(cell["ruler"] / base[n]["ruler"], 3)
    for setting, records in pod.items():
        summary["pod_tidal"][setting] = cells(records)
    summary["pod_tidal"]["tidal_calibrated@1/8 on the original (H100 board)"] = cells(
        placement.lr.load(PLACEMENT / "board" / "board_tidal_calibrated_1_8" / "records.jsonl"))
    summary["pod_calibrated_minus_pod_today"] = paired(pod["pod_adapted+tidal_calibrated@1/8"],
                                                       pod["pod_adapted+tidal@1/8"])
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary)
    for part in ("half", "token_sparse", "pod_tidal"):
        for label, row in summary[part].items():
            print(f"{part:13s} {label:60s}", {n: (c["ruler"], c.get("of_dense")) for n, c in row.items()})
    print("layer 14 @1/2 - Quest @1/2", summary["half_minus_quest"])
    print("POD + calibrated - POD + today's @1/8", summary["pod_calibrated_minus_pod_today"])
    return summary


def placement_records(name: str) -> list[dict]:
    """The 2026-12-03 board's records of one file (its tar, as placement.earlier_records reads it)."""
    with tarfile.open(placement.FIRST_BOARD) as tar:
        text = tar.extractfile(f"./{name}").read().decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def plot(summary: dict) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for ax, part, title in ((axes[0], "half", "TidalDecode at 1/2 of the context"),
                            (axes[1], "token_sparse", "Token Sparse: the question prefilled or decoded"),
                            (axes[2], "pod_tidal", "POD + TidalDecode @1/8 on the adapted export")):
        for label, row in summary[part].items():
            xs = [int(n) for n in row]
            dashed = label.startswith("dense") or "original" in label or label == "pod_adapted"
            ax.plot(xs, [c["ruler"] for c in row.values()], "o--" if dashed else "o-", label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 55)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("RULER average, test seed (13 tasks x 20)")
    fig.suptitle("Issue 31 on SmolLM2-135M-Instruct (H200, 2026-12-06; earlier rows as labelled)", fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "board.png", dpi=120)


if __name__ == "__main__":
    main()
