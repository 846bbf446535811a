"""TidalDecode: position-persistent sparse decode (Yang et al., arXiv 2410.05076).

Selection layers run full attention and choose the top-(budget - 1) past positions plus the current
one (per query head, the paper's choice, or per KV group); the layers above read only those
positions until the next selection layer. Prefill is dense. KV-cache correction (paper §3.3) lives
in the model loop (``sparse_models.modeling_common``): every T steps the last T tokens are re-run
with full attention and their K/V overwritten.
"""

from __future__ import annotations

import torch

import kernels

from ..config import TidalConfig


def tidal_select_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                        cfg: TidalConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection layer: exact attention + the positions the next layers read.

    Returns (out [B, Hq, D], indices [B, Hs, budget]); Hs = Hq or Hkv (``cfg.selection``).
    """
    return kernels.selection_decode_attention(q, k_cache, v_cache, seq_lens, cfg.budget,
                                              per_kv_group=cfg.selection == "kv_group")


def tidal_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        indices: torch.Tensor) -> torch.Tensor:
    """Sparse layer: attention over the selected positions only -> [B, Hq, D]."""
    return kernels.sparse_decode_attention(q, k_cache, v_cache, indices)
