"""Dense causal prefill inner-loop variants, for one A/B run on an H200 (issue 13, dense prefill <= 1.05x SDPA).

Each variant is the FlashAttention-2 forward of kernels/triton_prefill_attention.py (fresh causal prefill: every
query offset 0, kv_len = S; GQA native) with one change to the inner loop:

- ``fma``:  the Triton fused-attention tutorial's arithmetic: the softmax scale folded into the max subtraction
            (one FMA per logit instead of a multiply then a subtract) and the P @ V product accumulated into the
            rescaled accumulator by the MMA itself (``tl.dot(p, v, acc)``) instead of a separate add.
- ``tma``:  ``fma`` with K/V (and Q/O) moved by host-built TMA tensor descriptors (the tutorial's Hopper path).
- ``pipe``: ``fma`` with the next key block's Q K^T issued before the current block's softmax (FlashAttention-3
            §3.2's intra-warpgroup overlap, written out in the source so the async wgmma can run under the exp2s).
- ``pair``: ``fma`` with two query sub-blocks per program sharing each K/V tile (two independent softmax chains
            the scheduler can interleave: one's exp2s under the other's wgmma, the ping-pong of FA3 §3.1 inside
            one program).
- ``ws``:   ``tma`` with Triton's automatic warp specialisation on the unmasked key loop
            (``tl.range(..., warp_specialize=True)``: the compiler splits the loop into a TMA-load partition and
            MMA / softmax partitions, FA3 §3.1's producer-consumer split). Added in the session after the first four
            were measured; the Triton tutorial enables it on Blackwell only, so whether Triton 3.6 partitions this
            loop on sm_90 at all is part of the question.
- ``wsm``:  ``ws`` with the masked diagonal blocks in a warp-specialised loop too.

Not part of the package: the winner, if any, moves into kernels/triton_prefill_attention.py with its tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def _softmax_step(acc, m_i, l_i, qk, v, q_pos, key_pos, qk_scale, MASKED: tl.constexpr):
    if MASKED:
        qk = tl.where(key_pos[None, :] <= q_pos[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _fwd_fma(Q, K, V, OUT, S, H, GROUP: tl.constexpr, qk_scale, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPE: tl.constexpr):
    # q/out [B, H, S, D], k/v [B, H // GROUP, S, D], contiguous
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // GROUP
    hkv = H // GROUP
    q_base = Q + ((b * H + h) * S).to(tl.int64) * D
    k_base = K + ((b * hkv + kvh) * S).to(tl.int64) * D
    v_base = V + ((b * hkv + kvh) * S).to(tl.int64) * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_base + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < S, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    full_end = (pid_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    last = tl.minimum((pid_m + 1) * BLOCK_M, S)
    k_ptrs = k_base + offs_n[:, None] * D + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * D + offs_d[None, :]
    if PIPE:
        if full_end > 0:
            k = tl.load(k_ptrs)
            qk = tl.dot(q, tl.trans(k))
            for start_n in range(BLOCK_N, full_end, BLOCK_N):
                k_next = tl.load(k_ptrs + start_n * D)
                qk_next = tl.dot(q, tl.trans(k_next))
                v = tl.load(v_ptrs + (start_n - BLOCK_N) * D)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, offs_m, offs_n, qk_scale, False)
                qk = qk_next
            v = tl.load(v_ptrs + (full_end - BLOCK_N) * D)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, offs_m, offs_n, qk_scale, False)
    else:
        for start_n in range(0, full_end, BLOCK_N):
            k = tl.load(k_ptrs + start_n * D)
            qk = tl.dot(q, tl.trans(k))
            v = tl.load(v_ptrs + start_n * D)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, offs_m, offs_n, qk_scale, False)
    for start_n in range(full_end, last, BLOCK_N):
        key_pos = start_n + offs_n
        k = tl.load(k_ptrs + start_n * D, mask=key_pos[:, None] < S, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        v = tl.load(v_ptrs + start_n * D, mask=key_pos[:, None] < S, other=0.0)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, offs_m, key_pos, qk_scale, True)
    out = acc / l_i[:, None]
    tl.store(OUT + ((b * H + h) * S).to(tl.int64) * D + offs_m[:, None] * D + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=offs_m[:, None] < S)


@triton.jit
def _fwd_pair(Q, K, V, OUT, S, H, GROUP: tl.constexpr, qk_scale, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # two query sub-blocks of BLOCK_M rows (rows [2 m BLOCK_M, 2 (m + 1) BLOCK_M)) per program, one K/V stream
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // GROUP
    hkv = H // GROUP
    q_base = Q + ((b * H + h) * S).to(tl.int64) * D
    k_base = K + ((b * hkv + kvh) * S).to(tl.int64) * D
    v_base = V + ((b * hkv + kvh) * S).to(tl.int64) * D
    offs_a = pid_m * 2 * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_b = offs_a + BLOCK_M
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    qa = tl.load(q_base + offs_a[:, None] * D + offs_d[None, :], mask=offs_a[:, None] < S, other=0.0)
    qb = tl.load(q_base + offs_b[:, None] * D + offs_d[None, :], mask=offs_b[:, None] < S, other=0.0)
    ma = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    la = tl.zeros([BLOCK_M], dtype=tl.float32)
    acca = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    mb = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lb = tl.zeros([BLOCK_M], dtype=tl.float32)
    accb = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    first = pid_m * 2 * BLOCK_M
    full_end = (first + 1) // BLOCK_N * BLOCK_N  # visible to every row of both sub-blocks
    k_ptrs = k_base + offs_n[:, None] * D + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * D + offs_d[None, :]
    for start_n in range(0, full_end, BLOCK_N):
        k = tl.load(k_ptrs + start_n * D)
        v = tl.load(v_ptrs + start_n * D)
        kt = tl.trans(k)
        qka = tl.dot(qa, kt)
        qkb = tl.dot(qb, kt)
        acca, ma, la = _softmax_step(acca, ma, la, qka, v, offs_a, offs_n, qk_scale, False)
        accb, mb, lb = _softmax_step(accb, mb, lb, qkb, v, offs_b, offs_n, qk_scale, False)
    # the diagonal region: sub-block a ends at first + BLOCK_M, b at first + 2 BLOCK_M (masked, per sub-block)
    last_a = tl.minimum(first + BLOCK_M, S)
    last_b = tl.minimum(first + 2 * BLOCK_M, S)
    for start_n in range(full_end, last_a, BLOCK_N):
        key_pos = start_n + offs_n
        k = tl.load(k_ptrs + start_n * D, mask=key_pos[:, None] < S, other=0.0)
        v = tl.load(v_ptrs + start_n * D, mask=key_pos[:, None] < S, other=0.0)
        kt = tl.trans(k)
        acca, ma, la = _softmax_step(acca, ma, la, tl.dot(qa, kt), v, offs_a, key_pos, qk_scale, True)
        accb, mb, lb = _softmax_step(accb, mb, lb, tl.dot(qb, kt), v, offs_b, key_pos, qk_scale, True)
    for start_n in range(last_a, last_b, BLOCK_N):  # BLOCK_M % BLOCK_N == 0: last_a is a block start
        key_pos = start_n + offs_n
        k = tl.load(k_ptrs + start_n * D, mask=key_pos[:, None] < S, other=0.0)
        v = tl.load(v_ptrs + start_n * D, mask=key_pos[:, None] < S, other=0.0)
        accb, mb, lb = _softmax_step(accb, mb, lb, tl.dot(qb, tl.trans(k)), v, offs_b, key_pos, qk_scale, True)
    out_base = OUT + ((b * H + h) * S).to(tl.int64) * D
    tl.store(out_base + offs_a[:, None] * D + offs_d[None, :], (acca / la[:, None]).to(OUT.dtype.element_ty),
             mask=offs_a[:, None] < S)
    tl.store(out_base + offs_b[:, None] * D + offs_d[None, :], (accb / lb[:, None]).to(OUT.dtype.element_ty),
             mask=offs_b[:, None] < S)


@triton.jit
def _fwd_tma(desc_q, desc_k, desc_v, desc_o, S, H, GROUP: tl.constexpr, qk_scale, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr = False, WS_MASKED: tl.constexpr = False):
    # descriptors over the 2-D views q/out [B*H*S, D], k/v [B*Hkv*S, D]; S a multiple of BLOCK_M and BLOCK_N
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // GROUP
    hkv = H // GROUP
    q_row = (b * H + h) * S + pid_m * BLOCK_M
    kv_row = (b * hkv + kvh) * S
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([q_row, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    full_end = (pid_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    last = (pid_m + 1) * BLOCK_M
    for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([kv_row + start_n, 0])
        qk = tl.dot(q, tl.trans(k))
        v = desc_v.load([kv_row + start_n, 0])
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, offs_m, offs_n, qk_scale, False)
    for start_n in tl.range(full_end, last, BLOCK_N, warp_specialize=WS_MASKED):
        k = desc_k.load([kv_row + start_n, 0])
        qk = tl.dot(q, tl.trans(k))
        v = desc_v.load([kv_row + start_n, 0])
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, offs_m, start_n + offs_n, qk_scale, True)
    desc_o.store([q_row, 0], (acc / l_i[:, None]).to(desc_o.dtype))


def dense_prefill_variant(name, q, k, v, *, block_m, block_n, num_warps, num_stages):
    """Fresh causal prefill: q [B, H, S, D], k/v [B, Hkv, S, D] contiguous, same dtype -> out [B, H, S, D]."""
    batch, heads, seq, dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty_like(q)
    scale = dim ** -0.5 * LOG2_E
    if name in ("fma", "pipe"):
        grid = (batch * heads, triton.cdiv(seq, block_m))
        _fwd_fma[grid](q, k, v, out, seq, heads, group, scale, dim, block_m, block_n, name == "pipe",
                       num_warps=num_warps, num_stages=num_stages)
    elif name == "pair":
        if block_m % block_n:
            raise ValueError(f"pair variant needs BLOCK_M={block_m} to be a multiple of BLOCK_N={block_n}")
        grid = (batch * heads, triton.cdiv(seq, 2 * block_m))
        _fwd_pair[grid](q, k, v, out, seq, heads, group, scale, dim, block_m, block_n,
                        num_warps=num_warps, num_stages=num_stages)
    elif name in ("tma", "ws", "wsm"):
        from triton.tools.tensor_descriptor import TensorDescriptor

        if seq % block_m or seq % block_n:
            raise ValueError(f"tma variant needs S={seq} to be a multiple of the blocks")
        q2, o2 = q.view(-1, dim), out.view(-1, dim)
        k2, v2 = k.reshape(-1, dim), v.reshape(-1, dim)
        desc_q = TensorDescriptor.from_tensor(q2, [block_m, dim])
        desc_o = TensorDescriptor.from_tensor(o2, [block_m, dim])
        desc_k = TensorDescriptor.from_tensor(k2, [block_n, dim])
        desc_v = TensorDescriptor.from_tensor(v2, [block_n, dim])
        grid = (batch * heads, seq // block_m)
        _fwd_tma[grid](desc_q, desc_k, desc_v, desc_o, seq, heads, group, scale, dim, block_m, block_n,
                       name in ("ws", "wsm"), name == "wsm", num_warps=num_warps, num_stages=num_stages)
    else:
        raise ValueError(f"variant {name!r}; allowed: fma, pipe, pair, tma, ws, wsm")
    return out
