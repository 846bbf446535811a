"""Quest's key pages (Tang et al., arXiv 2406.10774 §3; METHODS.md D): per page of ``page_size`` positions, the
per-channel max and min of its keys, [B, Hkv, P, D]. One decode-time update for the model's ``SparseKVCache``
(``sparse_models/cache.py``) and the engine's ``StaticCache`` (``sparse_models/engine/static_cache.py``); whole
pages are (re)computed by ``kernels.quest_page_minmax`` in both."""

from __future__ import annotations

import torch


def fold_token(page_max: torch.Tensor, page_min: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               page_size: int, rows: torch.Tensor | None = None) -> None:
    """In place: the key ``k`` [B, Hkv, D] of the token at ``positions`` [B] joins its page's max / min
    (page_max, page_min [Bmax >= B, Hkv, P, D]); a page's first token replaces what the page held. ``rows``: the
    batch indices 0 .. B-1 (a preallocated arange keeps the engine's CUDA graph free of allocations). No host sync."""
    rows = torch.arange(k.shape[0], device=k.device) if rows is None else rows
    page = positions // page_size
    fresh = (positions % page_size == 0)[:, None, None]
    k = k.to(page_max.dtype)
    page_max[rows, :, page] = torch.where(fresh, k, torch.maximum(page_max[rows, :, page], k))
    page_min[rows, :, page] = torch.where(fresh, k, torch.minimum(page_min[rows, :, page], k))
