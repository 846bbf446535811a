"""What the unit selection leaves beside the exploration: ``unit_gates.json`` and ``unit_gates.png``.

``unit_gates.json`` (format ``podkit.unit_gates/1``): every unit's learned gate (``alpha[layer][kv_head]``,
null at the candidate map's anchors), the shared units in rank order with their gates, the loss curve, the
chosen units (the ``pod.protect_units`` they amount to), the candidate and final anchor maps with their KV
savings, and the settings and data that produced them. ``unit_gates.png``: alpha as a KV head x layer heat map,
chosen units outlined.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparse_models.calibration.outputs import save_figure, write_json

GATES_FORMAT = "podkit.unit_gates/1"


def gates_payload(alpha: torch.Tensor, candidate: list[list[int]], final: list[list[int]], ranked, chosen,
                  curve: list[dict], **metadata) -> dict:
    """The JSON body; ``alpha[L, Hkv]``, ``ranked`` / ``chosen`` lists of (layer, KV head)."""
    grid = [[None if candidate[layer][head] == layer else round(float(alpha[layer, head]), 6)
             for head in range(len(candidate[0]))] for layer in range(len(candidate))]
    return {"format": GATES_FORMAT, "alpha": grid,
            "ranked_units": [{"layer": l, "kv_head": h, "alpha": round(float(alpha[l, h]), 6)} for l, h in ranked],
            "chosen_units": [list(unit) for unit in chosen], "candidate_anchor_layers": candidate,
            "anchor_layers": final, "loss_curve": curve, **metadata}


def write_unit_gates(folder: Path, payload: dict) -> tuple[Path, Path]:
    """``folder/unit_gates.json`` and ``folder/unit_gates.png``."""
    folder = Path(folder)
    return write_json(folder / "unit_gates.json", payload), plot_gates(payload, folder / "unit_gates.png")


def plot_gates(payload: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    grid = torch.tensor([[float("nan") if a is None else a for a in row] for row in payload["alpha"]]).T  # [Hkv, L]
    num_kv_heads, num_layers = grid.shape
    fig, ax = plt.subplots(figsize=(max(6, num_layers * 0.3), 1.6 + 0.5 * num_kv_heads))
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    for layer, head in payload["chosen_units"]:
        ax.add_patch(Rectangle((layer - 0.5, head - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    ax.set_yticks(range(num_kv_heads))
    ax.set_xticks(range(0, num_layers, max(1, num_layers // 15)))
    ax.set_xlabel("layer")
    ax.set_ylabel("KV head")
    ax.set_title("learned gate alpha per shared unit (blank: candidate anchor; red: keeps its own keys)")
    fig.colorbar(image, ax=ax, label="alpha (1: needs its own distant keys)")
    fig.tight_layout()
    return save_figure(fig, path)
