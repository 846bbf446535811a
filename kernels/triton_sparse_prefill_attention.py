"""Attention over per-head position lists for prefill: Token Sparse Attention (Triton).

Token Sparse Attention (Jo et al., arXiv 2602.03216, METHODS.md C.1) keeps, per query head,
a sorted list of positions; the listed rows are both the kept queries and the kept keys, attention
is causal by original position, and the outputs go back to their original rows with zeros
elsewhere. The paper gathers compressed Q/K/V, runs FlashAttention and scatters back; this kernel
does all three in one pass without materialising the compressed tensors: a program owns
``BLOCK_M`` consecutive list entries (its queries), loads their rows by position, walks the list's
key blocks up to its own block (the list is ascending, so list order = position order) and
stores the output rows at their positions.

    q[B,Hq,S,D], k/v[B,Hkv,S,D], indices[B,Hs,K] (Hs = Hq per query head, or Hkv per GQA group;
    int32/int64, strictly ascending, -1 padded at the end) -> out[B,Hq,S,D], zeros at unlisted rows.

Cost: ``K^2/2`` logits per head instead of ``S^2/2`` (``rho^2`` of dense for keep ratio ``rho``),
plus a zero-fill of ``out``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._prefill_common import (
    FLOAT32_FIRST_CANDIDATE,
    LOG2_E,
    check_float_tensor,
    check_gqa,
    dot_precision,
    forward_tile_configs,
    head_dim_block,
    resolve_scale,
)
from ._prefill_indices import check_sorted_index_lists


def _configs():
    return forward_tile_configs()


@triton.jit
def _attend_listed_block(
    acc, m_i, l_i, q, q_pos, K, V, IDX_ROW, start_n, num_listed, offs_n, offs_d, stride_kn, stride_vn,
    qk_scale, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One block of listed keys. Unmasked blocks lie entirely before the query block in the list,
    so every (valid) query sees every key; ``MASKED`` blocks apply causal-by-position and padding."""
    entry = start_n + offs_n
    key_pos = tl.load(IDX_ROW + entry, mask=entry < num_listed, other=-1)
    key_ok = key_pos >= 0
    safe_pos = tl.where(key_ok, key_pos, 0)
    d_ok = offs_d[None, :] < HEAD_DIM
    k = tl.load(K + safe_pos[:, None] * stride_kn + offs_d[None, :], mask=key_ok[:, None] & d_ok, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + safe_pos[:, None] * stride_vn + offs_d[None, :], mask=key_ok[:, None] & d_ok, other=0.0)
    # P @ V accumulates into the rescaled accumulator inside the MMA (kernels/triton_prefill_attention.py)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP"], prune_configs_by=FLOAT32_FIRST_CANDIDATE)
@triton.jit
def _sparse_prefill_kernel(
    Q, K, V, OUT, IDX,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_os,
    stride_ib, stride_ih,
    num_q_heads, num_listed, qk_scale,
    GROUP: tl.constexpr, INDEX_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = pid_bh % num_q_heads
    kvh = h // GROUP
    idx_row = IDX + b * stride_ib + (h // INDEX_GROUP) * stride_ih

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = tl.load(idx_row + offs_m, mask=offs_m < num_listed, other=-1)
    row_ok = q_pos >= 0
    first_pos = tl.max(q_pos, 0)  # any valid entry; -1 means the whole block is padding
    if first_pos >= 0:
        safe_q = tl.where(row_ok, q_pos, 0)
        d_ok = offs_d[None, :] < HEAD_DIM
        q = tl.load(Q + b * stride_qb + h * stride_qh + safe_q[:, None] * stride_qs + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok, other=0.0)
        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # list entries before this block are valid and smaller than every query position here
        full_end = pid_m * BLOCK_M // BLOCK_N * BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_listed_block(
                acc, m_i, l_i, q, q_pos, k_base, v_base, idx_row, start_n, num_listed, offs_n, offs_d,
                stride_kn, stride_vn, qk_scale, HEAD_DIM, False, DOT_PRECISION)
        for start_n in range(full_end, (pid_m + 1) * BLOCK_M, BLOCK_N):
            acc, m_i, l_i = _attend_listed_block(
                acc, m_i, l_i, q, q_pos, k_base, v_base, idx_row, start_n, num_listed, offs_n, offs_d,
                stride_kn, stride_vn, qk_scale, HEAD_DIM, True, DOT_PRECISION)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + b * stride_ob + h * stride_oh + safe_q[:, None] * stride_os + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok)


def sparse_prefill_attention_triton(q, k, v, indices, *, scale=None):
    """Token Sparse prefill attention over per-head position lists (Triton).

    Args:
        q: ``[B, Hq, S, D]`` fp16/bf16/fp32 (post-RoPE).
        k, v: ``[B, Hkv, S, D]``, same dtype; ``Hq % Hkv == 0``.
        indices: ``[B, Hs, K]`` int32/int64, ``Hs`` = Hq (per query head) or Hkv (one list per GQA
            group); strictly ascending positions in ``[0, S)``, padded with -1 at the end.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``out[B, Hq, S, D]`` in q's dtype: attention of each listed query over the listed keys at
        positions ``<=`` its own, at the query's original row; unlisted rows are 0.
    """
    check_float_tensor("q", q, 4)
    check_float_tensor("k", k, 4, dtype=q.dtype, device=q.device)
    check_float_tensor("v", v, 4, dtype=q.dtype, device=q.device)
    batch, num_q_heads, seq_len, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} must match")
    if k.shape[0] != batch or k.shape[2] != seq_len or k.shape[3] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} must be [B={batch}, Hkv, S={seq_len}, D={head_dim}]")
    group = check_gqa(num_q_heads, k.shape[1])
    indices = check_sorted_index_lists(indices, batch, num_q_heads, k.shape[1], seq_len, q.device)
    scale = resolve_scale(scale, head_dim)

    out = torch.zeros(q.shape, device=q.device, dtype=q.dtype)
    num_listed = indices.shape[2]
    if out.numel() == 0 or num_listed == 0:
        return out
    index_group = num_q_heads // indices.shape[1]
    grid = lambda meta: (triton.cdiv(num_listed, meta["BLOCK_M"]), batch * num_q_heads)  # noqa: E731
    _sparse_prefill_kernel[grid](
        q, k, v, out, indices,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        indices.stride(0), indices.stride(1),
        num_q_heads, num_listed, scale * LOG2_E,
        GROUP=group, INDEX_GROUP=index_group, HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim),
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return out
