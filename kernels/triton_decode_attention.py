"""Full decode attention (split-K / flash-decoding) and the TidalDecode selection layer, in Triton.

`decode_attention_triton`: one query per sequence (at position seq_lens[b]-1, its own K/V already
in the cache) against all cached keys, GQA native (one program loads each K/V row once for the
`G` query heads of its group), ragged batches native (slot = position layout), optional raw
per-head logits `scores[B,Hq,N]` (fp32, q.k*scale, -inf at slots >= seq_lens[b]).

`selection_decode_attention_triton`: TidalDecode's token selection layer (Yang et al., "TidalDecode:
Fast and Accurate LLM Decoding with Position Persistent Sparse Attention", arXiv 2410.05076, B.2 of
METHODS.md): full attention (exact output) plus, per query head (Hs = Hq) or per
GQA group (Hs = Hkv, summing the group's softmax probabilities), the top-(budget-1) slots among
slots < seq_lens-1 plus the current slot, returned ascending and -1 padded.

Top-k choice (topk_impl / PODKIT_SELECTION_TOPK; default "auto" = "split" per KV group, "legacy" per head,
the faster of the two in each mode on an H200, BENCHMARKS.md "Decode selection, POD decode and the TidalDecode
paper's comparison"): "split" is an exact radix select
whose passes run over every SM, its first pass fused into this file's attention kernel: each key
chunk counts the top radix digit of the logits it writes into a per-row histogram
(kernels/_decode_topk_split.py); three more histogram passes, a count pass and a write pass over
the fp32 logits follow, each a (chunk, row) grid. "legacy" is the earlier path: for rows up to 16K
slots a one-program-per-row Triton radix select (kernels/_decode_topk.py), for longer rows
torch.topk(sorted=False) + a sort of the k winners (kernels/_decode_topk.py); the selection layer's target
and its current value are in BENCHMARKS.md's status table. Both return the same indices (ties at the k-th value:
lowest slots first, except torch.topk, which breaks them arbitrarily).
Per-KV-group mode adds one small Triton pass that turns the G heads' logits into summed
probabilities with the merged LSE (with "split" it also builds the first histogram).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import _decode_common as C
from kernels import _decode_topk_split as TS
from kernels import _fp8_device as F8
from kernels._decode_topk import select_slots

# Tile of keys per loop iteration and launch shape. BLOCK_N=64, 4 warps, 2 stages: the best of the
# variants timed on an H200 by `eval/bench/kernels_decode.py --tune` (BENCHMARKS.md, "Kernels (issue 3; H200,
# 2026-11-29)"; more stages or 8 warps were slower at 128K).
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 2
# CVT=3's weight on fp16 probabilities (see _decode_split_kernel), a power of two so that undoing it is exact
V16_BOOST = tl.constexpr(256.0)


@triton.jit
def _decode_split_kernel(
    Q, K, V, SeqLens, OPart, LSEPart, Scores, Hist, KS, VS,
    sm_scale, N, chunk,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    stride_opb, stride_oph, stride_ops,
    stride_lpb, stride_lph,
    stride_sb, stride_sh,
    Hkv,
    KR, stride_krb, stride_krh, stride_krn,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    RETURN_SCORES: tl.constexpr, EXCLUDE_LAST: tl.constexpr, IEEE: tl.constexpr,
    HIST0: tl.constexpr = False, GH: tl.constexpr = 1, BITS: tl.constexpr = 8, LEVELS: tl.constexpr = 4,
    FP8: tl.constexpr = False, CVT: tl.constexpr = 0, REMASK: tl.constexpr = 0, RECENT: tl.constexpr = 0,
):
    """Program (split, b*Hkv + kvh): keys [split*chunk, split*chunk + chunk) of one sequence and KV
    head, for the G query heads kvh*G .. kvh*G+G-1. Writes o_part/lse_part and, with
    RETURN_SCORES, the logits of its slots (-inf past seq_len; with EXCLUDE_LAST also at the
    current slot seq_len-1, which TidalDecode appends to the selection unconditionally). With HIST0
    (needs RETURN_SCORES) it also counts the top radix digit of every finite logit it writes, per
    head, into hist[b*Hq + head, 0, :] (the first pass of kernels/_decode_topk_split.py). FP8: K/V are
    float8_e4m3fn with per-slot fp32 scales KS/VS [B,Hkv,N], dequantised in registers (kernels/fp8_kv.py); CVT picks
    how (FP8 only, see FP8_DECODE_VARIANTS): 0 through fp32, 1 straight to q's dtype, 2 keys to fp16 and the
    q.k dot in fp16 (q cast to fp16), 3 keys and values to fp16, both dots in fp16. 2 and 3 apply to 16-bit q
    only (fp32 q keeps IEEE fp32 dots, as CVT=1). REMASK (FP8): 1 re-masks the converted V tile, 2 the K tile
    too (kernels/_fp8_device.load_kv_tile: keeps the 8-bit tile out of byte-wise shared-memory transposes).
    RECENT (FP8, > 0): keys of positions [seq_len - RECENT, seq_len) come from KR [B,Hkv,RECENT,D] at slot
    position % RECENT (kernels/fp8_kv.py "Recent keys")."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)  # int64: batch offsets of a large cache overflow int32
    kvh = bh % Hkv
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    # FP8 with CVT >= 2: the q.k dot runs in fp16, the cheapest e4m3 conversion on sm_90 (one cvt per pair);
    # bf16 -> fp16 is exact for |q| in [2^-17, 65504] (fp16's 11 bits hold bf16's 8 down to its subnormals)
    K16: tl.constexpr = FP8 and CVT >= 2 and not IEEE
    V16: tl.constexpr = FP8 and CVT >= 3 and not IEEE
    if K16:
        q = q.to(tl.float16)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    ks_base = KS + b * stride_ksb + kvh * stride_ksh
    vs_base = VS + b * stride_vsb + kvh * stride_vsh
    kr_base = KR + b * stride_krb + kvh * stride_krh
    s_base = Scores + b * stride_sb + heads[:, None] * stride_sh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    NB: tl.constexpr = 1 << BITS
    hist = tl.zeros([GH * NB], tl.int32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k, k_sc = F8.load_kv_tile(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], kv_mask,
                                  ks_base + offs_n * stride_ksn, n_mask, tl.float16 if K16 else Q.dtype.element_ty,
                                  FP8, CVT == 0, REMASK >= 2)
        if RECENT > 0:
            # only a tile that reaches the newest RECENT positions reads the ring: a per-row select on every tile
            # cost more decode time than the ring's bytes (BENCHMARKS.md "Recent keys' decode cost on an H100")
            if n0 + BLOCK_N > seq_len - RECENT:
                k, k_sc = F8.recent_key_rows(k, k_sc, kr_base, offs_n, stride_krn, offs_d, d_mask, n_mask, seq_len,
                                             RECENT)
        v, v_sc = F8.load_kv_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], kv_mask,
                                  vs_base + offs_n * stride_vsn, n_mask, tl.float16 if V16 else Q.dtype.element_ty,
                                  FP8, CVT == 0, REMASK >= 1)
        if V16:
            # fp16 probabilities p * v_scale underflow (fp16's normals end at 2^-14, v_scale = amax / 448): weigh
            # them by 2^8 too, undone on acc below (exact: a power of two); fp16 overflows only past a value amax of
            # 65504 * 448 / 2^8 (about 1.1e5)
            v_sc = v_sc * V16_BOOST
        s = C.tile_logits(q, k, sm_scale, True, IEEE)
        if FP8:
            s = s * k_sc[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        if RETURN_SCORES:
            s_out = s
            if EXCLUDE_LAST:
                s_out = tl.where(offs_n[None, :] == seq_len - 1, float("-inf"), s)
            tl.store(s_base + offs_n[None, :], s_out, mask=g_mask[:, None] & n_mask[None, :])
            if HIST0:
                # one histogram of GH * NB bins: head g's digits land in bins [g*NB, g*NB + NB)
                key = TS.order_key(s_out)
                counted = g_mask[:, None] & (key > TS.neg_inf_key())
                digit = (key >> (32 - BITS)).to(tl.int32) + offs_g[:, None] * NB
                digit = tl.where(counted, digit, 0)
                hist += tl.histogram(tl.reshape(digit, [BLOCK_G * BLOCK_N], can_reorder=True), GH * NB,
                                     mask=tl.reshape(counted, [BLOCK_G * BLOCK_N], can_reorder=True))
        m_i, l_i, acc = C.online_softmax_update(s, v, m_i, l_i, acc, True, IEEE, v_sc, FP8)

    if RETURN_SCORES:
        # slots of this chunk at or past seq_len (up to the capacity N) read as -inf
        tail_end = tl.minimum(start + chunk, N)
        tail_start = tl.maximum(start, seq_len)
        for n0 in range(tail_start, tail_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            neg = tl.full([BLOCK_G, BLOCK_N], float("-inf"), tl.float32)
            tl.store(s_base + offs_n[None, :], neg, mask=g_mask[:, None] & (offs_n[None, :] < tail_end))

    if HIST0:
        bins = tl.arange(0, GH * NB)
        hist_head = bins // NB
        row = b * (Hkv * G) + kvh * G + hist_head
        tl.atomic_add(Hist + row * (LEVELS * NB) + bins % NB, hist, mask=(hist_head < G) & (hist > 0))

    if V16:
        acc = acc * (1.0 / V16_BOOST)
    C.store_partial(OPart, LSEPart, m_i, l_i, acc,
                    b * stride_opb + heads * stride_oph + split * stride_ops,
                    b * stride_lpb + heads * stride_lph + split,
                    g_mask, offs_d, D)


# FP8 full-decode variants (the FP8 kernel ran no faster than bf16 on an H200 although it reads half the bytes),
# A/B-timed by benchmarks/plans/issue32_fp8_variants.py (BENCHMARKS.md, "H200, 2026-12-04: FP8 decode variants").
# cvt: the CVT constexpr of
# _decode_split_kernel (0 e4m3 -> fp32 -> q's dtype; 1 e4m3 -> q's dtype; 2 keys as fp16, q.k in fp16; 3 keys and
# values as fp16, both dots in fp16); remask: the REMASK constexpr (1: V, 2: K and V re-masked after the
# conversion, see kernels/_fp8_device.load_kv_tile: "vreg" names); block_n / num_warps / num_stages: the launch;
# waves: programs per SM that
# kernels/_decode_common.plan_splits aims at. Why tiles and waves: a tile of FP8 rows is half the bytes of a bf16
# one, so with the bf16 launch (chosen for 2-byte rows) each SM has half the bytes in flight, and a kernel that
# is latency-bound on its loads (Little's law) then moves half the bytes per second. "base" is the default.
FP8_DECODE_VARIANTS = {
    "base": dict(cvt=0, remask=0, block_n=_BLOCK_N, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, waves=4),
    "direct": dict(cvt=1, remask=0, block_n=64, num_warps=4, num_stages=2, waves=4),
    "f16": dict(cvt=3, remask=0, block_n=64, num_warps=4, num_stages=2, waves=4),
    "base_vreg": dict(cvt=0, remask=1, block_n=64, num_warps=4, num_stages=2, waves=4),
    "direct_vreg": dict(cvt=1, remask=1, block_n=64, num_warps=4, num_stages=2, waves=4),
    "f16_vreg": dict(cvt=3, remask=1, block_n=64, num_warps=4, num_stages=2, waves=4),
    "f16_kvreg": dict(cvt=3, remask=2, block_n=64, num_warps=4, num_stages=2, waves=4),
    "f16_vreg_n128": dict(cvt=3, remask=1, block_n=128, num_warps=4, num_stages=2, waves=4),
    "f16_vreg_n128_w8": dict(cvt=3, remask=1, block_n=128, num_warps=8, num_stages=2, waves=4),
    "f16_vreg_n128_s3": dict(cvt=3, remask=1, block_n=128, num_warps=4, num_stages=3, waves=4),
    "f16_vreg_n64_s4": dict(cvt=3, remask=1, block_n=64, num_warps=4, num_stages=4, waves=4),
    "f16_vreg_n256_w8": dict(cvt=3, remask=1, block_n=256, num_warps=8, num_stages=2, waves=4),
    "direct_vreg_n128_w8": dict(cvt=1, remask=1, block_n=128, num_warps=8, num_stages=2, waves=4),
    "f16_vreg_n128_w8_waves8": dict(cvt=3, remask=1, block_n=128, num_warps=8, num_stages=2, waves=8),
}
_FP8_VARIANT_ENV = "PODKIT_FP8_DECODE_VARIANT"


def resolve_fp8_variant(fp8_variant: str | None = None) -> dict:
    """The launch of an FP8 full decode: ``fp8_variant`` or, when None, $PODKIT_FP8_DECODE_VARIANT (default
    "base"), looked up in FP8_DECODE_VARIANTS. Raises ValueError naming the source for an unknown name."""
    name = fp8_variant if fp8_variant is not None else os.environ.get(_FP8_VARIANT_ENV, "base")
    if name not in FP8_DECODE_VARIANTS:
        source = "fp8_variant" if fp8_variant is not None else _FP8_VARIANT_ENV
        raise ValueError(f"{source} must be one of {tuple(FP8_DECODE_VARIANTS)}, got {name!r}")
    return FP8_DECODE_VARIANTS[name]


def _check_decode_inputs(q, k_cache, v_cache, seq_lens, k_scale=None, v_scale=None, k_recent=None):
    B, Hq, Hkv, N, D, G = C.check_query_and_cache(q, k_cache, v_cache, k_scale, v_scale)
    C.check_recent(k_recent, k_cache, q)
    C.check_index_tensor("seq_lens", seq_lens, 1, "[B]", q.device)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but the batch is B={B}")
    if N < 1:
        raise ValueError(f"k_cache has capacity N={N}; it must hold at least the current token")
    C.check_seq_lens_values(seq_lens, N)
    return B, Hq, Hkv, N, D, G


def _launch_decode(q, k_cache, v_cache, seq_lens, scale, scores, exclude_last, lse_out=None,
                   block_n=_BLOCK_N, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, hist=None, k_scale=None,
                   v_scale=None, cvt=0, remask=0, waves=4, k_recent=None):
    B, Hq, D = q.shape
    Hkv, N = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    q, k_cache, v_cache = (C.last_dim_contiguous(t) for t in (q, k_cache, v_cache))
    num_splits, chunk = C.plan_splits(N, B * Hkv, q.device, block_n, waves=waves)
    o_part, lse_part = C.alloc_partials(B, Hq, num_splits, D, q.device)
    scores_arg = scores if scores is not None else lse_part
    launch = dict(num_warps=num_warps) if C.interpreting() else dict(num_warps=num_warps, num_stages=num_stages)
    ks_args, vs_args = C.scale_args(k_scale, lse_part), C.scale_args(v_scale, lse_part)
    _decode_split_kernel[(num_splits, B * Hkv)](
        q, k_cache, v_cache, seq_lens, o_part, lse_part, scores_arg, hist if hist is not None else seq_lens,
        ks_args[0], vs_args[0],
        scale, N, chunk,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *ks_args[1:], *vs_args[1:],
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        scores_arg.stride(0) if scores is not None else 0, scores_arg.stride(1) if scores is not None else 0,
        Hkv,
        *C.recent_args(k_recent, lse_part),
        G=G, BLOCK_G=C.block_g(G), BLOCK_N=block_n, D=D, BLOCK_D=triton.next_power_of_2(D),
        RETURN_SCORES=scores is not None, EXCLUDE_LAST=exclude_last,
        IEEE=q.dtype == torch.float32,
        HIST0=hist is not None, GH=triton.next_power_of_2(G), BITS=TS.BITS, LEVELS=TS.LEVELS,
        FP8=k_scale is not None, CVT=cvt if k_scale is not None else 0,
        REMASK=remask if k_scale is not None else 0, RECENT=k_recent.shape[2] if k_recent is not None else 0,
        **launch,
    )
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    C.merge_splits(o_part, lse_part, out, lse_out=lse_out)
    return out


def decode_attention_triton(q, k_cache, v_cache, seq_lens, *, scale=None, return_scores=False, k_scale=None,
                            v_scale=None, fp8_variant=None, k_recent=None):
    """Full decode attention.

    q: [B,Hq,D]; k_cache, v_cache: [B,Hkv,N,D] (q's float dtype: fp16 / bf16 / fp32, or both float8_e4m3fn
    with k_scale, v_scale [B,Hkv,N] fp32, kernels/fp8_kv.py; keys post-RoPE); seq_lens: [B] int32/int64 in
    [1, N]. Hq = G * Hkv for any G.
    Returns out [B,Hq,D] (q.dtype; fp32 accumulation), and with return_scores=True also
    scores [B,Hq,N] fp32 raw logits q.k*scale with -inf at slots >= seq_lens[b].
    fp8_variant: FP8 caches only, a name of FP8_DECODE_VARIANTS (None: $PODKIT_FP8_DECODE_VARIANT, default
    "base"); all give the same results within rounding (their timings: BENCHMARKS.md, "H200, 2026-12-04: FP8
    decode variants").
    k_recent: FP8 caches only, [B,Hkv,W,D] in q's dtype: the keys of positions [seq_lens - W, seq_lens) at slot
    position % W, read instead of their FP8 rows (kernels/fp8_kv.py "Recent keys").
    """
    B, Hq, Hkv, N, D, G = _check_decode_inputs(q, k_cache, v_cache, seq_lens, k_scale, v_scale, k_recent)
    launch = resolve_fp8_variant(fp8_variant) if k_scale is not None else {}
    scale = C.resolve_scale(scale, D)
    scores = torch.empty(B, Hq, N, device=q.device, dtype=torch.float32) if return_scores else None
    out = _launch_decode(q, k_cache, v_cache, seq_lens, scale, scores, exclude_last=False, k_scale=k_scale,
                         v_scale=v_scale, k_recent=k_recent, **launch)
    return (out, scores) if return_scores else out


# ---------------------------------------------------------------------------------------------
# Selection layer
# ---------------------------------------------------------------------------------------------

@triton.jit
def _group_probability_kernel(
    Scores, LSE, Out, Hist, N,
    stride_sb, stride_sh, stride_ob, stride_oh,
    Hkv, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HIST0: tl.constexpr = False, BITS: tl.constexpr = 8, LEVELS: tl.constexpr = 4,
):
    """Program (n-block, b*Hkv+kvh): out[b,kvh,n] = sum_g exp(scores[b,kvh*G+g,n] - lse[b,kvh*G+g]),
    the summed softmax probability of the group (-inf where every head has -inf, so that empty
    slots stay unselectable). With HIST0 also counts the top radix digit of the finite sums into
    hist[b*Hkv + kvh, 0, :] (first pass of kernels/_decode_topk_split.py)."""
    nb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    n_mask = offs_n < N
    heads = kvh * G + offs_g
    lse = tl.load(LSE + b * (Hkv * G) + heads, mask=g_mask, other=float("inf"))
    s = tl.load(Scores + b * stride_sb + heads[:, None] * stride_sh + offs_n[None, :],
                mask=g_mask[:, None] & n_mask[None, :], other=float("-inf"))
    p = tl.exp(s - lse[:, None])
    total = tl.sum(p, axis=0)
    any_valid = tl.max(s, axis=0) > float("-inf")
    total = tl.where(any_valid, total, float("-inf"))
    tl.store(Out + b * stride_ob + kvh * stride_oh + offs_n, total, mask=n_mask)
    if HIST0:
        NB: tl.constexpr = 1 << BITS
        key = TS.order_key(total)
        counted = n_mask & (key > TS.neg_inf_key())
        hist = tl.histogram((key >> (32 - BITS)).to(tl.int32), NB, mask=counted)
        bins = tl.arange(0, NB)
        tl.atomic_add(Hist + (b * Hkv + kvh) * (LEVELS * NB) + bins, hist, mask=hist > 0)


# Top-k path of the selection layer: "split" (kernels/_decode_topk_split.py, the first radix pass
# fused into the attention) or "legacy" (kernels/_decode_topk.py: one program per row up to 16K
# slots, torch.topk above). PODKIT_SELECTION_TOPK picks the default, for A/B runs of the engine.
# "auto" (the default) takes the faster one per selection mode, as measured on an H200 (BENCHMARKS.md,
# "Decode selection, POD decode and the TidalDecode paper's comparison"; raw
# benchmarks/h200_2026-11-30/decode_issue12/kernels_decode_issue12.json): split per KV group, legacy per head,
# because per head the fused first histogram pass (GH * 256 bins per key tile) slows the attention kernel itself.
TOPK_IMPLS = ("split", "legacy")
_TOPK_CHOICES = ("auto",) + TOPK_IMPLS
_TOPK_ENV = "PODKIT_SELECTION_TOPK"


def _resolve_topk_impl(topk_impl, per_kv_group: bool) -> str:
    impl = topk_impl if topk_impl is not None else os.environ.get(_TOPK_ENV, "auto")
    if impl not in _TOPK_CHOICES:
        source = "topk_impl" if topk_impl is not None else _TOPK_ENV
        raise ValueError(f"{source} must be one of {_TOPK_CHOICES}, got {impl!r}")
    if impl == "auto":
        return "split" if per_kv_group else "legacy"
    return impl


def selection_decode_attention_triton(q, k_cache, v_cache, seq_lens, budget, *, scale=None,
                                      per_kv_group=False, topk_impl=None, k_scale=None, v_scale=None,
                                      k_recent=None):
    """TidalDecode token-selection layer: full decode attention + top-k positions.

    q: [B,Hq,D]; k_cache, v_cache: [B,Hkv,N,D]; seq_lens: [B] in [1, N]; budget: int >= 1, the
    number of selected slots including the current one.
    Returns (out [B,Hq,D] exact full attention, indices [B,Hs,budget] int64), Hs = Hq, or Hkv with
    per_kv_group=True (the G heads' softmax probabilities summed, one selection per KV head).
    Indices: the top-(budget-1) slots among [0, seq_lens[b]-1) by logit (per head) or summed
    probability (per group), plus seq_lens[b]-1; ascending; -1 padded when seq_lens[b] < budget.
    topk_impl: "auto", "split" or "legacy" (see TOPK_IMPLS above); None reads PODKIT_SELECTION_TOPK
    (default "auto"). All return the same indices (ties at the k-th value: lowest slots first).
    k_scale, v_scale, k_recent: FP8 caches' scales and recent keys, as in decode_attention_triton.
    """
    B, Hq, Hkv, N, D, G = _check_decode_inputs(q, k_cache, v_cache, seq_lens, k_scale, v_scale, k_recent)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1 (selected slots, current one included), got {budget!r}")
    split = _resolve_topk_impl(topk_impl, per_kv_group) == "split"
    scale = C.resolve_scale(scale, D)
    scores = torch.empty(B, Hq, N, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, Hq, device=q.device, dtype=torch.float32) if per_kv_group else None
    hist = TS.alloc_hist(B * (Hkv if per_kv_group else Hq), q.device) if split else None
    out = _launch_decode(q, k_cache, v_cache, seq_lens, scale, scores, exclude_last=True, lse_out=lse,
                         hist=None if per_kv_group else hist, k_scale=k_scale, v_scale=v_scale, k_recent=k_recent)
    if per_kv_group:
        group_scores = torch.empty(B, Hkv, N, device=q.device, dtype=torch.float32)
        block_n = 256
        _group_probability_kernel[(triton.cdiv(N, block_n), B * Hkv)](
            scores, lse, group_scores, hist if split else lse, N,
            scores.stride(0), scores.stride(1), group_scores.stride(0), group_scores.stride(1),
            Hkv, G=G, BLOCK_G=triton.next_power_of_2(G), BLOCK_N=block_n,
            HIST0=split, BITS=TS.BITS, LEVELS=TS.LEVELS, num_warps=4,
        )
        scores = group_scores
    if split:
        return out, TS.split_topk_slots(scores, seq_lens, budget, hist=hist)
    return out, select_slots(scores, seq_lens, budget)
