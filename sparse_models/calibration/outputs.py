"""Writing the analyses' outputs (shared by calibration and eval): JSON files and matplotlib figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path, payload: Any) -> Path:
    """Write ``payload`` as indented JSON through a temporary file, so that an interrupted run never
    leaves a half-written result behind (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)
    return path


def save_figure(fig, path) -> Path:
    """Write ``fig`` to ``path`` (parents created, 110 dpi) and close it; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
