"""Decode attention over per-head slot lists, in Triton (split-K over the list).

One query per sequence attends only to the cache slots listed for its head: TidalDecode's sparse
(PPSA) layers (Yang et al., arXiv 2410.05076: the positions chosen at the selection layer), Quest's
selected pages expanded to slots (Tang et al., arXiv 2406.10774), StreamingLLM's sink + window.
The K/V rows are gathered inside the kernel; no compressed copy is materialised.

Two list granularities, told apart by `indices.shape[1]` (ARCHITECTURE.md):
- Hs = Hq: one list per query head. One program per (chunk of the list, sequence, query head)
  gathers its rows; the logits are a broadcast multiply-sum (tl.dot needs 16 query rows).
- Hs = Hkv (G > 1): one list per GQA group. One program per (chunk, sequence, KV head) gathers each
  listed row once and serves the group's G query heads with tl.dot, so the bytes read are G times
  fewer than per-head lists of the same length.

FP8 caches (kernels/fp8_kv.py): float8_e4m3fn K/V with per-slot fp32 scales [B,Hkv,N] (``k_scale``,
``v_scale``); the kernel gathers the listed rows' scales with their rows and dequantises in registers (FP8 flag).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _decode_common as C
from kernels import _fp8_device as F8

# Launch plan per list granularity: rows gathered per loop iteration (BLOCK_N), warps, pipeline stages and
# the split planner's programs per SM (waves, kernels/_decode_common.py plan_splits). Chosen by a sweep on an
# H200 (block 16/32/64 x warps 2/4/8 x stages 2/3 x waves 4/16 at 32K x 1 to 128K x 8, k = 2048; BENCHMARKS.md,
# "Decode, second pass", item 2, with the sweep scripts in its raw folder): per-head lists want many small
# programs (random 256-byte rows are latency-bound; more rows in flight per SM, not wider programs). Per-group
# lists: 2 warps were as fast but spill registers for sm_90 (tests/kernels/sm90_compile.py); 4 warps do not.
_PLAN_HEAD = dict(block_n=16, num_warps=2, num_stages=3, waves=16)
_PLAN_GROUP = dict(block_n=64, num_warps=4, num_stages=2, waves=4)


@triton.jit
def _sparse_decode_split_kernel(
    Q, K, V, Idx, OPart, LSEPart,
    sm_scale, list_len, chunk,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ib, stride_ih,
    stride_opb, stride_oph, stride_ops,
    stride_lpb, stride_lph,
    Hs,
    # FP8 scales last: placed after the K/V strides they made the bf16 per-head variant take 168 registers
    # instead of 96 in tests/kernels/sm90_compile.py
    KS, VS,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    SeqLens, KR, stride_krb, stride_krh, stride_krn,
    G: tl.constexpr, HEADS_PER_LIST: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr = False, RECENT: tl.constexpr = 0,
):
    """Program (split, b*Hs + hs): entries [split*chunk, split*chunk+chunk) of list (b, hs), for the
    HEADS_PER_LIST query heads that read it (G when Hs = Hkv, 1 when Hs = Hq). RECENT (FP8, > 0): listed
    positions in [seq_lens[b] - RECENT, seq_lens[b]) read their key from KR at slot position % RECENT."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hs).to(tl.int64)
    hs = bh % Hs
    if HEADS_PER_LIST == 1:
        first_head = hs
        kvh = hs // G
    else:
        first_head = hs * G
        kvh = hs
    start = split * chunk
    end = tl.minimum(start + chunk, list_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < HEADS_PER_LIST
    d_mask = offs_d < D
    heads = first_head + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    ks_base = KS + b * stride_ksb + kvh * stride_ksh
    vs_base = VS + b * stride_vsb + kvh * stride_vsh
    i_base = Idx + b * stride_ib + hs * stride_ih
    kr_base = KR + b * stride_krb + kvh * stride_krh
    if RECENT > 0:
        seq_len = tl.load(SeqLens + b).to(tl.int64)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slots = tl.load(i_base + offs_n, mask=offs_n < end, other=-1).to(tl.int64)
        valid = slots >= 0
        rows = tl.where(valid, slots, 0)
        kv_mask = valid[:, None] & d_mask[None, :]
        k, k_sc = F8.load_kv_tile(k_base + rows[:, None] * stride_kn + offs_d[None, :], kv_mask,
                                  ks_base + rows * stride_ksn, valid, Q.dtype.element_ty, FP8)
        if RECENT > 0:
            k, k_sc = F8.recent_key_rows(k, k_sc, kr_base, rows, stride_krn, offs_d, d_mask, valid, seq_len, RECENT)
        v, v_sc = F8.load_kv_tile(v_base + rows[:, None] * stride_vn + offs_d[None, :], kv_mask,
                                  vs_base + rows * stride_vsn, valid, Q.dtype.element_ty, FP8)
        s = C.tile_logits(q, k, sm_scale, USE_DOT, IEEE)
        if FP8:
            s = s * k_sc[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = C.online_softmax_update(s, v, m_i, l_i, acc, USE_DOT, IEEE, v_sc, FP8)

    C.store_partial(OPart, LSEPart, m_i, l_i, acc,
                    b * stride_opb + heads * stride_oph + split * stride_ops,
                    b * stride_lpb + heads * stride_lph + split,
                    g_mask, offs_d, D)


def _check_inputs(q, k_cache, v_cache, indices, k_scale=None, v_scale=None, k_recent=None, seq_lens=None):
    B, Hq, Hkv, N, D, G = C.check_query_and_cache(q, k_cache, v_cache, k_scale, v_scale)
    C.check_recent(k_recent, k_cache, q)
    if k_recent is not None:
        if seq_lens is None:
            raise ValueError("k_recent needs seq_lens (which listed positions are the newest W)")
        C.check_index_tensor("seq_lens", seq_lens, 1, "[B]", q.device)
        if seq_lens.shape[0] != B:
            raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but the batch is B={B}")
    C.check_index_tensor("indices", indices, 3, "[B,Hs,K]", q.device)
    if indices.shape[0] != B or indices.shape[1] not in (Hq, Hkv):
        raise ValueError(f"indices shape {tuple(indices.shape)} must be [B={B}, Hs, K] with Hs = Hq={Hq} "
                         f"(per query head) or Hs = Hkv={Hkv} (per KV group)")
    C.check_index_values("indices", indices, N)
    return B, Hq, Hkv, N, D, G


def sparse_decode_attention_triton(q, k_cache, v_cache, indices, *, scale=None, k_scale=None, v_scale=None,
                                   k_recent=None, seq_lens=None, _block_n=None, _num_warps=None, _num_stages=None,
                                   _waves=None):
    """Decode attention over listed slots only.

    q: [B,Hq,D]; k_cache, v_cache: [B,Hkv,N,D] (q's dtype: fp16 / bf16 / fp32, or both float8_e4m3fn with
    k_scale, v_scale [B,Hkv,N] fp32, kernels/fp8_kv.py);
    indices: [B,Hs,K] int32/int64 slots in [0, N), -1 = unused; Hs = Hq (one list per query head)
    or Hkv (one list per GQA group, read once for its G heads). Lists need not be sorted.
    Returns out [B,Hq,D] in q.dtype: softmax over the listed slots (0 where a list is all -1).
    k_recent [B,Hkv,W,D] (q's dtype) with seq_lens [B]: FP8 caches only, listed positions in
    [seq_lens - W, seq_lens) read their key from the ring at slot position % W (kernels/fp8_kv.py "Recent keys").
    The `_block_n` / `_num_warps` / `_num_stages` / `_waves` knobs override the launch plan (tuning sweeps).
    """
    B, Hq, Hkv, N, D, G = _check_inputs(q, k_cache, v_cache, indices, k_scale, v_scale, k_recent, seq_lens)
    scale = C.resolve_scale(scale, D)
    Hs, list_len = indices.shape[1], indices.shape[2]
    per_group = Hs == Hkv and G > 1
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    if list_len == 0:
        return out.zero_()
    q, k_cache, v_cache = (C.last_dim_contiguous(t) for t in (q, k_cache, v_cache))
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    plan = _PLAN_GROUP if per_group else _PLAN_HEAD
    block_n = _block_n or plan["block_n"]
    num_warps, num_stages = _num_warps or plan["num_warps"], _num_stages or plan["num_stages"]
    num_splits, chunk = C.plan_splits(list_len, B * Hs, q.device, block_n, waves=_waves or plan["waves"])
    o_part, lse_part = C.alloc_partials(B, Hq, num_splits, D, q.device)
    launch = dict(num_warps=num_warps) if C.interpreting() else dict(num_warps=num_warps, num_stages=num_stages)
    ks_args, vs_args = C.scale_args(k_scale, lse_part), C.scale_args(v_scale, lse_part)
    _sparse_decode_split_kernel[(num_splits, B * Hs)](
        q, k_cache, v_cache, indices, o_part, lse_part,
        scale, list_len, chunk,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        indices.stride(0), indices.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        Hs,
        ks_args[0], vs_args[0], *ks_args[1:], *vs_args[1:],
        seq_lens if k_recent is not None else indices, *C.recent_args(k_recent, lse_part),
        G=G, HEADS_PER_LIST=G if per_group else 1, BLOCK_G=C.block_g(G) if per_group else 1,
        BLOCK_N=block_n, D=D, BLOCK_D=triton.next_power_of_2(D),
        USE_DOT=per_group, IEEE=q.dtype == torch.float32, FP8=k_scale is not None,
        RECENT=k_recent.shape[2] if k_recent is not None else 0,
        **launch,
    )
    C.merge_splits(o_part, lse_part, out)
    return out
