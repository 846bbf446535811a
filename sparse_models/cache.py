"""``SparseKVCache``: podkit's KV cache, in the "slot = position" layout (ARCHITECTURE.md).

Per layer it keeps values ``[B, Hkv, N, D]`` and keys, post-RoPE, laid out by the layer's plan:

- Plain layers: keys ``[B, Hkv, N, D]`` like values.
- POD (arXiv 2412.02252, §2.3) when ``decode_scheme`` is ``pod`` or ``pod+tidal``: a KV head that is
  its own anchor keeps keys for every position; a head that shares an earlier layer's distant keys
  keeps only ``sink`` keys plus a ring of the last ``recent`` keys (``[B, heads, sink + recent, D]``,
  slot ``t < sink`` = position t, slot ``sink + j % recent`` = position j). The saving is real:
  those positions' keys are never allocated. :meth:`kv_bytes` reports it against a dense cache.
- A scheme's own ``StateBuffer``s (``CacheNeeds.buffers``, laid out by ``sparse_models/cache_layout.py``):
  [B, Hkv, entries, *trailing] per layer of its roles, reordered and grown with the rest. Those a ``KeyState``
  names follow the stored keys (:meth:`update_key_state` after each write): Quest's (arXiv 2406.10774) per-page,
  per-channel key max / min ``page_max`` / ``page_min`` [B, Hkv, P, D], fp32 here (``StateBuffer.dynamic_dtype``).

- ``kv_cache_dtype="fp8_e4m3"`` (``layout.fp8``; kernels/fp8_kv.py): values, keys and POD's ring hold
  float8_e4m3fn, each with fp32 scales [B, H, N] (``value_scale``, ``key_scale``, ``local_scale``: one per token or
  ring slot and KV head); :meth:`write` quantises (``kernels.quantize_kv``). This is the research / CPU path: its
  readers (:meth:`layer_keys`, :meth:`layer_values`, :meth:`anchor_keys`, :meth:`local_key_view`) return the
  dequantised K/V in fp32, exactly what the reference ops compute from FP8 + scales (the engine's static cache
  passes the scales to the kernels, which dequantise in registers); on CUDA (Triton kernels, which take K/V in
  q's dtype) in the model's dtype, one more rounding than the engine. Quest's pages bound the dequantised keys.
  With ``kv_cache_recent_keys`` W > 0 every layer also keeps its heads' own keys of the newest W positions in the
  model's dtype (``recent_keys`` [B, Hkv, W, D], slot ``position % W``, ``sparse_models/ring.py`` without a sink),
  and the key readers return those positions' keys from there (kernels/fp8_kv.py "Recent keys"); Quest's pages then
  bound both versions of a recent key.

Cross-layer state that must follow the batch lives here too: ``seq_lens`` (tokens per sequence),
the positions a selecting decode scheme (TidalDecode) chose at the last step, by layer
(``selected_indices``, for inspection; ``tidal_indices`` is its old name), and the token ids
of the last sparse-decoded tokens (for TidalDecode's KV-cache correction).

It subclasses transformers' ``Cache`` only for what ``generate()`` touches (5.17 and 5.24):
``get_seq_length`` (= mask columns seen, padding included), ``reorder_cache`` (beam search),
``batch_repeat_interleave`` / ``batch_select_indices``, ``is_linear`` / ``is_compileable`` /
``is_croppable``. The model's forward does all reads and writes.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

import kernels
from kernels.fp8_kv import FP8_DTYPE, SCALE_DTYPE, kv_storage_dtype, overlay_recent_keys

from .cache_layout import CacheLayout
from .kv_bytes import KVBytes
from .plan import LayerPlan
from .ring import local_slot_positions, written_ring


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its uint8 bytes (torch's CPU scatter / gather have no float8 kernels); others unchanged."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


class SparseKVCache(Cache):
    """KV cache for podkit models; see the module docstring.

    Args:
        plan: the model's per-layer plan (``sparse_models.plan.build_plan``).
        num_kv_heads, head_dim: Hkv and D.
        layout: the state beyond K/V (``sparse_models/cache_layout.cache_layout``: POD's ring window for layers
            with ``pod_keys``, the scheme's buffers (Quest's pages) and their layers, the correction period).
        capacity: slots to allocate up front (grows on demand; ``generate`` passes max_length).
    """

    def __init__(self, plan: list[LayerPlan], num_kv_heads: int, head_dim: int, *,
                 layout: CacheLayout = CacheLayout(), capacity: int = 0):
        super().__init__(layers=[])
        self.plan = plan
        self.layout = layout
        self.num_layers = len(plan)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sink = layout.ring_sink
        self.recent = layout.ring_recent
        self.initial_capacity = capacity
        self.correction_period = layout.correction_period
        self.capacity = 0
        self.view_limit: int | None = None  # slots readers see (set per forward: the longest sequence, rounded up)
        self.seq_lens: torch.Tensor | None = None
        self.columns_seen = 0
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.local_keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.values: list[torch.Tensor | None] = [None] * self.num_layers
        self.fp8 = layout.fp8
        self.model_dtype: torch.dtype | None = None  # the K/V dtype the forward writes (set at allocation)
        # FP8 scales [B, H, N] of keys / local_keys / values (None per layer in the model's dtype)
        self.key_scale: list[torch.Tensor | None] = [None] * self.num_layers
        self.local_scale: list[torch.Tensor | None] = [None] * self.num_layers
        self.value_scale: list[torch.Tensor | None] = [None] * self.num_layers
        # FP8 with kv_cache_recent_keys = W > 0: every head's own keys of the newest W positions, in the model's dtype
        # ([B, Hkv, W, D], slot position % W), and the lengths [B] each layer's ring reflects (after its last write)
        self.recent_window = layout.recent_keys
        self.recent_keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.recent_lens: list[torch.Tensor | None] = [None] * self.num_layers
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}  # (layer, name) -> the scheme's StateBuffer
        self.selected_indices: dict[int, torch.Tensor] = {}  # layer -> [B, Hq or Hkv, k] of the last step
        self.decoded_tokens: torch.Tensor | None = None  # [B, T] token ids of the last T decode steps
        self.steps_since_correction = 0
        # key storage per (layer, KV head): ("full", i) -> keys[layer][:, i]; ("local", i) -> local_keys[layer][:, i]
        self.key_slot: list[list[tuple[str, int]]] = []
        for p in plan:
            row, full_i, local_i = [], 0, 0
            for h in range(num_kv_heads):
                if p.pod_keys and p.anchors[h] != p.layer:
                    row.append(("local", local_i))
                    local_i += 1
                else:
                    row.append(("full", full_i))
                    full_i += 1
            self.key_slot.append(row)
        self.full_heads = [[h for h, (kind, _) in enumerate(row) if kind == "full"] for row in self.key_slot]
        self.local_heads = [[h for h, (kind, _) in enumerate(row) if kind == "local"] for row in self.key_slot]

    # ------------------------------------------------------------------ transformers' Cache surface
    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        lens = None if self.seq_lens is None else self.seq_lens.tolist()
        return f"SparseKVCache(layers={self.num_layers}, seq_lens={lens}, capacity={self.capacity})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Mask columns processed so far (padding included): what ``generate()`` slices inputs with."""
        return self.columns_seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def tidal_indices(self) -> dict[int, torch.Tensor]:
        """The old name of :attr:`selected_indices` (kept for code that reads it)."""
        return self.selected_indices

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.seq_lens is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.seq_lens is None else int(self.seq_lens.shape[0])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("SparseKVCache cannot be cropped (assisted/speculative decoding is not supported)")

    def reset(self) -> None:
        self.__init__(self.plan, self.num_kv_heads, self.head_dim, layout=self.layout, capacity=self.initial_capacity)

    def _map_batch(self, fn) -> None:
        for store in (self.keys, self.local_keys, self.values, self.key_scale, self.local_scale, self.value_scale,
                      self.recent_keys, self.recent_lens):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = fn(t)
        self.buffers = {key: fn(t) for key, t in self.buffers.items()}
        self.selected_indices = {k: fn(v) for k, v in self.selected_indices.items()}
        if self.seq_lens is not None:
            self.seq_lens = fn(self.seq_lens)
        if self.decoded_tokens is not None:
            self.decoded_tokens = fn(self.decoded_tokens)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes the old row ``beam_idx[i]``."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)])

    # ------------------------------------------------------------------ storage
    def _alloc_layer(self, layer: int, batch: int, capacity: int, dtype, device) -> None:
        row = self.key_slot[layer]
        num_full = sum(1 for kind, _ in row if kind == "full")
        num_local = len(row) - num_full
        d = self.head_dim
        self.model_dtype = dtype
        buffers = dict(dtype=kv_storage_dtype(self.layout.kv_cache_dtype, dtype), device=device)
        self.values[layer] = torch.zeros(batch, self.num_kv_heads, capacity, d, **buffers)
        self.keys[layer] = torch.zeros(batch, num_full, capacity, d, **buffers) if num_full else None
        self.local_keys[layer] = (torch.zeros(batch, num_local, self.sink + self.recent, d, **buffers)
                                  if num_local else None)
        if self.fp8:
            for data, scale in self._scaled_stores():
                scale[layer] = (None if data[layer] is None
                                else torch.ones(data[layer].shape[:-1], dtype=SCALE_DTYPE, device=device))
        if self.recent_window:
            self.recent_keys[layer] = torch.zeros(batch, self.num_kv_heads, self.recent_window, d, dtype=dtype,
                                                  device=device)
            self.recent_lens[layer] = torch.zeros(batch, dtype=torch.long, device=device)
        for buffer in self.layout.buffers_of(layer):
            self.buffers[(layer, buffer.name)] = buffer.allocate(batch, self.num_kv_heads, capacity, dtype, device,
                                                                 dynamic=True)

    def reserve(self, batch: int, needed: int, dtype, device) -> None:
        """Allocate on first use and grow (by doubling, 64-slot granules) so that ``needed`` slots fit."""
        if self.seq_lens is None:
            self.seq_lens = torch.zeros(batch, dtype=torch.long, device=device)
            capacity = max(needed, self.initial_capacity)
            capacity = -(-capacity // 64) * 64
            for layer in range(self.num_layers):
                self._alloc_layer(layer, batch, capacity, dtype, device)
            self.capacity = capacity
            self._rebuild_key_state(range(self.num_layers))
            return
        if self.seq_lens.shape[0] != batch:
            raise ValueError(f"the cache holds {self.seq_lens.shape[0]} sequences but the input has batch size {batch}")
        if needed <= self.capacity:
            return
        capacity = -(-max(needed, 2 * self.capacity) // 64) * 64
        grow = capacity - self.capacity
        for layer in range(self.num_layers):
            for store in (self.keys, self.values, self.key_scale, self.value_scale):
                t = store[layer]
                if t is not None:
                    store[layer] = torch.cat([t, t.new_zeros(*t.shape[:2], grow, *t.shape[3:])], dim=2)
            for buffer in self.layout.buffers_of(layer):
                t = self.buffers[(layer, buffer.name)]
                more = buffer.allocate(t.shape[0], t.shape[1], capacity, t.dtype, t.device)[:, :, t.shape[2]:]
                self.buffers[(layer, buffer.name)] = torch.cat([t, more], dim=2)
        self.capacity = capacity
        self._rebuild_key_state(range(self.num_layers))

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, start: torch.Tensor,
              num_new: torch.Tensor) -> None:
        """Store new tokens' K/V. k_new, v_new: [B, Hkv, S, D]; row b's token j goes to slot start[b] + j.

        Entries j >= num_new[b] (padding) land past the sequence end, where nothing reads them, except
        in POD's local ring and the key state (Quest's pages, :meth:`update_key_state`), which only take real
        tokens.
        """
        batch, _, s, d = k_new.shape
        if self.recent_window:  # the newest keys in the model's dtype, before any quantisation
            self.recent_keys[layer] = written_ring(self.recent_keys[layer], k_new, start, start + num_new, 0,
                                                   self.recent_window)
            self.recent_lens[layer] = start + num_new
        slots = (start[:, None] + torch.arange(s, device=start.device)[None, :])  # [B, S]
        index = slots[:, None, :, None].expand(-1, self.num_kv_heads, -1, d)
        if self.fp8:  # one scale per (token, KV head), kernels/fp8_kv.py
            (k_new, k_sc), (v_new, v_sc) = kernels.quantize_kv(k_new), kernels.quantize_kv(v_new)
            self.value_scale[layer].scatter_(2, index[..., 0], v_sc)
        _bytes(self.values[layer]).scatter_(2, index, _bytes(v_new.to(self.values[layer].dtype)))
        full, local = self.full_heads[layer], self.local_heads[layer]
        if full:
            k_full = k_new if len(full) == self.num_kv_heads else k_new[:, full]
            _bytes(self.keys[layer]).scatter_(2, index[:, : len(full)], _bytes(k_full.to(self.keys[layer].dtype)))
            if self.fp8:
                self.key_scale[layer].scatter_(2, index[:, : len(full), :, 0], k_sc[:, full])
        if local:
            ring = written_ring(_bytes(self.local_keys[layer]), _bytes(k_new[:, local].to(self.local_keys[layer].dtype)),
                                start, start + num_new, self.sink, self.recent)
            self.local_keys[layer] = ring.view(self.local_keys[layer].dtype)
            if self.fp8:
                self.local_scale[layer] = written_ring(self.local_scale[layer][..., None], k_sc[:, local, :, None],
                                                       start, start + num_new, self.sink, self.recent)[..., 0]

    def set_view_limit(self, longest: int) -> None:
        """Readers see slots [0, N') with N' = ``longest`` rounded up to 64 (not the whole capacity)."""
        self.view_limit = min(self.capacity, -(-max(longest, 1) // 64) * 64)

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.view_limit is None or self.view_limit >= t.shape[2] else t[:, :, : self.view_limit]

    def _scaled_stores(self):
        return ((self.keys, self.key_scale), (self.local_keys, self.local_scale), (self.values, self.value_scale))

    def _read(self, store: list, scales: list, layer: int, view: bool = True) -> torch.Tensor:
        """``store[layer]`` (its view when ``view``) as attention reads it: FP8 dequantised to fp32 with its scales."""
        t = store[layer]
        if not self.fp8:
            return self._view(t) if view else t
        scale = scales[layer]
        if view:
            t, scale = self._view(t), self._view(scale)
        # fp32 for the reference ops (what they compute from FP8 + scales); the Triton kernels take K/V in q's dtype
        return kernels.dequantize_kv(t, scale, self.model_dtype if kernels.use_triton(t) else torch.float32)

    def _keys_as_read(self, layer: int, view: bool = True) -> torch.Tensor:
        """[B, full heads, N', D]: ``layer``'s stored full keys as attention reads them (:meth:`_read`, and with
        recent keys the newest positions' keys in the model's dtype)."""
        k = self._read(self.keys, self.key_scale, layer, view)
        if not self.recent_window:
            return k
        ring = self.recent_keys[layer]
        if len(self.full_heads[layer]) != self.num_kv_heads:
            ring = ring[:, self.full_heads[layer]]
        return overlay_recent_keys(k, ring, self.recent_lens[layer])

    def _local_as_read(self, layer: int) -> torch.Tensor:
        """[B, local heads, sink + recent, D]: POD's ring of ``layer`` as attention reads it; with recent keys, slots
        whose position is among the newest W take the key in the model's dtype."""
        local = self._read(self.local_keys, self.local_scale, layer, view=False)
        if not self.recent_window:
            return local
        lens, window = self.recent_lens[layer], self.recent_window
        pos = local_slot_positions(lens, self.sink, self.recent)  # [B, sink + recent]
        newest = (pos >= 0) & (pos >= lens[:, None] - window)
        ring = self.recent_keys[layer][:, self.local_heads[layer]]  # [B, local heads, W, D]
        index = (pos.clamp(min=0) % window)[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3])
        return torch.where(newest[:, None, :, None], torch.gather(ring, 2, index).to(local.dtype), local)

    def view_slots(self, layer: int) -> int:
        """Cache slots readers of ``layer`` see (the view limit, or the capacity)."""
        return int(self._view(self.values[layer]).shape[2])

    def state_buffer(self, layer: int, name: str) -> torch.Tensor:
        """[B, Hkv, E', *trailing]: the scheme's StateBuffer ``name`` of ``layer``, its entries covering the view limit
        (a view: in-place updates reach the cache)."""
        if (layer, name) not in self.buffers:
            raise RuntimeError(f"layer {layer} keeps no state buffer {name!r} (its scheme's CacheNeeds.buffers)")
        t = self.buffers[(layer, name)]
        return t if self.view_limit is None else t[:, :, : self.layout.buffer(layer, name).entries(self.view_limit)]

    def layer_values(self, layer: int) -> torch.Tensor:
        """[B, Hkv, N', D] values of ``layer`` (N' = the view limit)."""
        return self._read(self.values, self.value_scale, layer)

    def layer_keys(self, layer: int) -> torch.Tensor:
        """[B, Hkv, N, D] keys of a layer that keeps every head's keys (not POD-shared)."""
        if self.local_keys[layer] is not None:
            raise RuntimeError(f"layer {layer} keeps POD-shared heads' keys for sinks + ring only; "
                               f"use anchor_keys / local_key_view")
        return self._keys_as_read(layer)

    def _full_head(self, layer: int, head: int) -> torch.Tensor:
        kind, i = self.key_slot[layer][head]
        if kind != "full":
            raise RuntimeError(f"layer {layer} KV head {head} is not an anchor: its distant keys are not stored")
        return self._keys_as_read(layer)[:, i]

    def anchor_keys(self, layer: int) -> torch.Tensor:
        """[B, Hkv, N, D]: per KV head, the full keys of its anchor layer (its own for anchor heads)."""
        anchors = self.plan[layer].anchors
        if all(a == layer for a in anchors):
            return self._keys_as_read(layer)
        return torch.stack([self._full_head(a, h) for h, a in enumerate(anchors)], dim=1)

    def local_key_view(self, layer: int, lens: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, sink + recent, D] POD local buffer of every head once ``lens`` tokens are stored
        (anchor heads, which keep every key, are gathered into the same layout)."""
        pos = local_slot_positions(lens, self.sink, self.recent).clamp(min=0)
        heads = []
        local = self._local_as_read(layer) if self.local_keys[layer] is not None else None
        full = self._keys_as_read(layer) if self.keys[layer] is not None else None
        for h, (kind, i) in enumerate(self.key_slot[layer]):
            if kind == "local":
                heads.append(local[:, i])
            else:
                k = full[:, i]  # [B, N', D]
                heads.append(torch.gather(k, 1, pos[:, :, None].expand(-1, -1, self.head_dim)))
        return torch.stack(heads, dim=1)

    def effective_keys(self, layer: int, lens: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, N, D] keys as POD attention reads them for the query at position ``lens - 1``: the
        layer's own key at proximal positions, the anchor's key elsewhere (``pod+tidal`` decode).
        A temporary copy: the stored cache stays POD-sized."""
        k = self.anchor_keys(layer)
        if self.local_keys[layer] is None:
            return k
        k = k.clone()
        pos = local_slot_positions(lens, self.sink, self.recent)  # [B, L]
        query = (lens - 1)[:, None]
        proximal = (pos >= 0) & ((pos < self.sink) | (query - pos < self.recent))
        local = self.local_key_view(layer, lens)  # [B, Hkv, L, D]
        rows, slots = proximal.nonzero(as_tuple=True)
        k.permute(0, 2, 1, 3)[rows, pos[rows, slots]] = local.permute(0, 2, 1, 3)[rows, slots]
        return k

    # ------------------------------------------------------------------ key state (Quest's pages)
    def _rebuild_key_state(self, layers) -> None:
        """The buffers that follow the stored keys (``layout.key_state``), recomputed from the keys of ``layers``."""
        if self.seq_lens is None:
            return
        for layer in layers:
            self._rebuild_layer_state(layer, self.seq_lens)

    def _rebuild_layer_state(self, layer: int, lens: torch.Tensor) -> None:
        for state in self.layout.key_state_of(layer):
            dtypes = [self.buffers[(layer, name)].dtype for name in state.names]
            also = {"also": self._keys_as_read(layer, view=False)} if self.recent_window else {}
            new = state.rebuild(self.keys[layer], lens, self.key_scale[layer], state.slots_per_entry, dtypes[0], **also)
            for name, t, dtype in zip(state.names, new, dtypes):
                self.buffers[(layer, name)] = t.to(dtype)

    def update_key_state(self, layer: int, old_lens: torch.Tensor, new_lens: torch.Tensor) -> None:
        """Bring the buffers that follow ``layer``'s keys (Quest's pages) up to date after a write: one token per
        sequence folds in (``KeyState.fold``), anything else rebuilds them (``KeyState.rebuild``)."""
        states = self.layout.key_state_of(layer)
        if not states:
            return
        if not bool(((new_lens - old_lens) == 1).all()):
            self._rebuild_layer_state(layer, new_lens)
            return
        rows = torch.arange(new_lens.shape[0], device=new_lens.device)
        k = self.keys[layer][rows, :, new_lens - 1]  # [B, Hkv, D]: the appended token's key as stored
        if self.fp8:
            k = kernels.dequantize_kv(k, self.key_scale[layer][rows, :, new_lens - 1])
        also = {"also": self.recent_keys[layer][rows, :, (new_lens - 1) % self.recent_window]} \
            if self.recent_window else {}
        for state in states:
            state.fold(tuple(self.buffers[(layer, name)] for name in state.names), k, new_lens - 1,
                       state.slots_per_entry, rows, **also)

    # ------------------------------------------------------------------ bookkeeping
    def record_decoded(self, tokens: torch.Tensor) -> None:
        """Remember the ids of sparse-decoded tokens (TidalDecode correction re-runs them)."""
        if self.correction_period is None:
            return
        tokens = tokens.reshape(-1, 1)
        if self.decoded_tokens is None:
            self.decoded_tokens = tokens
        else:
            self.decoded_tokens = torch.cat([self.decoded_tokens, tokens], dim=1)[:, -self.correction_period:]
        self.steps_since_correction += 1

    def kv_bytes(self) -> KVBytes:
        """Bytes allocated for keys, values and the scheme's buffers (metadata: Quest's pages), and a dense cache's
        bytes (same capacity); FP8: the float8 data and the fp32 scales."""
        return KVBytes.of(self.keys + self.local_keys + self.key_scale + self.local_scale + self.recent_keys,
                          self.values + self.value_scale, self.buffers.values())
