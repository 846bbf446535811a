"""Validation of per-head position lists used by the sparse prefill kernels."""

from __future__ import annotations

import torch


def check_sorted_index_lists(indices, batch: int, num_q_heads: int, num_kv_heads: int, seq_len: int, device):
    """Check ``indices[B, Hs, K]`` (Hs = Hq or Hkv): int32/int64 positions in ``[0, seq_len)``,
    strictly ascending, ``-1`` padding only after the last valid entry. Returns int32, contiguous.

    One reduction plus one host sync, before any kernel launch.
    """
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices.dtype={indices.dtype} must be int32 or int64")
    if indices.dim() != 3 or indices.shape[0] != batch or indices.shape[1] not in (num_q_heads, num_kv_heads):
        raise ValueError(
            f"indices must have shape [B={batch}, Hs, K] with Hs = Hq ({num_q_heads}) or Hkv ({num_kv_heads}), "
            f"got {tuple(indices.shape)}"
        )
    if indices.device != device:
        raise ValueError(f"indices is on {indices.device} but q is on {device}; all inputs must share a device")
    if indices.numel() == 0:
        return indices.to(torch.int32).contiguous()
    valid = indices >= 0
    bad_value = (indices < -1) | (indices >= seq_len)
    # ascending: each valid successor is larger than its predecessor, which must be valid too
    nxt_valid = valid[..., 1:]
    bad_order = nxt_valid & (~valid[..., :-1] | (indices[..., 1:] <= indices[..., :-1]))
    flags = torch.stack([bad_value.any(), bad_order.any()]).tolist()
    if flags[0]:
        lo, hi = int(indices.min()), int(indices.max())
        raise ValueError(
            f"indices has values in [{lo}, {hi}]; allowed are positions in [0, {seq_len - 1}] and -1 for padding"
        )
    if flags[1]:
        raise ValueError(
            "indices must be strictly ascending per (batch, head) with -1 padding only at the end of each list"
        )
    return indices.to(torch.int32).contiguous()
