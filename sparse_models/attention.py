"""Per-layer attention routing: one call per layer and forward, by phase and the layer's plan.

Phases (decided once per forward by the model loop):

- ``prefill``: no past in the cache (or no cache: training, scoring). The plan's prefill role runs
  on the fresh K/V; with a cache the K/V are stored afterwards (uncompressed, so decode sees all).
- ``decode``: every sequence adds exactly one token after a non-empty past. The decode role runs.
- ``chunk``: several new tokens after a past (continued prompts, TidalDecode's KV correction).
  Exact causal attention over the cache, or the decode scheme's ``Scheme.chunk`` where its cache layout
  needs one (POD: token by token, because a non-anchor head no longer holds distant keys of its own).

State handed between layers (TidalDecode indices, POD gates, anchor keys in prefill) lives in the
explicit :class:`ForwardState` of one forward, never in module attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import kernels

from .cache import SparseKVCache
from .config import SparseAttentionConfig
from .decode_view import CacheDecodeView
from .plan import LayerPlan
from .schemes.base import DecodeStepState
from .schemes.registry import get_scheme


@dataclass
class ForwardState:
    """What the layers of one forward share.

    Attributes:
        phase: ``prefill`` | ``decode`` | ``chunk``.
        old_lens, num_new, new_lens: [B] tokens before this forward, added by it, after it.
        cache: the SparseKVCache or None.
        selected: TidalDecode indices chosen in this step, by selection layer.
        gates: POD proximal gates [B, Hq] of this decode step, by layer (gate_tau).
        queries: this step's queries by layer (decode/chunk, POD score sharing reads the anchor's).
        stats: what the prefill scheme's layers report (``Scheme.prefill_stats()``, e.g. Token Sparse's), or None.
        capture: when not None, layer -> (q, k) post-RoPE for the layers in ``capture_layers``.
        scale, token_sparse_keep_ratio: see :class:`sparse_models.schemes.base.PrefillState` (the engine's
            prefill sets them; the model uses the defaults).
    """

    phase: str
    old_lens: torch.Tensor
    num_new: torch.Tensor
    new_lens: torch.Tensor
    cache: SparseKVCache | None
    config: SparseAttentionConfig
    plan: list[LayerPlan]
    selected: dict[int, torch.Tensor] = field(default_factory=dict)
    gates: dict[int, torch.Tensor] = field(default_factory=dict)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    stats: Any = None
    capture: dict | None = None
    capture_layers: set | None = None
    scale: float | None = None
    token_sparse_keep_ratio: float | None = None


def _autocast_inputs(*tensors):
    """Under autocast, attention runs in the autocast dtype, as torch SDPA does (it is on autocast's
    lower-precision list). Needed because RoPE (fp32 cos/sin times a bf16 projection) promotes q and k
    back to fp32 while v stays bf16, and the kernels require one dtype. No-op outside autocast."""
    reference = tensors[0]
    device_type = reference.device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def layer_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: ForwardState,
                    k_anchor: torch.Tensor | None = None, q_anchor: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one layer. q [B, Hq, S, D], k/v [B, Hkv, S, D] post-RoPE (packed layout).

    ``k_anchor`` [B, Hkv, S, D]: the anchor keys per KV head for a ``pod-shared`` prefill;
    ``q_anchor`` [B, Hq, S, D]: the anchor queries (``pod.sharing="scores"`` only).
    Returns [B, Hq, S, D].
    """
    q, k, v, k_anchor, q_anchor = _autocast_inputs(q, k, v, k_anchor, q_anchor)
    if state.capture is not None and (state.capture_layers is None or layer in state.capture_layers):
        state.capture[layer] = (q.detach(), k.detach())
    if state.config.pod.sharing == "scores" and state.phase != "prefill":
        state.queries[layer] = q
    if state.phase == "decode":
        return _decode(layer, q, k, v, state)
    if state.phase == "chunk":
        return _chunk(layer, q, k, v, state)
    return _prefill(layer, q, k, v, state, k_anchor, q_anchor)


def _prefill(layer, q, k, v, state, k_anchor, q_anchor=None):
    role = state.plan[layer].prefill
    scheme = get_scheme(state.config.prefill_scheme)
    if role not in scheme.prefill:
        raise RuntimeError(f"prefill role {role!r} of layer {layer} has no function in scheme {scheme.name!r}")
    out = scheme.prefill[role](layer, q, k, v, state, k_anchor, q_anchor)
    if state.cache is not None:
        state.cache.write(layer, k, v, state.old_lens, state.num_new)
        state.cache.update_key_state(layer, state.old_lens, state.new_lens)
    return out


def _decode(layer, q, k, v, state):
    p = state.plan[layer]
    cache = state.cache
    lens = state.new_lens
    cache.write(layer, k, v, state.old_lens, state.num_new)
    cache.update_key_state(layer, state.old_lens, lens)
    scheme = get_scheme(state.config.decode_scheme)
    if p.decode not in scheme.decode:
        raise RuntimeError(f"unknown decode role {p.decode!r} for layer {layer} (scheme {scheme.name!r})")
    view = CacheDecodeView(p, cache, lens, state.config, state)
    out = scheme.decode[p.decode](view, q[:, :, 0], p, DecodeStepState(state.selected))
    return out.unsqueeze(2)


def _chunk(layer, q, k, v, state):
    """Exact causal attention over the cache, or the decode scheme's own (``Scheme.chunk``: POD's cache keeps no
    distant keys for its non-anchor heads) on the layers whose keys its cache lays out (``LayerPlan.pod_keys``)."""
    p = state.plan[layer]
    cache = state.cache
    chunk = get_scheme(state.config.decode_scheme).chunk
    if p.pod_keys and chunk is not None:
        return chunk(layer, q, k, v, state)
    cache.write(layer, k, v, state.old_lens, state.num_new)
    cache.update_key_state(layer, state.old_lens, state.new_lens)
    # an FP8 cache reads back dequantised (fp32) K/V: the chunk attends over them in its own dtype, as the engine's
    # continuing chunks do (engine/prefill.py); a no-op cast for a cache of the model's dtype
    return kernels.prefill_attention(q, cache.layer_keys(layer).to(q.dtype), cache.layer_values(layer).to(q.dtype),
                                     state.old_lens, state.new_lens)
