"""Saving the analyses' matplotlib figures (shared by calibration and eval plots)."""

from __future__ import annotations

from pathlib import Path


def save_figure(fig, path) -> Path:
    """Write ``fig`` to ``path`` (parents created, 110 dpi) and close it; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
