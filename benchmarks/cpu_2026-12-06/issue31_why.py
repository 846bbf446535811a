"""Why calibrated TidalDecode (`tidal_selection=all_union`) stays below Quest at 1/8 (issue 31): the attention-mass
analysis of this folder's `python -m eval.needle_heads` runs (a filler haystack and a prose one with the default
selection layers, and the prose one with the second selection layer moved) at the budgets that are 1/8 and 1/4 of
each length, beside the 2026-12-03 test board's per-task scores
(../h200_2026-12-03/issue31/board/records.tgz). Prints the tables of BENCHMARKS.md "Why calibrated TidalDecode
stays below Quest" and writes issue31_why.json.
    python3 benchmarks/cpu_2026-12-06/issue31_why.py"""
import io
import json
import statistics
import tarfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
BOARD = HERE.parent / "h200_2026-12-03" / "issue31" / "board" / "records.tgz"
RUNS = {  # haystack and selection layers -> the needle_heads run (the default plan selects at layers 2 and 12)
    "filler, layers 2+12": HERE / "needle_heads_union.json",
    "prose, layers 2+12": HERE / "needle_heads_union_prose.json",
    "prose, layers 2+14": HERE / "needle_heads_union_prose_sel2_14.json",
    "prose, layers 2+12+18": HERE / "needle_heads_union_prose_sel2_12_18.json",
}
SELECTIONS = ("query_head", "kv_group", "all_union", "union_of_heads", "own_topk")
BOARD_ROWS = {"dense": "records_dense.jsonl", "Quest @1/8": "records_quest_1_8.jsonl",
              "TidalDecode @1/8, all_union": "records_tidal_calibrated_1_8.jsonl"}
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "retrieval", "aggregation", "question answering")


def mass_kept() -> dict:
    """Per haystack, length and budget fraction: the retrieval heads' needle mass each selection keeps (per-prompt
    mean, %), and the prompts dense answered when teacher forced."""
    out = {}
    for haystack, path in RUNS.items():
        data = json.loads(path.read_text())
        for length in data["lengths"]:
            prompts = [p for p in data["prompts"] if p["length"] == length]
            for fraction in (8, 4):
                budget = str(length // fraction)
                if budget not in prompts[0]["kept"]["all_union"]:
                    continue
                out[f"{haystack} | {length} | 1/{fraction}"] = {
                    s: round(100 * statistics.mean(p["kept"][s][budget] for p in prompts), 1) for s in SELECTIONS}
    return out


def board_tasks() -> dict:
    """Per row and length: the test board's score (%) by task / category for TASKS."""
    out = {}
    with tarfile.open(BOARD) as tar:
        for row, name in BOARD_ROWS.items():
            member = next(m for m in tar.getmembers() if m.name.endswith(name))
            scores = defaultdict(list)
            for line in io.TextIOWrapper(tar.extractfile(member)):
                r = json.loads(line)
                scores[(r["length"], r["task"])].append(r["score"])
                scores[(r["length"], r["category"])].append(r["score"])
            out[row] = {f"{length} | {key}": round(100 * statistics.mean(v), 1)
                        for (length, key), v in sorted(scores.items()) if key in TASKS}
    return out


def main():
    result = {"mass_kept": mass_kept(), "board": board_tasks()}
    (HERE / "issue31_why.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| haystack, selection layers | length | budget | " + " | ".join(SELECTIONS) + " |")
    for key, row in result["mass_kept"].items():
        print("| " + key + " | " + " | ".join(f"{row[s]:.0f}%" for s in SELECTIONS) + " |")
    print()
    for length in (2048, 4096, 8192):
        print(length, {row: {t: v for t, v in scores.items() if t.startswith(str(length))}
                       for row, scores in result["board"].items()})


if __name__ == "__main__":
    main()
