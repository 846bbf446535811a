"""POD + TidalDecode in one kernel: decode attention over selected positions, with POD's key sharing and gate.

TidalDecode's sparse layers (Yang et al., arXiv 2410.05076) attend only to the positions the
selection layer chose; in a POD model (Ma et al., arXiv 2412.02252, section 2.3) a non-anchor layer
holds its own keys only for proximal positions (sinks + a ring of the last `recent`), distant keys
being the anchor layer's. So a selected position j of the query at p = seq_lens[b]-1 reads
  - proximal (j < sink or p - j < recent): key k_local[slot], slot = j (j < sink) or sink + j % recent;
  - distant (otherwise): key k_anchor[..., j, :];
and its value v_cache[..., j, :] either way. Before this kernel the engine did it with a torch
gather (sparse_models/engine/decode_layers.py, _pod_sparse_run).

Layout: split-K over the index list, as kernels/triton_sparse_decode_attention.py, with the grid
doubled: program (split, ...) with split < S attends to the distant entries of list chunk `split`,
split >= S to the proximal entries of chunk split - S; each K/V row is loaded by exactly one of the
two (masked loads). The merge (kernels/_decode_common.py) keeps the two sides apart, which gives the
gate g = sigmoid(lse_P - lse_D) over the selected positions and POD's compute skip:
  - gate_tau with the exact gate: heads with g >= tau output the proximal part only (all distant
    rows are still read: the gate needs them);
  - gate_tau with gate_estimate [B,Hq] (a pre-evaluated gate, e.g. the anchor layer's): heads with
    estimate >= tau read no distant row; a distant program whose heads all skip loads nothing.
Without gate_tau the result is one softmax over all selected positions (the gate is implicit).

Lists: indices [B,Hs,K], Hs = Hq (one list per query head) or Hkv (one per GQA group, rows read once
for the G heads); entries are positions in [0, N) or -1 (ignored); any order.

FP8 caches (kernels/fp8_kv.py): k_local, k_anchor and v_cache float8_e4m3fn with k_local_scale [B,Hkv,sink+recent],
k_anchor_scale and v_scale [B,Hkv,N] fp32; each row's scale comes from the same cache as its row (FP8 flag).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _decode_common as C
from kernels import _fp8_device as F8
from kernels.triton_pod_decode_attention import _check_gate_estimate, _checked_q_distant
from kernels.triton_pod_decode_attention import _check_inputs as _check_pod_inputs

# Launch plan per list granularity (rows per iteration, warps, stages, programs per SM for the split planner), as
# kernels/triton_sparse_decode_attention.py, chosen by a sweep on an H200 (block 16/32/64 x warps 2/4/8 x stages
# 2/3 x waves 4/16 at 32K x 1, 128K x 1 and 128K x 4, k = 2048; BENCHMARKS.md, "Decode, second pass", item 2):
# per-head lists at 64 x 2 warps x 2 stages are each row's best, although ptxas spills registers there
# (tests/kernels/sm90_compile.py allows that one spill): the spill-free 16-row tile is slower, so the measured
# time wins. Per-group lists: 32 x 4 warps x 2 stages, no spill, close to each row's best (64 rows at 4 warps is
# slightly faster but spills).
_PLAN_HEAD = dict(block_n=64, num_warps=2, num_stages=2, waves=4)
_PLAN_GROUP = dict(block_n=32, num_warps=4, num_stages=2, waves=4)


@triton.jit
def _pod_sparse_split_kernel(
    Q, KLocal, KAnchor, V, Idx, SeqLens, OPart, LSEPart, GateEst, KLS, KAS, VS,
    sm_scale, sink, recent, list_len, chunk, num_splits, tau,
    stride_qb, stride_qh,
    stride_lb, stride_lh, stride_ln,
    stride_ab, stride_ah, stride_an,
    stride_vb, stride_vh, stride_vn,
    stride_lsb, stride_lsh, stride_lsn,
    stride_asb, stride_ash, stride_asn,
    stride_vsb, stride_vsh, stride_vsn,
    stride_ib, stride_ih,
    stride_opb, stride_oph, stride_ops,
    stride_lpb, stride_lph,
    Hs, Hq,
    KRL, stride_krlb, stride_krlh, stride_krln,
    KRA, stride_krab, stride_krah, stride_kran,
    G: tl.constexpr, HEADS_PER_LIST: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr, SKIP: tl.constexpr, FP8: tl.constexpr = False,
    RECENT: tl.constexpr = 0,
):
    """Program (part * num_splits + split, b*Hs + hs): the distant (part 0) or proximal (part 1)
    entries of list chunk [split*chunk, split*chunk+chunk) of list (b, hs), for the HEADS_PER_LIST
    query heads that read that list. Writes partial slot part*num_splits + split. RECENT (FP8, > 0): listed
    positions in [seq_len - RECENT, seq_len) read their key from the model-dtype ring, the layer's own KRL
    (proximal part) or the anchor's KRA (distant part), at slot position % RECENT."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    is_prox = pid >= num_splits
    split = pid % num_splits
    b = (bh // Hs).to(tl.int64)
    hs = bh % Hs
    if HEADS_PER_LIST == 1:
        first_head = hs
        kvh = hs // G
    else:
        first_head = hs * G
        kvh = hs
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = split * chunk
    end = tl.minimum(start + chunk, list_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < HEADS_PER_LIST
    d_mask = offs_d < D
    heads = first_head + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    kl_base = KLocal + b * stride_lb + kvh * stride_lh
    ka_base = KAnchor + b * stride_ab + kvh * stride_ah
    v_base = V + b * stride_vb + kvh * stride_vh
    kls_base = KLS + b * stride_lsb + kvh * stride_lsh
    kas_base = KAS + b * stride_asb + kvh * stride_ash
    vs_base = VS + b * stride_vsb + kvh * stride_vsh
    i_base = Idx + b * stride_ib + hs * stride_ih

    if SKIP:
        est = tl.load(GateEst + b * Hq + heads, mask=g_mask, other=float("inf"))
        skip = (est >= tau) & ~is_prox  # padded rows count as skipped
        end = tl.where(tl.sum((~skip).to(tl.int32), axis=0) > 0, end, start)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # positions < 2**31: slot arithmetic in int32 (int64 modulo costs registers: the kernel
        # spilled with it at 4 warps on sm_90), widened only for the row offsets
        pos = tl.load(i_base + offs_n, mask=offs_n < end, other=-1).to(tl.int32)
        proximal = (pos < sink) | (seq_len - 1 - pos < recent)
        valid = (pos >= 0) & (proximal == is_prox)
        rows = tl.where(valid, pos, 0)
        kv_mask = valid[:, None] & d_mask[None, :]
        # one load from either cache (a pointer select, not a branch, keeps the loop pipelinable)
        k_row = tl.where(is_prox, tl.where(rows < sink, rows, sink + rows % recent), rows).to(tl.int64)
        k_rows = tl.where(is_prox, kl_base + k_row * stride_ln, ka_base + k_row * stride_an)
        k_scales = tl.where(is_prox, kls_base + k_row * stride_lsn, kas_base + k_row * stride_asn)
        rows = rows.to(tl.int64)
        k, k_sc = F8.load_kv_tile(k_rows[:, None] + offs_d[None, :], kv_mask, k_scales, valid, Q.dtype.element_ty, FP8)
        if RECENT > 0:
            if is_prox:
                k, k_sc = F8.recent_key_rows(k, k_sc, KRL + b * stride_krlb + kvh * stride_krlh, rows, stride_krln,
                                             offs_d, d_mask, valid, seq_len, RECENT)
            else:
                k, k_sc = F8.recent_key_rows(k, k_sc, KRA + b * stride_krab + kvh * stride_krah, rows, stride_kran,
                                             offs_d, d_mask, valid, seq_len, RECENT)
        v, v_sc = F8.load_kv_tile(v_base + rows[:, None] * stride_vn + offs_d[None, :], kv_mask,
                                  vs_base + rows * stride_vsn, valid, Q.dtype.element_ty, FP8)
        s = C.tile_logits(q, k, sm_scale, USE_DOT, IEEE)
        if FP8:
            s = s * k_sc[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        if SKIP:
            s = tl.where(skip[:, None], float("-inf"), s)
        m_i, l_i, acc = C.online_softmax_update(s, v, m_i, l_i, acc, USE_DOT, IEEE, v_sc, FP8)

    part = pid  # distant chunks first, then proximal: merge_splits' split_p_start = num_splits
    C.store_partial(OPart, LSEPart, m_i, l_i, acc,
                    b * stride_opb + heads * stride_oph + part * stride_ops,
                    b * stride_lpb + heads * stride_lph + part,
                    g_mask, offs_d, D)


def pod_sparse_decode_attention_triton(q, k_local, k_anchor, v_cache, indices, seq_lens, *, sink, recent,
                                       scale=None, gate_tau=None, gate_estimate=None, return_gate=False,
                                       return_skip=False, k_local_scale=None, k_anchor_scale=None, v_scale=None,
                                       q_distant=None, k_local_recent=None, k_anchor_recent=None, _block_n=None,
                                       _num_warps=None, _num_stages=None, _waves=None):
    """POD-aware sparse decode.

    q: [B,Hq,D] (query at p = seq_lens-1); k_local: [B,Hkv,sink+recent,D] (the layer's own keys: sinks
    at slots 0..sink-1, position j of the ring at sink + j % recent); k_anchor, v_cache: [B,Hkv,N,D]
    (slot = position); indices: [B,Hs,K] int32/int64 positions in [0, N) or -1, Hs = Hq or Hkv;
    seq_lens: [B] in [1, N]; sink >= 0, recent >= 1; gate_tau / gate_estimate as in
    kernels/triton_pod_decode_attention.py. `_block_n` / `_num_warps` / `_num_stages` / `_waves` override the
    launch plan (tuning sweeps).
    Returns out [B,Hq,D] (q.dtype; 0 for a head whose list is empty after skipping); with return_gate
    also gate [B,Hq] fp32 = sigmoid(lse_P - lse_D) over the selected positions (1 without distant
    entries or, with gate_estimate, for skipped heads; 0 without proximal ones); with return_skip
    also skip [B,Hq] bool. Order: out, gate, skip.
    k_local_scale, k_anchor_scale, v_scale: FP8 caches' scales (module docstring), else None.
    q_distant: [B,Hq,D] the query of the distant entries' logits, default q (key sharing); the anchor layer's
    query gives v1's score sharing (METHODS.md A.3). The kernel reads one query per program, so score sharing
    launches it twice, q_distant's distant partials beside q's proximal ones: twice the reads of key sharing (a
    query select inside this kernel made ptxas spill more, tests/kernels/sm90_compile.py).
    k_local_recent, k_anchor_recent: FP8 caches only, both or neither, as in pod_decode_attention_triton.
    """
    if k_local is None:
        raise ValueError("k_local is None: a layer that is its own anchor has no POD split; use "
                         "sparse_decode_attention")
    B, Hq, Hkv, N, D, G = _check_pod_inputs(q, k_local, k_anchor, v_cache, seq_lens, sink, recent, gate_tau,
                                            k_local_scale, k_anchor_scale, v_scale)
    _check_gate_estimate(gate_estimate, gate_tau, q)
    C.check_recent(k_local_recent, k_local, q)
    C.check_recent(k_anchor_recent, k_anchor, q)
    if (k_local_recent is None) != (k_anchor_recent is None) or (
            k_local_recent is not None and k_local_recent.shape != k_anchor_recent.shape):
        raise ValueError("k_local_recent and k_anchor_recent go together: pass both rings (one window W) or neither")
    C.check_index_tensor("indices", indices, 3, "[B,Hs,K]", q.device)
    if indices.shape[0] != B or indices.shape[1] not in (Hq, Hkv):
        raise ValueError(f"indices shape {tuple(indices.shape)} must be [B={B}, Hs, K] with Hs = Hq={Hq} "
                         f"(per query head) or Hs = Hkv={Hkv} (per KV group)")
    C.check_index_values("indices", indices, N)
    scale = C.resolve_scale(scale, D)
    Hs, list_len = indices.shape[1], indices.shape[2]
    per_group = Hs == Hkv and G > 1
    use_est = gate_estimate is not None
    est = gate_estimate.float().contiguous() if use_est else None
    q, k_local, k_anchor, v_cache = (C.last_dim_contiguous(t) for t in (q, k_local, k_anchor, v_cache))
    if q_distant is not None:
        q_distant = C.last_dim_contiguous(_checked_q_distant(q_distant, q))
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    plan = _PLAN_GROUP if per_group else _PLAN_HEAD
    block_n = _block_n or plan["block_n"]
    num_warps, num_stages = _num_warps or plan["num_warps"], _num_stages or plan["num_stages"]
    # half the usual split cap: the merge holds all 2 * num_splits partials of a row in registers
    num_splits, chunk = C.plan_splits(max(list_len, 1), B * Hs, q.device, block_n, waves=_waves or plan["waves"],
                                      max_splits=C.MAX_SPLITS // 2)
    o_part, lse_part = C.alloc_partials(B, Hq, 2 * num_splits, D, q.device)
    launch = dict(num_warps=num_warps) if C.interpreting() else dict(num_warps=num_warps, num_stages=num_stages)
    scale_args = [C.scale_args(t, lse_part) for t in (k_local_scale, k_anchor_scale, v_scale)]

    def launch_into(query, parts, lses):
        _pod_sparse_split_kernel[(2 * num_splits, B * Hs)](
            query, k_local, k_anchor, v_cache, indices, seq_lens, parts, lses, est if use_est else lses,
            *(a[0] for a in scale_args),
            scale, sink, recent, list_len, chunk, num_splits, float(gate_tau) if use_est else 0.0,
            query.stride(0), query.stride(1),
            k_local.stride(0), k_local.stride(1), k_local.stride(2),
            k_anchor.stride(0), k_anchor.stride(1), k_anchor.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *(x for a in scale_args for x in a[1:]),
            indices.stride(0), indices.stride(1),
            parts.stride(0), parts.stride(1), parts.stride(2),
            lses.stride(0), lses.stride(1),
            Hs, Hq,
            *C.recent_args(k_local_recent, lses), *C.recent_args(k_anchor_recent, lses),
            G=G, HEADS_PER_LIST=G if per_group else 1, BLOCK_G=C.block_g(G) if per_group else 1,
            BLOCK_N=block_n, D=D, BLOCK_D=triton.next_power_of_2(D),
            USE_DOT=per_group, IEEE=q.dtype == torch.float32, SKIP=use_est, FP8=v_scale is not None,
            RECENT=k_anchor_recent.shape[2] if k_anchor_recent is not None else 0,
            **launch,
        )

    launch_into(q, o_part, lse_part)
    if q_distant is not None:  # the distant partials (slots < num_splits) again, from the anchor's query
        o_dist, lse_dist = C.alloc_partials(B, Hq, 2 * num_splits, D, q.device)
        launch_into(q_distant, o_dist, lse_dist)
        o_part[:, :, :num_splits] = o_dist[:, :, :num_splits]
        lse_part[:, :, :num_splits] = lse_dist[:, :, :num_splits]
    # with an estimate the skipped heads' distant partials are already empty: no tau in the merge
    return C.merge_gated_splits(o_part, lse_part, q, split_p_start=num_splits, gate_tau=gate_tau, estimate=est,
                                return_gate=return_gate, return_skip=return_skip)
