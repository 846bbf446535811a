"""Issue 31's test-seed board (H200, 2026-12-03): board/<row>.json (one eval.leaderboard run per row, the same 260
samples per length) -> board_summary.json, board.png and the markdown table in BENCHMARKS.md.
Usage: python benchmarks/h200_2026-12-03/issue31/summarise.py"""
import json
from pathlib import Path

HERE = Path(__file__).parent
ROWS = ["dense", "quest_1_8", "tidal_1_4", "tidal_calibrated_1_4", "tidal_1_8", "tidal_calibrated_1_8",
        "token_sparse_0.005", "token_sparse_calibrated"]
LENGTHS = ["2048", "4096", "8192"]


def main():
    table, bf16 = {}, {}
    for name in ROWS + ["fp8"]:
        run = json.loads((HERE / "board" / f"{name}.json").read_text())
        for setting, lengths in run["summary"].items():
            label = setting + (" (fp8 KV)" if run["kv_cache_dtype"] == "fp8_e4m3" else "")
            table[label] = {n: e["average"] for n, e in lengths.items()}
            assert all(e["n"] == 260 for e in lengths.values()), (label, "not on all 260 samples")
            if run["kv_cache_dtype"] != "fp8_e4m3":
                bf16[setting] = table[label]
    dense = bf16["dense"]
    out = {label: {n: {"ruler": round(v, 2), "of_dense": round(v / dense[n], 3)} for n, v in cells.items()}
           for label, cells in table.items()}
    (HERE / "board_summary.json").write_text(json.dumps(out, indent=1))
    print("| RULER, test seed (% of dense) | " + " | ".join(f"{int(n) // 1024}K" for n in LENGTHS) + " |")
    print("|---|" + "---|" * len(LENGTHS))
    for label, cells in out.items():
        print(f"| {label} | " + " | ".join(f"{cells[n]['ruler']:.1f} ({100 * cells[n]['of_dense']:.0f}%)"
                                          if n in cells else "-" for n in LENGTHS) + " |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, cells in table.items():
        xs = [int(n) for n in LENGTHS if n in cells]
        ax.plot(xs, [cells[str(x)] for x in xs], marker="o", label=label,
                linestyle="--" if "fp8" in label else "-", linewidth=2.5 if label == "dense" else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xticks([2048, 4096, 8192], ["2K", "4K", "8K"])
    ax.set_xlabel("context length")
    ax.set_ylabel("RULER average (13 tasks x 20 samples)")
    ax.set_title("SmolLM2-135M-Instruct, H200, test seed 7919 (budgets: fraction of the context)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(HERE / "board.png", dpi=120)


if __name__ == "__main__":
    main()
