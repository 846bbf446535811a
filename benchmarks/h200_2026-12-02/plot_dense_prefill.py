"""Dense prefill podkit / SDPA against length on an H200, before and after 2026-12-02 (BENCHMARKS.md).

    python benchmarks/h200_2026-12-02/plot_dense_prefill.py   # writes dense_prefill_vs_sdpa.png beside itself
Before: benchmarks/h200_2026-12-01/prefill_issue13_s8 (8K, 32K) and issue13_s11 (128K, same kernel); after:
s3/kernels_prefill.json (python -m eval.bench kernels-prefill, same run as SDPA)."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
after = json.loads((HERE / "s3" / "kernels_prefill.json").read_text())
rows = [r for r in after["rows"] if r["op"] == "dense causal prefill" and r["impl"] == "podkit"]
lengths = [r["S"] for r in rows]
before = {8192: 1.37, 32768: 1.26, 131072: 1.17}
fig, ax = plt.subplots(figsize=(6, 4))
ax.plot(lengths, [before[s] for s in lengths], "o--", label="podkit 2026-12-01")
ax.plot(lengths, [r["ratio_vs_sdpa"] for r in rows], "o-", label="podkit 2026-12-02")
ax.plot([32768], [1.17], "s", label="Triton's fused-attention tutorial (2026-12-01)")
ax.axhline(1.05, color="grey", ls=":", label="target 1.05x")
ax.axhline(1.0, color="black", lw=0.8)
ax.set_xscale("log", base=2)
ax.set_xticks(lengths, [f"{s // 1024}K" for s in lengths])
ax.set_xlabel("sequence length (one sequence, 32 / 8 heads, D 128, bf16, causal)")
ax.set_ylabel("time / torch SDPA")
ax.set_title("Dense causal prefill forward on an H200")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "dense_prefill_vs_sdpa.png", dpi=120)
