"""``CacheLayout``: the one description of the state a cache keeps beyond per-layer K/V, computed once from the
config and the per-layer plan out of the decode scheme's :class:`~sparse_models.schemes.base.CacheNeeds`. Both
caches are built from it: the model's ``SparseKVCache`` (``sparse_models/cache.py``, grows with ``generate()``)
and the engine's ``StaticCache`` (``sparse_models/engine/static_cache.py``, preallocated for CUDA graphs), so
which layers keep a ring or pages, and their sizes, are decided here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .schemes.registry import get_scheme


@dataclass(frozen=True)
class CacheLayout:
    """What a cache keeps besides values [B, Hkv, N, D] and keys of every (layer, KV head).

    Attributes:
        ring_sink, ring_recent: the proximal key window of layers whose keys are laid out POD-style
            (``LayerPlan.pod_keys``): a KV head that reads distant keys from another layer keeps keys for
            ``ring_sink`` sink slots + a ring of the ``ring_recent`` latest positions only
            ([B, Hkv, sink + recent, D], ``sparse_models/ring.py``); (0, 1) where no layer has them.
        page_layers: layers that keep per-page, per-channel key max / min [B, Hkv, ceil(N / page_size), D].
        page_size: tokens per page of those layers (None: no page layers).
        correction_period: every T decode steps the last T tokens are re-run (TidalDecode's KV correction), so
            the cache remembers their ids; None: off.
        kv_cache_dtype: "bfloat16" (K/V in the model's dtype) or "fp8_e4m3": keys, values and POD's ring as
            float8_e4m3fn with one fp32 scale per (token or ring slot, KV head), [B, Hkv, N] next to each
            [B, Hkv, N, D] buffer (kernels/fp8_kv.py); Quest's page max / min stay in the model's dtype.
    """

    ring_sink: int = 0
    ring_recent: int = 1
    page_layers: tuple[int, ...] = ()
    page_size: int | None = None
    correction_period: int | None = None
    buffers: tuple[BufferLayout, ...] = ()
    kv_cache_dtype: str = "bfloat16"

    @property
    def fp8(self) -> bool:
        """Whether K/V are stored as FP8 with scales."""
        return self.kv_cache_dtype == "fp8_e4m3"

    def buffers_of(self, layer: int) -> tuple[BufferLayout, ...]:
        return tuple(b for b in self.buffers if layer in b.layers)


@dataclass(frozen=True)
class BufferLayout:
    """A scheme's ``StateBuffer`` resolved for one model: [B, Hkv, entries(N), *trailing] in ``layers``."""

    name: str
    layers: tuple[int, ...]
    slots_per_entry: int
    trailing: tuple[int, ...]
    fill: float
    dtype: torch.dtype | None

    def entries(self, slots: int) -> int:
        """Entries covering ``slots`` cache slots."""
        return -(-slots // self.slots_per_entry)

    def allocate(self, batch: int, num_kv_heads: int, slots: int, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.full((batch, num_kv_heads, self.entries(slots), *self.trailing), self.fill,
                          dtype=self.dtype or dtype, device=device)


def cache_layout(config, plan, head_dim: int = 0) -> CacheLayout:
    """The layout ``config``'s decode scheme asks for (``Scheme.cache``) over ``plan`` (``build_plan``'s rows);
    ``head_dim`` D sizes the buffers whose trailing dims depend on it."""
    needs = get_scheme(config.decode_scheme, "decode").cache
    sink, recent = needs.ring_window(config) if needs.ring_window is not None and needs.pod_keys else (0, 1)
    page_layers = tuple(row.layer for row in plan if row.decode in needs.page_roles)
    page_size = needs.page_size(config) if page_layers and needs.page_size is not None else None
    correction = needs.correction_period(config) if needs.correction_period is not None else None
    buffers = tuple(BufferLayout(b.name, tuple(row.layer for row in plan if row.decode in b.roles), b.slots_per_entry,
                                 tuple(b.trailing(config, head_dim)), b.fill, b.dtype) for b in needs.buffers)
    return CacheLayout(sink, recent, page_layers, page_size, correction, buffers,
                       getattr(config, "kv_cache_dtype", "bfloat16"))
