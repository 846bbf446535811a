"""Anchor maps (``LayerPlan.anchors``: per layer, the layer each KV head reads distant keys from; POD,
arXiv 2412.02252 §2.3): their validation and the per-KV-head gathers of an anchor layer's tensors, used by
the model's decoder loop (``sparse_models/modeling_common.py``) and POD's attention
(``sparse_models/schemes/pod.py``)."""

from __future__ import annotations

from typing import Any

import torch

from .validation import fail


def validate_anchor_layers(anchor_layers: Any) -> None:
    """Check that an anchor map describes blocks of consecutive layers anchored at their lowest layer."""
    if not isinstance(anchor_layers, (list, tuple)) or not anchor_layers:
        fail("pod.anchor_layers", anchor_layers, "expected a non-empty list (layers) of lists (KV heads)")
    width = None
    for layer, row in enumerate(anchor_layers):
        if not isinstance(row, (list, tuple)) or not row:
            fail(f"pod.anchor_layers[{layer}]", row, "expected a non-empty list with one anchor layer per KV head")
        if width is None:
            width = len(row)
        elif len(row) != width:
            fail(f"pod.anchor_layers[{layer}]", row, f"expected {width} entries, like row 0")
        for head, anchor in enumerate(row):
            previous = anchor_layers[layer - 1][head] if layer > 0 else 0
            if isinstance(anchor, bool) or not isinstance(anchor, int) or anchor not in (layer, previous):
                fail(f"pod.anchor_layers[{layer}][{head}]", anchor,
                      f"a block is consecutive layers anchored at its lowest layer: expected {layer} (new block)"
                      + (f" or {previous} (the anchor of layer {layer - 1})" if layer > 0 else ""))


def assemble_anchor_keys(anchors: tuple[int, ...], keys_by_layer: dict[int, torch.Tensor]) -> torch.Tensor:
    """[B, Hkv, S, D]: KV head h takes the keys of layer ``anchors[h]`` (same head)."""
    return torch.stack([keys_by_layer[a][:, h] for h, a in enumerate(anchors)], dim=1)


def assemble_anchor_queries(anchors: tuple[int, ...], queries_by_layer: dict[int, torch.Tensor]) -> torch.Tensor:
    """[B, Hq, S, D]: query head qh takes the queries of the anchor layer of its KV head (v1 score sharing)."""
    group = next(iter(queries_by_layer.values())).shape[1] // len(anchors)
    return torch.stack([queries_by_layer[anchors[qh // group]][:, qh] for qh in range(group * len(anchors))], dim=1)
