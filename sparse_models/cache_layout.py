"""``CacheLayout``: the one description of the state a cache keeps beyond per-layer K/V, computed once from the
config and the per-layer plan out of the decode scheme's :class:`~sparse_models.schemes.base.CacheNeeds`. Both
caches are built from it: the model's ``SparseKVCache`` (``sparse_models/cache.py``, grows with ``generate()``)
and the engine's ``StaticCache`` (``sparse_models/engine/static_cache.py``, preallocated for CUDA graphs), so
which layers keep a ring or a scheme's buffers (Quest's pages among them), and their sizes, are decided here and
nowhere else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .schemes.registry import get_scheme


@dataclass(frozen=True)
class BufferLayout:
    """A scheme's ``StateBuffer`` resolved for one model: [B, Hkv, entries(N), *trailing] in ``layers``."""

    name: str
    layers: tuple[int, ...]
    slots_per_entry: int
    trailing: tuple[int, ...]
    fill: float
    dtype: torch.dtype | None
    dynamic_dtype: torch.dtype | None = None

    def entries(self, slots: int) -> int:
        """Entries covering ``slots`` cache slots."""
        return -(-slots // self.slots_per_entry)

    def storage_dtype(self, kv_dtype: torch.dtype, dynamic: bool = False) -> torch.dtype:
        """Its dtype in a cache whose K/V (model) dtype is ``kv_dtype``; ``dynamic``: the model's dynamic cache."""
        return (self.dynamic_dtype if dynamic else None) or self.dtype or kv_dtype

    def allocate(self, batch: int, num_kv_heads: int, slots: int, dtype: torch.dtype, device,
                 dynamic: bool = False) -> torch.Tensor:
        return torch.full((batch, num_kv_heads, self.entries(slots), *self.trailing), self.fill,
                          dtype=self.storage_dtype(dtype, dynamic), device=device)


@dataclass(frozen=True)
class KeyStateLayout:
    """A scheme's ``KeyState`` resolved for one model: the buffers ``names`` of ``layers`` follow their stored keys
    through ``rebuild`` / ``fold`` (``schemes/base.KeyState``), with ``slots_per_entry`` slots per entry."""

    names: tuple[str, ...]
    layers: tuple[int, ...]
    slots_per_entry: int
    rebuild: Callable[..., tuple[torch.Tensor, ...]]
    fold: Callable[..., None]


@dataclass(frozen=True)
class CacheLayout:
    """What a cache keeps besides values [B, Hkv, N, D] and keys of every (layer, KV head).

    Attributes:
        ring_sink, ring_recent: the proximal key window of layers whose keys are laid out POD-style
            (``LayerPlan.pod_keys``): a KV head that reads distant keys from another layer keeps keys for
            ``ring_sink`` sink slots + a ring of the ``ring_recent`` latest positions only
            ([B, Hkv, sink + recent, D], ``sparse_models/ring.py``); (0, 1) where no layer has them.
        correction_period: every T decode steps the last T tokens are re-run (TidalDecode's KV correction), so
            the cache remembers their ids; None: off.
        buffers: the scheme's ``StateBuffer``s, each with the layers keeping it (Quest's ``page_max`` /
            ``page_min`` [B, Hkv, ceil(N / page_size), D] of its ``quest`` layers).
        key_state: which of those buffers follow the stored keys, and how (Quest's pages).
        kv_cache_dtype: "bfloat16" (K/V in the model's dtype) or "fp8_e4m3": keys, values and POD's ring as
            float8_e4m3fn with one fp32 scale per (token or ring slot, KV head), [B, Hkv, N] next to each
            [B, Hkv, N, D] buffer (kernels/fp8_kv.py); the buffers stay in their own dtype (Quest's pages: the
            model's).
        recent_keys: W, FP8 caches only (0 otherwise): every layer also keeps its own keys of the newest W positions
            in the model's dtype, a ring [B, Hkv, W, D] at slot ``position % W``, and readers take those keys from
            it instead of the FP8 copy (kernels/fp8_kv.py "Recent keys").
    """

    ring_sink: int = 0
    ring_recent: int = 1
    correction_period: int | None = None
    buffers: tuple[BufferLayout, ...] = ()
    key_state: tuple[KeyStateLayout, ...] = ()
    kv_cache_dtype: str = "bfloat16"
    recent_keys: int = 0

    @property
    def fp8(self) -> bool:
        """Whether K/V are stored as FP8 with scales."""
        return self.kv_cache_dtype == "fp8_e4m3"

    def buffers_of(self, layer: int) -> tuple[BufferLayout, ...]:
        return tuple(b for b in self.buffers if layer in b.layers)

    def buffer(self, layer: int, name: str) -> BufferLayout | None:
        """The layout of ``layer``'s buffer ``name`` (None: the layer keeps none)."""
        return next((b for b in self.buffers_of(layer) if b.name == name), None)

    def key_state_of(self, layer: int) -> tuple[KeyStateLayout, ...]:
        return tuple(s for s in self.key_state if layer in s.layers)


def _key_state(state, buffers: tuple[BufferLayout, ...]) -> KeyStateLayout:
    named = [next((b for b in buffers if b.name == name), None) for name in state.buffers]
    if not named or None in named or len({(b.layers, b.slots_per_entry) for b in named}) != 1:
        raise ValueError(f"KeyState {state.buffers} must name StateBuffers of the same CacheNeeds with the same roles "
                         f"and slots_per_entry")
    return KeyStateLayout(state.buffers, named[0].layers, named[0].slots_per_entry, state.rebuild, state.fold)


def cache_layout(config, plan, head_dim: int = 0) -> CacheLayout:
    """The layout ``config``'s decode scheme asks for (``Scheme.cache``) over ``plan`` (``build_plan``'s rows);
    ``head_dim`` D sizes the buffers whose trailing dims depend on it."""
    needs = get_scheme(config.decode_scheme, "decode").cache
    sink, recent = needs.ring_window(config) if needs.ring_window is not None and needs.pod_keys else (0, 1)
    correction = needs.correction_period(config) if needs.correction_period is not None else None
    buffers = tuple(
        BufferLayout(b.name, tuple(row.layer for row in plan if row.decode in b.roles),
                     b.slots_per_entry(config) if callable(b.slots_per_entry) else b.slots_per_entry,
                     tuple(b.trailing(config, head_dim)), b.fill, b.dtype, b.dynamic_dtype)
        for b in needs.buffers)
    key_state = tuple(_key_state(s, buffers) for s in needs.key_state)
    kv_cache_dtype = getattr(config, "kv_cache_dtype", "bfloat16")
    recent_keys = getattr(config, "kv_cache_recent_keys", 0) if kv_cache_dtype == "fp8_e4m3" else 0
    return CacheLayout(sink, recent, correction, buffers, key_state, kv_cache_dtype, recent_keys)
