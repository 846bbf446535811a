"""One decode step of the whole model on the static cache: the function a CUDA graph captures.

``DecodeStep(parts, plan, cache, config)(input_ids [B], positions [B]) -> logits [B, V] (fp32)``.
It embeds the tokens, runs every layer (projections, RoPE, cache append, the decode scheme's function
for the layer's role over a :class:`~sparse_models.engine.decode_layers.StaticDecodeView`, MLP), and
returns the next-token logits. Static shapes, no host syncs: the layer loop and the role dispatch are
Python that runs at capture time only. The scheme functions are the same ones the model's attention
calls (``sparse_models/schemes/<method>.py``).
"""

from __future__ import annotations

import torch

from ..config import SparseAttentionConfig
from ..schemes.base import DecodeStepState, exact_decode
from ..schemes.registry import get_scheme
from .decode_layers import StaticDecodeView
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
        scheme = get_scheme(config.decode_scheme)
        if role_override is not None and role_override != "full":
            raise EngineError(f"role_override={role_override!r} is not supported: expected 'full' (exact attention)")
        bad = [r for r in self.roles if role_override is None and r not in scheme.decode]
        if bad:
            raise EngineError(f"decode role {bad[0]!r} is not supported by the engine for decode_scheme="
                              f"{scheme.name!r}: expected one of {sorted(scheme.decode)}")
        self.functions = [exact_decode if role_override else scheme.decode[r] for r in self.roles]

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        parts, cache, cfg = self.parts, self.cache, self.config
        batch = input_ids.shape[0]
        lens = positions + 1
        hidden = parts.embed_tokens(input_ids[:, None])  # [B, 1, hidden]
        cos, sin = rope_tables(parts, hidden, positions[:, None])
        step = DecodeStepState()
        share_scores = cfg.pod.sharing == "scores"
        for layer_idx, (layer, function) in enumerate(zip(parts.layers, self.functions)):
            residual = hidden
            if self.compiled is not None:
                q, k, v = self.compiled.pre(layer, hidden, cos, sin)
            else:
                q, k, v = project_qkv(parts, layer, rms_norm(layer.input_layernorm, hidden), cos, sin)
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, H, D]
            cache.append(layer_idx, k, v, positions)
            if share_scores:  # POD v1: later layers' distant logits are this layer's q . k
                step.pod_queries[layer_idx] = q
            view = StaticDecodeView(cache, layer_idx, lens, parts.scale, cfg, step)
            out = function(view, q, self.plan[layer_idx], step)
            out = out.reshape(batch, 1, -1).to(hidden.dtype)
            if self.compiled is not None:
                hidden = self.compiled.post(layer, residual, out)
            else:
                hidden = finish_layer(layer, residual, out)
        return parts.lm_head(rms_norm(parts.norm, hidden[:, 0])).float()
