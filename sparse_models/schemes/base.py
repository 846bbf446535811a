"""What a scheme is: the :class:`Scheme` object each ``schemes/<method>.py`` defines, and the
:class:`DecodeView` its decode functions run over.

A scheme bundles, for one method:

* ``config_key`` / ``config_cls``: its section of :class:`sparse_models.config.SparseAttentionConfig`
  (``config.json`` key and flat-override prefix: ``tidal`` -> ``tidal_budget``);
* its phases: ``prefill_roles`` and/or ``decode_roles`` say what each layer does (the per-layer plan,
  ``sparse_models/plan.py``), and ``prefill`` / ``decode`` map each of those roles to a function;
* ``cache``: the cache state it needs beyond K/V (POD's shared keys, the TidalDecode KV correction period,
  :class:`StateBuffer`s of its own such as Quest's key pages, with a :class:`KeyState` where they follow the stored
  keys), one description both caches allocate from (``sparse_models/cache_layout.py``);
* hooks the generic code calls instead of importing it: ``chunk``, ``model_view``, ``prefill_stats``;
* ``budget``: the one meaning of a ``--budget B`` for it (``generate --budget``, ``eval.schemes``,
  the benchmarks all go through :meth:`Budget.overrides`);
* ``footprint``: what its layers keep in memory and read per decode query as a function of that budget
  (``sparse_models/schemes/footprint.py`` turns it into the KV fractions eval's leaderboard reports);
* ``display_name`` / ``order``: how reports name it and where tables and plots put it.

Decode functions are written once for both paths: ``fn(view, q, row, step) -> out [B, Hq, D]`` with
``view`` a :class:`DecodeView` over the model's dynamic cache (``sparse_models/decode_view.py``) or
the engine's static cache (``sparse_models/engine/decode_layers.py``), ``q`` [B, Hq, D] post-RoPE,
``row`` the layer's :class:`~sparse_models.plan.LayerPlan` and ``step`` the :class:`DecodeStepState`
shared by the layers of one decode step. They must stay CUDA-graph safe (no host syncs, static
shapes): the engine captures them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch


class DecodeView(Protocol):
    """One layer's cache during one decode step (the current token's K/V already appended).

    Attributes:
        layer: layer index; ``lens`` [B] sequence lengths (the query sits at ``lens - 1``);
        num_kv_heads: Hkv; ``config``: the SparseAttentionConfig; ``capacity``: the cache slots the view
        reads (a host int, no sync: the dynamic cache's view width, the engine's ``max_seq_len``).
    """

    layer: int
    lens: torch.Tensor
    num_kv_heads: int
    config: Any
    capacity: int

    def full(self, q: torch.Tensor) -> torch.Tensor:
        """Exact attention over every cached position -> [B, Hq, D] (POD-aware on a shared-key cache)."""

    def pod(self, q: torch.Tensor) -> torch.Tensor:
        """POD attention with the config's gate policy (``pod.gate_tau``) -> [B, Hq, D]."""

    def select(self, q: torch.Tensor, budget: int, selection: str = "query_head",
               recent: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention + TidalDecode's selection: the last ``recent`` slots (the current one included) and the
        best budget - recent older ones by ``selection`` (``kernels.reference.select_topk_positions``'s ``mode``):
        (out [B, Hq, D], indices [B, Hs, budget]), Hs = Hq for ``"query_head"``, else Hkv."""

    def sparse(self, q: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Attention over the listed slots only (indices [B, Hs, K], -1 padded) -> [B, Hq, D]."""

    def buffer(self, name: str) -> torch.Tensor:
        """The layer's :class:`StateBuffer` ``name``, [B, Hkv, E, *trailing] (E entries cover at least the slots the
        view reads), to read and update in place."""


class PrefillState(Protocol):
    """What a prefill function reads besides its tensors (the model's ``ForwardState`` in
    ``sparse_models/attention.py``, built by the model's forward or by the engine's prefill).

    Attributes:
        num_new: [B] fresh tokens per sequence (queries and keys at positions 0 .. num_new - 1).
        config: the SparseAttentionConfig.
        stats: what the prefill scheme's layers report into (``Scheme.prefill_stats()``; Token Sparse:
            TokenSparseStats), or None.
        scale: softmax scale (None: D ** -0.5).
        token_sparse_keep_ratio: a fixed kept fraction replacing Token Sparse's Dynamic Token
            Coverage (the engine's benchmark knob), or None.
    """

    num_new: torch.Tensor
    config: Any
    stats: Any
    scale: float | None
    token_sparse_keep_ratio: float | None


@dataclass
class DecodeStepState:
    """What the layers of one decode step share: the TidalDecode indices chosen so far, POD's gates [B, Hq]
    of the anchor layers (the engine's pod.gate_estimate="anchor" skip reads them), and under POD's v1 score
    sharing the queries [B, Hq, D] of the layers other layers read distant logits from, by layer."""

    selected: dict[int, torch.Tensor] = field(default_factory=dict)
    pod_gates: dict[int, torch.Tensor] = field(default_factory=dict)
    pod_queries: dict[int, torch.Tensor] = field(default_factory=dict)


DecodeFn = Callable[[DecodeView, torch.Tensor, Any, DecodeStepState], torch.Tensor]


def exact_decode(view: DecodeView, q: torch.Tensor, row, step: DecodeStepState) -> torch.Tensor:
    """Exact attention over the whole cache (dense layers, TidalDecode's full layers, KV correction)."""
    return view.full(q)


def covers_cache(view: DecodeView, budget: int) -> bool:
    """Whether a decode budget reaches every slot the view's cache holds. A sparse scheme then runs exact
    attention (``view.full``: every position, at dense cost; what its selection would read anyway) instead of
    building position lists sized by the budget, which could be far larger than the cache. Static per
    capture (host ints), so graph-safe."""
    return budget >= view.capacity


def fused_selection(selection: str, recent: int) -> bool:
    """Whether ``view.select`` can run the fused attention + top-k op (``kernels.selection_decode_attention``:
    the paper's per-head lists or the KV group's summed probabilities, only the current slot kept). The other
    selections (the union modes, a recent window) take the read's logits [B, Hq, N] and
    ``kernels.select_topk_positions``: torch ops of static shapes, graph-safe too."""
    return selection in ("query_head", "kv_group") and recent == 1


@dataclass(frozen=True)
class Budget:
    """A scheme's budget: the number of cached positions one decode query reads, current token included.

    ``to_overrides(budget, given)`` returns the flat overrides that set it (``given``: the overrides
    already chosen, e.g. ``streaming_sink_tokens``); ``reads(config)`` the budget a config gives (its
    inverse). ``meaning`` is the one-line documentation shown by ``--help`` and ARCHITECTURE.md.
    """

    meaning: str
    to_overrides: Callable[[int, Mapping[str, Any]], dict[str, Any]]
    minimum: int = 2
    reads: Callable[[Any], int] | None = None

    def overrides(self, scheme: str, budget: Any, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        from ..validation import ConfigError

        if isinstance(budget, bool) or not isinstance(budget, int) or budget < self.minimum:
            raise ConfigError(f"budget={budget!r} is invalid for decode_scheme={scheme!r}: expected an integer >= "
                              f"{self.minimum} ({self.meaning})")
        return {"decode_scheme": scheme} | self.to_overrides(budget, dict(given or {}))


@dataclass(frozen=True)
class StateBuffer:
    """Per-layer cache state a scheme declares (``CacheNeeds.buffers``: Quest's page max / min, an H2O-like
    accumulated score, ...). Both caches allocate it from this description (``sparse_models/cache_layout.py``) as
    [B, Hkv, ceil(N / slots_per_entry), *trailing], filled with ``fill``, reorder it with the batch (beams), grow it
    with the cache and count it in ``kv_bytes()`` (metadata); ``view.buffer(name)`` hands it to the scheme's decode
    functions, which read it and may update it in place (no host syncs: the engine captures them). State that
    follows the stored keys (written on every append, not by a decode function) is named by a :class:`KeyState` too.

    Attributes:
        name: its key for ``view.buffer``.
        roles: decode roles whose layers keep it.
        slots_per_entry: cache slots one entry covers (1: one entry per position), or config -> that number
            (Quest: ``quest.page_size``).
        trailing: (config, head_dim) -> the dims after the entry axis (``()``: one number per entry).
        fill: the value of an entry nothing wrote.
        dtype: None: the cache's K/V dtype (the model's dtype, FP8 caches included).
        dynamic_dtype: the dtype the model's dynamic cache (``sparse_models/cache.py``, the research path) keeps it
            in instead (None: as ``dtype``). Quest's pages keep there the fp32 bounds ``kernels.quest_page_minmax``
            computes; the engine's static buffers hold the model's dtype its kernels read.
    """

    name: str
    roles: tuple[str, ...]
    slots_per_entry: int | Callable[[Any], int] = 1
    trailing: Callable[[Any, int], tuple[int, ...]] = lambda config, head_dim: ()
    fill: float = 0.0
    dtype: torch.dtype | None = None
    dynamic_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class KeyState:
    """StateBuffers a cache keeps in step with a layer's stored keys (Quest's page max / min): both caches call these
    functions on every write of a layer that keeps the ``buffers`` (such a layer keeps all its heads' keys: the
    dense key layout), so the scheme's decode functions only read them.

    Attributes:
        buffers: names of :class:`StateBuffer`s of the same ``CacheNeeds`` (same roles and ``slots_per_entry``), in
            the order the two functions take and return them.
        rebuild: (keys [B, Hkv, N, D] as stored, lens [B], k_scale [B, Hkv, N] of an FP8 cache or None,
            slots_per_entry, dtype) -> the buffers' whole contents [B, Hkv, E, *trailing] in ``dtype`` from the first
            ``lens[b]`` stored keys of each row (after a prefill or a chunk).
        fold: (buffers [Bmax >= B, Hkv, E, *trailing], k [B, Hkv, D] the token's key as attention reads it (FP8:
            dequantised, fp32), positions [B], slots_per_entry, rows [B] = 0 .. B-1) -> None: in place, one decode
            token joins them. Graph-safe (the engine captures it).
        Both take ``also=`` on an FP8 cache with ``kv_cache_recent_keys``: the keys in the model's dtype that
        attention reads while their positions are recent ([B, Hkv, N, D] for rebuild, the token's [B, Hkv, D] for
        fold); what the buffers summarise must then hold for both versions of a key.
    """

    buffers: tuple[str, ...]
    rebuild: Callable[..., tuple[torch.Tensor, ...]]
    fold: Callable[..., None]


@dataclass(frozen=True)
class CacheNeeds:
    """Cache state beyond per-layer K/V.

    Both caches are built from it through ``sparse_models/cache_layout.cache_layout`` (one description).

    Attributes:
        pod_keys: non-anchor (layer, KV head) units keep only sink + ring keys (POD's saving). This is the key
            storage itself (those keys are never allocated), not state beside it: each cache lays it out in its
            key buffers (``sparse_models/ring.py`` indexes it for both).
        ring_window: config -> (sink, recent) of that ring.
        correction_period: config -> TidalDecode's KV correction period T, or None.
        buffers: further per-layer state (:class:`StateBuffer`), allocated by both caches from the description.
        key_state: the buffers among them that follow the stored keys (:class:`KeyState`).
    """

    pod_keys: bool = False
    ring_window: Callable[[Any], tuple[int, int]] | None = None
    correction_period: Callable[[Any], int | None] | None = None
    buffers: tuple[StateBuffer, ...] = ()
    key_state: tuple[KeyState, ...] = ()


@dataclass(frozen=True)
class Footprint:
    """What a scheme's layers keep and read, per layer of the plan (``schemes/footprint.kv_fractions``).

    Attributes:
        budget_roles: decode roles whose layers read ``Budget.reads(config)`` cached positions per decode query
            (its sparse layers); every other role reads every position.
        kept: (config, row, num_kv_heads, num_tokens) -> the fraction of that layer's K/V bytes held for a
            ``num_tokens`` context (``row`` its :class:`~sparse_models.plan.LayerPlan`); None: all of it.
    """

    budget_roles: tuple[str, ...] = ()
    kept: Callable[[Any, Any, int, int], float] | None = None


@dataclass(frozen=True)
class Scheme:
    """One attention method (see the module docstring). Build one per ``schemes/<method>.py`` and add
    it to ``sparse_models/schemes/registry.py``.

    Attributes:
        name: the ``prefill_scheme`` / ``decode_scheme`` value.
        summary: one line (paper and what it does).
        config_key, config_cls: the config section it owns (None: it has none, or shares others').
        prefill_roles: (config, num_layers, anchors) -> one prefill role per layer; None: not a prefill scheme.
        decode_roles: (config, num_layers, anchors, family) -> one (role, selection_source) per layer;
            None: not a decode scheme.
        prefill: role -> prefill function ``fn(layer, q, k, v, state, k_anchor, q_anchor)`` on fresh tokens,
            run by the model's attention and by the engine's prefill alike; ``state`` is a
            :class:`PrefillState`.
        anchor_key_roles: prefill roles that take the anchor layers' keys (``k_anchor``); both paths
            assemble them for these roles only.
        decode: role -> decode function over a :class:`DecodeView`.
        uses_anchors: the plan needs POD's anchor map (``pod.anchor_layers``) in the phases it runs.
        cache: what the cache keeps for it.
        budget: the meaning of ``--budget``; None: the scheme has no budget.
        check: (config, num_layers) -> None, raising ConfigError for combinations the fields alone
            cannot rule out (run when the plan is built).
        config_notice: (config, phases) -> str or None, a notice about a configuration that runs but may not be
            what the user meant, said once as a RuntimeWarning (POD without an anchor map). ``phases``: the
            ``"decode_scheme='pod'"``-style phrases of the phases it is configured for; schemes that share one
            function get one notice.
        reads: config sections it reads besides its own (``pod+tidal``: pod and tidal).
        chunk: ``fn(layer, q, k, v, state) -> out`` for several new tokens after a past (the model's ``chunk``
            phase: continued prompts, TidalDecode's KV correction) on the cache layout this decode scheme asks
            for (``cache``); None: exact causal attention over the cache's full keys.
        model_view: view operations its decode functions call that only it needs (POD: ``pod``), implemented over
            the model's dynamic cache, name -> ``fn(view, *args)``; ``sparse_models/decode_view.py`` dispatches
            to them (the engine's ``StaticDecodeView`` implements its own over the static cache).
        prefill_stats: a factory of the object its prefill layers report into (``PrefillState.stats``; Token
            Sparse: TokenSparseStats, with a ``layers`` dict), made per prefill by the model and the engine.
        footprint: what its layers keep and read (:class:`Footprint`).
        display_name: the name reports print ("TidalDecode"); empty: ``name``.
        order: its place in tables and plots (ascending; ties by name).
    """

    name: str
    summary: str
    config_key: str | None = None
    config_cls: type | None = None
    prefill_roles: Callable[..., list[str]] | None = None
    decode_roles: Callable[..., list[tuple[str, int | None]]] | None = None
    prefill: Mapping[str, Callable[..., torch.Tensor]] = field(default_factory=dict)
    decode: Mapping[str, DecodeFn] = field(default_factory=dict)
    uses_anchors: bool = False
    anchor_key_roles: tuple[str, ...] = ()
    cache: CacheNeeds = CacheNeeds()
    budget: Budget | None = None
    check: Callable[[Any, int], None] | None = None
    config_notice: Callable[[Any, list[str]], str | None] | None = None
    reads: tuple[str, ...] = ()
    chunk: Callable[..., torch.Tensor] | None = None
    model_view: Mapping[str, Callable[..., torch.Tensor]] = field(default_factory=dict)
    prefill_stats: Callable[[], Any] | None = None
    footprint: Footprint = Footprint()
    display_name: str = ""
    order: int = 100

    @property
    def title(self) -> str:
        """The display name, or the registry name where none is given."""
        return self.display_name or self.name

    @property
    def sections(self) -> tuple[str, ...]:
        """Every config section the scheme reads (its own first)."""
        return ((self.config_key,) if self.config_key else ()) + self.reads

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(p for p, fn in (("prefill", self.prefill_roles), ("decode", self.decode_roles)) if fn is not None)
