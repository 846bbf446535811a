"""Causal prefill attention with ragged query offsets / KV lengths, returning the LSE (Triton).

FlashAttention-2 forward (Dao 2023, arXiv 2307.08691): one program per (query block, batch*head),
online softmax in the exp2 domain, fp32 accumulation. GQA is native: query head ``h`` reads KV
head ``h // G`` for any ``G`` (no ``repeat_kv``).

Layout (ARCHITECTURE.md, "slot = position"):
    q[B,Hq,S,D], k/v[B,Hkv,N,D], q_offsets[B], kv_lens[B]
    query ``i`` of sequence ``b`` sits at position ``q_offsets[b] + i`` and sees keys
    ``j <= q_offsets[b] + i`` with ``j < kv_lens[b]``. Rows at positions ``>= kv_lens[b]``
    (padding) output 0 and get ``lse = -inf``.

On a Hopper GPU, the fresh-prefill layout (bf16/fp16, D 64 or 128, ``N == S``) runs the Gluon kernel of
``kernels/gluon_prefill_attention_sm90.py`` instead (same contract; non-contiguous q/k/v are copied for its TMA
descriptors; ``PODKIT_PREFILL_KERNEL`` picks).

Gradients. The Triton kernel is forward only. When autograd needs gradients (training: grad mode on
and q, k or v requiring grad) a fresh prefill (every ``q_offsets`` 0, ``N == S``) runs
:func:`dense_causal_attention_sdpa`: PyTorch's fused causal attention (FlashAttention-2 on CUDA in
bf16/fp16, Dao 2023), the fastest causal forward + backward available, with its own backward. A chunk
after a cached past with gradients (no training path does this), or ``return_lse`` with gradients, takes
the differentiable PyTorch reference. Without this, the kernel's output was a leaf without ``grad_fn``
and the q/k/v projections of every dense layer (and of POD's anchor layers) would silently get no gradient
on CUDA (tests/sparse_models/test_training_on_kernels.py checks that they do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import reference
from ._prefill_common import (
    FLOAT32_FIRST_CANDIDATE,
    LOG2_E,
    check_float_tensor,
    check_gqa,
    check_int_vector,
    dot_precision,
    forward_tile_configs,
    head_dim_block,
    resolve_scale,
)
from .gluon_prefill_attention_sm90 import gluon_inputs, launch_prefill_kernel_sm90


def _configs():
    return forward_tile_configs()


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_n, offs_d, q_pos, kv_len, stride_kn, stride_vn,
    qk_scale, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
):
    """One key block of the online softmax. ``MASKED`` blocks apply causal + kv_len masks;
    unmasked blocks are the fully visible ones below the diagonal: every key of the block is valid, so
    their loads carry no row mask (and no column mask when ``EVEN_D``: D is the tile width) and their
    logits no per-element test, which keeps the loads vectorised and the loop free of selects."""
    if MASKED:
        key_pos = start_n + offs_n
        key_ok = key_pos < kv_len
        kv_mask = key_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs + start_n * stride_kn, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs + start_n * stride_kn)
    else:
        k = tl.load(k_ptrs + start_n * stride_kn, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows with no visible key yet keep m = -inf: subtract 0 instead, so exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s - m_safe[:, None]
    else:
        # every row sees every key of this block, so m_new is finite; the scale rides on the max
        # (max(s * c) = max(s) * c for c > 0) and on the subtraction (one FMA per logit instead of a
        # multiply and a subtract: Triton's fused-attention tutorial's arithmetic)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = m_new
        s = s * qk_scale - m_safe[:, None]
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=kv_mask, other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs + start_n * stride_vn)
    else:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    # P @ V accumulates into the rescaled accumulator inside the MMA (no separate [BLOCK_M, D] add)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# LEN_BUCKET (ceil log2 of the query count) is in the key so that a short prefill and a 32K one each get
# the tile that is fastest for them (at 8K vs 32K on an H200 the best BLOCK_N differs), without
# retuning for every length
@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "LEN_BUCKET"], prune_configs_by=FLOAT32_FIRST_CANDIDATE)
@triton.jit
def _prefill_attention_kernel(
    Q, K, V, OUT, LSE, Q_OFFSETS, KV_LENS, LEN_BUCKET,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    num_q_heads, seq_q, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
):
    # grid (batch*head, query block), query blocks in reverse: the longest causal rows start first and the
    # short ones fill the last wave (longest-processing-time-first order across all heads)
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = pid_bh % num_q_heads
    kvh = h // GROUP
    q_offset = tl.load(Q_OFFSETS + b)
    kv_len = tl.load(KV_LENS + b)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = q_offset + offs_m
    row_ok = (offs_m < seq_q) & (q_pos < kv_len)

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_ptrs = K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    first_pos = q_offset + pid_m * BLOCK_M  # smallest query position of this block
    # keys visible to every row of the block: [0, min(first_pos + 1, kv_len)), rounded down to blocks
    full_end = tl.minimum(first_pos + 1, kv_len)
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
    last_pos = tl.minimum(q_offset + tl.minimum((pid_m + 1) * BLOCK_M, seq_q), kv_len)  # exclusive
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_n, offs_d, q_pos,
                                      kv_len, stride_kn, stride_vn, qk_scale, HEAD_DIM, False, DOT_PRECISION, EVEN_D)
    for start_n in range(full_end, last_pos, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_n, offs_d, q_pos,
                                      kv_len, stride_kn, stride_vn, qk_scale, HEAD_DIM, True, DOT_PRECISION, EVEN_D)

    l_safe = tl.where(row_ok & (l_i > 0), l_i, 1.0)
    out = acc / l_safe[:, None]
    out = tl.where(row_ok[:, None], out, 0.0)
    o_ptrs = OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM))
    if WRITE_LSE:
        # back from the log2 domain: lse = (m + log2 l) * ln 2
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
        lse = tl.where(row_ok & (l_i > 0), lse, float("-inf"))
        tl.store(LSE + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < seq_q)


def prefill_attention_triton(q, k, v, q_offsets, kv_lens, *, scale=None, return_lse=False):
    """Causal prefill attention with ragged offsets (Triton, CUDA or ``TRITON_INTERPRET=1``).

    Args:
        q: ``[B, Hq, S, D]`` fp16/bf16/fp32 queries (post-RoPE).
        k, v: ``[B, Hkv, N, D]``, same dtype; ``Hq % Hkv == 0``.
        q_offsets: ``[B]`` int, position of query 0 of each sequence (``>= 0``).
        kv_lens: ``[B]`` int in ``[0, N]``, valid keys of each sequence.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return ``lse[B, Hq, S]`` fp32 (natural log; ``-inf`` on padding rows).

    Returns:
        ``out[B, Hq, S, D]`` in q's dtype (``, lse``).
    """
    check_float_tensor("q", q, 4)
    check_float_tensor("k", k, 4, dtype=q.dtype, device=q.device)
    check_float_tensor("v", v, 4, dtype=q.dtype, device=q.device)
    batch, num_q_heads, seq_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} must match")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} must be [B={batch}, Hkv, N, D={head_dim}]")
    group = check_gqa(num_q_heads, k.shape[1])
    num_keys = k.shape[2]
    q_offsets = check_int_vector("q_offsets", q_offsets, batch, q.device, low=0, high=None)
    kv_lens = check_int_vector("kv_lens", kv_lens, batch, q.device, low=0, high=num_keys)
    scale = resolve_scale(scale, head_dim)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        if num_keys == seq_q and not return_lse and not bool((q_offsets != 0).any()):
            return dense_causal_attention_sdpa(q, k, v, kv_lens, scale)
        return reference.prefill_attention(q, k, v, q_offsets, kv_lens, scale=scale, return_lse=return_lse)

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, num_q_heads, seq_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return (out, lse.fill_(float("-inf"))) if return_lse else out
    # on Hopper the Gluon kernel (TMA producer warp, async wgmma; kernels/gluon_prefill_attention_sm90.py) runs
    # the fresh-prefill layout at SDPA's speed; everything else runs the tl.dot kernel below
    contiguous = gluon_inputs(q, k, v)
    if contiguous is not None:
        launch_prefill_kernel_sm90(*contiguous, out, lse, q_offsets, kv_lens, group, scale, return_lse)
    else:
        launch_prefill_kernel(q, k, v, out, lse, q_offsets, kv_lens, group, scale, return_lse)
    return (out, lse) if return_lse else out


def launch_prefill_kernel(q, k, v, out, lse, q_offsets, kv_lens, group, scale, write_lse, tile=None):
    """Launch the kernel on checked inputs (shapes as :func:`prefill_attention_triton`; ``q_offsets`` / ``kv_lens``
    int32, ``out`` / ``lse`` allocated). ``tile=None`` autotunes; ``tile=(BLOCK_M, BLOCK_N, num_warps, num_stages)``
    launches that one candidate (the GPU tests run every candidate the autotuner may pick)."""
    batch, num_q_heads, seq_q, head_dim = q.shape
    args = (
        q, k, v, out, lse, q_offsets, kv_lens, max(seq_q - 1, 0).bit_length(),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        num_q_heads, seq_q, scale * LOG2_E,
    )
    meta = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim), WRITE_LSE=write_lse,
                DOT_PRECISION=dot_precision(q.dtype), EVEN_D=head_dim == head_dim_block(head_dim))
    if tile is None:
        grid = lambda meta: (batch * num_q_heads, triton.cdiv(seq_q, meta["BLOCK_M"]))  # noqa: E731
        _prefill_attention_kernel[grid](*args, **meta)
    else:
        block_m, block_n, num_warps, num_stages = tile
        _prefill_attention_kernel.fn[(batch * num_q_heads, triton.cdiv(seq_q, block_m))](
            *args, **meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


def dense_causal_attention_sdpa(q, k, v, kv_lens, scale):
    """Differentiable causal attention of a fresh prefill: q [B, Hq, S, D], k/v [B, Hkv, S, D], kv_lens [B]
    -> out [B, Hq, S, D] (0 on rows ``>= kv_lens``). GQA without copying k/v (``enable_gqa``).

    Right padding needs no mask: a row ``i < kv_lens[b]`` sees keys ``j <= i < kv_lens[b]`` only, so the
    causal mask already excludes the padding keys; the padding rows are zeroed (no gradient flows there).
    """
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    rows = torch.arange(q.shape[2], device=q.device)[None, :] < kv_lens[:, None]  # [B, S]
    if bool(rows.all()):  # packed training rows: nothing to zero
        return out
    return out * rows[:, None, :, None].to(out.dtype)
