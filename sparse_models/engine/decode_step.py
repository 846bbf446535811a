"""One decode step of the whole model on the static cache: the function a CUDA graph captures.

``DecodeStep(parts, plan, cache, config)(input_ids [B], positions [B]) -> logits [B, V] (fp32)``.
It embeds the tokens, runs every layer (projections, RoPE, cache append, the attention of the layer's
decode role, MLP), and returns the next-token logits. Static shapes, no host syncs: the layer loop
and the role dispatch are Python that runs at capture time only.
"""

from __future__ import annotations

import torch

from ..config import SparseAttentionConfig
from . import decode_layers as L
from .errors import EngineError
from .model_parts import ModelParts, finish_layer, project_qkv, rms_norm, rope_tables
from .static_cache import StaticCache


class DecodeStep:
    """The decode step for one decode scheme.

    ``role_override`` replaces every layer's role (the TidalDecode KV-cache correction replays
    tokens with ``"full"``, i.e. exact attention on the same cache layout).
    """

    def __init__(self, parts: ModelParts, plan, cache: StaticCache, config: SparseAttentionConfig,
                 role_override: str | None = None, compiled=None):
        self.parts = parts
        self.compiled = compiled  # CompiledLayers or None (eager)
        self.plan = plan
        self.cache = cache
        self.config = config
        self.roles = [role_override or p.decode for p in plan]
        known = {"dense", "full", "pod-anchor", "pod-shared", "full+select", "sparse-over-selected", "quest",
                 "streaming"}
        bad = [r for r in self.roles if r not in known]
        if bad:
            raise EngineError(f"decode role {bad[0]!r} is not supported by the engine: expected one of {sorted(known)}")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        parts, cache, cfg = self.parts, self.cache, self.config
        batch = input_ids.shape[0]
        lens = positions + 1
        hidden = parts.embed_tokens(input_ids[:, None])  # [B, 1, hidden]
        cos, sin = rope_tables(parts, hidden, positions[:, None])
        selected: dict[int, torch.Tensor] = {}
        tidal = cfg.tidal
        for layer_idx, (layer, role) in enumerate(zip(parts.layers, self.roles)):
            residual = hidden
            if self.compiled is not None:
                q, k, v = self.compiled.pre(layer, hidden, cos, sin)
            else:
                q, k, v = project_qkv(parts, layer, rms_norm(layer.input_layernorm, hidden), cos, sin)
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, H, D]
            cache.append(layer_idx, k, v, positions)
            if role in ("dense", "full", "pod-anchor", "pod-shared"):
                out = L.full_attention(cache, layer_idx, q, lens, parts.scale, gate_tau=cfg.pod.gate_tau)
            elif role == "full+select":
                out, selected[layer_idx] = L.selection_attention(
                    cache, layer_idx, q, lens, parts.scale, tidal.budget, tidal.selection == "kv_group")
            elif role == "sparse-over-selected":
                source = self.plan[layer_idx].selection_source
                out = L.sparse_attention(cache, layer_idx, q, lens, parts.scale, selected[source])
            elif role == "quest":
                out = L.quest_attention(cache, layer_idx, q, lens, parts.scale, cfg.quest.budget)
            else:  # streaming
                idx = L.streaming_indices(lens, parts.num_kv_heads, cfg.streaming.sink_tokens,
                                          cfg.streaming.recent_window)
                out = L.sparse_attention(cache, layer_idx, q, lens, parts.scale, idx)
            out = out.reshape(batch, 1, -1).to(hidden.dtype)
            if self.compiled is not None:
                hidden = self.compiled.post(layer, residual, out)
            else:
                hidden = finish_layer(layer, residual, out)
        return parts.lm_head(rms_norm(parts.norm, hidden[:, 0])).float()
