"""Launchers of the POD prefill / training kernels: forward (``_prefill_pod_fwd.py``), ``delta`` and the dK/dV and
dQ backward passes (``_prefill_pod_bwd.py``), optionally over the proximal pairs alone (``prox_only``).

Shared by the single-pass route (kernels/triton_pod_prefill_attention.py) and the split route, whose proximal band
they compute (kernels/pod_split_attention.py). Tensors as in those modules: q [B, Hq, S, D], k_own / k_anchor / v
[B, Hkv, S, D], seq_lens [B]; ``lse2`` [B, Hq, S] fp32 in the log2 domain (+inf on padding rows).
"""

from __future__ import annotations

import torch
import triton

from ._prefill_common import LOG2_E, dot_precision, head_dim_block
from ._prefill_pod_bwd import pod_delta_kernel, pod_dkdv_kernel, pod_dq_kernel
from ._prefill_pod_fwd import pod_forward_kernel


def _pod_forward(q, k_own, k_anchor, v, seq_lens, sink, recent, scale, return_gate, prox_only=False):
    """-> out, lse2 (log2-domain LSE, +inf on padding rows), gate or None. ``prox_only``: the proximal pairs alone."""
    batch, num_q_heads, seq_total, head_dim = q.shape
    group = num_q_heads // k_own.shape[1]
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse2 = torch.empty((batch, num_q_heads, seq_total), device=q.device, dtype=torch.float32)
    gate = torch.empty_like(lse2) if return_gate else lse2
    grid = lambda meta: (triton.cdiv(seq_total, meta["BLOCK_M"]), batch * num_q_heads)  # noqa: E731
    pod_forward_kernel[grid](
        q, k_own, k_anchor, v, seq_lens, out, lse2, gate,
        q.stride(0), q.stride(1), q.stride(2),
        k_own.stride(0), k_own.stride(1), k_own.stride(2),
        k_anchor.stride(0), k_anchor.stride(1), k_anchor.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse2.stride(0), lse2.stride(1),
        num_q_heads, seq_total, sink, recent, scale * LOG2_E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim),
        RETURN_GATE=return_gate, DOT_PRECISION=dot_precision(q.dtype), PROX_ONLY=prox_only,
    )
    return out, lse2, (gate if return_gate else None)


def pod_delta(out, dout, lse2):
    """``delta[b, h, i] = sum_d out * dout`` in fp32 ([B, Hq, S], laid out like ``lse2``); dout has unit last stride."""
    batch, num_q_heads, seq_total, head_dim = out.shape
    delta = torch.empty_like(lse2)
    delta_block = 64
    pod_delta_kernel[(triton.cdiv(seq_total, delta_block), batch * num_q_heads)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), delta.stride(0), delta.stride(1), num_q_heads, seq_total,
        HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim), BLOCK_M=delta_block,
    )
    return delta


def _pod_backward(dout, q, k_own, k_anchor, v, seq_lens, out, lse2, sink, recent, scale, prox_only=False, delta=None):
    """-> dq, dk_own, dk_anchor (None with ``prox_only``), dv. ``lse2`` / ``delta`` may be those of a merged
    attention (``prox_only``: the proximal pairs' gradients within it; ``delta`` then given, ``out`` unused)."""
    batch, num_q_heads, seq_total, head_dim = q.shape
    num_kv_heads = k_own.shape[1]
    group = num_q_heads // num_kv_heads
    block_d = head_dim_block(head_dim)
    precision = dot_precision(q.dtype)
    dout = dout.contiguous() if dout.stride(-1) != 1 else dout
    if delta is None:
        delta = pod_delta(out, dout, lse2)
    dk_own = torch.empty(k_own.shape, device=q.device, dtype=q.dtype)
    dk_anchor = dk_own if prox_only else torch.empty_like(dk_own)  # not written with prox_only
    dv = torch.empty_like(dk_own)
    # q, k_own, k_anchor, v, dout: (batch, head, position) strides; lse2 / delta: (batch, head)
    input_strides = (*q.stride()[:3], *k_own.stride()[:3], *k_anchor.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
                     *lse2.stride()[:2])
    grid_kv = lambda meta: (triton.cdiv(seq_total, meta["BLOCK_N"]), batch * num_kv_heads)  # noqa: E731
    pod_dkdv_kernel[grid_kv](
        q, k_own, k_anchor, v, dout, lse2, delta, seq_lens, dk_own, dk_anchor, dv,
        *input_strides,
        dk_own.stride(0), dk_own.stride(1), dk_own.stride(2),
        num_kv_heads, seq_total, sink, recent, scale * LOG2_E, scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, DOT_PRECISION=precision, PROX_ONLY=prox_only,
    )
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    grid_q = lambda meta: (triton.cdiv(seq_total, meta["BLOCK_M"]), batch * num_q_heads)  # noqa: E731
    pod_dq_kernel[grid_q](
        q, k_own, k_anchor, v, dout, lse2, delta, seq_lens, dq,
        *input_strides,
        dq.stride(0), dq.stride(1), dq.stride(2),
        num_q_heads, seq_total, sink, recent, scale * LOG2_E, scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, DOT_PRECISION=precision, PROX_ONLY=prox_only,
    )
    return dq, dk_own, (None if prox_only else dk_anchor), dv
