"""Summary table and PNG of issue 29's H200 runs (this folder): RULER test split per row, the dev split and held-out
perplexity from each run's learning curve, KV saved from the training logs.
    python3 benchmarks/h200_2026-12-03/issue29/summarise.py   ->  summary.json, ruler_vs_length.png, ruler_vs_kv.png"""
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
ROWS = {  # row -> (run whose export it scores, label)
    "original": (None, "original dense model"),
    "control_lm": ("control_lm", "dense fine-tune control (lm)"),
    "pod_lm": ("pod_lm", "POD export (lm, shipped recipe)"),
    "pod_lm_dense": ("pod_lm", "POD export's weights run densely (lm)"),
    "control_distill": ("control_distill", "dense fine-tune control (distill)"),
    "pod_distill": ("pod_distill", "POD export (distill)"),
    "pod_distill_dense": ("pod_distill", "POD export's weights run densely (distill)"),
    "pod_lm_s20": ("pod_lm_s20", "POD export (lm), no delta lowering"),
    "pod_lm_s20_dense": ("pod_lm_s20", "its weights run densely"),
    "pod_lm_s35": ("pod_lm_s35", "POD export (lm), min_kv_saving 0.35"),
    "pod_lm_s35_dense": ("pod_lm_s35", "its weights run densely"),
}


def kv_saved(run: str) -> float | None:
    log = HERE / "logs" / f"{run}.train.log"
    found = re.findall(r"KV saved at 2048 [\d.]+% -> ([\d.]+)%", log.read_text()) if log.is_file() else []
    return float(found[-1]) if found else (0.0 if run.startswith("control") else None)


def main():
    summary = {"protocol": json.loads((HERE / "protocol.json").read_text()), "rows": {}}
    for row, (run, label) in ROWS.items():
        data = json.loads((HERE / "rows" / f"{row}.json").read_text())
        entry = {"label": label, "split": data["split"],
                 "test": {n: round(s["average"], 2) for n, s in data["summary"].items()},
                 "kv_saved_pct": 0.0 if run is None else kv_saved(run)}
        if run:
            curve = json.loads((HERE / "train" / run / "learning_curve.json").read_text())["points"]
            first, last = curve[0], curve[-1]
            key = "dense" if row.endswith("_dense") or row.startswith("control") else "pod"
            entry["dev"] = {n: round(v[key], 2) for n, v in last["ruler"].items()}
            entry["ppl"] = {src: round(v[f"{key}_ppl"], 3) for src, v in last["sources"].items()}
            summary.setdefault("original_dev", {n: round(v["dense"], 2) for n, v in first["ruler"].items()})
            summary.setdefault("original_ppl", {s: round(v["original_dense_ppl"], 3) for s, v in first["sources"].items()})
        summary["rows"][row] = entry
    base = summary["rows"]["original"]["test"]
    for entry in summary["rows"].values():
        entry["test_pct_of_original"] = {n: round(100 * v / base[n], 1) for n, v in entry["test"].items()}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    lengths = list(base)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row in ("original", "control_lm", "pod_lm", "pod_lm_dense", "control_distill", "pod_distill", "pod_lm_s35"):
        e = summary["rows"][row]
        ax.plot([int(n) for n in lengths], [e["test"][n] for n in lengths], marker="o", label=e["label"],
                linestyle="--" if row.endswith("_dense") or row.startswith("control") else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(n) for n in lengths], lengths)
    ax.set_xlabel("context (tokens); training length 2048")
    ax.set_ylabel("RULER average, test split (13 tasks x 20)")
    ax.set_title("SmolLM2-135M on one H200, 2026-12-03: POD vs the dense fine-tune control")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "ruler_vs_length.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    points = [("control_lm", 0.0)] + [(r, summary["rows"][r]["kv_saved_pct"]) for r in ("pod_lm_s20", "pod_lm", "pod_lm_s35")]
    for n in lengths:
        ax.plot([kv for _, kv in points], [summary["rows"][r]["test"][n] for r, _ in points], marker="o", label=f"{n} tokens")
    ax.axvline(35, color="grey", linestyle=":", label="the paper's 35%")
    ax.set_xlabel("KV cache saved at 2048 tokens (%)")
    ax.set_ylabel("RULER average, test split")
    ax.set_title("RULER against KV saved (lm objective; 0% = dense control)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "ruler_vs_kv.png", dpi=120)


if __name__ == "__main__":
    main()
