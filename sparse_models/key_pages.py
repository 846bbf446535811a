"""Quest's key pages (Tang et al., arXiv 2406.10774 §3; METHODS.md D): per page of ``page_size`` positions, the
per-channel max and min of its keys, [B, Hkv, P, D]. One decode-time update for the model's ``SparseKVCache``
(``sparse_models/cache.py``) and the engine's ``StaticCache`` (``sparse_models/engine/static_cache.py``); whole
pages are (re)computed by ``kernels.quest_page_minmax`` in both."""

from __future__ import annotations

import torch

from kernels.fp8_kv import round_outward


def fold_token(page_max: torch.Tensor, page_min: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               page_size: int, rows: torch.Tensor | None = None) -> None:
    """In place: the key ``k`` [B, Hkv, D] of the token at ``positions`` [B] joins its page's max / min
    (page_max, page_min [Bmax >= B, Hkv, P, D]); a page's first token replaces what the page held. ``rows``: the
    batch indices 0 .. B-1 (a preallocated arange keeps the engine's CUDA graph free of allocations). No host sync.
    A dequantised FP8 key (fp32) joins pages of a narrower dtype rounded outward (max up, min down), so that the
    page bound still holds for the key attention reads (kernels/fp8_kv.py ``round_outward``)."""
    rows = torch.arange(k.shape[0], device=k.device) if rows is None else rows
    page = positions // page_size
    fresh = (positions % page_size == 0)[:, None, None]
    if k.dtype == torch.float32 and page_max.dtype != torch.float32:
        k_up, k_down = round_outward(k, k, page_max.dtype)
    else:
        k_up = k_down = k.to(page_max.dtype)
    page_max[rows, :, page] = torch.where(fresh, k_up, torch.maximum(page_max[rows, :, page], k_up))
    page_min[rows, :, page] = torch.where(fresh, k_down, torch.minimum(page_min[rows, :, page], k_down))
