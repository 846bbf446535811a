"""Attention of one decode step, per layer role, on the engine's static cache (CUDA-graph safe).

Every function takes q [B, Hq, D] (post-RoPE, the token at slot ``positions[b]``, whose K/V are already
appended) and ``lens`` = positions + 1 [B] (a device tensor), and returns out [B, Hq, D]. No host syncs,
no data-dependent shapes: the same Python runs eagerly and under CUDA-graph capture.

:class:`StaticDecodeView` exposes them as the scheme-facing view (``full``: exact attention, POD
non-anchor heads reading proximal keys from the ring and distant keys from the anchor layer, POD arXiv
2412.02252; ``select``: + TidalDecode's top-k positions, arXiv 2410.05076; ``sparse``: attention over
slot lists; ``buffer``: a scheme's declared cache state, e.g. Quest's page max/min, arXiv 2406.10774). Which of
them a layer runs is the decode scheme's business (``sparse_models/schemes/<method>.py``).

On an FP8 cache (``kv_cache_dtype="fp8_e4m3"``) every op gets the scales of the buffers it reads
(``k_scale`` / ``v_scale``, POD's ``k_local_scale`` / ``k_anchor_scale``) and dequantises in registers; the
scales are None in the model's dtype, which is the bf16 call unchanged. With recent keys
(``kv_cache_recent_keys``, kernels/fp8_kv.py) each op also gets the model-dtype rings of the keys it reads
(``k_recent``; POD's ``k_local_recent`` / ``k_anchor_recent``) and the lengths.
"""

from __future__ import annotations

import torch

import kernels

from ..schemes.base import fused_selection
from .errors import EngineError
from .static_cache import KeyRun, StaticCache


def _heads(run: KeyRun, group: int) -> slice:
    return slice(run.h0 * group, run.h1 * group)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _scales(cache: StaticCache, layer: int, run: KeyRun, batch: int):
    """(k_scale, v_scale) of a run's full keys (its anchor layer's) and values: None on a cache of the model's dtype."""
    return cache.full_key_scale(run.anchor, run.h0, run.h1, batch), cache.value_scales(layer, run.h0, run.h1, batch)


def _local_scale(cache: StaticCache, layer: int, run: KeyRun, batch: int) -> dict:
    """POD's ``k_local_scale`` of a non-anchor run's ring ({} on a cache of the model's dtype)."""
    scale = cache.local_scales(layer, run.h0, run.h1, batch)
    return {} if scale is None else {"k_local_scale": scale}


def _recent(cache: StaticCache, layer: int, run: KeyRun, batch: int) -> dict:
    """The recent-key rings a run's op reads ({} without recent keys): ``k_recent`` (with ``seq_lens``, which the
    sparse op needs) for an own run; POD's ``k_local_recent`` (this layer's) and ``k_anchor_recent`` for a
    non-anchor run."""
    if not cache.recent_window:
        return {}
    if run.own:
        return {"k_recent": cache.recent_ring(layer, run.h0, run.h1, batch)}
    return {"k_local_recent": cache.recent_ring(layer, run.h0, run.h1, batch),
            "k_anchor_recent": cache.recent_ring(run.anchor, run.h0, run.h1, batch)}


def _own_anchor_recent(rings: dict) -> dict:
    """An own run read by the POD kernel (k_local None): its ring is the anchor's."""
    return {"k_anchor_recent": rings["k_recent"]} if rings else {}


def gate_anchor_layers(cache: StaticCache) -> frozenset[int]:
    """Layers some POD non-anchor run reads distant keys from: the layers whose gates an anchor estimate reads."""
    return frozenset(run.anchor for runs in cache.runs for run in runs if not run.own)


def _anchor_query(queries, run: KeyRun, hq):
    """[B, Hq_run, D]: a non-anchor run's distant-logit query under score sharing (its anchor layer's query for the
    run's heads ``hq``), None under key sharing (``queries`` None)."""
    return None if queries is None else queries[run.anchor][:, hq]


def full_attention(cache: StaticCache, layer: int, q, lens, scale, gate_tau=None, gates=None, queries=None):
    """Exact attention over every cached token (POD-aware in the shared-key layout).

    POD's compute skip (Ma et al., arXiv 2412.02252, section 2.3) with ``gate_tau``:
    - ``gates=None``: each non-anchor run skips by its own exact gate (kernels.pod_decode_attention), which
      needs every distant key: the rule, without the saving.
    - ``gates`` a dict (this step's gates [B, Hq] by layer, pod.gate_estimate="anchor"): an anchor layer that
      a later layer reads distant keys from runs the POD kernel over its own keys (``k_local=None``: exact
      attention plus its gate) and stores its gate; a non-anchor run takes its anchor layer's gate for the
      same query heads as the estimate and reads no distant key for heads whose estimate is >= gate_tau
      (a KV group whose heads all skip loads no distant row).

    ``queries``: this step's queries [B, Hq, D] by layer under POD's v1 score sharing: a non-anchor run's distant
    logits take its anchor layer's query (``q_distant``), and its skip is by the exact gate (``gates`` None).
    """
    batch, num_heads, _ = q.shape
    group = num_heads // cache.num_kv_heads
    estimate = gates is not None and gate_tau is not None
    stores_gate = estimate and layer in gate_anchor_layers(cache)  # a later layer's estimate reads this one's gate
    pod = dict(sink=cache.sink, recent=cache.recent, scale=scale)
    outs, layer_gates = [], []
    # (a run whose anchor layer stored no gate this step, e.g. a TidalDecode selection layer, skips by its exact gate)
    for run in cache.runs[layer]:
        hq = _heads(run, group)
        v = cache.values[layer][:batch, run.h0:run.h1]
        k_full = cache.full_keys(run.anchor, run.h0, run.h1, batch)
        ks, vs = _scales(cache, layer, run, batch)
        fp8 = {} if vs is None else dict(k_anchor_scale=ks, v_scale=vs)
        rings = _recent(cache, layer, run, batch)
        if run.own and stores_gate:
            out, gate = kernels.pod_decode_attention(q[:, hq], None, k_full, v, lens, return_gate=True, **pod, **fp8,
                                                     **_own_anchor_recent(rings))
        elif run.own:
            out, gate = kernels.decode_attention(q[:, hq], k_full, v, lens, scale=scale, k_scale=ks, v_scale=vs,
                                                 **rings), None
        elif estimate and run.anchor in gates:
            k_local = cache.local_keys[layer][:batch, run.h0:run.h1]
            fp8.update(_local_scale(cache, layer, run, batch))
            out, gate = kernels.pod_decode_attention(q[:, hq], k_local, k_full, v, lens, gate_tau=gate_tau,
                                                     gate_estimate=gates[run.anchor][:, hq], return_gate=True, **pod,
                                                     **fp8, **rings)
        else:
            k_local = cache.local_keys[layer][:batch, run.h0:run.h1]
            fp8.update(_local_scale(cache, layer, run, batch))
            out, gate = kernels.pod_decode_attention(q[:, hq], k_local, k_full, v, lens, gate_tau=gate_tau,
                                                     q_distant=_anchor_query(queries, run, hq), **pod,
                                                     **fp8, **rings), None
        outs.append(out)
        layer_gates.append(gate)
    if stores_gate:
        # heads of runs without a gate are never read: a later layer's head takes its anchor layer's gate, and
        # in that layer the head is its own anchor (a block is anchored at its lowest layer)
        gates[layer] = _cat([g if g is not None else torch.ones(batch, (r.h1 - r.h0) * group, device=q.device)
                             for g, r in zip(layer_gates, cache.runs[layer])])
    return _cat(outs)


def selection_attention(cache: StaticCache, layer: int, q, lens, scale, budget: int, selection: str = "query_head",
                        recent: int = 1, queries=None):
    """TidalDecode selection layer: exact attention + indices [B, Hs, budget] (Hs = Hq for ``"query_head"``, else
    Hkv; ``selection`` / ``recent`` as in ``kernels.reference.select_topk_positions``'s ``mode`` / ``recent``).

    The fused selection (``schemes/base.fused_selection``) selects per run; the others need every head's logits at
    once (a union spans a KV group or the whole layer), so each run returns its logits [B, Hq_run, N] and one
    selection runs over their concatenation [B, Hq, N]. ``queries``: as in :func:`full_attention` (score sharing:
    a non-anchor run's distant logits take its anchor layer's query).
    """
    batch, num_heads, _ = q.shape
    group = num_heads // cache.num_kv_heads
    fused = fused_selection(selection, recent)
    outs, indices, scores = [], [], []
    for run in cache.runs[layer]:
        hq = _heads(run, group)
        v = cache.values[layer][:batch, run.h0:run.h1]
        ks, vs = _scales(cache, layer, run, batch)
        rings = _recent(cache, layer, run, batch)
        if run.own and fused:
            k_full = cache.full_keys(run.anchor, run.h0, run.h1, batch)
            out, idx = kernels.selection_decode_attention(q[:, hq], k_full, v, lens, budget, scale=scale,
                                                          per_kv_group=selection == "kv_group", k_scale=ks,
                                                          v_scale=vs, **rings)
            indices.append(idx)
        elif run.own:
            k_full = cache.full_keys(run.anchor, run.h0, run.h1, batch)
            out, run_scores = kernels.decode_attention(q[:, hq], k_full, v, lens, scale=scale, return_scores=True,
                                                       k_scale=ks, v_scale=vs, **rings)
            scores.append(run_scores)
        else:
            # a POD non-anchor run: one read gives the output and the logit of every position by the key it is
            # attended with (ring key if proximal, anchor key if distant), which the selection ranks
            k_local = cache.local_keys[layer][:batch, run.h0:run.h1]
            k_anchor = cache.full_keys(run.anchor, run.h0, run.h1, batch)
            fp8 = {} if vs is None else dict(k_anchor_scale=ks, v_scale=vs, **_local_scale(cache, layer, run, batch))
            out, run_scores = kernels.pod_decode_attention(q[:, hq], k_local, k_anchor, v, lens, sink=cache.sink,
                                                           recent=cache.recent, scale=scale, return_scores=True,
                                                           q_distant=_anchor_query(queries, run, hq), **fp8, **rings)
            if fused:
                indices.append(kernels.select_topk_positions(run_scores, lens, budget, group_size=group,
                                                             per_kv_group=selection == "kv_group"))
            else:
                scores.append(run_scores)
        outs.append(out)
    if not fused:
        indices = [kernels.select_topk_positions(_cat(scores), lens, budget, group_size=group, mode=selection,
                                                 recent=recent)]
    return _cat(outs), _cat(indices)


def _pod_sparse_run(cache: StaticCache, layer: int, run: KeyRun, q_run, indices, lens, scale, q_distant=None):
    """Attention of a POD non-anchor run over selected slots (``kernels.pod_sparse_decode_attention``): a
    selected position's key is the layer's own (sink or ring) key if it is proximal to the query, else the
    anchor layer's key; values are the layer's own. indices [B, Hs, K] with Hs = the run's query heads or
    its KV heads. One softmax over the selected positions, as TidalDecode's sparse layers do (no gate skip).
    ``q_distant``: the anchor layer's query for these heads (score sharing), else None."""
    batch = q_run.shape[0]
    k_local = cache.local_keys[layer][:batch, run.h0:run.h1]
    k_anchor = cache.full_keys(run.anchor, run.h0, run.h1, batch)
    v = cache.values[layer][:batch, run.h0:run.h1]
    ks, vs = _scales(cache, layer, run, batch)
    fp8 = {} if vs is None else dict(k_anchor_scale=ks, v_scale=vs, **_local_scale(cache, layer, run, batch))
    return kernels.pod_sparse_decode_attention(q_run, k_local, k_anchor, v, indices, lens, sink=cache.sink,
                                               recent=cache.recent, scale=scale, q_distant=q_distant, **fp8,
                                               **_recent(cache, layer, run, batch))


def sparse_attention(cache: StaticCache, layer: int, q, lens, scale, indices, queries=None):
    """Attention over per-head slot lists indices [B, Hs, K] (TidalDecode sparse layers, Quest, streaming);
    ``queries`` as in :func:`full_attention`."""
    batch, num_heads, _ = q.shape
    group = num_heads // cache.num_kv_heads
    per_kv = indices.shape[1] == cache.num_kv_heads and group > 1
    outs = []
    for run in cache.runs[layer]:
        hq = _heads(run, group)
        idx = indices[:, run.h0:run.h1] if per_kv else indices[:, hq]
        if run.own:
            k_full = cache.full_keys(run.anchor, run.h0, run.h1, batch)
            v = cache.values[layer][:batch, run.h0:run.h1]
            ks, vs = _scales(cache, layer, run, batch)
            rings = _recent(cache, layer, run, batch)
            if rings:
                rings["seq_lens"] = lens
            outs.append(kernels.sparse_decode_attention(q[:, hq], k_full, v, idx, scale=scale, k_scale=ks, v_scale=vs,
                                                        **rings))
        else:
            outs.append(_pod_sparse_run(cache, layer, run, q[:, hq], idx, lens, scale,
                                        _anchor_query(queries, run, hq)))
    return _cat(outs)


class StaticDecodeView:
    """The engine's :class:`~sparse_models.schemes.base.DecodeView`: one layer of the static cache in
    one decode step (the model path's twin is ``sparse_models/decode_view.py``). Every method is one
    of the functions above, so a scheme's decode function runs here unchanged and graph-safe."""

    def __init__(self, cache: StaticCache, layer: int, lens: torch.Tensor, scale: float, config, step=None):
        self.cache = cache
        self.step = step  # DecodeStepState of this step (POD's anchor-gate estimates live there)
        self.layer = layer
        self.lens = lens
        self.scale = scale
        self.config = config
        self.num_kv_heads = cache.num_kv_heads
        self.capacity = cache.capacity  # static: a budget that covers it is exact attention in every replay

    def full(self, q):
        pod = self.config.pod
        queries = self._score_sharing_queries()
        # score sharing skips by the exact gate (the anchor's logits are at hand), so no anchor-gate estimates
        estimate = queries is None and self.step is not None and pod.gate_estimate == "anchor"
        return full_attention(self.cache, self.layer, q, self.lens, self.scale, gate_tau=pod.gate_tau,
                              gates=self.step.pod_gates if estimate else None, queries=queries)

    def pod(self, q):
        return self.full(q)  # POD-aware by the cache's runs; the gate skip as pod.gate_estimate says

    def _score_sharing_queries(self):
        """This step's queries by layer under POD's score sharing (the distant logits' queries), else None."""
        return self.step.pod_queries if self.config.pod.sharing == "scores" and self.step is not None else None

    def select(self, q, budget: int, selection: str = "query_head", recent: int = 1):
        return selection_attention(self.cache, self.layer, q, self.lens, self.scale, budget, selection, recent,
                                   queries=self._score_sharing_queries())

    def sparse(self, q, indices):
        return sparse_attention(self.cache, self.layer, q, self.lens, self.scale, indices,
                                queries=self._score_sharing_queries())

    def buffer(self, name: str):
        if (self.layer, name) not in self.cache.buffers:
            raise EngineError(f"layer {self.layer} keeps no state buffer {name!r} (its scheme's CacheNeeds.buffers)")
        return self.cache.buffers[(self.layer, name)][: self.lens.shape[0]]
