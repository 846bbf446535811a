"""Summary table and PNG of issue 29's third H200 round (this folder): the 8K recipe with v1's score sharing
(`pod.sharing: scores`), beside the second round's rows on the same test samples (../issue29_round2/summary.json:
the original model, the 8K dense fine-tune control, the 8K recipe with key sharing). RULER test split per row; the
dev split and held-out perplexity from the run's learning curve (last point); KV saved from the training log.
    python3 benchmarks/h200_2026-12-04/issue29_round3/summarise.py  ->  summary.json, ruler_vs_length.png"""
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
SECOND_ROUND = HERE.parent / "issue29_round2" / "summary.json"
sys.path.insert(0, str(SECOND_ROUND.parent))
import summarise as second_round  # noqa: E402  (the second round's row and percentage helpers)

CARRIED = ("original", "control_8k", "pod_8k", "pod_8k_dense", "control_2k", "pod_keys_2k", "pod_scores")
ROWS = {  # row -> (run, label)
    "pod_8k_scores": ("pod_8k_scores", "POD export, 8K recipe, score sharing (v1)"),
    "pod_8k_scores_dense": ("pod_8k_scores", "its weights run densely"),
}


def kv_saved(run: str) -> float:
    text = (HERE / "logs" / f"{run}.train.log").read_text()
    return float(re.findall(r"KV saved at \d+ [\d.]+% -> ([\d.]+)%", text)[-1])


def main():
    second = json.loads(SECOND_ROUND.read_text())
    summary = {"protocol": second["protocol"]}
    summary["rows"] = second_round.later_round_rows(second, CARRIED, "2026-12-04, round 2", HERE, ROWS, kv_saved)
    second_round.add_percentages(summary)
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    rows = ["original", "control_8k", "pod_8k", "pod_8k_dense", "pod_8k_scores", "pod_8k_scores_dense"]
    title = ("SmolLM2-135M trained at 8192 tokens, 30.1% KV saved: key against score sharing\n"
             "one H200, 2026-12-04")
    second_round.save_one_panel(summary, rows, title, HERE / "ruler_vs_length.png")


if __name__ == "__main__":
    main()
