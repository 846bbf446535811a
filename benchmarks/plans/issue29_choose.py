"""Issue 29: which 8K recipe setting ships, decided on the wide dev split only (written 2026-12-06, before the rows
it reads were scored).

Reads the devrows archive of issue29_serving_length.sh (`devrows.tgz`: one `<row>.json` per POD export scored on the
wide dev split, 13 tasks x 10 samples, seed 104729, at 2K / 4K / 8K) and applies the rule:
  * each candidate's score is its mean RULER average over the three lengths (the export as served, not its weights
    run densely);
  * the shipped setting (SHIPPED) stays unless a candidate's score is at least MARGIN points higher; among those that
    are, the highest wins. One dev sample moves a length's average by about 0.8 points, and re-scoring the same
    samples in another batch moved 7% of the records (BENCHMARKS.md, "The re-selection layer chosen on RULER").
The test split is never read here. Prints the table and writes choice.json beside the archive.
    python3 benchmarks/plans/issue29_choose.py OUT/issue29/devrows.tgz [SHIPPED] [MARGIN]"""
import json
import sys
import tarfile
from pathlib import Path

SHIPPED = "pod_8k_scores"
MARGIN = 1.0
LENGTHS = ("2048", "4096", "8192")   # the 8K recipe's long_context.lengths


VARIANT_ROWS = ("_dense.json", "_proximal.json")   # the same export run another way: not a setting to ship


def dev_scores(archive: Path) -> dict[str, dict[str, float]]:
    """row -> {length: RULER average} for every export row as served (``RUN:dense`` / ``RUN:proximal`` rows left
    out) in the devrows archive."""
    scores = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if not name.endswith(".json") or name.endswith(VARIANT_ROWS):
                continue
            data = json.loads(tar.extractfile(member).read())
            if "dev split" not in data.get("split", ""):
                raise SystemExit(f"{member.name}: split {data.get('split')!r} is not the dev split: refusing to choose")
            scores[data["row"]] = {n: round(s["average"], 2) for n, s in data["summary"].items()}
    return scores


def choose(scores: dict[str, dict[str, float]], shipped: str = SHIPPED, margin: float = MARGIN) -> dict:
    if shipped not in scores:
        raise SystemExit(f"the shipped setting {shipped!r} has no dev row (rows: {', '.join(sorted(scores))})")
    if set(scores[shipped]) != set(LENGTHS):
        raise SystemExit(f"the shipped setting's dev row has lengths {sorted(scores[shipped], key=int)}, not "
                         f"{list(LENGTHS)}: it was stopped early; score it again before choosing")
    # a row stopped before its last length would be averaged over the shorter (easier) lengths only
    incomplete = sorted(row for row, cells in scores.items() if set(cells) != set(scores[shipped]))
    for row in incomplete:
        print(f"{row}: lengths {sorted(scores[row], key=int)}, not the shipped row's "
              f"{sorted(scores[shipped], key=int)}: left out of the choice")
    scores = {row: cells for row, cells in scores.items() if row not in incomplete}
    means = {row: round(sum(cells.values()) / len(cells), 2) for row, cells in scores.items()}
    better = [row for row in means if row != shipped and means[row] >= means[shipped] + margin]
    pick = max(better, key=lambda row: means[row]) if better else shipped
    return {"rule": f"highest mean over lengths; {shipped} stays unless beaten by >= {margin} points",
            "dev": scores, "mean": means, "pick": pick, "left_out_incomplete": incomplete}


def main(argv: list[str]) -> dict:
    archive = Path(argv[0])
    shipped = argv[1] if len(argv) > 1 else SHIPPED
    margin = float(argv[2]) if len(argv) > 2 else MARGIN
    result = choose(dev_scores(archive), shipped, margin)
    for row, mean in sorted(result["mean"].items(), key=lambda item: -item[1]):
        cells = " / ".join(f"{v:.1f}" for v in result["dev"][row].values())
        print(f"{row:36s} {cells}   mean {mean:.2f}{'   <- pick' if row == result['pick'] else ''}")
    (archive.parent / "choice.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
