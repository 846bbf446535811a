"""Token Sparse Attention's key scorer (Jo et al., arXiv 2602.03216; METHODS.md §C.1 step 2), Triton.

``scores[b, h, t]`` = mean over the last ``W`` valid queries ``i`` of ``softmax_j(q_i . k_j / sqrt(D))[t]``
(softmax over the causal keys ``j <= i``) for every prefix key ``t < seq_lens[b] - W``; keys inside
the window and padding score 0. The ``W x S`` probability matrix is never materialised:

1. ``_window_stats_kernel``: online-softmax statistics (running max ``m`` and sum ``l``, log2
   domain) of the window queries over all keys. The G query heads of a KV head are stacked as
   ``G * W`` rows so each key tile is loaded once per group; the key axis is split across
   programs (``num_splits``) so that a long sequence still fills the GPU, and the partial
   statistics are merged with a log-sum-exp in torch (tiny: ``[splits, B, Hq, W]``).
2. ``_prefix_scores_kernel``: per key block, ``sum_i exp2(s_it - m_i) / l_i`` over the window rows
   of each head, divided by ``W`` (``reduce="max"``: ``max_i`` instead, podkit's option, METHODS.md C.1).
   Prefix keys precede every window query, so no causal mask is needed there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._prefill_common import (
    LOG2_E,
    check_float_tensor,
    check_gqa,
    check_int_vector,
    dot_precision,
    head_dim_block,
    interpreter_active,
)
from .reference import check_token_sparse_reduce


def _stats_block_sizes():
    return (16, 16, 4, 1) if interpreter_active() else (128, 64, 8, 3)  # BLOCK_M, BLOCK_N, warps, stages


def _scores_block_sizes():
    return (16, 16, 4, 1) if interpreter_active() else (64, 128, 8, 3)


@triton.jit
def _window_stats_kernel(
    Q, K, SEQ_LENS, M_OUT, L_OUT,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kn,
    stride_sz, stride_sb, stride_sh,
    num_kv_heads, window, split_len, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    seq_len = tl.load(SEQ_LENS + b)
    win_start = seq_len - window
    if win_start > 0:  # otherwise there is no prefix key to score
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = g * window + w
        row_ok = rows < GROUP * window
        head = kvh * GROUP + rows // window
        q_pos = win_start + rows % window
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d[None, :] < HEAD_DIM
        q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + q_pos[:, None] * stride_qs + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok, other=0.0)
        k_ptrs = K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        lo = split * split_len
        hi = tl.minimum(lo + split_len, seq_len)
        # keys below win_start are visible to every window query: no mask
        full_end = tl.maximum(tl.minimum(hi, win_start) - lo, 0) // BLOCK_N * BLOCK_N + lo
        for start_n in range(lo, full_end, BLOCK_N):
            k = tl.load(k_ptrs + start_n * stride_kn, mask=d_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        for start_n in range(full_end, hi, BLOCK_N):
            key_pos = start_n + offs_n
            k = tl.load(k_ptrs + start_n * stride_kn, mask=(key_pos[:, None] < hi) & d_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < hi)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
        out_off = split * stride_sz + b * stride_sb + head * stride_sh + rows % window
        tl.store(M_OUT + out_off, m_i, mask=row_ok)
        tl.store(L_OUT + out_off, l_i, mask=row_ok)


@triton.jit
def _prefix_scores_kernel(
    Q, K, SEQ_LENS, M_IN, INV_L_IN, SCORES,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kn,
    stride_sb, stride_sh,
    stride_ob, stride_oh,
    num_kv_heads, seq_total, window, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, REDUCE_MAX: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    seq_len = tl.load(SEQ_LENS + b)
    win_start = seq_len - window
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = offs_n < win_start  # prefix keys only; window keys and padding score 0
    store_ok = offs_n < seq_total
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    if pid_n * BLOCK_N < win_start:
        k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok, other=0.0)
        for g in range(GROUP):
            head = kvh * GROUP + g
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for w0 in range(0, window, BLOCK_M):
                w = w0 + offs_m
                w_ok = w < window
                q = tl.load(Q + b * stride_qb + head * stride_qh + (win_start + w)[:, None] * stride_qs
                            + offs_d[None, :], mask=w_ok[:, None] & d_ok, other=0.0)
                m = tl.load(M_IN + b * stride_sb + head * stride_sh + w, mask=w_ok, other=0.0)
                inv_l = tl.load(INV_L_IN + b * stride_sb + head * stride_sh + w, mask=w_ok, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
                p = tl.exp2(s - m[:, None]) * inv_l[:, None]  # inv_l = 0 on rows past the window
                if REDUCE_MAX:  # probabilities are >= 0, so the zero rows past the window never win
                    acc = tl.maximum(acc, tl.max(p, 0))
                else:
                    acc += tl.sum(p, 0)
            if REDUCE_MAX:
                score = tl.where(key_ok, acc, 0.0)
            else:
                score = tl.where(key_ok, acc / window, 0.0)
            tl.store(SCORES + b * stride_ob + head * stride_oh + offs_n, score, mask=store_ok)
    else:
        zero = tl.zeros([BLOCK_N], dtype=tl.float32)
        for g in range(GROUP):
            tl.store(SCORES + b * stride_ob + (kvh * GROUP + g) * stride_oh + offs_n, zero, mask=store_ok)


def _num_key_splits(seq_len: int, programs_without_split: int, block_n: int) -> int:
    """Split the key axis so that about 4 programs per SM (132 on H200) are busy, but keep at
    least 8 key blocks per split so the merge stays negligible."""
    if interpreter_active():
        return 2 if seq_len > 2 * block_n else 1
    want = max(1, 528 // max(programs_without_split, 1))
    return max(1, min(want, seq_len // (8 * block_n)))


def token_sparse_scores_triton(q, k, seq_lens, window, reduce="mean"):
    """Mean (or max) window-query attention probability of each prefix key (Triton).

    Args:
        q: ``[B, Hq, S, D]`` fp16/bf16/fp32 (post-RoPE); k: ``[B, Hkv, S, D]`` same dtype.
        seq_lens: ``[B]`` int in ``[0, S]``, valid tokens per sequence (right padding).
        window: ``W >= 1``, the number of last valid queries that vote (128 in the paper).
        reduce: ``"mean"`` (the paper's) or ``"max"`` over the voting queries.

    Returns:
        ``scores[B, Hq, S]`` fp32: for keys ``t < seq_lens[b] - W`` the mean over the window
        queries (or their max) of their causal softmax probability of ``t``; 0 for window keys and padding (all
        zeros when ``seq_lens[b] <= W``). The softmax scale is ``D ** -0.5``.
    """
    check_float_tensor("q", q, 4)
    check_float_tensor("k", k, 4, dtype=q.dtype, device=q.device)
    batch, num_q_heads, seq_total, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq_total or k.shape[3] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} must be [B={batch}, Hkv, S={seq_total}, D={head_dim}]")
    num_kv_heads = k.shape[1]
    group = check_gqa(num_q_heads, num_kv_heads)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be a positive int (the number of last queries that vote)")
    check_token_sparse_reduce(reduce)
    seq_lens = check_int_vector("seq_lens", seq_lens, batch, q.device, low=0, high=seq_total)

    scores = torch.empty((batch, num_q_heads, seq_total), device=q.device, dtype=torch.float32)
    if scores.numel() == 0:
        return scores
    qk_scale = head_dim ** -0.5 * LOG2_E
    block_d = head_dim_block(head_dim)
    precision = dot_precision(q.dtype)

    bm, bn, warps, stages = _stats_block_sizes()
    row_blocks = triton.cdiv(group * window, bm)
    splits = _num_key_splits(seq_total, row_blocks * batch * num_kv_heads, bn)
    split_len = triton.cdiv(triton.cdiv(seq_total, splits), bn) * bn
    splits = triton.cdiv(seq_total, split_len)
    part_m = torch.full((splits, batch, num_q_heads, window), float("-inf"), device=q.device, dtype=torch.float32)
    part_l = torch.zeros_like(part_m)
    _window_stats_kernel[(row_blocks, batch * num_kv_heads, splits)](
        q, k, seq_lens, part_m, part_l,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        part_m.stride(0), part_m.stride(1), part_m.stride(2),
        num_kv_heads, window, split_len, qk_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn,
        DOT_PRECISION=precision, num_warps=warps, num_stages=stages,
    )
    # merge the splits (log2 domain): m = max_z m_z, l = sum_z l_z 2^(m_z - m)
    m = part_m.amax(0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = (part_l * torch.exp2(part_m - m_safe)).sum(0)
    inv_l = torch.where(l > 0, 1.0 / l, torch.zeros_like(l)).contiguous()
    m_safe = m_safe.contiguous()

    bm, bn, warps, stages = _scores_block_sizes()
    _prefix_scores_kernel[(triton.cdiv(seq_total, bn), batch * num_kv_heads)](
        q, k, seq_lens, m_safe, inv_l, scores,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        m_safe.stride(0), m_safe.stride(1),
        scores.stride(0), scores.stride(1),
        num_kv_heads, seq_total, window, qk_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn,
        DOT_PRECISION=precision, REDUCE_MAX=reduce == "max", num_warps=warps, num_stages=stages,
    )
    return scores
