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
* A scheme's own ``StateBuffer``s (``CacheNeeds.buffers``, laid out by ``sparse_models/cache_layout.py``):
  ``buffers[(layer, name)]`` [Bmax, Hkv, entries, *trailing] in the model's dtype, reset by a fresh prefill, updated
  by its decode functions through ``view.buffer``, or, those a ``KeyState`` names, by every write here: Quest's
  (arXiv 2406.10774) ``page_max`` / ``page_min`` [Bmax, Hkv, P, D] (P = ceil(N / page_size)), the per-channel key
  max / min of each page.
* ``kv_cache_dtype="fp8_e4m3"`` (``layout.fp8``; kernels/fp8_kv.py): ``values``, ``keys``, ``key_pool`` and
  ``local_keys`` hold float8_e4m3fn, and each has its fp32 scales [Bmax, H, N] (``value_scale``, ``key_scale``,
  ``key_pool_scale``, ``local_scale``: one per token or ring slot and KV head). The prefill quantises
  (``kernels.quantize_kv``), the decode append writes data and scales (``kernels.append_kv`` or the same
  assignments), and the decode kernels take the scales and dequantise in registers. Quest's pages stay in the model's
  dtype, computed from the dequantised keys and rounded outward.
  With ``kv_cache_recent_keys`` W > 0 (``layout.recent_keys``) every layer also keeps its heads' own keys of the
  newest W positions in the model's dtype, ``recent_keys[l]`` [Bmax, Hkv, W, D] at slot ``position % W``, written by
  both writes and read by the decode ops (``recent_ring``); Quest's pages then bound both versions of a recent key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels.fp8_kv import FP8_DTYPE, SCALE_DTYPE, kv_storage_dtype, overlay_recent_keys

from ..cache_layout import CacheLayout
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
            with ``pod_keys``, the scheme's buffers (Quest's pages) and their layers).
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
        self.fused_append = fused_append  # decode appends through kernels.append_kv (one launch per layer)
        shape = (max_batch, num_kv_heads, capacity, head_dim)
        self.fp8 = layout.fp8
        alloc = dict(dtype=kv_storage_dtype(layout.kv_cache_dtype, dtype), device=self.device)
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
        # FP8: one fp32 scale per (token or ring slot, KV head) next to each K/V buffer; None in the model's dtype
        def scales(t):
            return (torch.ones(t.shape[:-1], dtype=SCALE_DTYPE, device=self.device)
                    if self.fp8 and t is not None else None)
        self.value_scale = [scales(t) for t in self.values]
        self.key_scale = [scales(t) for t in self.keys]
        self.local_scale = [scales(t) for t in self.local_keys]
        self.key_pool_scale = scales(self.key_pool)
        # recent keys (FP8 with kv_cache_recent_keys = W): each layer's own keys of the newest W positions, model dtype
        self.recent_window = layout.recent_keys
        self.recent_keys = [torch.zeros(max_batch, num_kv_heads, self.recent_window, head_dim, dtype=dtype,
                                        device=self.device) if self.recent_window else None for _ in plan]
        # the schemes' declared state (CacheNeeds.buffers: Quest's pages, ...), (layer, name) -> [Bmax, Hkv, E, ...]
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

    def full_key_scale(self, layer: int, h0: int, h1: int, batch: int) -> torch.Tensor | None:
        """[batch, h1 - h0, N] FP8 scales of :meth:`full_keys` (None in the model's dtype)."""
        if not self.fp8:
            return None
        if self.keys[layer] is not None:
            return self.key_scale[layer][:batch, h0:h1]
        u0 = self.unit_of[(layer, h0)]
        return self.key_pool_scale[:batch, u0:u0 + h1 - h0]

    def value_scales(self, layer: int, h0: int, h1: int, batch: int) -> torch.Tensor | None:
        """[batch, h1 - h0, N] FP8 scales of ``values[layer]`` (None in the model's dtype)."""
        return self.value_scale[layer][:batch, h0:h1] if self.fp8 else None

    def local_scales(self, layer: int, h0: int, h1: int, batch: int) -> torch.Tensor | None:
        """[batch, h1 - h0, sink + recent] FP8 scales of ``local_keys[layer]`` (None in the model's dtype)."""
        return self.local_scale[layer][:batch, h0:h1] if self.fp8 else None

    def recent_ring(self, layer: int, h0: int, h1: int, batch: int) -> torch.Tensor | None:
        """[batch, h1 - h0, W, D]: the model-dtype keys of (layer, heads h0..h1-1) at the newest W positions
        (slot position % W); None without recent keys."""
        return self.recent_keys[layer][:batch, h0:h1] if self.recent_window else None

    def dequantized(self, layer: int, batch: int, kv_max: int, dtype,
                    lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [batch, Hkv, kv_max, D] of a layer in the dense layout as attention over the cache reads
        them (a chunk that continues the cache: TidalDecode's correction), dequantised to ``dtype`` when FP8; with
        recent keys the newest positions of ``lens`` [batch] (the lengths after the chunk) from the ring."""
        keys = self.full_keys(layer, 0, self.num_kv_heads, batch)[:, :, :kv_max]
        values = self.values[layer][:batch, :, :kv_max]
        if not self.fp8:
            return keys, values
        keys = kernels.dequantize_kv(keys, self.full_key_scale(layer, 0, self.num_kv_heads, batch)[:, :, :kv_max],
                                     dtype)
        if self.recent_window:
            if lens is None:
                raise EngineError("dequantized() with recent keys needs the lengths the ring reflects")
            keys = overlay_recent_keys(keys, self.recent_keys[layer][:batch], lens)
        return keys, kernels.dequantize_kv(values, self.value_scale[layer][:batch, :, :kv_max], dtype)

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
        if self.fp8 and not self.fused_append:
            self._append_fp8(layer, k, v, positions, b)
        elif self.fused_append:  # one launch: values, the heads' full keys (dense or POD's pool) and POD's ring
            pooled = self.keys[layer] is None
            fp8 = dict(key_scale=self.key_pool_scale if pooled else self.key_scale[layer],
                       value_scale=self.value_scale[layer], ring_scale=self.local_scale[layer]) if self.fp8 else {}
            kernels.append_kv(self.key_pool if pooled else self.keys[layer], self.values[layer], k, v, positions,
                              key_heads=self._pool_rows[layer] if pooled else None, ring=local, sink=self.sink,
                              recent=self.recent, **fp8)
        else:
            self.values[layer][b, :, positions] = v
            for run in runs:
                if run.own:
                    self.full_keys(layer, run.h0, run.h1, self.max_batch)[b, :, positions] = k[:, run.h0:run.h1]
            if local is not None:
                local[b, :, self.ring_slots(positions)] = k
        also = {}
        if self.recent_window:  # the token's key in the model's dtype, read while it is among the newest W
            self.recent_keys[layer][b, :, positions % self.recent_window] = k
            also = {"also": k}
        states = self.layout.key_state_of(layer)
        if states and self.fp8:  # the key state covers the key as stored (dequantised), kernels/fp8_kv.py
            k = kernels.dequantize_kv(self.keys[layer][b, :, positions], self.key_scale[layer][b, :, positions])
        for state in states:
            state.fold(self._state_buffers(layer, state), k, positions, state.slots_per_entry, b, **also)

    def _state_buffers(self, layer: int, state) -> tuple[torch.Tensor, ...]:
        return tuple(self.buffers[(layer, name)] for name in state.names)

    def _rebuild_key_state(self, layer: int, batch: int, lens: torch.Tensor) -> None:
        """The buffers that follow ``layer``'s stored keys (``layout.key_state``: Quest's pages), recomputed for rows
        [0, batch) from their first ``lens`` keys."""
        for state in self.layout.key_state_of(layer):
            k_scale = self.key_scale[layer][:batch] if self.fp8 else None
            also = {}
            if self.recent_window:  # both versions of the newest keys (the ring's and the FP8 copy)
                keys = kernels.dequantize_kv(self.keys[layer][:batch], k_scale)
                also = {"also": overlay_recent_keys(keys, self.recent_keys[layer][:batch], lens)}
            new = state.rebuild(self.keys[layer][:batch], lens, k_scale, state.slots_per_entry, self.dtype, **also)
            for t, value in zip(self._state_buffers(layer, state), new):
                t[:batch] = value

    def _append_fp8(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, b) -> None:
        """The unfused decode append of an FP8 cache: the token's K/V quantised per KV head (kernels.quantize_kv),
        data and scales stored where the bf16 path stores K/V."""
        kq, ks = kernels.quantize_kv(k)  # [B, Hkv, D], [B, Hkv]
        vq, vs = kernels.quantize_kv(v)
        self.values[layer][b, :, positions] = vq
        self.value_scale[layer][b, :, positions] = vs
        for run in self.runs[layer]:
            if run.own:
                self.full_keys(layer, run.h0, run.h1, self.max_batch)[b, :, positions] = kq[:, run.h0:run.h1]
                self.full_key_scale(layer, run.h0, run.h1, self.max_batch)[b, :, positions] = ks[:, run.h0:run.h1]
        if self.local_keys[layer] is not None:
            slots = self.ring_slots(positions)
            self.local_keys[layer][b, :, slots] = kq
            self.local_scale[layer][b, :, slots] = ks

    def write_chunk(self, layer: int, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    lens: torch.Tensor) -> None:
        """Prefill / correction write: k, v [B, Hkv, S, D] of positions offsets[b] + i.

        ``lens`` [B] is each sequence's length after the chunk; columns at positions >= lens[b]
        (right padding) may be written to the dense buffers (they are past the sequence and get
        overwritten by later tokens) but never into POD's ring or the key state (Quest's pages).
        """
        batch, _, s, d = k.shape
        pos = offsets[:, None] + torch.arange(s, device=k.device)[None, :]  # [B, S]
        zero_offsets = not bool(offsets.any())
        idx = pos.clamp(max=self.capacity - 1)[:, None, :, None].expand(batch, k.shape[1], s, d)

        def put(buffer: torch.Tensor, x: torch.Tensor) -> None:
            if buffer.dtype == FP8_DTYPE:  # torch's CPU scatter has no float8 kernel: write the bytes
                buffer, x = buffer.view(torch.uint8), x.view(torch.uint8)
            if zero_offsets:
                buffer[:, :, :s] = x
            elif buffer.dim() == 3:  # FP8 scales [B, H, N]
                buffer.scatter_(2, idx[:, :x.shape[1], :, 0], x)
            else:
                buffer.scatter_(2, idx[:, :x.shape[1]], x)

        if self.fp8:
            return self._write_chunk_fp8(layer, k, v, offsets, lens, put)
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
        self._rebuild_key_state(layer, batch, lens)

    def _write_chunk_fp8(self, layer: int, k, v, offsets, lens, put) -> None:
        """``write_chunk`` of an FP8 cache: K/V quantised per (token, KV head) and stored with their scales; the ring
        takes the quantised keys and their scales; the key state (Quest's pages) follows the dequantised keys."""
        batch = k.shape[0]
        if self.recent_window:  # the newest keys in the model's dtype, before quantising
            self.recent_keys[layer][:batch] = written_ring(self.recent_keys[layer][:batch], k, offsets, lens, 0,
                                                           self.recent_window)
        kq, ks = kernels.quantize_kv(k)  # [B, Hkv, S, D], [B, Hkv, S]
        vq, vs = kernels.quantize_kv(v)
        put(self.values[layer][:batch], vq)
        put(self.value_scale[layer][:batch], vs)
        if not bool(offsets.any()):
            for buffer in self.layout.buffers_of(layer):
                self.buffers[(layer, buffer.name)][:batch].fill_(buffer.fill)
        for run in self.runs[layer]:
            if run.own:
                put(self.full_keys(layer, run.h0, run.h1, batch), kq[:, run.h0:run.h1])
                put(self.full_key_scale(layer, run.h0, run.h1, batch), ks[:, run.h0:run.h1])
        local = self.local_keys[layer]
        if local is not None:
            local.view(torch.uint8)[:batch] = written_ring(local.view(torch.uint8)[:batch], kq.view(torch.uint8),
                                                           offsets, lens, self.sink, self.recent)
            self.local_scale[layer][:batch] = written_ring(self.local_scale[layer][:batch, :, :, None], ks[..., None],
                                                           offsets, lens, self.sink, self.recent)[..., 0]
        self._rebuild_key_state(layer, batch, lens)

    def fill_random(self, lens: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Benchmarks: put random keys/values in every buffer and set positions = lens (no model run)."""
        batch = lens.shape[0]
        stores = [(self.values, self.value_scale), (self.keys, self.key_scale), (self.local_keys, self.local_scale),
                  ([self.key_pool], [self.key_pool_scale])]
        for data, scale in stores:
            for i, t in enumerate(data):
                if t is None:
                    continue
                if self.fp8:  # random normals, quantised as the prefill would
                    x = torch.empty(t.shape, dtype=self.dtype, device=t.device).normal_(generator=generator)
                    xq, xs = kernels.quantize_kv(x)
                    t.copy_(xq)
                    scale[i].copy_(xs)
                else:
                    t.normal_(generator=generator)
        for ring in self.recent_keys:
            if ring is not None:
                ring.normal_(generator=generator)
        for layer in range(self.num_layers):
            self._rebuild_key_state(layer, batch, lens)
        self.positions[:batch] = lens.to(self.device)

    # ------------------------------------------------------------------------------------------
    # Accounting
    # ------------------------------------------------------------------------------------------

    def kv_bytes(self) -> KVBytes:
        """Bytes really allocated for keys and values (+ the scheme's buffers as metadata: Quest's pages) against a
        dense cache of the same size (FP8: the float8 data and the fp32 scales)."""
        return KVBytes.of([*self.keys, self.key_pool, *self.local_keys, *self.key_scale, self.key_pool_scale,
                           *self.local_scale, *self.recent_keys], [*self.values, *self.value_scale],
                          self.buffers.values())
