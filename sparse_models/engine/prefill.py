"""Prefill (and TidalDecode's correction chunks) on the engine's static cache.

``forward_chunk`` runs a chunk of tokens ``tokens [B, S]`` at positions ``offsets[b] + i`` through the
model, writes their K/V (and POD ring / Quest pages) into the static cache and returns the logits of
each sequence's last valid token. On a fresh prompt each layer runs its prefill role's function from
the scheme registry (``sparse_models/schemes/<method>.py``), the same function the model's attention
runs, over a :class:`~sparse_models.attention.ForwardState`; the engine only supplies what lives in its
cache: the anchor layers' keys for the scheme's ``anchor_key_roles`` (POD's ``pod-shared``).

A chunk that continues earlier ones (nonzero offsets: TidalDecode's KV correction) and ``mode="full"``
run exact causal attention over the cache (``kernels.prefill_attention`` reading the cached prefix).
Prefill is eager (variable shapes) and may sync with the host.

FP8 cache (``kv_cache_dtype="fp8_e4m3"``): the prefill attends in the model's dtype, as vLLM does, and the
model's ``generate()`` path alike (``sparse_models/attention.py``): a fresh chunk attends over its own unquantised
K/V (POD's anchor keys included: this chunk's keys of the anchor layers, kept while the chunk runs, not the FP8
cache), and a chunk that continues the cache attends over the dequantised cache (its own tokens included, as
stored). The cache write quantises.
"""

from __future__ import annotations

import torch

import kernels

from ..anchors import assemble_anchor_queries
from ..attention import ForwardState
from ..config import SparseAttentionConfig
from ..schemes.registry import get_scheme
from .errors import EngineError
from .model_parts import ModelParts, finish_layer, project_qkv, rms_norm, rope_tables
from .static_cache import StaticCache


def check_prefill_roles(plan, scheme_name: str) -> None:
    """Raise EngineError if a layer's prefill role has no function in the prefill scheme."""
    functions = get_scheme(scheme_name).prefill
    missing = sorted({p.prefill for p in plan} - set(functions))
    if missing:
        raise EngineError(f"prefill_scheme={scheme_name!r} plans prefill role(s) {missing} without a function in its "
                          f"scheme (sparse_models/schemes/registry.py); expected roles in {sorted(functions)}")


@torch.no_grad()
def forward_chunk(parts: ModelParts, plan, cache: StaticCache, config: SparseAttentionConfig,
                  tokens: torch.Tensor, offsets: torch.Tensor, lens: torch.Tensor, *, mode: str = "scheme",
                  token_sparse_keep_ratio: float | None = None, stats: dict | None = None) -> torch.Tensor:
    """Run a chunk through the model.

    Args:
        tokens: [B, S] token ids, right-padded; row b holds positions offsets[b] .. lens[b]-1.
        offsets: [B] first position of the chunk per row (0 for a fresh prompt).
        lens: [B] length of each sequence after the chunk.
        mode: "scheme" (the plan's prefill roles) or "full" (dense attention in every layer).
        token_sparse_keep_ratio: Token Sparse's fixed kept fraction (benchmarks), None: Dynamic Token Coverage.
        stats: if given, receives the prefill scheme's report under its name when its layers recorded any
            (``Scheme.prefill_stats``; ``token_sparse``: a TokenSparseStats, kept tokens per layer and row).
    Returns:
        logits [B, V] fp32 of each row's last valid token (position lens[b] - 1).
    """
    batch, s = tokens.shape
    fresh = not bool(offsets.any())
    if not fresh and any(p.pod_keys and any(not r.own for r in cache.runs[p.layer]) for p in plan):
        raise EngineError("forward_chunk with nonzero offsets is not supported on POD's shared-key cache "
                          "(kernels.pod_prefill_attention has no offset); replay tokens with the decode step instead")
    device = cache.device
    scheme = get_scheme(config.prefill_scheme)
    state = ForwardState("prefill", offsets, lens, lens, None, config, plan,
                         stats=scheme.prefill_stats() if scheme.prefill_stats is not None else None,
                         scale=parts.scale, token_sparse_keep_ratio=token_sparse_keep_ratio)
    position_ids = offsets[:, None] + torch.arange(s, device=device)[None, :]
    hidden = parts.embed_tokens(tokens)
    cos, sin = rope_tables(parts, hidden, position_ids)
    kv_max = int(lens.max())
    # FP8: the fresh keys of the layers another layer's POD heads read as anchors (attention reads them unquantised)
    anchor_layers = {a for p in plan for a in p.anchors if a != p.layer} if cache.fp8 else set()
    fresh_keys: dict[int, torch.Tensor] = {}
    # v1 score sharing: the queries of the layers that POD heads read distant logits from (METHODS.md A.3)
    query_sources = {a for p in plan for a in p.anchors if a != p.layer} if config.pod.sharing == "scores" else set()
    fresh_queries: dict[int, torch.Tensor] = {}
    for layer_idx, layer in enumerate(parts.layers):
        role = plan[layer_idx].prefill
        residual = hidden
        x = rms_norm(layer.input_layernorm, hidden)
        q, k, v = project_qkv(parts, layer, x, cos, sin)
        cache.write_chunk(layer_idx, k, v, offsets, lens)
        if layer_idx in anchor_layers:
            fresh_keys[layer_idx] = k
        if layer_idx in query_sources:
            fresh_queries[layer_idx] = q
        if fresh and mode == "scheme":
            shared = role in scheme.anchor_key_roles
            k_anchor = _anchor_keys(cache, plan, layer_idx, k, batch, s, fresh_keys) if shared else None
            q_anchor = (assemble_anchor_queries(plan[layer_idx].anchors, {**fresh_queries, layer_idx: q})
                        if shared and query_sources else None)
            out = scheme.prefill[role](layer_idx, q, k, v, state, k_anchor, q_anchor)
        elif fresh:
            out = kernels.prefill_attention(q, k, v, offsets, lens, scale=parts.scale)
        else:
            keys, values = cache.dequantized(layer_idx, batch, kv_max, q.dtype, lens)
            out = kernels.prefill_attention(q, keys, values, offsets, lens, scale=parts.scale)
        hidden = finish_layer(layer, residual, out.transpose(1, 2).reshape(batch, s, -1).to(hidden.dtype))
    if stats is not None and state.stats is not None and state.stats.layers:
        stats[scheme.name] = state.stats  # "token_sparse": what its layers kept
    last = (lens - offsets - 1).clamp(min=0)
    hidden = hidden[torch.arange(batch, device=device), last]  # [B, hidden]
    return parts.lm_head(rms_norm(parts.norm, hidden)).float()


def _anchor_keys(cache: StaticCache, plan, layer: int, k: torch.Tensor, batch: int, s: int,
                 fresh_keys: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """[B, Hkv, S, D]: per KV head, the fresh keys of its anchor layer (its own where it is the anchor), read
    from the static cache, which already holds the earlier layers' keys of this prompt (FP8: from ``fresh_keys``,
    this chunk's unquantised keys by layer)."""
    if fresh_keys:
        return torch.cat([k[:, h:h + 1] if a == layer else fresh_keys[a][:, h:h + 1]
                          for h, a in enumerate(plan[layer].anchors)], dim=1)
    if _has_shared(cache, layer):
        return torch.cat([k[:, r.h0:r.h1] if r.own else cache.full_keys(r.anchor, r.h0, r.h1, batch)[:, :, :s]
                          for r in cache.runs[layer]], dim=1)
    return _anchor_keys_dense_layout(cache, plan, layer, k, batch, s)


def _has_shared(cache: StaticCache, layer: int) -> bool:
    return any(not r.own for r in cache.runs[layer])


def _anchor_keys_dense_layout(cache: StaticCache, plan, layer: int, k: torch.Tensor, batch: int, s: int):
    """POD prefill while the cache keeps every key (decode scheme is not POD): read anchors' keys there."""
    anchors = plan[layer].anchors
    return torch.cat([k[:, h:h + 1] if a == layer else cache.full_keys(a, h, h + 1, batch)[:, :, :s]
                      for h, a in enumerate(anchors)], dim=1)
