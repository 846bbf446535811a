"""POD prefill attention, backward kernels (Triton): FlashAttention-2 style recomputation.

With ``P`` recomputed from the forward's log2-domain LSE and ``delta_i = rowsum(dO_i * O_i)``:
``dS = P * (dO V^T - delta)``, ``dV = P^T dO``, ``dQ = scale * (dS_P K_own + dS_D K_anchor)``,
``dK_own = scale * dS_P^T Q``, ``dK_anchor = scale * dS_D^T Q`` where ``dS_P`` / ``dS_D`` keep the
proximal / distant pairs of ``dS``.

``pod_dkdv_kernel``: a program owns ``BLOCK_N`` keys of one KV head and visits the query blocks
of its ``G`` query heads in two phases so that only two fp32 accumulators are live at a time:
phase 1 (``dK_own`` + ``dV``) over the query blocks with any proximal pair, phase 2
(``dK_anchor``, plus ``dV`` of the purely distant blocks) over those with any distant pair.
Blocks with both kinds of pair (the sink column, the band where the recent window starts, the
diagonal) are computed in both phases; ``dV`` counts them in phase 1 only.

``pod_dq_kernel``: a program owns ``BLOCK_M`` queries and walks the same five key ranges as the
forward (``pod_key_ranges``).

``PROX_ONLY``: gradients of the proximal pairs alone (phase 2 and the distant key range skipped, distant
pairs of mixed blocks masked; ``DK_ANC`` is not written), with ``LSE2`` / ``DELTA`` of the *merged*
attention so that ``P`` is each pair's share of the whole softmax (``kernels/pod_split_attention.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._prefill_common import FLOAT32_FIRST_CANDIDATE, POD_HOPPER_CONFIGS_ENV, pick_configs
from ._prefill_pod_fwd import pod_key_ranges


def dkdv_configs():
    return pick_configs([
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    ], triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1), hopper_configs=[
        # sm_90 (Triton's fused-attention tutorial: dK/dV over 32-query x 128-key tiles, 4 warps, 5 stages)
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4, num_stages=5),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=5),
    ], hopper_opt_in_env=POD_HOPPER_CONFIGS_ENV)  # kernels/_prefill_common.py says why


def dq_configs():
    return pick_configs([
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    ], triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1), hopper_configs=[
        # sm_90 (the tutorial's dQ tiles: 128 queries x 32 keys, 4 warps, 5 stages)
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=5),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=5),
    ], hopper_opt_in_env=POD_HOPPER_CONFIGS_ENV)  # kernels/_prefill_common.py says why


@triton.jit
def pod_delta_kernel(OUT, DOUT, DELTA, stride_ob, stride_oh, stride_os, stride_db, stride_dh, stride_ds,
                     stride_lb, stride_lh, num_q_heads, seq_total,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d out[b, h, i, d] * dout[b, h, i, d] in fp32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = pid_bh % num_q_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seq_total) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    do = tl.load(DOUT + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    tl.store(DELTA + b * stride_lb + h * stride_lh + offs_m, tl.sum(o * do, 1), mask=offs_m < seq_total)


@triton.jit
def _dkdv_block(
    dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, start_m, offs_m,
    offs_d, key_pos, seq_total, sink, recent, qk_scale,
    HEAD_DIM: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, PROX_ONLY: tl.constexpr = False,
):
    """One query block against the program's key block, transposed: rows are keys.

    MODE 0: all pairs proximal (own keys; dk is dK_own; dv accumulated).
    MODE 2: all pairs distant (anchor keys; dk is dK_anchor; dv accumulated).
    MODE 3: mixed, phase 1 (dk is dK_own, proximal pairs only; dv accumulated), causal mask.
    MODE 4: mixed, phase 2 (dk is dK_anchor, distant pairs only; dv not accumulated), causal mask.
    """
    q_pos = start_m + offs_m
    rows_ok = q_pos < seq_total
    mask = rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + q_pos[:, None] * stride_qs + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(do_base + q_pos[:, None] * stride_ds + offs_d[None, :], mask=mask, other=0.0)
    lse2 = tl.load(lse_base + q_pos, mask=rows_ok, other=float("inf"))
    delta = tl.load(delta_base + q_pos, mask=rows_ok, other=0.0)
    if MODE == 0:
        s_t = tl.dot(k_own, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        take = s_t == s_t
    elif MODE == 2:
        s_t = tl.dot(k_anc, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        take = s_t == s_t
    elif PROX_ONLY:  # MODE 3 with the distant pairs masked out of P (so out of dV too)
        s_t = tl.dot(k_own, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        is_prox = (key_pos[:, None] < sink) | ((q_pos[None, :] - key_pos[:, None]) < recent)
        s_t = tl.where(is_prox & (key_pos[:, None] <= q_pos[None, :]), s_t, float("-inf"))
        take = is_prox
    else:
        s_own = tl.dot(k_own, tl.trans(q), input_precision=DOT_PRECISION)
        s_anc = tl.dot(k_anc, tl.trans(q), input_precision=DOT_PRECISION)
        is_prox = (key_pos[:, None] < sink) | ((q_pos[None, :] - key_pos[:, None]) < recent)
        s_t = tl.where(is_prox, s_own, s_anc) * qk_scale
        s_t = tl.where(key_pos[:, None] <= q_pos[None, :], s_t, float("-inf"))
        if MODE == 3:
            take = is_prox
        else:
            take = ~is_prox
    p_t = tl.exp2(s_t - lse2[None, :])  # [BLOCK_N, BLOCK_M]; 0 on masked pairs and padding rows
    if MODE != 4:
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if (MODE == 3 or MODE == 4) and not PROX_ONLY:
        ds_t = tl.where(take, ds_t, 0.0)
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=dkdv_configs(), key=["HEAD_DIM", "GROUP", "PROX_ONLY"], prune_configs_by=FLOAT32_FIRST_CANDIDATE)
@triton.jit
def pod_dkdv_kernel(
    Q, K_OWN, K_ANC, V, DOUT, LSE2, DELTA, SEQ_LENS, DK_OWN, DK_ANC, DV,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kn,
    stride_ab, stride_ah, stride_an,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_ds,
    stride_lb, stride_lh,
    stride_gb, stride_gh, stride_gn,
    num_kv_heads, seq_total, sink, recent, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PROX_ONLY: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    seq_len = tl.load(SEQ_LENS + b)

    j0 = pid_n * BLOCK_N
    j1 = j0 + BLOCK_N - 1
    key_pos = j0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kmask = (key_pos[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM)
    k_own = tl.load(K_OWN + b * stride_kb + kvh * stride_kh + key_pos[:, None] * stride_kn + offs_d[None, :],
                    mask=kmask, other=0.0)
    k_anc = tl.load(K_ANC + b * stride_ab + kvh * stride_ah + key_pos[:, None] * stride_an + offs_d[None, :],
                    mask=kmask, other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + key_pos[:, None] * stride_vn + offs_d[None, :],
                mask=kmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # query-block boundaries (multiples of BLOCK_M); see the module docstring
    q_end = tl.cdiv(seq_len, BLOCK_M) * BLOCK_M
    q_start = tl.minimum(j0 // BLOCK_M * BLOCK_M, q_end)
    all_sink = j1 < sink
    if all_sink or j0 < sink:
        p1_end = q_end
    else:
        p1_end = tl.minimum(tl.maximum(tl.cdiv(j1 + recent, BLOCK_M) * BLOCK_M, q_start), q_end)
    m1 = tl.minimum(tl.maximum(tl.cdiv(j1, BLOCK_M) * BLOCK_M, q_start), p1_end)  # no causal mask from m1 on
    if all_sink:
        pp = p1_end
    else:
        pp = tl.minimum(tl.maximum((j0 + recent) // BLOCK_M * BLOCK_M, m1), p1_end)  # pure proximal before pp

    for g in range(GROUP):
        h = kvh * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DOUT + b * stride_db + h * stride_dh
        lse_base = LSE2 + b * stride_lb + h * stride_lh
        delta_base = DELTA + b * stride_lb + h * stride_lh
        for start_m in range(q_start, m1, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, stride_qs,
                                 stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent, qk_scale,
                                 HEAD_DIM, 3, DOT_PRECISION, PROX_ONLY)
        for start_m in range(m1, pp, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, stride_qs,
                                 stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent, qk_scale,
                                 HEAD_DIM, 0, DOT_PRECISION)
        for start_m in range(pp, p1_end, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, stride_qs,
                                 stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent, qk_scale,
                                 HEAD_DIM, 3, DOT_PRECISION, PROX_ONLY)
    out_off = b * stride_gb + kvh * stride_gh + key_pos[:, None] * stride_gn + offs_d[None, :]
    out_mask = (key_pos[:, None] < seq_total) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK_OWN + out_off, (dk * sm_scale).to(DK_OWN.dtype.element_ty), mask=out_mask)
    if PROX_ONLY:
        tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=out_mask)
        return

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if all_sink:
        p2_start = q_end
        pd_start = q_end
    else:
        j0_distant = tl.maximum(j0, sink)
        p2_start = tl.cdiv(tl.maximum(j0_distant + recent - BLOCK_M + 1, 0), BLOCK_M) * BLOCK_M
        p2_start = tl.minimum(tl.maximum(p2_start, q_start), q_end)
        if j0 < sink:
            pd_start = q_end
        else:
            pd_start = tl.minimum(tl.maximum(tl.cdiv(j1 + recent, BLOCK_M) * BLOCK_M, p2_start), q_end)
    for g in range(GROUP):
        h = kvh * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DOUT + b * stride_db + h * stride_dh
        lse_base = LSE2 + b * stride_lb + h * stride_lh
        delta_base = DELTA + b * stride_lb + h * stride_lh
        for start_m in range(p2_start, pd_start, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, stride_qs,
                                 stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent, qk_scale,
                                 HEAD_DIM, 4, DOT_PRECISION)
        for start_m in range(pd_start, q_end, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, stride_qs,
                                 stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent, qk_scale,
                                 HEAD_DIM, 2, DOT_PRECISION)
    tl.store(DK_ANC + out_off, (dk * sm_scale).to(DK_ANC.dtype.element_ty), mask=out_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _dq_block(
    dq, q, do, lse2, delta, k_own_base, k_anc_base, v_base, stride_kn, stride_an, stride_vn, start_n, offs_n,
    offs_d, q_pos, kv_end, sink, recent, qk_scale,
    HEAD_DIM: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, PROX_ONLY: tl.constexpr = False,
):
    """One key block for a query tile (modes as in the forward's five ranges)."""
    key_pos = start_n + offs_n
    kmask = (key_pos[:, None] < kv_end) & (offs_d[None, :] < HEAD_DIM)
    if MODE == 0 or MODE == 1:
        k_a = tl.load(k_own_base + key_pos[:, None] * stride_kn + offs_d[None, :], mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k_a), input_precision=DOT_PRECISION) * qk_scale
        if MODE == 1:
            s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        k_b = k_a
        is_prox = s == s
    elif MODE == 2:
        k_a = tl.load(k_anc_base + key_pos[:, None] * stride_an + offs_d[None, :], mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k_a), input_precision=DOT_PRECISION) * qk_scale
        k_b = k_a
        is_prox = s == s
    elif PROX_ONLY:  # MODE 3, distant pairs masked out of P: only the own keys take part
        k_a = tl.load(k_own_base + key_pos[:, None] * stride_kn + offs_d[None, :], mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k_a), input_precision=DOT_PRECISION) * qk_scale
        is_prox = (key_pos[None, :] < sink) | ((q_pos[:, None] - key_pos[None, :]) < recent)
        s = tl.where(is_prox & (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < kv_end), s, float("-inf"))
        k_b = k_a
    else:
        k_a = tl.load(k_own_base + key_pos[:, None] * stride_kn + offs_d[None, :], mask=kmask, other=0.0)
        k_b = tl.load(k_anc_base + key_pos[:, None] * stride_an + offs_d[None, :], mask=kmask, other=0.0)
        s_own = tl.dot(q, tl.trans(k_a), input_precision=DOT_PRECISION)
        s_anc = tl.dot(q, tl.trans(k_b), input_precision=DOT_PRECISION)
        is_prox = (key_pos[None, :] < sink) | ((q_pos[:, None] - key_pos[None, :]) < recent)
        s = tl.where(is_prox, s_own, s_anc) * qk_scale
        s = tl.where((key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < kv_end), s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    v = tl.load(v_base + key_pos[:, None] * stride_vn + offs_d[None, :], mask=kmask, other=0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if MODE == 3 and not PROX_ONLY:
        dq += tl.dot(tl.where(is_prox, ds, 0.0).to(q.dtype), k_a, input_precision=DOT_PRECISION)
        dq += tl.dot(tl.where(is_prox, 0.0, ds).to(q.dtype), k_b, input_precision=DOT_PRECISION)
    else:
        dq += tl.dot(ds.to(q.dtype), k_a, input_precision=DOT_PRECISION)
    return dq


@triton.autotune(configs=dq_configs(), key=["HEAD_DIM", "GROUP", "PROX_ONLY"], prune_configs_by=FLOAT32_FIRST_CANDIDATE)
@triton.jit
def pod_dq_kernel(
    Q, K_OWN, K_ANC, V, DOUT, LSE2, DELTA, SEQ_LENS, DQ,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kn,
    stride_ab, stride_ah, stride_an,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_ds,
    stride_lb, stride_lh,
    stride_gb, stride_gh, stride_gs,
    num_q_heads, seq_total, sink, recent, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PROX_ONLY: tl.constexpr = False,
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
    rows_ok = offs_m < seq_total
    mask = rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=mask,
                other=0.0)
    do = tl.load(DOUT + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :], mask=mask,
                 other=0.0)
    lse2 = tl.load(LSE2 + b * stride_lb + h * stride_lh + offs_m, mask=rows_ok, other=float("inf"))
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + offs_m, mask=rows_ok, other=0.0)
    k_own_base = K_OWN + b * stride_kb + kvh * stride_kh
    k_anc_base = K_ANC + b * stride_ab + kvh * stride_ah
    v_base = V + b * stride_vb + kvh * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    first_q = pid_m * BLOCK_M
    last_q = tl.minimum(first_q + BLOCK_M, seq_len) - 1
    kv_end = tl.where(first_q < seq_len, last_q + 1, 0)
    e1, e2, e3, e4, end = pod_key_ranges(first_q, last_q, kv_end, sink, recent, BLOCK_N)
    for start_n in range(0, e1, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_own_base, k_anc_base, v_base, stride_kn, stride_an, stride_vn,
                       start_n, offs_n, offs_d, offs_m, kv_end, sink, recent, qk_scale, HEAD_DIM, 3, DOT_PRECISION,
                       PROX_ONLY)
    if not PROX_ONLY:
        for start_n in range(e1, e2, BLOCK_N):
            dq = _dq_block(dq, q, do, lse2, delta, k_own_base, k_anc_base, v_base, stride_kn, stride_an, stride_vn,
                           start_n, offs_n, offs_d, offs_m, kv_end, sink, recent, qk_scale, HEAD_DIM, 2,
                           DOT_PRECISION)
    for start_n in range(e2, e3, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_own_base, k_anc_base, v_base, stride_kn, stride_an, stride_vn,
                       start_n, offs_n, offs_d, offs_m, kv_end, sink, recent, qk_scale, HEAD_DIM, 3, DOT_PRECISION,
                       PROX_ONLY)
    for start_n in range(e3, e4, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_own_base, k_anc_base, v_base, stride_kn, stride_an, stride_vn,
                       start_n, offs_n, offs_d, offs_m, kv_end, sink, recent, qk_scale, HEAD_DIM, 0, DOT_PRECISION)
    for start_n in range(e4, end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_own_base, k_anc_base, v_base, stride_kn, stride_an, stride_vn,
                       start_n, offs_n, offs_d, offs_m, kv_end, sink, recent, qk_scale, HEAD_DIM, 1, DOT_PRECISION)
    tl.store(DQ + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=mask)
