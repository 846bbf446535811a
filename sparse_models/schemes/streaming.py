"""StreamingLLM (Xiao et al., 2023) as a decode baseline: attention sinks + a recent window.

The full cache is kept (this is a quality baseline, not a memory one); each decode step reads the
first ``sink_tokens`` positions and the last ``recent_window`` positions (the current one included).
"""

from __future__ import annotations

import torch

import kernels

from ..config import StreamingConfig


def streaming_indices(seq_lens: torch.Tensor, num_kv_heads: int, cfg: StreamingConfig) -> torch.Tensor:
    """[B, Hkv, sink + window] ascending positions, -1 padded (at the end) where a sequence is shorter."""
    sink, window = cfg.sink_tokens, cfg.recent_window
    lens = seq_lens.long()
    sinks = torch.arange(sink, device=lens.device)[None, :].expand(lens.shape[0], -1)
    sinks = torch.where(sinks < lens[:, None], sinks, torch.full_like(sinks, -1))
    recent = lens[:, None] - window + torch.arange(window, device=lens.device)[None, :]
    recent = torch.where(recent >= sink, recent, torch.full_like(recent, -1))
    idx = torch.cat([sinks, recent], dim=1)
    # ascending with the -1 padding last (kernels read lists front to back)
    big = torch.iinfo(idx.dtype).max
    idx = torch.where(idx < 0, torch.full_like(idx, big), idx).sort(dim=1).values
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
    return idx[:, None, :].expand(-1, num_kv_heads, -1).contiguous()


def streaming_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     cfg: StreamingConfig) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D], attending to sinks + recent window."""
    return kernels.sparse_decode_attention(q, k_cache, v_cache, streaming_indices(seq_lens, k_cache.shape[1], cfg))
