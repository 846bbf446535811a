"""POD + TidalDecode (decode): POD's shared-key cache, TidalDecode's selection on top.

The decode roles are TidalDecode's (``sparse_models/schemes/tidal.py``); every key a layer reads
comes from POD's cache (``pod_keys``: sinks + ring for non-anchor units, distant keys from the
anchor layer). Under v1's score sharing (``pod.sharing="scores"``) a position's logit in a layer with shared
heads is ``q . k_own`` if proximal and the anchor's ``q_a . k_a`` if distant: the model path selects and attends
over those logits through POD's kernels (``q_distant``), as the engine does. A KV correction period is rejected
(re-running past tokens needs proximal keys the ring has already dropped).
"""

from __future__ import annotations

import kernels

from ..validation import ConfigError
from . import tidal
from .base import CacheNeeds, Footprint, Scheme
from .pod import model_view_pod, no_block_map_notice, pod_chunk, pod_decode, pod_kept, ring_window, step_anchor_queries


def _anchor_queries(view):
    """[B, Hq, D]: this step's anchor-layer queries of ``view``'s layer under score sharing, else None (key
    sharing, or a layer without shared heads: one key per slot, the generic path)."""
    return step_anchor_queries(view.row, view.config.pod, view.state.queries) if view.row.pod_keys else None


def model_view_full(view, q):
    """``DecodeView.full`` on the model's cache (TidalDecode's full layers): POD attention, q [B, Hq, D] -> [B, Hq, D]."""
    q_distant = _anchor_queries(view)
    if q_distant is None:
        return view.full_over_keys(q)
    return pod_decode(view.layer, view.row.anchors, q, view.cache, view.lens, view.config.pod, q_distant=q_distant)


def model_view_select(view, q, budget: int, selection: str = "query_head", recent: int = 1):
    """``DecodeView.select`` on the model's cache: out [B, Hq, D] and indices [B, Hs, budget]."""
    q_distant = _anchor_queries(view)
    if q_distant is None:
        return view.select_over_keys(q, budget, selection, recent)
    cfg, cache, layer = view.config.pod, view.cache, view.layer
    out, scores = kernels.pod_decode_attention(q, cache.local_key_view(layer, view.lens), cache.anchor_keys(layer),
                                               view.values, view.lens, sink=cfg.sink_tokens,
                                               recent=cfg.recent_window, return_scores=True, q_distant=q_distant)
    return out, kernels.select_topk_positions(scores, view.lens, budget, group_size=q.shape[1] // view.num_kv_heads,
                                              mode=selection, recent=recent)


def model_view_sparse(view, q, indices):
    """``DecodeView.sparse`` on the model's cache: attention over ``indices`` [B, Hs, K] -> [B, Hq, D]."""
    q_distant = _anchor_queries(view)
    if q_distant is None:
        return view.sparse_over_keys(q, indices)
    cfg, cache, layer = view.config.pod, view.cache, view.layer
    return kernels.pod_sparse_decode_attention(q, cache.local_key_view(layer, view.lens), cache.anchor_keys(layer),
                                               view.values, indices, view.lens, sink=cfg.sink_tokens,
                                               recent=cfg.recent_window, q_distant=q_distant)


def check(config, num_layers: int) -> None:
    if config.tidal.correction_period is not None:
        raise ConfigError(f"tidal.correction_period={config.tidal.correction_period} is invalid with "
                          f"decode_scheme='pod+tidal': re-running past tokens needs their proximal keys, which POD's "
                          f"ring has already overwritten; use null (no correction) or decode_scheme='tidal'")


SCHEME = Scheme(
    name="pod+tidal",
    summary="POD's shared-key cache with TidalDecode selection on top (decode)",
    decode_roles=tidal.tidal_decode_roles,
    decode=tidal.DECODE,
    uses_anchors=True,
    config_notice=no_block_map_notice,
    cache=CacheNeeds(pod_keys=True, ring_window=ring_window,
                     correction_period=lambda config: config.tidal.correction_period),
    budget=tidal.BUDGET,
    check=check,
    reads=("pod", "tidal"),
    chunk=pod_chunk,
    model_view={"pod": model_view_pod, "full": model_view_full, "select": model_view_select,
                "sparse": model_view_sparse},
    footprint=Footprint(budget_roles=tidal.BUDGET_ROLES, kept=pod_kept),
    display_name="POD + TidalDecode",
    order=60,
)
