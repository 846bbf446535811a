"""Dense causal attention: prefill (fresh or a chunk after a cached past) and decode."""

from __future__ import annotations

import torch

import kernels

from .base import Scheme, exact_decode


def dense_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                  kv_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, S, D] at positions q_offsets + i; k, v [B, Hkv, N, D] (slot = position) -> [B, Hq, S, D]."""
    return kernels.prefill_attention(q, k, v, q_offsets, kv_lens, scale=scale)


def dense_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D] at position seq_lens - 1 -> [B, Hq, D]."""
    return kernels.decode_attention(q, k_cache, v_cache, seq_lens)


def fresh_prefill(layer, q, k, v, state, k_anchor=None, q_anchor=None) -> torch.Tensor:
    """Prefill role ``dense``: causal attention over the fresh tokens (no past)."""
    return dense_prefill(q, k, v, torch.zeros_like(state.num_new), state.num_new, state.scale)


SCHEME = Scheme(
    name="dense",
    summary="exact causal attention in every layer (the reference every scheme is measured against)",
    prefill_roles=lambda config, num_layers, anchors: ["dense"] * num_layers,
    decode_roles=lambda config, num_layers, anchors, family: [("dense", None)] * num_layers,
    prefill={"dense": fresh_prefill},
    decode={"dense": exact_decode},
    display_name="dense",
    order=0,
)
