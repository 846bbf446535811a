"""Summary, table and PNG of issue 29's sixth round (this folder; one H200, 2026-12-06, the fourth session that day).

What the round measured (benchmarks/plans/issue29_31_round6.sh, the last call's script inlined in BENCHMARKS.md):
  * the wide dev split (seed 104729, 13 tasks x 10 samples at 2K / 4K / 8K) of three 8K exports trained side by
    side: the shipped setting (pod_8k_scores), the recall candidate (13% podkit:recall-long rows) and the recall
    candidate with units chosen by learned gates; benchmarks/plans/issue29_choose.py's rule, written before these
    rows existed, picks the setting to ship (dev/choice.json: the first two; the third is compared here by the
    same rule);
  * on the test split (seed 7919, 13 x 20), the recall candidate as served and with every shared unit's distant
    part skipped (``pod_gate_tau`` near 0: its sink and 1008-token recent window only): does the shared distant
    attention help or cost? The two rows are the same weights on the same samples, so their difference is paired;
  * the run's training loss against the fourth round's run of the same seed on an H100 (the runs are seeded).
Carried rows (the original, the recall candidate's own dense control, the fourth round's run and its weights run
densely) come from ../../h100_2026-12-06/issue29_round5/summary.json, the same test samples.
    python3 benchmarks/h200_2026-12-06/issue29_round6/summarise.py [RULER_SAMPLES_DIR]
RULER_SAMPLES_DIR (optional; benchmarks/plans/ruler_samples.py's test samples) adds the split by needle distance
(the fifth round's needle_distance.py). Writes summary.json and round6.png here."""
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
FIFTH = HERE.parents[1] / "h100_2026-12-06" / "issue29_round5"
sys.path.insert(0, str(FIFTH))
sys.path.insert(0, str(FIFTH.parent / "issue31_placement"))
sys.path.insert(0, str(HERE.parents[1] / "plans"))
import issue29_choose  # noqa: E402  (the pre-registered ship rule)
import needle_distance  # noqa: E402  (the fifth round's distance buckets and prompt rendering)
import summarise as placement  # noqa: E402  (issue 31's paired bootstrap interval)

CARRIED = ("original", "control_8k_recall", "pod_8k_scores_recall", "pod_8k_scores_recall_dense")
TEST_ROWS = {"pod_8k_scores_recall_h200": ("rows/pod_8k_scores_recall.json",
                                           "POD export, recall candidate: this round's run (H200, same seed)"),
             "pod_8k_scores_recall_proximal": ("rows/pod_8k_scores_recall_proximal.json",
                                               "the same export, shared units' distant part skipped")}
DEV_ROWS = {"pod_8k_scores": "dev/devrows/pod_8k_scores.json",
            "pod_8k_scores_recall": "dev/devrows/pod_8k_scores_recall.json",
            "pod_8k_scores_recall_auto": "dev_auto/devrows/pod_8k_scores_recall_auto.json"}
LENGTHS = ("2048", "4096", "8192")


def records_by_task(path: Path) -> dict[str, dict[str, dict[int, float]]]:
    """length -> task -> index -> score in [0, 1] (the rows store 0-100), from a row JSON's per-sample records."""
    out = defaultdict(lambda: defaultdict(dict))
    for r in json.loads(path.read_text())["records"]:
        out[str(r["length"])][r["task"]][int(r["index"])] = float(r["score"]) / 100
    return out


def loss_agreement() -> dict:
    """This run's training loss against the fourth round's run of the same seed (H100), step by step."""
    def losses(path: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]

    h100 = losses(FIFTH.parent / "issue29_round4" / "train" / "pod_8k_scores_recall" / "losses.jsonl")
    h200 = losses(HERE / "train" / "pod_8k_scores_recall" / "losses.jsonl")
    pairs = list(zip(h100, h200))
    return {"steps_compared": len(pairs), "mean_abs_difference": round(sum(abs(a - b) for a, b in pairs) / len(pairs), 5),
            "mean_loss_last_100": [round(sum(a for a, _ in pairs[-100:]) / 100, 4),
                                   round(sum(b for _, b in pairs[-100:]) / 100, 4)]}


def choice_of_all_three(dev: dict) -> dict:
    """issue29_choose.py's rule over the three dev rows (its own run read the first two; the third was scored in a
    separate folder of the same call)."""
    return issue29_choose.choose(dev)


def needle_split(samples_dir: Path) -> dict:
    """Retrieval score by needle distance for this round's two test rows (the fifth round's buckets)."""
    far = needle_distance.distances(samples_dir, needle_distance.load_tokenizer("default"))
    out = {}
    for row, (path, _) in TEST_ROWS.items():
        cells = defaultdict(list)
        for r in json.loads((HERE / path).read_text())["records"]:
            key = (r["task"], r["length"], r["index"])
            if key in far:
                cells[(r["length"], needle_distance.bucket_of(far[key]))].append(r["score"])
        out[row] = {f"{n}@{b}": {"score": round(sum(v) / len(v), 1), "n": len(v)} for (n, b), v in sorted(cells.items())}
    return out


def plot(summary: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    xs = [int(n) for n in LENGTHS]
    for row, entry in summary["test"].items():
        dashed = row in ("original", "control_8k_recall", "pod_8k_scores_recall_dense")
        left.plot(xs, [entry["test"][n] for n in LENGTHS], marker="o", linestyle="--" if dashed else "-",
                  label=entry["label"])
    left.set_xscale("log", base=2)
    left.set_xticks(xs, LENGTHS)
    left.set_xlabel("context (tokens)")
    left.set_ylabel("RULER average, test split (13 tasks x 20)")
    left.set_ylim(0, 60)
    left.grid(alpha=0.3)
    left.legend(fontsize=6.5, loc="lower left")
    left.set_title("The recall candidate, its control, and its shared distant part skipped", fontsize=9)
    width = 0.25
    for i, (row, cells) in enumerate(summary["dev"].items()):
        right.bar([j + width * (i - 1) for j in range(len(LENGTHS))], [cells[n] for n in LENGTHS], width=width,
                  label=f"{row} (mean {summary['dev_choice']['mean'][row]:.2f})")
    right.set_xticks(range(len(LENGTHS)), LENGTHS)
    right.set_xlabel("context (tokens)")
    right.set_ylabel("RULER average, wide dev split (13 tasks x 10)")
    right.set_title(f"The choice on the dev split: {summary['dev_choice']['pick']} ships", fontsize=9)
    right.grid(alpha=0.3, axis="y")
    right.legend(fontsize=7)
    fig.suptitle("Issue 29, sixth round: SmolLM2-135M, 8K recipe, score sharing, 30.1% KV saved (H200, 2026-12-06)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> dict:
    fifth = json.loads((FIFTH / "summary.json").read_text())
    control = fifth["rows"]["control_8k_recall"]["test"]
    original = fifth["rows"]["original"]["test"]
    test = {row: {"label": fifth["rows"][row]["label"], "test": fifth["rows"][row]["test"]} for row in CARRIED}
    for row, (path, label) in TEST_ROWS.items():
        data = json.loads((HERE / path).read_text())
        test[row] = {"label": label, "test": {n: round(s["average"], 2) for n, s in data["summary"].items()},
                     "categories": {n: {c: round(v, 2) for c, v in s["categories"].items()}
                                    for n, s in data["summary"].items()}}
    for entry in test.values():
        entry["pct_of_original"] = {n: round(100 * entry["test"][n] / original[n], 1) for n in LENGTHS}
        entry["pct_of_own_control"] = {n: round(100 * entry["test"][n] / control[n], 1) for n in LENGTHS}
    served = records_by_task(HERE / TEST_ROWS["pod_8k_scores_recall_h200"][0])
    proximal = records_by_task(HERE / TEST_ROWS["pod_8k_scores_recall_proximal"][0])
    dev = {row: {n: round(s["average"], 2) for n, s in json.loads((HERE / path).read_text())["summary"].items()}
           for row, path in DEV_ROWS.items()}
    summary = {
        "protocol": {"test": "seed 7919, 13 tasks x 20 samples per length, scored once after training; nothing "
                             "chosen on it", "dev": "seed 104729, 13 tasks x 10 per length (the wide dev split): "
                                                    "the ship choice, by issue29_choose.py's rule"},
        "device": "NVIDIA H200 (this round); carried rows as their labels say",
        "test": test,
        "proximal_minus_served": {n: list(placement.paired_interval(proximal[n], served[n])) for n in LENGTHS},
        "dev": dev, "dev_choice": choice_of_all_three(dev),
        "same_seed_rerun": loss_agreement(),
    }
    if argv:
        summary["needle_distance"] = needle_split(Path(argv[0]))
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, HERE / "round6.png")
    for row, entry in test.items():
        print(f"{row:32s}", entry["test"], entry["pct_of_original"], entry["pct_of_own_control"])
    print("proximal - served", summary["proximal_minus_served"])
    print("dev", summary["dev_choice"]["mean"], "pick", summary["dev_choice"]["pick"])
    print("same seed", summary["same_seed_rerun"])
    for row, cells in summary.get("needle_distance", {}).items():
        print(row, {k: (v["score"], v["n"]) for k, v in cells.items()})
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
