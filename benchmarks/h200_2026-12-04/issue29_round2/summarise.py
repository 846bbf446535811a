"""Summary table and PNG of issue 29's second H200 round (this folder): the 8K recipe and its dense control, LoRA,
units chosen by learned gates, and v1's score sharing, beside the first round's rows on the same test samples
(benchmarks/h200_2026-12-03/issue29/summary.json: the original model, the 2K control and the shipped POD export).
RULER test split per row; the dev split and held-out perplexity from each run's learning curve (last point); KV
saved from the training logs.
    python3 benchmarks/h200_2026-12-04/issue29_round2/summarise.py  ->  summary.json, ruler_vs_length.png"""
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
FIRST_ROUND = HERE.parent.parent / "h200_2026-12-03" / "issue29" / "summary.json"
CARRIED = {"original": "original", "control_lm": "control_2k", "pod_lm": "pod_keys_2k", "pod_lm_dense": "pod_keys_2k_dense"}
ROWS = {  # row -> (run, label, training length)
    "pod_scores": ("pod_scores", "POD export, score sharing (v1)", 2048),
    "pod_scores_dense": ("pod_scores", "its weights run densely", 2048),
    "pod_lora": ("pod_lora", "POD export, LoRA (lr 5e-4)", 2048),
    "pod_lora_dense": ("pod_lora", "its weights run densely", 2048),
    "pod_auto": ("pod_auto", "POD export, units by learned gates (17 units)", 2048),
    "control_8k": ("control_8k", "dense fine-tune control, 8K recipe", 8192),
    "pod_8k": ("pod_8k", "POD export, 8K recipe (key sharing)", 8192),
    "pod_8k_dense": ("pod_8k", "its weights run densely", 8192),
}


def kv_saved(run: str) -> float | None:
    if run.startswith("control"):
        return 0.0
    text = (HERE / "logs" / f"{run}.train.log").read_text()
    found = re.findall(r"KV saved at \d+ [\d.]+% -> ([\d.]+)%|KV saved ([\d.]+)% >=", text)
    return float(next(x for x in found[-1] if x)) if found else None


def row_entry(folder: Path, row: str, run: str, label: str, length: int, dense: bool, kv_saved) -> dict:
    """One row of summary.json: the test split from ``folder/rows/ROW.json``, the dev split and perplexity from the
    run's learning curve (last point), KV saved from ``kv_saved(run)`` (0 when the row runs densely)."""
    data = json.loads((folder / "rows" / f"{row}.json").read_text())
    curve = json.loads((folder / "train" / run / "learning_curve.json").read_text())["points"][-1]
    key = "dense" if dense else "pod"
    return {"label": label, "split": data["split"], "training_length": length,
            "test": {n: round(s["average"], 2) for n, s in data["summary"].items()},
            "kv_saved_pct": 0.0 if dense else kv_saved(run),
            "dev": {n: round(v[key], 2) for n, v in curve.get("ruler", {}).items()},
            "ppl": {src: round(v[f"{key}_ppl"], 3) for src, v in curve["sources"].items()}}


def add_percentages(summary: dict) -> None:
    """Each row's test split as % of the original model, and of the control trained at the row's length."""
    base = summary["rows"]["original"]["test"]
    controls = {2048: summary["rows"]["control_2k"]["test"], 8192: summary["rows"]["control_8k"]["test"]}
    for entry in summary["rows"].values():
        entry["test_pct_of_original"] = {n: round(100 * v / base[n], 1) for n, v in entry["test"].items()}
        control = controls.get(entry.get("training_length"))
        if control is not None:
            entry["test_pct_of_control"] = {n: round(100 * v / control[n], 1) for n, v in entry["test"].items()}


def later_round_rows(previous: dict, carried, suffix: str, folder: Path, rows: dict, kv_saved) -> dict:
    """``summary["rows"]`` of a later round: the ``carried`` rows of the previous round's summary (labels dated
    with ``suffix`` unless they carry a date), then ``rows`` (row -> (run, label)) from ``folder``, trained at 8192
    tokens, each with its test split's categories."""
    out = {}
    for row in carried:
        entry = dict(previous["rows"][row])
        if "(2026-12-0" not in entry["label"]:
            entry["label"] += f" ({suffix})"
        out[row] = entry
    for row, (run, label) in rows.items():
        entry = row_entry(folder, row, run, label, 8192, row.endswith("_dense"), kv_saved)
        data = json.loads((folder / "rows" / f"{row}.json").read_text())["summary"]
        entry["categories"] = {n: {c: round(v, 2) for c, v in s["categories"].items()} for n, s in data.items()}
        out[row] = entry
    return out


def plot_rows(ax, summary: dict, rows: list[str], lengths: list[int]) -> None:
    """RULER test average against context length, one line per row (dashed: the original, controls and weights
    run densely), on a log2 length axis; the later rounds' summarise.py draw with it too."""
    for row in rows:
        e = summary["rows"][row]
        xs = [n for n in lengths if str(n) in e["test"]]
        name = e["label"] if not e["label"].startswith("its weights") else f"{row}: weights run densely"
        ax.plot(xs, [e["test"][str(n)] for n in xs], marker="o", label=name,
                linestyle="--" if row.endswith("_dense") or row.startswith("control") or row == "original" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("context (tokens)")


def save_one_panel(summary: dict, rows: list[str], title: str, path: Path) -> None:
    """A later round's PNG: ``rows`` against context length (:func:`plot_rows`) in one panel, 0-60 points."""
    lengths = [int(n) for n in summary["rows"]["original"]["test"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    plot_rows(ax, summary, rows, lengths)
    ax.set_ylabel("RULER average, test split (13 tasks x 20)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(0, 60)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    first = json.loads(FIRST_ROUND.read_text())
    summary = {"protocol": first["protocol"], "rows": {}}
    for old, new in CARRIED.items():
        entry = dict(first["rows"][old])
        entry["label"] += " (2026-12-03)"
        entry["training_length"] = None if old == "original" else 2048
        if old.endswith("_dense"):
            entry["kv_saved_pct"] = 0.0
        summary["rows"][new] = entry
    for row, (run, label, length) in ROWS.items():
        dense = row.endswith("_dense") or row.startswith("control")
        summary["rows"][row] = row_entry(HERE, row, run, label, length, dense, kv_saved)
    add_percentages(summary)
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    lengths = [int(n) for n in summary["rows"]["original"]["test"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    panels = [("trained at 2048 tokens", ["original", "control_2k", "pod_keys_2k", "pod_keys_2k_dense", "pod_scores",
                                          "pod_scores_dense", "pod_lora", "pod_auto"]),
              ("trained at 8192 tokens", ["original", "control_8k", "pod_8k", "pod_8k_dense"])]
    for ax, (title, rows) in zip(axes, panels):
        plot_rows(ax, summary, rows, lengths)
        ax.set_title(f"SmolLM2-135M, {title} (30.1% KV saved)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 68)
        ax.legend(fontsize=6.5, loc="upper right", ncol=2)
    axes[0].set_ylabel("RULER average, test split (13 tasks x 20)")
    fig.suptitle("POD adaptation against the dense model, one H200, 2026-12-04", fontsize=11)
    fig.tight_layout()
    fig.savefig(HERE / "ruler_vs_length.png", dpi=120)


if __name__ == "__main__":
    main()
