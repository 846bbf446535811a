"""The decode step's projections as grouped matrix-vector launches (``kernels.decode_linear``).

At decode every projection is a matrix-vector product that only has to read its weight once; cuBLAS runs the
per-layer shapes well above their bytes / bandwidth and the engine launched q, k, v, gate and up separately
(BENCHMARKS.md, "Where the dense decode step's time goes"). Here q/k/v are one launch, gate/up one launch with the
SiLU gating in its epilogue, then o and down: four launches per layer instead of seven (plus split-K reduces).

The functions have the signatures of ``compiled_layers.pre_attention`` / ``post_attention``, so
``CompiledLayers`` runs them compiled (Inductor fuses the norms, RoPE and residual adds around the launches) or
eagerly. ``podkit::decode_linear`` is a ``torch.library`` custom op so that torch.compile treats the Triton
launch as one opaque op (``fullgraph=True`` holds) instead of tracing into the autotuner.
"""

# No ``from __future__ import annotations`` here: torch.library infers the op's schema from real annotations.
from typing import Optional

import torch

import kernels

from .model_parts import apply_rope, weighted_rms


@torch.library.custom_op("podkit::decode_linear", mutates_args=())
def decode_linear_op(x: torch.Tensor, weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                     gated: bool) -> torch.Tensor:
    return kernels.decode_linear(x, tuple(weights), tuple(biases), gated=gated)


@decode_linear_op.register_fake
def _decode_linear_shape(x, weights, biases, gated):
    width = weights[0].shape[0] if gated else sum(w.shape[0] for w in weights)
    return x.new_empty(x.shape[0], width)


def pre_attention_grouped(hidden, norm_w, eps: float, wq, bq, wk, bk, wv, bv, cos, sin, num_heads: int, num_kv: int,
                          head_dim: int):
    """hidden [B, S, H] -> q [B, Hq, S, D], k [B, Hkv, S, D] (post-RoPE), v [B, Hkv, S, D]; B * S <= 64."""
    batch, s, _ = hidden.shape
    x = weighted_rms(hidden, norm_w, eps).reshape(batch * s, -1)
    qkv = decode_linear_op(x, [wq, wk, wv], [bq, bk, bv], False)
    q, k, v = qkv.split([num_heads * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q = q.reshape(batch, s, num_heads, head_dim).transpose(1, 2)
    k = k.reshape(batch, s, num_kv, head_dim).transpose(1, 2)
    v = v.reshape(batch, s, num_kv, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def post_attention_grouped(residual, attn, wo, bo, norm_w, eps: float, wg, bg, wu, bu, wd, bd):
    """residual [B, S, H], attn [B, S, Hq * D] -> next hidden [B, S, H]; B * S <= 64."""
    batch, s, width = residual.shape
    hidden = residual + decode_linear_op(attn.reshape(batch * s, -1), [wo], [bo], False).view(batch, s, width)
    x = weighted_rms(hidden, norm_w, eps).reshape(batch * s, -1)
    act = decode_linear_op(x, [wg, wu], [bg, bu], True)
    return hidden + decode_linear_op(act, [wd], [bd], False).view(batch, s, width)
