"""Summary table and PNG of issue 29's fourth round (this folder, one H100, 2026-12-06): the 8K recipe with score
sharing (as shipped since the third round) with long-range training data that is not RULER's (13% of the rows
podkit:recall-long episodes) and, separately, with units chosen by gates learned on synthetic recall episodes
(`pod.protect_units: auto`), beside the earlier rounds' rows on the same test samples
(../../h200_2026-12-04/issue29_round3/summary.json: the original model, the 8K dense fine-tune control, the 8K
recipe with key and with score sharing; those ran on an H200). RULER test split per row; the dev split and
held-out perplexity from each run's learning curve (last point); KV saved from the training log.
    python3 benchmarks/h100_2026-12-06/issue29_round4/summarise.py  ->  summary.json, ruler_vs_length.png"""
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
THIRD_ROUND = HERE.parents[1] / "h200_2026-12-04" / "issue29_round3" / "summary.json"
sys.path.insert(0, str(HERE.parents[1] / "h200_2026-12-04" / "issue29_round2"))
import summarise as second_round  # noqa: E402  (the second round's row and percentage helpers)

CARRIED = ("original", "control_8k", "control_2k", "pod_8k", "pod_8k_scores", "pod_8k_scores_dense")
ROWS = {  # row -> (run, label)
    "pod_8k_scores_recall": ("pod_8k_scores_recall",
                             "POD export, 8K recipe, score sharing, 13% podkit:recall-long rows"),
    "pod_8k_scores_recall_dense": ("pod_8k_scores_recall", "its weights run densely"),
    "pod_8k_scores_auto": ("pod_8k_scores_auto", "POD export, 8K recipe, score sharing, 16 units by learned gates"),
    "pod_8k_scores_auto_dense": ("pod_8k_scores_auto", "its weights run densely"),
}


def kv_saved(run: str) -> float:
    """The map's KV saved at 8192 as the training log states it (the explore stage's or the unit selection's)."""
    text = (HERE / "logs" / f"{run}.train.log").read_text()
    found = re.findall(r"KV saved at \d+ [\d.]+% -> ([\d.]+)%", text) or re.findall(r"KV saved ([\d.]+)% >=", text)
    return float(found[-1])


def main():
    third = json.loads(THIRD_ROUND.read_text())
    summary = {"protocol": third["protocol"], "device": "NVIDIA H100 80GB HBM3 (the carried rows: H200)"}
    summary["rows"] = second_round.later_round_rows(third, CARRIED, "2026-12-04, round 3", HERE, ROWS, kv_saved)
    second_round.add_percentages(summary)
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    rows = ["original", "control_8k", "pod_8k_scores", "pod_8k_scores_recall", "pod_8k_scores_recall_dense",
            "pod_8k_scores_auto"]
    title = ("SmolLM2-135M trained at 8192 tokens with score sharing, 30.1% KV saved:\n"
             "recall-long data and learned units (H100, 2026-12-06; earlier rows H200)")
    second_round.save_one_panel(summary, rows, title, HERE / "ruler_vs_length.png")


if __name__ == "__main__":
    main()
