"""Dense prefill podkit / SDPA against length on an H200, from 2026-12-01 to the Gluon kernel (BENCHMARKS.md).

    python benchmarks/h200_2026-12-02/plot_dense_prefill.py   # writes dense_prefill_vs_sdpa.png beside itself
2026-12-01: benchmarks/h200_2026-12-01/prefill_issue13_s8 (8K, 32K) and issue13_s11 (128K, same kernel);
tl.dot kernel 2026-12-02: s3/kernels_prefill.json; Gluon sm_90 kernel (the default on Hopper) and the tl.dot
kernel in the same run: s8/out/kernels_prefill.json (python -m eval.bench kernels-prefill, each against SDPA of
its own run)."""
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
gluon_run = json.loads((HERE / "s8" / "out" / "kernels_prefill.json").read_text())["rows"]
gluon = {r["S"]: r["ratio_vs_sdpa"] for r in gluon_run if r["op"] == "dense causal prefill" and r["impl"] == "podkit"}
tl_dot = {r["S"]: r["ratio_vs_sdpa"] for r in gluon_run
          if r["op"] == "dense causal prefill" and r["impl"] == "podkit (tl.dot kernel)"}
fig, ax = plt.subplots(figsize=(6, 4))
ax.plot(lengths, [before[s] for s in lengths], "o--", label="podkit tl.dot kernel, 2026-12-01")
ax.plot(lengths, [r["ratio_vs_sdpa"] for r in rows], "o-", label="podkit tl.dot kernel, 2026-12-02 (s3)")
ax.plot(lengths, [tl_dot[s] for s in lengths], "x:", label="podkit tl.dot kernel, 2026-12-02 (s8)")
ax.plot(lengths, [gluon[s] for s in lengths], "o-", lw=2, label="podkit Gluon sm_90 kernel (default), s8")
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
