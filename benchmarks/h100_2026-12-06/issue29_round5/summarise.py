"""Summary table and PNG of issue 29's fifth round (this folder, one H100, 2026-12-06): the dense fine-tune control
trained with the recall candidate's data (the 8K recipe, train.attention=dense, 13% podkit:recall-long rows), the
fair reference for that candidate, beside the fourth round's rows on the same test samples
(../issue29_round4/summary.json: the original model, the 8K control without the recall rows, the shipped 8K export
and the recall candidate with its weights run densely). RULER test split per row; the dev split and held-out
perplexity from the run's learning curve (last point).
The second run of the candidate that this round started was stopped at step 811 of 1000 for device time; its
training loss is compared with the fourth round's run (the runs are seeded: the same data order and initial state).
    python3 benchmarks/h100_2026-12-06/issue29_round5/summarise.py  ->  summary.json, ruler_vs_length.png"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
FOURTH_ROUND = HERE.parent / "issue29_round4"
sys.path.insert(0, str(HERE.parents[1] / "h200_2026-12-04" / "issue29_round2"))
import summarise as second_round  # noqa: E402  (the second round's row and percentage helpers)

CARRIED = ("original", "control_8k", "control_2k", "pod_8k_scores", "pod_8k_scores_recall",
           "pod_8k_scores_recall_dense")
ROWS = {"control_8k_recall": ("control_8k_recall",
                              "dense fine-tune control, 8K recipe, 13% podkit:recall-long rows")}
OWN_CONTROL = {"pod_8k_scores_recall": "control_8k_recall", "pod_8k_scores_recall_dense": "control_8k_recall",
               "control_8k_recall": "control_8k_recall", "pod_8k_scores": "control_8k", "control_8k": "control_8k"}


def loss_agreement() -> dict:
    """The stopped second run's training loss against the fourth round's run over the steps both reached."""
    def losses(path: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]

    first = losses(FOURTH_ROUND / "train" / "pod_8k_scores_recall" / "losses.jsonl")
    second = losses(HERE / "train" / "pod_8k_scores_recall" / "losses.jsonl")
    pairs = list(zip(first, second))
    return {"steps_compared": len(pairs), "first_run_steps": len(first),
            "mean_abs_difference": round(sum(abs(a - b) for a, b in pairs) / len(pairs), 5),
            "mean_loss_last_100": [round(sum(a for a, _ in pairs[-100:]) / 100, 4),
                                   round(sum(b for _, b in pairs[-100:]) / 100, 4)]}


def main():
    fourth = json.loads((FOURTH_ROUND / "summary.json").read_text())
    summary = {"protocol": fourth["protocol"], "device": "NVIDIA H100 80GB HBM3 (carried rows: as their labels say)"}
    summary["rows"] = second_round.later_round_rows(fourth, CARRIED, "2026-12-06, round 4", HERE, ROWS,
                                                    lambda run: 0.0)
    second_round.add_percentages(summary)
    for row, control in OWN_CONTROL.items():   # the control trained on the row's own data
        entry, reference = summary["rows"][row], summary["rows"][control]["test"]
        entry["own_control"] = control
        entry["test_pct_of_own_control"] = {n: round(100 * v / reference[n], 1) for n, v in entry["test"].items()}
    summary["second_run_stopped"] = loss_agreement()
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    rows = ["original", "control_8k", "control_8k_recall", "pod_8k_scores", "pod_8k_scores_recall",
            "pod_8k_scores_recall_dense"]
    title = ("SmolLM2-135M trained at 8192 tokens, score sharing, 30.1% KV saved: the recall candidate\n"
             "against the dense control trained on the same data (H100, 2026-12-06; earlier rows as labelled)")
    second_round.save_one_panel(summary, rows, title, HERE / "ruler_vs_length.png")
    for row in rows:
        e = summary["rows"][row]
        print(row, e["test"], e.get("test_pct_of_original"), e.get("test_pct_of_own_control"), e.get("dev"),
              e.get("ppl"))
    print(summary["second_run_stopped"])


if __name__ == "__main__":
    main()
