"""Prefill (and TidalDecode's correction chunks) on the engine's static cache.

``forward_chunk`` runs a chunk of tokens ``tokens [B, S]`` at positions ``offsets[b] + i`` through the
model, writes their K/V (and POD ring / Quest pages) into the static cache and returns the logits of
each sequence's last valid token. Attention per layer follows the plan's prefill role:

* ``dense`` / ``pod-anchor``: causal attention (``kernels.prefill_attention``; with nonzero offsets it
  reads the cache, so chunks continue earlier ones);
* ``token-sparse``: Token Sparse Attention (arXiv 2602.03216) on fresh prompts: per-head kept tokens
  (``token_sparse_select``), compressed causal attention (``kernels.sparse_prefill_attention``);
* ``pod-shared``: POD (arXiv 2412.02252): proximal pairs use the layer's own keys, distant pairs the
  anchor layer's keys (``kernels.pod_prefill_attention``) — fresh prompts only.

``mode="full"`` forces exact dense attention everywhere (the KV-cache correction).
Prefill is eager (variable shapes) and may sync with the host.
"""

from __future__ import annotations

import torch

import kernels

from ..config import SparseAttentionConfig
from ..schemes.token_sparse import TokenSparseStats
from .errors import EngineError
from .model_parts import ModelParts, finish_layer, project_qkv, rms_norm, rope_tables
from .static_cache import StaticCache
from .token_sparse_select import token_sparse_attention

# The prefill roles forward_chunk implements on the static cache (every other role would silently be
# dense here, so the engine refuses plans with any other role: see check_prefill_roles).
ENGINE_PREFILL_ROLES = ("dense", "pod-anchor", "pod-shared", "token-sparse")


def check_prefill_roles(plan, scheme_name: str) -> None:
    """Raise EngineError if a layer's prefill role has no engine implementation."""
    missing = sorted({p.prefill for p in plan} - set(ENGINE_PREFILL_ROLES))
    if missing:
        raise EngineError(f"prefill_scheme={scheme_name!r} plans prefill role(s) {missing} that the engine's prefill "
                          f"(sparse_models/engine/prefill.py) does not implement: expected roles in "
                          f"{list(ENGINE_PREFILL_ROLES)}; use the model's generate() or add the role there")


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
        stats: if given, receives ``token_sparse``: a TokenSparseStats (kept tokens per layer and row).
    Returns:
        logits [B, V] fp32 of each row's last valid token (position lens[b] - 1).
    """
    batch, s = tokens.shape
    fresh = not bool(offsets.any())
    if not fresh and any(p.pod_keys and any(not r.own for r in cache.runs[p.layer]) for p in plan):
        raise EngineError("forward_chunk with nonzero offsets is not supported on POD's shared-key cache "
                          "(kernels.pod_prefill_attention has no offset); replay tokens with the decode step instead")
    device = cache.device
    position_ids = offsets[:, None] + torch.arange(s, device=device)[None, :]
    hidden = parts.embed_tokens(tokens)
    cos, sin = rope_tables(parts, hidden, position_ids)
    ts = config.token_sparse
    kv_max = int(lens.max())
    for layer_idx, layer in enumerate(parts.layers):
        role = "dense" if mode == "full" else plan[layer_idx].prefill
        residual = hidden
        x = rms_norm(layer.input_layernorm, hidden)
        q, k, v = project_qkv(parts, layer, x, cos, sin)
        cache.write_chunk(layer_idx, k, v, offsets, lens)
        if role == "token-sparse" and fresh:
            if stats is not None and "token_sparse" not in stats:
                stats["token_sparse"] = TokenSparseStats()
            out = token_sparse_attention(q, k, v, lens, ts, layer_idx, stats.get("token_sparse") if stats is not None
                                         else None, keep_ratio=token_sparse_keep_ratio, scale=parts.scale)
        elif role == "pod-shared" and mode != "full":
            k_anchor = torch.cat([k[:, r.h0:r.h1] if r.own else cache.full_keys(r.anchor, r.h0, r.h1, batch)[:, :, :s]
                                  for r in cache.runs[layer_idx]], dim=1) if _has_shared(cache, layer_idx) else \
                _anchor_keys_dense_layout(cache, plan, layer_idx, k, batch, s)
            out = kernels.pod_prefill_attention(q, k, k_anchor, v, lens, sink=config.pod.sink_tokens,
                                                recent=config.pod.recent_window, scale=parts.scale)
        elif fresh:
            out = kernels.prefill_attention(q, k, v, offsets, lens, scale=parts.scale)
        else:
            keys = cache.full_keys(layer_idx, 0, parts.num_kv_heads, batch)[:, :, :kv_max]
            values = cache.values[layer_idx][:batch, :, :kv_max]
            out = kernels.prefill_attention(q, keys, values, offsets, lens, scale=parts.scale)
        hidden = finish_layer(layer, residual, out.transpose(1, 2).reshape(batch, s, -1).to(hidden.dtype))
    last = (lens - offsets - 1).clamp(min=0)
    hidden = hidden[torch.arange(batch, device=device), last]  # [B, hidden]
    return parts.lm_head(rms_norm(parts.norm, hidden)).float()


def _has_shared(cache: StaticCache, layer: int) -> bool:
    return any(not r.own for r in cache.runs[layer])


def _anchor_keys_dense_layout(cache: StaticCache, plan, layer: int, k: torch.Tensor, batch: int, s: int):
    """POD prefill while the cache keeps every key (decode scheme is not POD): read anchors' keys there."""
    anchors = plan[layer].anchors
    return torch.cat([k[:, h:h + 1] if a == layer else cache.full_keys(a, h, h + 1, batch)[:, :, :s]
                      for h, a in enumerate(anchors)], dim=1)
