"""POD: Proximal tokens Over Distant tokens (Ma et al., arXiv 2412.02252; METHODS.md A).

A query attends to proximal keys (the first ``sink`` positions and the last ``recent`` positions up
to itself) with the layer's own keys and to every other position with the keys of its block's anchor
layer (per KV head); one softmax over both, i.e. the log-sum-exp merge with gate
g = sigmoid(lse_P - lse_D). Anchor layers are plain causal attention.

Prefill/training: ``kernels.pod_prefill_attention`` (differentiable); the anchor keys come in as an
argument (the decoder loop passes them explicitly, which keeps gradient checkpointing correct).
Decode: ``kernels.pod_decode_attention`` over the cache's sink + ring buffer and the anchor's keys.

Compute skipping (``pod.gate_tau``, decode only): where the proximal gate g >= tau the distant part is
dropped. ``gate_estimate="exact"`` uses this layer's own gate (the kernel's skip); ``"anchor"`` uses
the gate the anchor layer computed for the same query head (METHODS.md A.4, reading ii). In this
model path both parts are still computed; the engine's decode (sparse_models/engine/decode_layers.py,
``full_attention``) reads no distant key for heads whose anchor estimate clears tau.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

import kernels

from ..anchors import assemble_anchor_queries, validate_anchor_layers
from ..ring import local_slot_positions
from ..validation import check_int, fail
from . import pod_skip_stats
from .base import CacheNeeds, Footprint, Scheme
from .dense import fresh_prefill


@dataclass
class PodConfig:
    """POD: Proximal tokens Over Distant tokens (Ma et al., arXiv 2412.02252).

    A query attends to *proximal* keys (the first ``sink_tokens`` positions plus the last
    ``recent_window`` positions up to itself) with the layer's own keys, and to every other
    (*distant*) position with the keys of its block's anchor layer; both parts go through one
    softmax, i.e. a log-sum-exp merge with the parameter-free gate g = sigmoid(lse_P - lse_D).

    ``anchor_layers[layer][kv_head]`` is the anchor layer of that (layer, KV head); blocks are
    consecutive layers whose lowest layer is the anchor, so each entry equals either ``layer``
    or the entry of ``layer - 1`` for the same head. ``None`` means every layer is its own anchor
    (exactly dense attention). ``blocks_file`` points to the JSON written by the exploration
    (``sparse_models.calibration.pod_similarity``) and is resolved by the model at load time.

    ``sharing="keys"`` is the paper's v2 (own query, anchor keys; default); ``"scores"`` is v1
    (the anchor layer's distant logits reused with the layer's own values).
    ``gate_tau``: if set, a query whose estimated proximal gate is >= tau skips distant attention
    (paper: 0.7). ``gate_estimate`` says how the gate is pre-evaluated under key sharing:
    ``"exact"`` computes both parts and then discards the distant one (for testing), ``"anchor"``
    reuses the gate the anchor layer computed for the same query (METHODS.md A.4, reading ii).
    """

    sink_tokens: int = 16
    recent_window: int = 4080
    anchor_layers: list[list[int]] | None = None
    blocks_file: str | None = None
    sharing: str = "keys"
    gate_tau: float | None = None
    gate_estimate: str = "anchor"

    def __post_init__(self) -> None:
        check_int("pod.sink_tokens", self.sink_tokens, 0)
        check_int("pod.recent_window", self.recent_window, 1)
        if self.sharing not in ("keys", "scores"):
            fail("pod.sharing", self.sharing, "expected 'keys' (paper v2, default) or 'scores' (paper v1)")
        if self.gate_tau is not None and (isinstance(self.gate_tau, bool) or not isinstance(self.gate_tau, (int, float))
                                          or not 0.0 < float(self.gate_tau) <= 1.0):
            fail("pod.gate_tau", self.gate_tau, "expected null or a number in (0, 1] (paper: 0.7)")
        if self.gate_estimate not in ("anchor", "exact"):
            fail("pod.gate_estimate", self.gate_estimate, "expected 'anchor' or 'exact'")
        if self.anchor_layers is not None:
            validate_anchor_layers(self.anchor_layers)

    def anchor_map(self, num_layers: int, num_kv_heads: int) -> list[list[int]]:
        """The [num_layers][num_kv_heads] anchor map, checked against the model's shape."""
        if self.anchor_layers is None:
            return [[layer] * num_kv_heads for layer in range(num_layers)]
        if len(self.anchor_layers) != num_layers or any(len(row) != num_kv_heads for row in self.anchor_layers):
            fail("pod.anchor_layers", f"<{len(self.anchor_layers)} rows>",
                  f"expected {num_layers} rows (layers) of {num_kv_heads} entries (KV heads) for this model")
        return [list(row) for row in self.anchor_layers]


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1) if heads != x.shape[1] else x


def pod_scores_prefill(q: torch.Tensor, q_anchor: torch.Tensor, k_own: torch.Tensor, k_anchor: torch.Tensor,
                       v: torch.Tensor, seq_lens: torch.Tensor, cfg: PodConfig) -> torch.Tensor:
    """POD v1 "score sharing" (METHODS.md A.3): distant logits are the anchor layer's own q_a . k_a,
    proximal logits the layer's q . k; one softmax over both, applied to the layer's own values.

    POD attention with the anchor's queries on the distant pairs (``kernels.pod_prefill_attention``'s
    ``q_distant``): on CUDA the split route, whose distant core is the anchor's own causal attention.
    q, q_anchor [B, Hq, S, D]; k_own, k_anchor, v [B, Hkv, S, D] -> [B, Hq, S, D] (differentiable).
    """
    return kernels.pod_prefill_attention(q, k_own, k_anchor, v, seq_lens.to(q.device), sink=cfg.sink_tokens,
                                         recent=cfg.recent_window, q_distant=q_anchor.to(q.dtype))


def pod_prefill(q: torch.Tensor, k_own: torch.Tensor, k_anchor: torch.Tensor, v: torch.Tensor,
                seq_lens: torch.Tensor, cfg: PodConfig, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, S, D]; k_own, k_anchor, v [B, Hkv, S, D] -> [B, Hq, S, D] (differentiable)."""
    return kernels.pod_prefill_attention(q, k_own, k_anchor, v, seq_lens, sink=cfg.sink_tokens,
                                         recent=cfg.recent_window, scale=scale)


def proximal_only_decode(q: torch.Tensor, k_local: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                         cfg: PodConfig) -> torch.Tensor:
    """Attention over proximal positions only (the output when distant attention is skipped).

    q [B, Hq, D]; k_local [B, Hkv, sink + recent, D]; v_cache [B, Hkv, N, D] -> [B, Hq, D].
    """
    sink, recent = cfg.sink_tokens, cfg.recent_window
    pos = local_slot_positions(seq_lens, sink, recent)  # [B, L]
    query = (seq_lens.long() - 1)[:, None]
    slot = torch.arange(pos.shape[1], device=pos.device)[None, :]
    # ring slots holding a sink position duplicate a sink slot: count each position once
    proximal = (pos >= 0) & (pos <= query) & ((slot < sink) | ((pos >= sink) & (query - pos < recent)))
    v_local = torch.gather(v_cache, 2, pos.clamp(min=0)[:, None, :, None].expand(-1, v_cache.shape[1], -1,
                                                                                  v_cache.shape[3]))
    indices = torch.where(proximal, slot.expand_as(pos), torch.full_like(pos, -1))
    big = pos.shape[1] + 1
    indices = torch.where(indices < 0, torch.full_like(indices, big), indices).sort(-1).values
    indices = torch.where(indices == big, torch.full_like(indices, -1), indices)
    indices = indices[:, None, :].expand(-1, k_local.shape[1], -1).contiguous()
    return kernels.sparse_decode_attention(q, k_local, v_local, indices)


def pod_decode(layer: int, anchors: tuple[int, ...], q: torch.Tensor, cache: Any, seq_lens: torch.Tensor,
               cfg: PodConfig, gates: dict[int, torch.Tensor] | None = None,
               q_distant: torch.Tensor | None = None) -> torch.Tensor:
    """POD decode of one layer: q [B, Hq, D] at position seq_lens - 1 -> [B, Hq, D], over the model's
    ``SparseKVCache`` (``sparse_models/cache.py``; the engine's path is ``sparse_models/engine/decode_layers.py``).

    ``gates`` collects each layer's proximal gate [B, Hq] when ``cfg.gate_tau`` is set (the anchor
    estimate of later layers reads it). Inside ``pod_skip_stats.record_gate_skips()`` a decode call
    (one with ``gates``) also records its gate estimates and skips; with ``gate_tau`` None it then
    computes the gates on the side and returns the unrecorded output unchanged.

    ``q_distant`` [B, Hq, D]: the anchor layers' queries of this step (v1 score sharing; None: key sharing). The
    distant logits are then the anchor's own, so the exact gate is what decides a skip (METHODS.md A.4, reading (i)).
    """
    recorder = pod_skip_stats.active_recorder() if gates is not None else None
    estimate_mode = "exact" if q_distant is not None else cfg.gate_estimate
    v = cache.layer_values(layer)
    own_only = all(a == layer for a in anchors)
    tau = cfg.gate_tau
    if recorder is not None and tau is None:
        out = pod_decode(layer, anchors, q, cache, seq_lens, cfg, q_distant=q_distant)  # unrecorded output
        _, gate = kernels.pod_decode_attention(q, cache.local_key_view(layer, seq_lens), cache.anchor_keys(layer), v,
                                               seq_lens, sink=cfg.sink_tokens, recent=cfg.recent_window,
                                               return_gate=True, q_distant=q_distant)
        gates[layer] = gate
        group = q.shape[1] // len(anchors)
        shared_q = torch.tensor([anchors[qh // group] != layer for qh in range(q.shape[1])], device=q.device)
        estimate = gate if estimate_mode == "exact" else _anchor_estimate(layer, anchors, gate, gates, group)
        recorder.add(layer, estimate, torch.zeros_like(gate, dtype=torch.bool), shared_q, group, seq_lens,
                     cfg.sink_tokens, cfg.recent_window, None)
        return out
    if own_only and tau is None:
        return kernels.decode_attention(q, cache.anchor_keys(layer), v, seq_lens)
    k_local = cache.local_key_view(layer, seq_lens)
    k_anchor = cache.anchor_keys(layer)
    common = dict(sink=cfg.sink_tokens, recent=cfg.recent_window, q_distant=q_distant)
    if tau is None:
        return kernels.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, **common)
    group = q.shape[1] // len(anchors)
    shared_q = torch.tensor([anchors[qh // group] != layer for qh in range(q.shape[1])], device=q.device)
    if estimate_mode == "exact" and bool(shared_q.all()):
        # the kernel's own skip: every head of this layer reads distant keys from an anchor
        out, gate = kernels.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, gate_tau=tau, return_gate=True,
                                                 **common)
        if gates is not None:
            gates[layer] = gate
        if recorder is not None:
            recorder.add(layer, gate, gate >= tau, shared_q, group, seq_lens, cfg.sink_tokens, cfg.recent_window, tau)
        return out
    out, gate = kernels.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, return_gate=True, **common)
    if gates is not None:
        gates[layer] = gate
    if own_only:
        if recorder is not None:
            recorder.add(layer, gate, torch.zeros_like(gate, dtype=torch.bool), shared_q, group, seq_lens,
                         cfg.sink_tokens, cfg.recent_window, tau)
        return out  # anchor heads never skip: their distant keys are their own (exact attention)
    if estimate_mode == "exact":
        estimate = gate
    else:
        estimate = _anchor_estimate(layer, anchors, gate, gates, group)
    skip = (estimate >= tau) & shared_q[None, :]
    if recorder is not None:
        recorder.add(layer, estimate, skip, shared_q, group, seq_lens, cfg.sink_tokens, cfg.recent_window, tau)
    if not bool(skip.any()):
        return out
    prox = proximal_only_decode(q, k_local, v, seq_lens, cfg)
    return torch.where(skip[..., None], prox, out)


def _anchor_estimate(layer: int, anchors: tuple[int, ...], gate: torch.Tensor, gates: dict[int, torch.Tensor],
                     group: int) -> torch.Tensor:
    """[B, Hq]: per query head, the gate its KV head's anchor layer computed in this step (its own gate
    where the head is its own anchor)."""
    return torch.stack([gates[anchors[qh // group]][:, qh] if anchors[qh // group] != layer else gate[:, qh]
                        for qh in range(gate.shape[1])], dim=1)


def no_block_map_notice(config, phases: list[str]) -> str | None:
    """``Scheme.config_notice`` of the schemes that read POD's anchor map, run without one. A model that was never
    POD-adapted has no ``pod.anchor_layers`` / ``pod.blocks_file`` in its config; POD then uses the identity map
    (every layer its own anchor), which is exactly dense attention: ``--decode-scheme pod`` on it would otherwise
    look like POD."""
    if config.pod.anchor_layers is not None:
        return None
    return (f"{' and '.join(phases)} on a model that is not POD-adapted (no pod.anchor_layers or pod.blocks_file in "
            f"its config): POD uses the identity map, every layer its own anchor, which is exactly dense attention; "
            f"for zero-shot POD give a map (pod_blocks_file=<blocks.json>; python -m eval.calibrate pod writes one)")


def pod_layer_roles(anchors, num_layers: int) -> list[str]:
    """``pod-shared`` where some KV head reads distant keys from an earlier layer, else ``pod-anchor``."""
    return ["pod-shared" if any(a != layer for a in anchors[layer]) else "pod-anchor" for layer in range(num_layers)]


def shared_prefill(layer, q, k, v, state, k_anchor=None, q_anchor=None) -> torch.Tensor:
    """Prefill role ``pod-shared``: POD attention with the anchor keys the caller assembled (the model's
    decoder loop, or the engine's prefill from its static cache)."""
    if k_anchor is None:
        raise RuntimeError(f"layer {layer} is POD-shared but received no anchor keys")
    cfg = state.config.pod
    if cfg.sharing == "scores":
        return pod_scores_prefill(q, q_anchor, k, k_anchor, v, state.num_new, cfg)
    return pod_prefill(q, k, k_anchor, v, state.num_new, cfg, state.scale)


def step_anchor_queries(row, cfg: PodConfig, queries: dict[int, torch.Tensor], j: int = 0) -> torch.Tensor | None:
    """[B, Hq, D]: under score sharing, the queries at column ``j`` of ``queries`` (layer -> [B, Hq, S, D], the
    model's ForwardState.queries) that layer ``row``'s distant logits take, each head its anchor layer's; None under
    key sharing or in a layer without shared heads."""
    if cfg.sharing != "scores" or not row.shared_heads:
        return None
    return assemble_anchor_queries(row.anchors, {a: t[:, :, j] for a, t in queries.items()})


def model_view_pod(view, q: torch.Tensor) -> torch.Tensor:
    """``DecodeView.pod`` over the model's dynamic cache (``sparse_models/decode_view.CacheDecodeView``):
    q [B, Hq, D] -> [B, Hq, D] with the config's sharing and gate policy."""
    row, cfg = view.row, view.config.pod
    return pod_decode(view.layer, row.anchors, q, view.cache, view.lens, cfg, view.state.gates,
                      step_anchor_queries(row, cfg, view.state.queries))


def pod_chunk(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state) -> torch.Tensor:
    """Several new tokens after a past on POD's cache (``Scheme.chunk``): q [B, Hq, S, D], k / v [B, Hkv, S, D] ->
    [B, Hq, S, D]. Appended and attended one position at a time (exact POD attention, no gate skip), because a
    non-anchor head no longer holds distant keys of its own. ``state``: the model's ForwardState."""
    row, cache, cfg = state.plan[layer], state.cache, dataclasses.replace(state.config.pod, gate_tau=None)
    outs = []
    for j in range(q.shape[2]):
        active = (j < state.num_new).long()
        start = state.old_lens + j
        cache.write(layer, k[:, :, j: j + 1], v[:, :, j: j + 1], start, active)
        lens = torch.where(active.bool(), start + 1, state.new_lens.clamp(min=1))
        out = pod_decode(layer, row.anchors, q[:, :, j], cache, lens, cfg,
                         q_distant=step_anchor_queries(row, cfg, state.queries, j))
        outs.append(torch.where(active.bool()[:, None, None], out, torch.zeros_like(out)))
    return torch.stack(outs, dim=2)


def pod_layer_decode(view, q: torch.Tensor, row, step) -> torch.Tensor:
    """Decode roles ``pod-anchor`` / ``pod-shared``: POD attention with the configured gate policy."""
    return view.pod(q)


def ring_window(config) -> tuple[int, int]:
    """(sink, recent) of the shared heads' key ring (``CacheNeeds.ring_window``)."""
    return config.pod.sink_tokens, config.pod.recent_window


def pod_kept(config, row, num_kv_heads: int, num_tokens: int) -> float:
    """Fraction of a layer's K/V bytes POD's cache holds for ``num_tokens`` tokens: a shared KV head keeps keys for
    the sinks + ring only (its values are kept: half of that head's bytes at distant positions are dropped)."""
    if not row.pod_keys:
        return 1.0
    shared = len(row.shared_heads) / num_kv_heads
    return 1.0 - 0.5 * shared * (1.0 - min(1.0, (config.pod.sink_tokens + config.pod.recent_window) / num_tokens))


SCHEME = Scheme(
    name="pod",
    summary="POD: proximal keys of the layer, distant keys shared across a block of layers (prefill + decode)",
    config_key="pod",
    config_cls=PodConfig,
    prefill_roles=lambda config, num_layers, anchors: pod_layer_roles(anchors, num_layers),
    decode_roles=lambda config, num_layers, anchors, family: [(r, None) for r in pod_layer_roles(anchors, num_layers)],
    prefill={"pod-anchor": fresh_prefill, "pod-shared": shared_prefill},  # an anchor layer attends causally
    anchor_key_roles=("pod-shared",),
    decode={"pod-anchor": pod_layer_decode, "pod-shared": pod_layer_decode},
    uses_anchors=True,
    config_notice=no_block_map_notice,
    cache=CacheNeeds(pod_keys=True, ring_window=ring_window),
    chunk=pod_chunk,
    model_view={"pod": model_view_pod},
    footprint=Footprint(kept=pod_kept),  # every layer reads every position (shared heads: the anchor's keys)
    display_name="POD",
    order=50,
)
