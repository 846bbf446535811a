"""POD prefill attention, forward kernel (Triton). See ``pod_prefill_attention.py`` for the method.

A program owns ``BLOCK_M`` queries of one (batch, query head) and walks the causal key blocks in
five contiguous ranges, each with a compile-time mode so that the common blocks do one ``tl.dot``
and no per-element masking (the loads stay unconditional, so the GPU compiler pipelines them):

    [0, e1)    MIXED        sink blocks: both key tensors, per-pair choice, causal mask
    [e1, e2)   DIST         every pair distant: anchor keys, no mask
    [e2, e3)   MIXED        the band where the recent window starts
    [e3, e4)   PROX         every pair proximal: own keys, no mask
    [e4, end)  PROX_MASKED  diagonal blocks, own keys, causal mask (all pairs proximal there)

The running max is shared by both kinds of pair, so one online softmax equals the LSE merge of
the two masked passes; ``l_prox`` (the proximal part of the sum) gives the gate ``l_prox / l``.

``PROX_ONLY`` computes the proximal pass alone (the distant range is skipped, distant pairs of the
mixed blocks are masked): ``kernels/pod_split_attention.py`` merges it with torch's fused causal
attention over the distant core.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._prefill_common import FLOAT32_FIRST_CANDIDATE, POD_HOPPER_CONFIGS_ENV, forward_tile_configs

MODE_PROX = 0
MODE_PROX_MASKED = 1
MODE_DIST = 2
MODE_MIXED = 3


def forward_configs():
    # sm_90 candidates opt-in for the POD kernels (kernels/_prefill_common.py, POD_HOPPER_CONFIGS_ENV)
    return forward_tile_configs(hopper_opt_in_env=POD_HOPPER_CONFIGS_ENV)


@triton.jit
def pod_block_logits(
    q, k_own_base, k_anc_base, stride_kn, stride_an, start_n, offs_n, offs_d, q_pos, kv_end, sink, recent,
    qk_scale, HEAD_DIM: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, PROX_ONLY: tl.constexpr = False,
):
    """Logits (log2 domain) of a query tile against one key block.

    q: [BLOCK_M, BLOCK_D]; returns s [BLOCK_M, BLOCK_N] (-inf where masked) and is_prox
    [BLOCK_M, BLOCK_N] (which pairs used the own keys; meaningful in MIXED mode).
    """
    key_pos = start_n + offs_n
    key_ok = key_pos < kv_end
    d_ok = offs_d[None, :] < HEAD_DIM
    if MODE == 0 or MODE == 1:
        k = tl.load(k_own_base + key_pos[:, None] * stride_kn + offs_d[None, :], mask=key_ok[:, None] & d_ok,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        is_prox = s == s
        if MODE == 1:
            s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    elif MODE == 2:
        k = tl.load(k_anc_base + key_pos[:, None] * stride_an + offs_d[None, :], mask=key_ok[:, None] & d_ok,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        is_prox = s != s
    elif PROX_ONLY:  # mixed block, proximal pairs only: the own keys, distant pairs masked
        k = tl.load(k_own_base + key_pos[:, None] * stride_kn + offs_d[None, :], mask=key_ok[:, None] & d_ok,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        is_prox = (key_pos[None, :] < sink) | ((q_pos[:, None] - key_pos[None, :]) < recent)
        s = tl.where(is_prox & (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :], s, float("-inf"))
    else:
        k_own = tl.load(k_own_base + key_pos[:, None] * stride_kn + offs_d[None, :],
                        mask=key_ok[:, None] & d_ok, other=0.0)
        k_anc = tl.load(k_anc_base + key_pos[:, None] * stride_an + offs_d[None, :],
                        mask=key_ok[:, None] & d_ok, other=0.0)
        s_own = tl.dot(q, tl.trans(k_own), input_precision=DOT_PRECISION)
        s_anc = tl.dot(q, tl.trans(k_anc), input_precision=DOT_PRECISION)
        is_prox = (key_pos[None, :] < sink) | ((q_pos[:, None] - key_pos[None, :]) < recent)
        s = tl.where(is_prox, s_own, s_anc) * qk_scale
        s = tl.where((key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :], s, float("-inf"))
    return s, is_prox


@triton.jit
def _fwd_block(
    acc, m_i, l_i, l_prox, q, k_own_base, k_anc_base, v_base, stride_kn, stride_an, stride_vn, start_n,
    offs_n, offs_d, q_pos, kv_end, sink, recent, qk_scale,
    HEAD_DIM: tl.constexpr, MODE: tl.constexpr, RETURN_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PROX_ONLY: tl.constexpr = False,
):
    s, is_prox = pod_block_logits(q, k_own_base, k_anc_base, stride_kn, stride_an, start_n, offs_n, offs_d,
                                  q_pos, kv_end, sink, recent, qk_scale, HEAD_DIM, MODE, DOT_PRECISION, PROX_ONLY)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if RETURN_GATE:
        if MODE == 0 or MODE == 1:
            l_prox = l_prox * alpha + tl.sum(p, 1)
        elif MODE == 2:
            l_prox = l_prox * alpha
        else:
            l_prox = l_prox * alpha + tl.sum(tl.where(is_prox, p, 0.0), 1)
    key_pos = start_n + offs_n
    v = tl.load(v_base + key_pos[:, None] * stride_vn + offs_d[None, :],
                mask=(key_pos[:, None] < kv_end) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    # P @ V accumulates into the rescaled accumulator inside the MMA (kernels/triton_prefill_attention.py)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i, l_prox


@triton.jit
def pod_key_ranges(first_q, last_q, kv_end, sink, recent, BLOCK_N: tl.constexpr):
    """Block-aligned boundaries e1..e4 of the five key ranges for queries [first_q, last_q]
    (keys < kv_end). See the module docstring."""
    end = tl.cdiv(kv_end, BLOCK_N) * BLOCK_N
    e1 = tl.minimum(tl.cdiv(sink, BLOCK_N) * BLOCK_N, end)
    # pure distant: j0 >= sink and j0 + BLOCK_N - 1 <= first_q - recent
    dist_end = tl.maximum(first_q - recent + 1, 0) // BLOCK_N * BLOCK_N
    e2 = tl.minimum(tl.maximum(dist_end, e1), end)
    # pure proximal: last_q - j0 < recent
    prox_start = tl.cdiv(tl.maximum(last_q - recent + 1, 0), BLOCK_N) * BLOCK_N
    e3 = tl.minimum(tl.maximum(prox_start, e2), end)
    # no causal mask needed: j0 + BLOCK_N - 1 <= first_q
    full_end = (first_q + 1) // BLOCK_N * BLOCK_N
    e4 = tl.minimum(tl.maximum(full_end, e3), end)
    return e1, e2, e3, e4, end


@triton.autotune(configs=forward_configs(), key=["HEAD_DIM", "GROUP", "RETURN_GATE", "PROX_ONLY"],
                 prune_configs_by=FLOAT32_FIRST_CANDIDATE)
@triton.jit
def pod_forward_kernel(
    Q, K_OWN, K_ANC, V, SEQ_LENS, OUT, LSE2, GATE,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kn,
    stride_ab, stride_ah, stride_an,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    num_q_heads, seq_total, sink, recent, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RETURN_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr, PROX_ONLY: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = pid_bh % num_q_heads
    kvh = h // GROUP
    seq_len = tl.load(SEQ_LENS + b)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    row_ok = offs_m < seq_len
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None] & d_ok, other=0.0)
    k_own_base = K_OWN + b * stride_kb + kvh * stride_kh
    k_anc_base = K_ANC + b * stride_ab + kvh * stride_ah
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    l_prox = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    first_q = pid_m * BLOCK_M
    last_q = tl.minimum(first_q + BLOCK_M, seq_len) - 1
    kv_end = tl.where(first_q < seq_len, last_q + 1, 0)  # a block of padding rows reads no key
    e1, e2, e3, e4, end = pod_key_ranges(first_q, last_q, kv_end, sink, recent, BLOCK_N)
    for start_n in range(0, e1, BLOCK_N):
        acc, m_i, l_i, l_prox = _fwd_block(acc, m_i, l_i, l_prox, q, k_own_base, k_anc_base, v_base, stride_kn,
                                           stride_an, stride_vn, start_n, offs_n, offs_d, offs_m, kv_end, sink,
                                           recent, qk_scale, HEAD_DIM, 3, RETURN_GATE, DOT_PRECISION, PROX_ONLY)
    if not PROX_ONLY:
        for start_n in range(e1, e2, BLOCK_N):
            acc, m_i, l_i, l_prox = _fwd_block(acc, m_i, l_i, l_prox, q, k_own_base, k_anc_base, v_base, stride_kn,
                                               stride_an, stride_vn, start_n, offs_n, offs_d, offs_m, kv_end, sink,
                                               recent, qk_scale, HEAD_DIM, 2, RETURN_GATE, DOT_PRECISION)
    for start_n in range(e2, e3, BLOCK_N):
        acc, m_i, l_i, l_prox = _fwd_block(acc, m_i, l_i, l_prox, q, k_own_base, k_anc_base, v_base, stride_kn,
                                           stride_an, stride_vn, start_n, offs_n, offs_d, offs_m, kv_end, sink,
                                           recent, qk_scale, HEAD_DIM, 3, RETURN_GATE, DOT_PRECISION, PROX_ONLY)
    for start_n in range(e3, e4, BLOCK_N):
        acc, m_i, l_i, l_prox = _fwd_block(acc, m_i, l_i, l_prox, q, k_own_base, k_anc_base, v_base, stride_kn,
                                           stride_an, stride_vn, start_n, offs_n, offs_d, offs_m, kv_end, sink,
                                           recent, qk_scale, HEAD_DIM, 0, RETURN_GATE, DOT_PRECISION)
    for start_n in range(e4, end, BLOCK_N):
        acc, m_i, l_i, l_prox = _fwd_block(acc, m_i, l_i, l_prox, q, k_own_base, k_anc_base, v_base, stride_kn,
                                           stride_an, stride_vn, start_n, offs_n, offs_d, offs_m, kv_end, sink,
                                           recent, qk_scale, HEAD_DIM, 1, RETURN_GATE, DOT_PRECISION)

    l_safe = tl.where(row_ok & (l_i > 0), l_i, 1.0)
    out = tl.where(row_ok[:, None], acc / l_safe[:, None], 0.0)
    store_rows = offs_m < seq_total
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=store_rows[:, None] & d_ok)
    # log2-domain LSE for the backward; +inf on padding rows makes their probabilities exactly 0
    lse2 = tl.where(row_ok, m_i + tl.log2(l_safe), float("inf"))
    tl.store(LSE2 + b * stride_lb + h * stride_lh + offs_m, lse2, mask=store_rows)
    if RETURN_GATE:
        gate = tl.where(row_ok, l_prox / l_safe, 0.0)
        tl.store(GATE + b * stride_lb + h * stride_lh + offs_m, gate, mask=store_rows)
