"""POD decode attention in Triton: proximal keys from the layer's own sink + ring, distant keys from
the anchor layer, values from the layer itself (Ma et al., "Compressing KV Cache for Long-Context LLM
Inference with Inter-Layer Attention Similarity", arXiv 2412.02252, A.4 of
METHODS.md).

For the query at position p = seq_lens[b]-1, key position j is proximal when j < sink or
p - j < recent; its key is then k_local[slot] (slot j for sinks, sink + j % recent for the ring),
otherwise k_anchor[..., j, :]. Values are v_cache[..., j, :] for every j. The two sets are attended
by separate chunks of one split-K launch (distant chunks tile [sink, p-recent+1), proximal chunks
tile the sink + recent virtual slots) and merged with a log-sum-exp reduction that also yields the
gate g = sigmoid(lse_P - lse_D) (1 when there is no distant key).

gate_tau (paper default 0.7): heads whose gate g >= tau output proximal attention only (Ma et al.,
section 2.3, "compute skipping"). Which gate decides:
- exact (gate_estimate=None): this layer's own gate, as kernels/reference.py computes it (reading
  (i) of METHODS.md A.4). The gate needs lse_D, i.e. every distant key, so this mode still reads all
  distant keys and values: it matches the paper's rule but saves no time.
- pre-evaluated (gate_estimate [B,Hq], e.g. the anchor layer's gate for the same query head,
  reading (ii); sparse_models/schemes/pod.py gate_estimate="anchor"): heads with estimate >= tau are
  skipped before any distant key is read. A distant chunk program whose G heads all skip returns at
  once (no K_anchor / V loads, no FLOPs); in a group where only some heads skip, the skipped heads'
  logits are masked (the group's K/V rows are read once for its G heads anyway). return_skip gives
  the skip mask [B,Hq]; its mean is the fraction of (query, head) pairs that read no distant key.

FP8 caches (kernels/fp8_kv.py): k_local (the ring, one scale per slot), k_anchor and v_cache all float8_e4m3fn with
fp32 scales ``k_local_scale [B,Hkv,sink+recent]``, ``k_anchor_scale`` / ``v_scale [B,Hkv,N]``, dequantised in
registers (FP8 flag); a layer that is its own anchor passes neither k_local nor k_local_scale.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import _decode_common as C
from kernels import _fp8_device as F8

_BLOCK_N = 64
# 4 warps (as dense decode); ptxas sm_90 reports 255 registers and a 40-byte spill there, 215 and
# none at 8 warps (tests/kernels/sm90_compile.py); the benchmark times both (`_num_warps` knob).
_NUM_WARPS = 4
_NUM_STAGES = 2


@triton.jit
def _pod_decode_split_kernel(
    Q, QD, KLocal, KAnchor, V, SeqLens, OPart, LSEPart, GateEst, Scores, KLS, KAS, VS,
    sm_scale, sink, recent, num_distant_splits, chunk_d, chunk_p, tau,
    stride_qb, stride_qh, stride_qdb, stride_qdh,
    stride_lb, stride_lh, stride_ln,
    stride_ab, stride_ah, stride_an,
    stride_vb, stride_vh, stride_vn,
    stride_lsb, stride_lsh, stride_lsn,
    stride_asb, stride_ash, stride_asn,
    stride_vsb, stride_vsh, stride_vsn,
    stride_opb, stride_oph, stride_ops,
    stride_lpb, stride_lph,
    stride_sb, stride_sh,
    Hkv,
    KRL, stride_krlb, stride_krlh, stride_krln,
    KRA, stride_krab, stride_krah, stride_kran,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, SKIP: tl.constexpr = False,
    LOCAL_BY_POSITION: tl.constexpr = False, RETURN_SCORES: tl.constexpr = False, FP8: tl.constexpr = False,
    RECENT: tl.constexpr = 0, RECENT_DISTANT: tl.constexpr = 0,
):
    """Program (split, b*Hkv + kvh). Splits < num_distant_splits: distant positions
    [sink + split*chunk_d, ...) below p - recent + 1, keys from k_anchor. Other splits: virtual
    proximal slots t in [(split - nd)*chunk_p, ...) below sink + recent: t < sink is position t,
    t >= sink is position seq_len - recent + (t - sink) (kept when >= sink), keys from k_local.
    With SKIP, heads with gate_est[b, head] >= tau take no distant key; a distant program whose
    heads all skip loads nothing and writes an empty partial (lse -inf). LOCAL_BY_POSITION: KLocal is
    slot = position (an anchor layer's own keys), so a proximal position's key is row `pos`, not its ring slot.
    RETURN_SCORES: each program also writes the logits of its positions to Scores[b, head, pos] (the caller
    fills the rest with -inf); every position below seq_len is written by exactly one program.
    FP8: the three caches are float8_e4m3fn, KLS / KAS / VS their per-slot fp32 scales.
    QD: the distant programs' queries (Q itself under key sharing; the anchor layer's under score sharing), so each
    program loads one query tile either way.
    RECENT (FP8, > 0): keys of positions [seq_len - RECENT, seq_len) come from the model-dtype rings KRL (the
    layer's own, proximal programs) and KRA (the anchor's, distant programs) at slot position % RECENT.
    RECENT_DISTANT: RECENT when it exceeds ``recent``, else 0. Distant positions lie below seq_len - recent, so a
    window no wider than the proximal one never reaches them and the distant loop leaves out the ring's select."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g
    v_base = V + b * stride_vb + kvh * stride_vh
    vs_base = VS + b * stride_vsb + kvh * stride_vsh
    s_base = Scores + b * stride_sb + heads[:, None].to(tl.int64) * stride_sh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if split < num_distant_splits:
        # distant: contiguous positions, keys from the anchor (same access pattern as full decode,
        # kept in its own loop so that the loads stay vectorised)
        q = tl.load(QD + b * stride_qdb + heads[:, None] * stride_qdh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        ka_base = KAnchor + b * stride_ab + kvh * stride_ah
        kas_base = KAS + b * stride_asb + kvh * stride_ash
        dist_end = tl.maximum(sink, seq_len - recent)  # distant positions: [sink, dist_end)
        lo = sink + split * chunk_d
        hi = tl.minimum(lo + chunk_d, dist_end)
        if SKIP:
            est = tl.load(GateEst + b * (Hkv * G) + heads, mask=g_mask, other=float("inf"))
            skip = est >= tau  # padded rows count as skipped
            hi = tl.where(tl.sum((~skip).to(tl.int32), axis=0) > 0, hi, lo)
        for n0 in range(lo, hi, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            valid = offs < hi
            kv_mask = valid[:, None] & d_mask[None, :]
            k, k_sc = F8.load_kv_tile(ka_base + offs[:, None] * stride_an + offs_d[None, :], kv_mask,
                                      kas_base + offs * stride_asn, valid, Q.dtype.element_ty, FP8)
            if RECENT_DISTANT > 0:
                k, k_sc = F8.recent_key_rows(k, k_sc, KRA + b * stride_krab + kvh * stride_krah, offs, stride_kran,
                                             offs_d, d_mask, valid, seq_len, RECENT)
            v, v_sc = F8.load_kv_tile(v_base + offs[:, None] * stride_vn + offs_d[None, :], kv_mask,
                                      vs_base + offs * stride_vsn, valid, Q.dtype.element_ty, FP8)
            s = C.tile_logits(q, k, sm_scale, True, IEEE)
            if FP8:
                s = s * k_sc[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            if RETURN_SCORES:
                tl.store(s_base + offs[None, :], s, mask=g_mask[:, None] & valid[None, :])
            if SKIP:
                s = tl.where(skip[:, None], float("-inf"), s)
            m_i, l_i, acc = C.online_softmax_update(s, v, m_i, l_i, acc, True, IEEE, v_sc, FP8)
    else:
        # proximal: virtual slots t (sinks, then the ring in position order), keys from k_local
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        kl_base = KLocal + b * stride_lb + kvh * stride_lh
        kls_base = KLS + b * stride_lsb + kvh * stride_lsh
        lo = (split - num_distant_splits) * chunk_p
        hi = tl.minimum(lo + chunk_p, sink + recent)
        for n0 in range(lo, hi, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            is_sink = offs < sink
            ring_pos = seq_len - recent + (offs - sink)
            valid = (offs < hi) & tl.where(is_sink, offs < seq_len, ring_pos >= sink)
            pos32 = tl.where(valid, tl.where(is_sink, offs, ring_pos), 0)
            # modulo in int32 (positions < 2**31), widened for the row offsets only
            pos = pos32.to(tl.int64)
            if LOCAL_BY_POSITION:
                local_slot = pos
            else:
                local_slot = tl.where(is_sink, offs, sink + pos32 % recent).to(tl.int64)
            kv_mask = valid[:, None] & d_mask[None, :]
            k, k_sc = F8.load_kv_tile(kl_base + local_slot[:, None] * stride_ln + offs_d[None, :], kv_mask,
                                      kls_base + local_slot * stride_lsn, valid, Q.dtype.element_ty, FP8)
            if RECENT > 0:
                k, k_sc = F8.recent_key_rows(k, k_sc, KRL + b * stride_krlb + kvh * stride_krlh, pos, stride_krln,
                                             offs_d, d_mask, valid, seq_len, RECENT)
            v, v_sc = F8.load_kv_tile(v_base + pos[:, None] * stride_vn + offs_d[None, :], kv_mask,
                                      vs_base + pos * stride_vsn, valid, Q.dtype.element_ty, FP8)
            s = C.tile_logits(q, k, sm_scale, True, IEEE)
            if FP8:
                s = s * k_sc[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            if RETURN_SCORES:
                tl.store(s_base + pos[None, :], s, mask=g_mask[:, None] & valid[None, :])
            m_i, l_i, acc = C.online_softmax_update(s, v, m_i, l_i, acc, True, IEEE, v_sc, FP8)

    C.store_partial(OPart, LSEPart, m_i, l_i, acc,
                    b * stride_opb + heads * stride_oph + split * stride_ops,
                    b * stride_lpb + heads * stride_lph + split,
                    g_mask, offs_d, D)


def _check_gate_estimate(gate_estimate, gate_tau, q):
    if gate_estimate is None:
        return
    if gate_tau is None:
        raise ValueError("gate_estimate is given but gate_tau is None; the estimate only decides a skip at gate_tau")
    if not isinstance(gate_estimate, torch.Tensor) or not gate_estimate.is_floating_point():
        raise TypeError(f"gate_estimate must be a float tensor [B,Hq], got "
                        f"{getattr(gate_estimate, 'dtype', type(gate_estimate).__name__)}")
    if tuple(gate_estimate.shape) != tuple(q.shape[:2]):
        raise ValueError(f"gate_estimate shape {tuple(gate_estimate.shape)} must be [B,Hq] = {tuple(q.shape[:2])}")
    if gate_estimate.device != q.device:
        raise ValueError(f"gate_estimate is on {gate_estimate.device} but q is on {q.device}; they must match")


def _checked_q_distant(q_distant, q):
    """``q_distant`` (score sharing's anchor queries) after checking that it matches q [B,Hq,D]."""
    C.check_float("q_distant", q_distant, 3, "[B,Hq,D]")
    if q_distant.shape != q.shape or q_distant.dtype != q.dtype or q_distant.device != q.device:
        raise ValueError(f"q_distant ({tuple(q_distant.shape)}, {q_distant.dtype}, {q_distant.device}) must "
                         f"match q ({tuple(q.shape)}, {q.dtype}, {q.device})")
    return q_distant


def _check_inputs(q, k_local, k_anchor, v_cache, seq_lens, sink, recent, gate_tau, k_local_scale=None,
                  k_anchor_scale=None, v_scale=None):
    """k_local None: the layer is its own anchor (proximal keys are k_anchor's rows). FP8 caches: all three
    float8_e4m3fn with their scales (kernels/fp8_kv.py)."""
    C.check_float("q", q, 3, "[B,Hq,D]")
    if k_local is not None:
        C.check_cache("k_local", k_local, "[B,Hkv,sink+recent,D]", q, "k_local_scale", k_local_scale)
    elif k_local_scale is not None:
        raise ValueError("k_local_scale is given but k_local is None (a layer that is its own anchor)")
    C.check_cache("k_anchor", k_anchor, "[B,Hkv,N,D]", q, "k_anchor_scale", k_anchor_scale)
    C.check_cache("v_cache", v_cache, "[B,Hkv,N,D]", q, "v_scale", v_scale)
    C.check_fp8_pair([("k_local", k_local), ("k_anchor", k_anchor), ("v_cache", v_cache)][k_local is None:])
    for name, val, low in (("sink", sink, 0), ("recent", recent, 1)):
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
    if gate_tau is not None and not (isinstance(gate_tau, (int, float)) and math.isfinite(gate_tau)):
        raise ValueError(f"gate_tau must be None or a finite float (paper default 0.7), got {gate_tau!r}")
    B, Hq, D = q.shape
    if v_cache.shape[0] != B or v_cache.shape[3] != D:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} does not match q [B={B},Hq={Hq},D={D}]; "
                         f"expected [B,Hkv,N,D]")
    if k_anchor.shape != v_cache.shape:
        raise ValueError(f"k_anchor shape {tuple(k_anchor.shape)} must equal v_cache shape {tuple(v_cache.shape)}")
    Hkv, N = v_cache.shape[1], v_cache.shape[2]
    want_local = (B, Hkv, sink + recent, D)
    if k_local is not None and tuple(k_local.shape) != want_local:
        raise ValueError(f"k_local shape {tuple(k_local.shape)} must be [B,Hkv,sink+recent,D] = {want_local}")
    C.check_head_dim(D)
    G = C.check_gqa(Hq, Hkv)
    C.check_index_tensor("seq_lens", seq_lens, 1, "[B]", q.device)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but the batch is B={B}")
    C.check_seq_lens_values(seq_lens, N)
    return B, Hq, Hkv, N, D, G


def pod_decode_attention_triton(q, k_local, k_anchor, v_cache, seq_lens, *, sink, recent, scale=None,
                                gate_tau=None, return_gate=False, gate_estimate=None, return_skip=False,
                                return_scores=False, k_local_scale=None, k_anchor_scale=None, v_scale=None,
                                q_distant=None, k_local_recent=None, k_anchor_recent=None, _num_warps=_NUM_WARPS):
    """POD decode attention.

    q: [B,Hq,D] (query at p = seq_lens-1); k_local: [B,Hkv,sink+recent,D] (sinks at slots 0..sink-1,
    the last `recent` positions j at slot sink + j % recent), or None for a layer that is its own anchor
    (proximal keys are k_anchor's: exact attention, with the gate an anchor estimate needs); k_anchor, v_cache: [B,Hkv,N,D]
    (slot = position); seq_lens: [B] in [1, N]; sink >= 0, recent >= 1.
    gate_estimate: None (gate_tau uses the exact gate) or [B,Hq] float, a pre-evaluated gate: heads
    with gate_estimate >= gate_tau read no distant key (module docstring). Needs gate_tau.
    `_num_warps` is a benchmark knob (launch width).
    Returns out [B,Hq,D] (q.dtype); with return_gate also gate [B,Hq] fp32 (the exact proximal gate,
    computed before any exact-gate skipping; 1 where no distant key exists or, with gate_estimate,
    where the head skipped); with return_skip also skip [B,Hq] bool (heads that dropped the distant
    part: gate >= tau, or gate_estimate >= tau; all False without gate_tau); with return_scores also
    scores [B,Hq,N] fp32, the logit of every position by the key the layer attends it with (own if proximal,
    anchor if distant), -inf past seq_lens (TidalDecode's selection in a POD layer; not with gate_estimate).
    Order: out, gate, skip, scores.
    k_local_scale [B,Hkv,sink+recent], k_anchor_scale, v_scale [B,Hkv,N]: fp32 scales of float8_e4m3fn caches
    (module docstring), else None.
    q_distant: [B,Hq,D] the query of the distant logits, default q (key sharing); the anchor layer's query of the
    same step gives v1's score sharing (METHODS.md A.3). The proximal logits keep q.
    k_local_recent, k_anchor_recent: FP8 caches only, [B,Hkv,W,D] in q's dtype, the layer's own and the anchor's keys
    of the newest W positions at slot position % W (kernels/fp8_kv.py "Recent keys"); both or neither, and a layer
    that is its own anchor (k_local None) passes k_anchor_recent only.
    """
    B, Hq, Hkv, N, D, G = _check_inputs(q, k_local, k_anchor, v_cache, seq_lens, sink, recent, gate_tau,
                                        k_local_scale, k_anchor_scale, v_scale)
    _check_gate_estimate(gate_estimate, gate_tau, q)
    C.check_recent(k_anchor_recent, k_anchor, q)
    if k_local is None and k_local_recent is not None:
        raise ValueError("k_local_recent is given but k_local is None (a layer that is its own anchor: its recent "
                         "keys are k_anchor_recent)")
    if k_local is not None:
        C.check_recent(k_local_recent, k_local, q)
        if (k_local_recent is None) != (k_anchor_recent is None):
            raise ValueError("k_local_recent and k_anchor_recent go together: pass both rings or neither")
        if k_local_recent is not None and k_local_recent.shape != k_anchor_recent.shape:
            raise ValueError(f"k_local_recent shape {tuple(k_local_recent.shape)} must equal k_anchor_recent shape "
                             f"{tuple(k_anchor_recent.shape)} (one window W for every layer)")
    if return_scores and gate_estimate is not None:
        raise ValueError("return_scores with gate_estimate: skipped heads read no distant key, so their distant "
                         "logits do not exist; ask for scores without a gate estimate")
    use_est = gate_estimate is not None
    est = gate_estimate.float().contiguous() if use_est else None
    scale = C.resolve_scale(scale, D)
    by_position = k_local is None
    q, k_anchor, v_cache = (C.last_dim_contiguous(t) for t in (q, k_anchor, v_cache))
    q_distant = q if q_distant is None else C.last_dim_contiguous(_checked_q_distant(q_distant, q))
    k_local = k_anchor if by_position else C.last_dim_contiguous(k_local)
    k_local_scale = k_anchor_scale if by_position else k_local_scale
    k_local_recent = k_anchor_recent if by_position else k_local_recent
    window = k_anchor_recent.shape[2] if k_anchor_recent is not None else 0
    rows = B * Hkv
    num_d, chunk_d = C.plan_splits(max(N - sink, 1), rows, q.device, _BLOCK_N)
    num_p, chunk_p = C.plan_splits(sink + recent, rows, q.device, _BLOCK_N, max_splits=8)
    num_splits = num_d + num_p
    o_part, lse_part = C.alloc_partials(B, Hq, num_splits, D, q.device)
    launch = dict(num_warps=_num_warps) if C.interpreting() else dict(num_warps=_num_warps, num_stages=_NUM_STAGES)
    # every position below seq_len is written by the kernel; the rest (past the sequence) stays -inf
    scores = torch.full((B, Hq, N), float("-inf"), device=q.device, dtype=torch.float32) if return_scores else None
    scale_args = [C.scale_args(t, lse_part) for t in (k_local_scale, k_anchor_scale, v_scale)]
    _pod_decode_split_kernel[(num_splits, rows)](
        q, q_distant, k_local, k_anchor, v_cache, seq_lens, o_part, lse_part, est if use_est else lse_part,
        scores if return_scores else lse_part, *(a[0] for a in scale_args),
        scale, sink, recent, num_d, chunk_d, chunk_p, float(gate_tau) if use_est else 0.0,
        q.stride(0), q.stride(1), q_distant.stride(0), q_distant.stride(1),
        k_local.stride(0), k_local.stride(1), k_local.stride(2),
        k_anchor.stride(0), k_anchor.stride(1), k_anchor.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *(x for a in scale_args for x in a[1:]),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        *((scores.stride(0), scores.stride(1)) if return_scores else (0, 0)),
        Hkv,
        *C.recent_args(k_local_recent, lse_part), *C.recent_args(k_anchor_recent, lse_part),
        G=G, BLOCK_G=C.block_g(G), BLOCK_N=_BLOCK_N, D=D, BLOCK_D=triton.next_power_of_2(D),
        IEEE=q.dtype == torch.float32, SKIP=use_est, LOCAL_BY_POSITION=by_position, RETURN_SCORES=return_scores,
        FP8=v_scale is not None, RECENT=window, RECENT_DISTANT=window if window > recent else 0,
        **launch,
    )
    # with an estimate the skipped heads' distant partials are already empty: no tau in the merge
    results = C.merge_gated_splits(o_part, lse_part, q, split_p_start=num_d, gate_tau=gate_tau, estimate=est,
                                   return_gate=return_gate, return_skip=return_skip)
    if not return_scores:
        return results
    return (*(results if isinstance(results, tuple) else (results,)), scores)
