"""Preallocated static KV caches for the engine (gpt-fast style buffers, slot = position).

Everything is allocated once for ``max_batch`` sequences of ``capacity`` slots, so that a decode step
has static shapes and can be captured in a CUDA graph. The only per-step state is ``positions`` [B]
(a device tensor: the slot the next token goes to); every op reads lengths from it, never from the host.

Layouts (per layer ``l``, chosen by the per-layer plan, ``sparse_models.plan``):

* dense layout (every scheme except POD decode):
    ``keys[l]``, ``values[l]``: [Bmax, Hkv, N, D].
* POD's shared-key layout (``plan[l].pod_keys``; POD arXiv 2412.02252, "pod" and "pod+tidal" decode):
    ``values[l]``: [Bmax, Hkv, N, D] (values are never shared);
    ``key_pool``: [Bmax, U, N, D], one plane per *anchor unit* (layer, KV head) whose anchor is itself,
    ordered by (layer, head), so the anchor heads of one layer are consecutive planes and a run of
    consecutive heads is a strided view ``key_pool[:, u0:u0 + r]`` ([B, r, N, D]) that kernels read in place;
    ``local_keys[l]``: [Bmax, Hkv, sink + recent, D] for layers with non-anchor heads: the layer's own
    keys at the sink slots ``0..sink-1`` and a ring of the last ``recent`` positions at slot
    ``sink + pos % recent`` (ARCHITECTURE.md pod_decode_attention). Non-anchor units keep
    nothing else, so the memory saving is real.
* Quest (arXiv 2406.10774) adds, per Quest layer, ``page_max`` / ``page_min``: [Bmax, Hkv, P, D]
  (P = ceil(N / page_size)), the per-channel key max / min of each page, updated on every append.
* A scheme's own ``StateBuffer``s (``CacheNeeds.buffers``, laid out by ``sparse_models/cache_layout.py``):
  ``buffers[(layer, name)]`` [Bmax, Hkv, entries, *trailing], reset by a fresh prefill, updated by its decode
  functions through ``view.buffer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels

from ..cache_layout import CacheLayout
from ..key_pages import fold_token
from ..kv_bytes import KVBytes
from ..ring import ring_slots, written_ring
from .errors import EngineError


@dataclass(frozen=True)
class KeyRun:
    """Consecutive KV heads [h0, h1) of one layer that read full keys from the same layer.

    ``anchor == layer`` (own) for anchor heads or in the dense layout; else the heads are POD
    non-anchor heads whose distant keys are the anchor layer's and whose proximal keys are in the ring.
    """

    h0: int
    h1: int
    anchor: int
    own: bool


def key_runs(anchors: tuple[int, ...], layer: int) -> list[KeyRun]:
    runs: list[KeyRun] = []
    start = 0
    for h in range(1, len(anchors) + 1):
        if h == len(anchors) or anchors[h] != anchors[start]:
            runs.append(KeyRun(start, h, anchors[start], anchors[start] == layer))
            start = h
    return runs


class StaticCache:
    """The engine's KV buffers for one model, plan and capacity.

    Args:
        plan: list of ``sparse_models.plan.LayerPlan`` (roles, anchors, ``pod_keys``).
        num_kv_heads, head_dim: Hkv, D.
        max_batch: Bmax; capacity: N slots per sequence.
        layout: the state beyond K/V (``sparse_models/cache_layout.cache_layout``: POD's ring window for layers
            with ``pod_keys``, the layers keeping page max/min and their page size).
        fused_append: write a decode token's keys, values and POD ring keys with ``kernels.append_kv`` (one
            launch per layer) instead of indexed assignments (the engine's ``decode_kernels="fused"``).
    """

    def __init__(self, plan, num_kv_heads: int, head_dim: int, max_batch: int, capacity: int, *,
                 dtype: torch.dtype, device, layout: CacheLayout = CacheLayout(), fused_append: bool = False):
        if max_batch < 1:
            raise EngineError(f"max_batch={max_batch} is invalid: expected >= 1")
        if capacity < 1:
            raise EngineError(f"capacity={capacity} is invalid: expected >= 1 slot per sequence")
        self.plan = plan
        self.num_layers = len(plan)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_batch = max_batch
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout = layout
        self.sink = layout.ring_sink
        self.recent = layout.ring_recent
        self.page_size = layout.page_size or 1  # unused without page layers
        self.fused_append = fused_append  # decode appends through kernels.append_kv (one launch per layer)
        shape = (max_batch, num_kv_heads, capacity, head_dim)
        alloc = dict(dtype=dtype, device=self.device)
        self.runs = [key_runs(p.anchors if p.pod_keys else (p.layer,) * num_kv_heads, p.layer) for p in plan]
        self.values = [torch.zeros(shape, **alloc) for _ in plan]
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.local_keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.unit_of: dict[tuple[int, int], int] = {}
        for p in plan:
            if not p.pod_keys:
                continue
            for h, a in enumerate(p.anchors):
                if a == p.layer:
                    self.unit_of[(p.layer, h)] = len(self.unit_of)
        self.key_pool = (torch.zeros(max_batch, len(self.unit_of), capacity, head_dim, **alloc)
                         if self.unit_of else None)
        for p in plan:
            if p.pod_keys:
                if any(not run.own for run in self.runs[p.layer]):
                    self.local_keys[p.layer] = torch.zeros(max_batch, num_kv_heads, self.sink + self.recent, head_dim,
                                                           **alloc)
            else:
                self.keys[p.layer] = torch.zeros(shape, **alloc)
        pages = -(-capacity // self.page_size)
        self.quest_layers = tuple(layout.page_layers)
        self.page_max = {l: torch.full((max_batch, num_kv_heads, pages, head_dim), float("-inf"), **alloc)
                         for l in self.quest_layers}
        self.page_min = {l: torch.full((max_batch, num_kv_heads, pages, head_dim), float("inf"), **alloc)
                         for l in self.quest_layers}
        # the schemes' declared state (CacheNeeds.buffers), (layer, name) -> [Bmax, Hkv, E, *trailing]
        self.buffers = {(layer, b.name): b.allocate(max_batch, num_kv_heads, capacity, dtype, self.device)
                        for b in layout.buffers for layer in b.layers}
        # kernels.append_kv's key rows of POD layers: head h's unit in key_pool, -1 for a non-anchor head
        self._pool_rows = {p.layer: torch.tensor([self.unit_of.get((p.layer, h), -1) for h in range(num_kv_heads)],
                                                 dtype=torch.int32, device=self.device)
                           for p in plan if p.pod_keys}
        # slot of the next token of each sequence (= its current length)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._batch_index = torch.arange(max_batch, device=self.device)

    # ------------------------------------------------------------------------------------------
    # Views
    # ------------------------------------------------------------------------------------------

    def full_keys(self, layer: int, h0: int, h1: int, batch: int) -> torch.Tensor:
        """[batch, h1 - h0, N, D] view of the keys of (layer, heads h0..h1-1) at every slot.

        In the POD layout only anchor units have them; asking for a non-anchor unit is a bug.
        """
        if self.keys[layer] is not None:
            return self.keys[layer][:batch, h0:h1]
        u0 = self.unit_of.get((layer, h0))
        if u0 is None or any(self.unit_of.get((layer, h)) != u0 + h - h0 for h in range(h0, h1)):
            raise EngineError(f"layer {layer} heads [{h0}, {h1}) keep no full keys in POD's cache (not anchors)")
        return self.key_pool[:batch, u0:u0 + h1 - h0]

    def ring_slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Slot in ``local_keys`` of key position ``pos`` (sinks first, then the ring)."""
        return ring_slots(pos, self.sink, self.recent)

    # ------------------------------------------------------------------------------------------
    # Writes
    # ------------------------------------------------------------------------------------------

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Decode write (CUDA-graph safe): k, v [B, Hkv, D] of the token at slot positions[b]."""
        batch = k.shape[0]
        b = self._batch_index[:batch]
        runs = self.runs[layer]
        local = self.local_keys[layer]
        if self.fused_append:  # one launch: values, the heads' full keys (dense or POD's pool) and POD's ring
            pooled = self.keys[layer] is None
            kernels.append_kv(self.key_pool if pooled else self.keys[layer], self.values[layer], k, v, positions,
                              key_heads=self._pool_rows[layer] if pooled else None, ring=local, sink=self.sink,
                              recent=self.recent)
        else:
            self.values[layer][b, :, positions] = v
            for run in runs:
                if run.own:
                    self.full_keys(layer, run.h0, run.h1, self.max_batch)[b, :, positions] = k[:, run.h0:run.h1]
            if local is not None:
                local[b, :, self.ring_slots(positions)] = k
        if layer in self.page_max:
            fold_token(self.page_max[layer], self.page_min[layer], k, positions, self.page_size, b)

    def write_chunk(self, layer: int, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    lens: torch.Tensor) -> None:
        """Prefill / correction write: k, v [B, Hkv, S, D] of positions offsets[b] + i.

        ``lens`` [B] is each sequence's length after the chunk; columns at positions >= lens[b]
        (right padding) may be written to the dense buffers (they are past the sequence and get
        overwritten by later tokens) but never into POD's ring or Quest's pages.
        """
        batch, _, s, d = k.shape
        pos = offsets[:, None] + torch.arange(s, device=k.device)[None, :]  # [B, S]
        zero_offsets = not bool(offsets.any())
        idx = pos.clamp(max=self.capacity - 1)[:, None, :, None].expand(batch, k.shape[1], s, d)

        def put(buffer: torch.Tensor, x: torch.Tensor) -> None:
            if zero_offsets:
                buffer[:, :, :s] = x
            else:
                buffer.scatter_(2, idx[:, :x.shape[1]], x)

        put(self.values[layer][:batch], v)
        if zero_offsets:  # fresh sequences: the schemes' declared state starts over, as in a new model cache
            for buffer in self.layout.buffers_of(layer):
                self.buffers[(layer, buffer.name)][:batch].fill_(buffer.fill)
        for run in self.runs[layer]:
            if run.own:
                put(self.full_keys(layer, run.h0, run.h1, batch), k[:, run.h0:run.h1])
        local = self.local_keys[layer]
        if local is not None:
            local[:batch] = written_ring(local[:batch], k, offsets, lens, self.sink, self.recent)
        if layer in self.page_max:
            pmax, pmin = kernels.quest_page_minmax(self.keys[layer][:batch], lens, self.page_size)
            self.page_max[layer][:batch] = pmax.to(self.dtype)
            self.page_min[layer][:batch] = pmin.to(self.dtype)

    def fill_random(self, lens: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Benchmarks: put random keys/values in every buffer and set positions = lens (no model run)."""
        batch = lens.shape[0]
        for t in [*self.values, *[x for x in self.keys if x is not None], *[x for x in self.local_keys if x is not None]]:
            t.normal_(generator=generator)
        if self.key_pool is not None:
            self.key_pool.normal_(generator=generator)
        for layer in self.quest_layers:
            pmax, pmin = kernels.quest_page_minmax(self.keys[layer][:batch], lens, self.page_size)
            self.page_max[layer][:batch] = pmax.to(self.dtype)
            self.page_min[layer][:batch] = pmin.to(self.dtype)
        self.positions[:batch] = lens.to(self.device)

    # ------------------------------------------------------------------------------------------
    # Accounting
    # ------------------------------------------------------------------------------------------

    def kv_bytes(self) -> KVBytes:
        """Bytes really allocated for keys and values (+ Quest metadata) against a dense cache of the same size."""
        return KVBytes.of([*self.keys, self.key_pool, *self.local_keys], self.values,
                          [*self.page_max.values(), *self.page_min.values()])
