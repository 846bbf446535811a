"""Peak GPU memory against context length, from ``train-multi-gpu`` reports (e.g. before / after tiling).

    python -m eval.bench memory-plot plain=outputs/bench/sp2_plain.json tiled=outputs/bench/sp2_tiled.json \
        --out outputs/bench/memory_vs_context.png

Each ``LABEL=REPORT`` is the JSON of ``python -m eval.bench train-multi-gpu`` (``--find-max-context`` gives
one row per doubled length): a line of ``peak_memory_gib_max_rank`` (the largest rank's
``torch.cuda.max_memory_allocated``) against ``seq``, and an ``x`` at the first length that failed (out of
memory), drawn at the top of the axes. ``train-multi-gpu --find-max-context`` draws its own report next to
its JSON the same way.

:func:`plot_kv_memory` draws the memory rows of ``python -m eval.bench e2e`` (``--sections memory``; e2e writes
it as ``<out>_memory.png``; ``e2e --plot-only JSON`` and ``memory-plot E2E.json --out PNG`` redraw it): per context, a bar per cache (dense, POD) and
KV dtype (bf16, fp8_e4m3) of the KV GiB one sequence takes, and of the largest batch whose KV fits the budget.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparse_models.calibration.outputs import save_figure


def _label(report: dict) -> str:
    args = report.get("args", {})
    parts = [f"SP {args.get('sp', 1)}", f"{args.get('layers', '?')} layers"]
    parts += ["LoRA"] * (args.get("method") == "lora")
    parts += ["tiled MLP"] * bool(args.get("tiled_mlp")) + ["ckpt offload"] * bool(args.get("activation_offload"))
    parts += ["whole logits"] * (args.get("loss_chunk_tokens") == 0)
    return ", ".join(parts)


def plot_memory_vs_context(reports: dict[str, dict], path: str | Path) -> Path:
    """``reports``: label -> train-multi-gpu report. Writes the PNG; returns its path. Raises ValueError when no
    report has a row with a measured peak (CPU runs measure none)."""
    import matplotlib  # lazy: matplotlib is optional (plots only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)

    measured = {label: sorted((r["seq"], r["peak_memory_gib_max_rank"]) for r in report.get("rows", [])
                              if r.get("peak_memory_gib_max_rank") is not None)
                for label, report in reports.items()}
    if not any(measured.values()):
        raise ValueError(f"no row with a measured peak memory in {', '.join(reports)} (CPU runs measure none)")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    top = max(peak for points in measured.values() for _, peak in points) * 1.15
    for label, points in measured.items():
        line = None
        if points:
            (line,) = ax.plot([s for s, _ in points], [p for _, p in points], marker="o", label=label)
        failed = sorted(f["seq"] for f in reports[label].get("failures", []))
        if failed:
            ax.plot([failed[0]], [top], marker="x", markersize=10, linestyle="none",
                    color=line.get_color() if line is not None else "black",
                    label=f"{label}: failed at {failed[0] // 1024}K")
    ax.set_xscale("log", base=2)
    lengths = sorted({s for points in measured.values() for s, _ in points}
                     | {f["seq"] for report in reports.values() for f in report.get("failures", [])})
    ax.set_xticks(lengths, [f"{s // 1024}K" if s >= 1024 else str(s) for s in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel("peak GPU memory, largest rank (GiB)")
    ax.set_ylim(0, top * 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    device = next((r.get("device") for report in reports.values() for r in report.get("rows", [])), "")
    ax.set_title(f"POD training memory against context length, {device}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def _kv_bars(memory: dict) -> dict[tuple[str, str], dict[int, dict]]:
    """(cache, KV dtype) -> context -> memory row; rows of older e2e JSONs (keys ``dense`` / ``pod``) are bf16."""
    bars: dict[tuple[str, str], dict[int, dict]] = {}
    for key, row in memory.items():
        name = row.get("scheme", key.split("@")[0].split("/")[0]).replace("podkit-", "")
        bars.setdefault((name, row.get("kv_cache_dtype", "bfloat16")), {})[row["context"]] = row
    return bars


def plot_kv_memory(result: dict, path: str | Path) -> Path:
    """``result``: an e2e JSON with memory rows. Two panels, KV GiB per sequence and the largest batch in the
    budget, grouped by context with one bar per (cache, KV dtype), FP8 hatched. Raises ValueError without rows."""
    import matplotlib  # lazy: matplotlib is optional (plots only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)

    bars = _kv_bars(result.get("memory", {}))
    if not bars:
        raise ValueError("no memory rows in this e2e result (run it with --sections memory)")
    contexts = sorted({c for rows in bars.values() for c in rows})
    width = 0.8 / len(bars)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    panels = ((axes[0], lambda row: row["kv_bytes_per_seq"] / 2 ** 30, "KV GiB per sequence"),  # unrounded
              (axes[1], lambda row: row["max_batch"], "largest batch in the budget"))
    for ax, value, label in panels:
        for i, ((name, dtype), rows) in enumerate(sorted(bars.items())):
            xs = [j + (i - (len(bars) - 1) / 2) * width for j, c in enumerate(contexts) if c in rows]
            ys = [value(rows[c]) for c in contexts if c in rows]
            drawn = ax.bar(xs, ys, width, label=f"{name} {dtype}", hatch="//" if dtype != "bfloat16" else None,
                           color=f"C{sorted({n for n, _ in bars}).index(name)}", edgecolor="black", linewidth=0.5)
            ax.bar_label(drawn, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(contexts)), [f"{c // 1024}K" if c >= 1024 else str(c) for c in contexts])
        ax.set_xlabel("context (tokens per sequence)")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    note = next(iter(next(iter(bars.values())).values())).get("budget_note", "")
    fig.suptitle(f"KV cache memory, {result.get('model', '')}, {result.get('device', '')}; budget {note}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.bench memory-plot", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="LABEL=REPORT.json (or REPORT.json: labelled by its settings)")
    p.add_argument("--out", default="outputs/bench/memory_vs_context.png")
    args = p.parse_args(argv)
    reports = {}
    for item in args.reports:
        label, sep, name = item.rpartition("=")
        path = Path(name)
        if not path.is_file():
            p.error(f"{item}: no such report file {str(path)!r}")
        report = json.loads(path.read_text())
        reports[label if sep else _label(report)] = report
    e2e = [report for report in reports.values() if report.get("benchmark") == "e2e"]
    if e2e and len(reports) > 1:
        p.error("an e2e JSON is drawn alone (its KV memory rows), not beside train-multi-gpu reports")
    try:
        print(f"-> {plot_kv_memory(e2e[0], args.out) if e2e else plot_memory_vs_context(reports, args.out)}")
    except ValueError as error:
        p.error(str(error))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
