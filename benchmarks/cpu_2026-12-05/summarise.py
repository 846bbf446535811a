"""fp8_recent_keys.jsonl -> fp8_recent_keys.json (each row's change against the same scheme's model-dtype cache) and
fp8_recent_keys.png (the changes, per scheme and length). Prints the Markdown table of BENCHMARKS.md's entry.
    python benchmarks/cpu_2026-12-05/summarise.py"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
rows = [json.loads(line) for line in (HERE / "fp8_recent_keys.jsonl").read_text().splitlines()]
base = {(r["length"], r["scheme"]): r["decode_ppl"] for r in rows if r["cache"] == "model_dtype"}
for r in rows:
    ref = base.get((r["length"], r["scheme"]))
    r["change_pct"] = None if ref is None else 100 * (r["decode_ppl"] / ref - 1)
(HERE / "fp8_recent_keys.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")

schemes = list(dict.fromkeys(r["scheme"] for r in rows))
lengths = sorted({r["length"] for r in rows})
caches = ["fp8", "fp8+recent64"]
print("| scheme | cache | " + " | ".join(f"{n // 1024}K: ppl (change)" for n in lengths) + " |")
print("|---|---|" + "---|" * len(lengths))
for s in schemes:
    for c in ["model_dtype"] + caches:
        cells = []
        for n in lengths:
            r = next((r for r in rows if (r["length"], r["scheme"], r["cache"]) == (n, s, c)), None)
            cells.append("not run" if r is None else f"{r['decode_ppl']:.3f}" + (
                "" if c == "model_dtype" or r["change_pct"] is None else f" ({r['change_pct']:+.2f}%)"))
        print(f"| {s} | {c} | " + " | ".join(cells) + " |")

fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.6), sharey=True, squeeze=False)
for ax, n in zip(axes[0], lengths):
    for i, c in enumerate(caches):
        vals = [next((r["change_pct"] for r in rows if (r["length"], r["scheme"], r["cache"]) == (n, s, c)
                      and r["change_pct"] is not None), float("nan")) for s in schemes]
        ax.bar([j + 0.38 * i for j in range(len(schemes))], vals, width=0.36, label=c)
    ax.axhline(0.5, color="k", lw=0.8, ls="--", label="target +0.5%")
    ax.set_xticks([j + 0.19 for j in range(len(schemes))], schemes)
    ax.set_title(f"{n // 1024}K windows (last 256 tokens decoded)")
axes[0][0].set_ylabel("decode ppl change vs model-dtype KV (%)")
axes[0][0].legend(fontsize=8)
fig.suptitle("FP8 KV, and FP8 KV with the newest 64 keys in the model dtype (SmolLM2-135M, CPU)", fontsize=9)
fig.tight_layout()
fig.savefig(HERE / "fp8_recent_keys.png", dpi=120)
