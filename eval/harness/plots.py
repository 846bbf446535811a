"""Figures and markdown tables of a fidelity sweep (records from eval.harness.quality / eval.harness.fidelity).

* :func:`plot_passkey_grid`: one panel per setting, needle depth (y) x context length (x), colour =
  accuracy (the usual needle-in-a-haystack picture);
* :func:`plot_perplexity`: decode-phase perplexity against context length, one panel per method with
  dense dashed in each, and a prefill-phase panel;
* :func:`markdown_tables`: the tables that go to BENCHMARKS.md.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from eval.schemes import method_rank
from sparse_models.calibration.outputs import save_figure


def _plt():
    import matplotlib  # lazy: matplotlib is optional (plots only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)

    return plt


def _order(labels) -> list[str]:
    """dense first, then by method and numeric budget/coverage."""
    def key(label: str):
        method, _, value = label.partition("@")
        value, _, variant = value.partition("[")   # "128[2,8,16]": a TidalDecode selection-layer ablation
        try:
            number = float(value)
        except ValueError:
            number = 0.0
        return method_rank(method), method, number, variant
    return sorted(set(labels), key=key)


def plot_passkey_grid(records: list[dict], path: str | Path, task: str = "passkey") -> Path | None:
    rows = [r for r in records if r["task"] == task]
    if not rows:
        return None
    plt = _plt()
    settings = _order(r["setting"] for r in rows)
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cols = min(5, len(settings))
    nrows = math.ceil(len(settings) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(2.3 * cols + 1, 2.5 * nrows + 0.6), squeeze=False)
    image = None
    for index in range(nrows * cols):
        ax = axes[index // cols][index % cols]
        if index >= len(settings):
            ax.axis("off")
            continue
        cells = defaultdict(list)
        for r in rows:
            if r["setting"] == settings[index]:
                cells[(depths.index(r["depth"]), lengths.index(r["length"]))].append(float(r["correct"]))
        grid = [[(sum(cells[(d, n)]) / len(cells[(d, n)]) if cells[(d, n)] else float("nan"))
                 for n in range(len(lengths))] for d in range(len(depths))]
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="upper")
        done = [v for row in grid for v in row if not math.isnan(v)]
        ax.set_title(f"{settings[index]}  ({100 * sum(done) / max(len(done), 1):.0f}%)", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6)
        if index % cols == 0:
            ax.set_ylabel("needle depth", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="accuracy")
    fig.suptitle(f"{task}: accuracy by context length and needle depth", fontsize=10)
    return save_figure(fig, path)


def plot_perplexity(summary: dict, path: str | Path) -> Path | None:
    """Decode-phase perplexity against context length, one panel per method (budgets and variants as
    separate lines, dense dashed in each), plus a prefill-phase panel with the settings that change it."""
    table = summary.get("ppl")
    if not table:
        return None
    plt = _plt()
    groups: dict[str, list[str]] = {}
    for setting in _order(table):
        if setting != "dense":
            groups.setdefault(setting.partition("@")[0], []).append(setting)
    dense = table.get("dense", {})

    def points(setting: str, field: str) -> list[tuple[int, float]]:
        return sorted((int(n), v[field]) for n, v in table[setting].items() if v.get(field) is not None)

    def draw(ax, settings: list[str], field: str, title: str) -> None:
        dense_points = points("dense", field) if dense else []
        if dense_points:
            ax.plot(*zip(*dense_points), linestyle="--", color="black", linewidth=2, label="dense")
        colours = plt.get_cmap("viridis")
        for index, setting in enumerate(settings):
            line = points(setting, field)
            if line:
                ax.plot(*zip(*line), marker="o", markersize=3, label=setting,
                        color=colours(index / max(len(settings) - 1, 1) * 0.9))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_ylabel("perplexity", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)

    prefill_changed = [s for s in _order(table) if s != "dense" and any(
        abs(v.get("prefill_ppl", 0) - dense.get(n, {}).get("prefill_ppl", 0)) > 1e-6 * max(v.get("prefill_ppl", 1), 1)
        for n, v in table[s].items())]
    panels = [(settings, "decode_ppl", f"{method}: decode phase") for method, settings in groups.items()]
    panels.append((prefill_changed, "prefill_ppl", "prefill phase (settings that change it)"))
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.4 * rows), squeeze=False)
    for index in range(rows * cols):
        ax = axes[index // cols][index % cols]
        if index < len(panels):
            draw(ax, *panels[index])
        else:
            ax.axis("off")
    fig.suptitle("Perplexity on held-out text (Emma); decode phase = last tokens, one decode step each", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def _fmt(value, digits=2) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_tables(summary: dict) -> str:
    """Retrieval accuracy (%) and perplexity tables, relative change against dense in brackets."""
    out: list[str] = []
    for task in ("passkey", "passkey_text", "needle"):
        table = summary.get(task)
        if not table:
            continue
        lengths = sorted({int(n) for setting in table.values() for n in setting})
        out.append(f"**{task}** accuracy (%), by context length (mean over depths):\n")
        out.append("| setting | " + " | ".join(f"{n}" for n in lengths) + " | all | token sparsity |")
        out.append("|---|" + "---:|" * (len(lengths) + 2))
        for setting in _order(table):
            cells = [table[setting].get(str(n)) for n in lengths]
            total_n = sum(c["n"] for c in cells if c)
            total = sum(c["accuracy"] * c["n"] for c in cells if c) / total_n if total_n else None
            sparsity = [c["token_sparsity"] for c in cells if c and "token_sparsity" in c]
            out.append(f"| {setting} | " + " | ".join(_fmt(100 * c["accuracy"], 0) if c else "–" for c in cells)
                       + f" | {_fmt(100 * total, 0) if total is not None else '–'} | "
                       + (f"{100 * sum(sparsity) / len(sparsity):.1f}%" if sparsity else "") + " |")
        out.append("")
    table = summary.get("ppl")
    if table:
        lengths = sorted({int(n) for setting in table.values() for n in setting})
        dense = table.get("dense", {})
        for field, name in (("decode_ppl", "decode-phase"), ("prefill_ppl", "prefill-phase")):
            out.append(f"**{name} perplexity** on held-out Emma (relative to dense):\n")
            out.append("| setting | " + " | ".join(str(n) for n in lengths) + " | token sparsity |")
            out.append("|---|" + "---:|" * (len(lengths) + 1))
            for setting in _order(table):
                cells = []
                for n in lengths:
                    value = table[setting].get(str(n), {}).get(field)
                    base = dense.get(str(n), {}).get(field)
                    if value is None:
                        cells.append("–")
                    elif base and setting != "dense":
                        cells.append(f"{value:.2f} ({100 * (value / base - 1):+.1f}%)")
                    else:
                        cells.append(f"{value:.2f}")
                sparsity = [v["token_sparsity"] for v in table[setting].values() if "token_sparsity" in v]
                out.append(f"| {setting} | " + " | ".join(cells) + " | "
                           + (f"{100 * sum(sparsity) / len(sparsity):.1f}%" if sparsity else "") + " |")
            out.append("")
    return "\n".join(out)
