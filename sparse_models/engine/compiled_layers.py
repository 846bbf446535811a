"""Fused (torch.compile'd) non-attention parts of a decoder layer for the decode step.

Why: a decode step of a Llama-3-8B shape at batch 1 launches ~45 kernels per layer in eager PyTorch
(RMSNorm alone is 7 elementwise kernels, RoPE ~10), ~1,400 per step; even inside a CUDA graph each
costs a few microseconds, which adds milliseconds to a step whose memory floor is a few milliseconds
(BENCHMARKS.md, "Where the dense decode step's time goes"). Inductor fuses the norm, RoPE, residual
adds and SiLU-gating into a handful of kernels; the GEMMs stay cuBLAS; attention stays podkit's
Triton kernels (outside the compiled regions).

The compiled functions take weights as tensor arguments (not modules), so one compiled graph serves
every layer (same shapes) and there is no per-layer recompilation. Supported: Llama-style layers
(RMSNorm, q/k/v/o projections with optional biases, SiLU-gated MLP); anything else keeps eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .model_parts import LayerModules, ModelParts, apply_rope, weighted_rms


def pre_attention(hidden, norm_w, eps: float, wq, bq, wk, bk, wv, bv, cos, sin, num_heads: int, num_kv: int,
                  head_dim: int):
    """hidden [B, S, H] -> q [B, Hq, S, D], k [B, Hkv, S, D] (post-RoPE), v [B, Hkv, S, D]."""
    batch, s, _ = hidden.shape
    x = weighted_rms(hidden, norm_w, eps)
    q = F.linear(x, wq, bq).view(batch, s, num_heads, head_dim).transpose(1, 2)
    k = F.linear(x, wk, bk).view(batch, s, num_kv, head_dim).transpose(1, 2)
    v = F.linear(x, wv, bv).view(batch, s, num_kv, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def post_attention(residual, attn, wo, bo, norm_w, eps: float, wg, bg, wu, bu, wd, bd):
    """residual [B, S, H], attn [B, S, Hq * D] -> next hidden [B, S, H]."""
    hidden = residual + F.linear(attn, wo, bo)
    x = weighted_rms(hidden, norm_w, eps)
    return hidden + F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


def _supported(parts: ModelParts) -> bool:
    act = getattr(parts.config, "hidden_act", "silu")
    for layer in parts.layers:
        mlp = layer.mlp
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) or act != "silu":
            return False
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if getattr(norm, "variance_epsilon", None) is None or getattr(norm, "weight", None) is None:
                return False
    return True


PROJECTIONS = ("torch", "grouped")


class CompiledLayers:
    """``pre(layer_index, hidden, cos, sin)`` and ``post(layer_index, residual, attn)`` backed by
    torch.compile'd functions (or the same functions eagerly, ``compile=False``); ``CompiledLayers.build(parts)``
    returns None when unsupported. ``projections="grouped"`` runs the projections as grouped matrix-vector
    launches (``grouped_projections``) instead of one ``F.linear`` each."""

    def __init__(self, parts: ModelParts, projections: str = "torch", compile: bool = True):
        if projections not in PROJECTIONS:
            raise ValueError(f"projections={projections!r}: expected one of {PROJECTIONS}")
        self.parts = parts
        self.projections = projections
        if projections == "grouped":
            from .grouped_projections import post_attention_grouped, pre_attention_grouped

            pre, post = pre_attention_grouped, post_attention_grouped
        else:
            pre, post = pre_attention, post_attention
        self._pre = torch.compile(pre, dynamic=False, fullgraph=True) if compile else pre
        self._post = torch.compile(post, dynamic=False, fullgraph=True) if compile else post

    @classmethod
    def build(cls, parts: ModelParts, projections: str = "torch", compile: bool = True) -> "CompiledLayers | None":
        return cls(parts, projections, compile) if _supported(parts) else None

    def pre(self, layer: LayerModules, hidden, cos, sin):
        p = self.parts
        a = layer
        return self._pre(hidden, a.input_layernorm.weight, float(a.input_layernorm.variance_epsilon),
                         a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight,
                         a.v_proj.bias, cos, sin, p.num_heads, p.num_kv_heads, p.head_dim)

    def post(self, layer: LayerModules, residual, attn):
        m = layer.mlp
        norm = layer.post_attention_layernorm
        return self._post(residual, attn, layer.o_proj.weight, layer.o_proj.bias, norm.weight,
                          float(norm.variance_epsilon), m.gate_proj.weight, m.gate_proj.bias, m.up_proj.weight,
                          m.up_proj.bias, m.down_proj.weight, m.down_proj.bias)
