"""Experiment: POD dK/dV kernel that also forms dQ (atomic adds into an fp32 buffer): 5 matmuls per block
instead of 4 + 3 (dkdv + a separate dq kernel). DQ_MODE 0: tl.atomic_add on pointers (relaxed);
DQ_MODE 1: TMA reduce-add through an on-device tensor descriptor (sm_90)."""
import triton
import triton.language as tl


@triton.jit
def _blk(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc, stride_qs, stride_ds,
         start_m, offs_m, offs_d, key_pos, seq_total, sink, recent, qk_scale, sm_scale,
         HEAD_DIM: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, DQ_MODE: tl.constexpr):
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
    p_t = tl.exp2(s_t - lse2[None, :])
    if MODE != 4:
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if MODE == 3 or MODE == 4:
        ds_t = tl.where(take, ds_t, 0.0)
    ds_lo = ds_t.to(q.dtype)
    dk += tl.dot(ds_lo, q, input_precision=DOT_PRECISION)
    if MODE == 0 or MODE == 3:
        dq = tl.dot(tl.trans(ds_lo), k_own, input_precision=DOT_PRECISION) * sm_scale
    else:
        dq = tl.dot(tl.trans(ds_lo), k_anc, input_precision=DOT_PRECISION) * sm_scale
    if DQ_MODE == 0:
        tl.atomic_add(dq_base + q_pos[:, None] * HEAD_DIM + offs_d[None, :], dq, mask=mask, sem="relaxed")
    else:
        dq_desc.atomic_add([start_m, 0], dq)
    return dk, dv


def fused_configs():
    return [
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    ]


def make_kernel(configs):
    @triton.autotune(configs=configs, key=["HEAD_DIM", "GROUP", "DQ_MODE"], reset_to_zero=["DQ"])
    @triton.jit
    def pod_dkdv_dq_kernel(
        Q, K_OWN, K_ANC, V, DOUT, LSE2, DELTA, SEQ_LENS, DK_OWN, DK_ANC, DV, DQ,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_kn, stride_ab, stride_ah, stride_an,
        stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_ds, stride_lb, stride_lh,
        stride_gb, stride_gh, stride_gn,
        num_kv_heads, seq_total, sink, recent, qk_scale, sm_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DQ_MODE: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // num_kv_heads).to(tl.int64)
        kvh = pid_bh % num_kv_heads
        seq_len = tl.load(SEQ_LENS + b)
        num_q_heads = num_kv_heads * GROUP
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
        q_end = tl.cdiv(seq_len, BLOCK_M) * BLOCK_M
        q_start = tl.minimum(j0 // BLOCK_M * BLOCK_M, q_end)
        all_sink = j1 < sink
        if all_sink or j0 < sink:
            p1_end = q_end
        else:
            p1_end = tl.minimum(tl.maximum(tl.cdiv(j1 + recent, BLOCK_M) * BLOCK_M, q_start), q_end)
        m1 = tl.minimum(tl.maximum(tl.cdiv(j1, BLOCK_M) * BLOCK_M, q_start), p1_end)
        if all_sink:
            pp = p1_end
        else:
            pp = tl.minimum(tl.maximum((j0 + recent) // BLOCK_M * BLOCK_M, m1), p1_end)
        for g in range(GROUP):
            h = kvh * GROUP + g
            q_base = Q + b * stride_qb + h * stride_qh
            do_base = DOUT + b * stride_db + h * stride_dh
            lse_base = LSE2 + b * stride_lb + h * stride_lh
            delta_base = DELTA + b * stride_lb + h * stride_lh
            dq_base = DQ + (b * num_q_heads + h) * seq_total * HEAD_DIM
            if DQ_MODE == 1:
                dq_desc = tl.make_tensor_descriptor(dq_base, shape=[seq_total, HEAD_DIM], strides=[HEAD_DIM, 1],
                                                    block_shape=[BLOCK_M, BLOCK_D])
            else:
                dq_desc = dq_base
            for start_m in range(q_start, m1, BLOCK_M):
                dk, dv = _blk(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
                              stride_qs, stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent,
                              qk_scale, sm_scale, HEAD_DIM, 3, DOT_PRECISION, DQ_MODE)
            for start_m in range(m1, pp, BLOCK_M):
                dk, dv = _blk(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
                              stride_qs, stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent,
                              qk_scale, sm_scale, HEAD_DIM, 0, DOT_PRECISION, DQ_MODE)
            for start_m in range(pp, p1_end, BLOCK_M):
                dk, dv = _blk(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
                              stride_qs, stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent,
                              qk_scale, sm_scale, HEAD_DIM, 3, DOT_PRECISION, DQ_MODE)
        out_off = b * stride_gb + kvh * stride_gh + key_pos[:, None] * stride_gn + offs_d[None, :]
        out_mask = (key_pos[:, None] < seq_total) & (offs_d[None, :] < HEAD_DIM)
        tl.store(DK_OWN + out_off, (dk * sm_scale).to(DK_OWN.dtype.element_ty), mask=out_mask)
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
            dq_base = DQ + (b * num_q_heads + h) * seq_total * HEAD_DIM
            if DQ_MODE == 1:
                dq_desc = tl.make_tensor_descriptor(dq_base, shape=[seq_total, HEAD_DIM], strides=[HEAD_DIM, 1],
                                                    block_shape=[BLOCK_M, BLOCK_D])
            else:
                dq_desc = dq_base
            for start_m in range(p2_start, pd_start, BLOCK_M):
                dk, dv = _blk(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
                              stride_qs, stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent,
                              qk_scale, sm_scale, HEAD_DIM, 4, DOT_PRECISION, DQ_MODE)
            for start_m in range(pd_start, q_end, BLOCK_M):
                dk, dv = _blk(dk, dv, k_own, k_anc, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
                              stride_qs, stride_ds, start_m, offs_m, offs_d, key_pos, seq_total, sink, recent,
                              qk_scale, sm_scale, HEAD_DIM, 2, DOT_PRECISION, DQ_MODE)
        tl.store(DK_ANC + out_off, (dk * sm_scale).to(DK_ANC.dtype.element_ty), mask=out_mask)
        tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=out_mask)
    return pod_dkdv_dq_kernel
