"""Compare POD adaptation runs by their learning curves (``learning_curve.json`` of train/learning_curve.py).

    python -m eval.learning_curves lm=outputs/run_lm distill=outputs/run_distill \\
        lm+distill=outputs/run_mix --targets podkit:heldout-indomain=3 podkit:heldout-ood=5 --out outputs/curves

Each ``LABEL=RUN`` names a run folder (or its learning_curve.json). Writes ``learning_curves.png`` (one panel
per held-out source: POD gap to the original dense model against training tokens, one line per run) and
``learning_curves.json``: per run and source, the final gaps and the first training-token count at which the
POD gap is within the source's target (``--targets SOURCE=PERCENT``; null when never reached).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.learning_curve import plot_learning_curves


def first_tokens_within(points: list[dict], source: str, target_percent: float) -> int | None:
    """The first point's training tokens at which ``pod_gap <= target`` on ``source`` (None: never)."""
    for point in points:
        scores = point["sources"].get(source)
        if scores is not None and 100 * scores["pod_gap"] <= target_percent:
            return int(point["tokens"])
    return None


def summarise(curves: dict[str, dict], targets: dict[str, float]) -> dict:
    summary: dict = {}
    for label, data in curves.items():
        points = data["points"]
        last = points[-1]
        summary[label] = {
            "objective": data.get("objective"), "final_tokens": last["tokens"],
            "sources": {source: {"final_pod_gap": scores["pod_gap"], "final_dense_gap": scores["dense_gap"],
                                 "target_percent": targets.get(source),
                                 "first_tokens_within_target": (first_tokens_within(points, source, targets[source])
                                                                if source in targets else None)}
                        for source, scores in last["sources"].items()}}
    return summary


def _read_curve(path: Path) -> dict:
    file = path / "learning_curve.json" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"error: {str(path)!r}: no learning_curve.json there (run train/pod.py with eval.every_steps)")
    return json.loads(file.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.learning_curves", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (or LABEL=learning_curve.json)")
    parser.add_argument("--targets", nargs="*", default=[], help="SOURCE=PERCENT: the POD gap that counts as reached")
    parser.add_argument("--out", type=Path, required=True, help="folder for learning_curves.{json,png}")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    curves, targets = {}, {}
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            parser.error(f"run {item!r}: expected LABEL=RUN_DIR, e.g. lm=outputs/smollm2_135m_pod_gpu")
        curves[label] = _read_curve(Path(path))
    for item in args.targets:
        source, sep, value = item.rpartition("=")
        try:
            targets[source] = float(value)
        except ValueError:
            source = ""
        if not sep or not source:
            parser.error(f"--targets {item!r}: expected SOURCE=PERCENT, e.g. podkit:heldout-ood=5")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = summarise(curves, targets)
    (args.out / "learning_curves.json").write_text(json.dumps({"runs": summary, "curves": curves}, indent=1))
    plot_learning_curves(curves, args.out / "learning_curves.png", title=args.title)
    for label, run in summary.items():
        for source, s in run["sources"].items():
            reached = s["first_tokens_within_target"]
            print(f"{label:<12} {source:<26} final POD gap {100 * s['final_pod_gap']:+6.1f}%  weights run densely "
                  f"{100 * s['final_dense_gap']:+6.1f}%  within {s['target_percent']}%: "
                  + (f"{reached / 1e6:.2f}M tokens" if reached is not None else "not reached"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
