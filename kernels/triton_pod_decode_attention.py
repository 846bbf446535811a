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

gate_tau (paper default 0.7): heads whose exact gate g >= tau output proximal attention only. This
follows kernels/reference.py, which computes the exact gate first, i.e. reading (i) of METHODS.md
A.4: the result matches the paper's skip rule, but the distant keys and values are still read
(the gate needs lse_D), so it saves no bandwidth in this kernel. A bandwidth-saving variant would
take g from an earlier layer (reading (ii)) and is not implemented here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import _decode_common as C

_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 2


@triton.jit
def _pod_decode_split_kernel(
    Q, KLocal, KAnchor, V, SeqLens, OPart, LSEPart,
    sm_scale, sink, recent, num_distant_splits, chunk_d, chunk_p,
    stride_qb, stride_qh,
    stride_lb, stride_lh, stride_ln,
    stride_ab, stride_ah, stride_an,
    stride_vb, stride_vh, stride_vn,
    stride_opb, stride_oph, stride_ops,
    stride_lpb, stride_lph,
    Hkv,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (split, b*Hkv + kvh). Splits < num_distant_splits: distant positions
    [sink + split*chunk_d, ...) below p - recent + 1, keys from k_anchor. Other splits: virtual
    proximal slots t in [(split - nd)*chunk_p, ...) below sink + recent: t < sink is position t,
    t >= sink is position seq_len - recent + (t - sink) (kept when >= sink), keys from k_local."""
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
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if split < num_distant_splits:
        # distant: contiguous positions, keys from the anchor (same access pattern as full decode,
        # kept in its own loop so that the loads stay vectorised)
        ka_base = KAnchor + b * stride_ab + kvh * stride_ah
        dist_end = tl.maximum(sink, seq_len - recent)  # distant positions: [sink, dist_end)
        lo = sink + split * chunk_d
        hi = tl.minimum(lo + chunk_d, dist_end)
        for n0 in range(lo, hi, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            valid = offs < hi
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(ka_base + offs[:, None] * stride_an + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
            s = C.tile_logits(q, k, sm_scale, True, IEEE)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_i, l_i, acc = C.online_softmax_update(s, v, m_i, l_i, acc, True, IEEE)
    else:
        # proximal: virtual slots t (sinks, then the ring in position order), keys from k_local
        kl_base = KLocal + b * stride_lb + kvh * stride_lh
        lo = (split - num_distant_splits) * chunk_p
        hi = tl.minimum(lo + chunk_p, sink + recent)
        for n0 in range(lo, hi, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            is_sink = offs < sink
            ring_pos = seq_len - recent + (offs - sink)
            valid = (offs < hi) & tl.where(is_sink, offs < seq_len, ring_pos >= sink)
            pos = tl.where(valid, tl.where(is_sink, offs, ring_pos), 0).to(tl.int64)
            local_slot = tl.where(is_sink, offs, sink + pos % recent).to(tl.int64)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(kl_base + local_slot[:, None] * stride_ln + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + pos[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
            s = C.tile_logits(q, k, sm_scale, True, IEEE)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_i, l_i, acc = C.online_softmax_update(s, v, m_i, l_i, acc, True, IEEE)

    C.store_partial(OPart, LSEPart, m_i, l_i, acc,
                    b * stride_opb + heads * stride_oph + split * stride_ops,
                    b * stride_lpb + heads * stride_lph + split,
                    g_mask, offs_d, D)


def _check_inputs(q, k_local, k_anchor, v_cache, seq_lens, sink, recent, gate_tau):
    C.check_float("q", q, 3, "[B,Hq,D]")
    C.check_float("k_local", k_local, 4, "[B,Hkv,sink+recent,D]")
    C.check_float("k_anchor", k_anchor, 4, "[B,Hkv,N,D]")
    C.check_float("v_cache", v_cache, 4, "[B,Hkv,N,D]")
    for name, t in (("k_local", k_local), ("k_anchor", k_anchor), ("v_cache", v_cache)):
        C.check_same(name, t, "q", q)
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
    if tuple(k_local.shape) != want_local:
        raise ValueError(f"k_local shape {tuple(k_local.shape)} must be [B,Hkv,sink+recent,D] = {want_local}")
    C.check_head_dim(D)
    G = C.check_gqa(Hq, Hkv)
    C.check_index_tensor("seq_lens", seq_lens, 1, "[B]", q.device)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but the batch is B={B}")
    C.check_seq_lens_values(seq_lens, N)
    return B, Hq, Hkv, N, D, G


def pod_decode_attention_triton(q, k_local, k_anchor, v_cache, seq_lens, *, sink, recent, scale=None,
                                gate_tau=None, return_gate=False):
    """POD decode attention.

    q: [B,Hq,D] (query at p = seq_lens-1); k_local: [B,Hkv,sink+recent,D] (sinks at slots 0..sink-1,
    the last `recent` positions j at slot sink + j % recent); k_anchor, v_cache: [B,Hkv,N,D]
    (slot = position); seq_lens: [B] in [1, N]; sink >= 0, recent >= 1.
    Returns out [B,Hq,D] (q.dtype), and with return_gate gate [B,Hq] fp32 (the exact proximal gate,
    computed before any gate_tau skipping; 1 where no distant key exists).
    """
    B, Hq, Hkv, N, D, G = _check_inputs(q, k_local, k_anchor, v_cache, seq_lens, sink, recent, gate_tau)
    scale = C.resolve_scale(scale, D)
    q, k_local, k_anchor, v_cache = (C.last_dim_contiguous(t) for t in (q, k_local, k_anchor, v_cache))
    rows = B * Hkv
    num_d, chunk_d = C.plan_splits(max(N - sink, 1), rows, q.device, _BLOCK_N)
    num_p, chunk_p = C.plan_splits(sink + recent, rows, q.device, _BLOCK_N, max_splits=8)
    num_splits = num_d + num_p
    o_part, lse_part = C.alloc_partials(B, Hq, num_splits, D, q.device)
    launch = dict(num_warps=_NUM_WARPS) if C.interpreting() else dict(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    _pod_decode_split_kernel[(num_splits, rows)](
        q, k_local, k_anchor, v_cache, seq_lens, o_part, lse_part,
        scale, sink, recent, num_d, chunk_d, chunk_p,
        q.stride(0), q.stride(1),
        k_local.stride(0), k_local.stride(1), k_local.stride(2),
        k_anchor.stride(0), k_anchor.stride(1), k_anchor.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        Hkv,
        G=G, BLOCK_G=C.block_g(G), BLOCK_N=_BLOCK_N, D=D, BLOCK_D=triton.next_power_of_2(D),
        IEEE=q.dtype == torch.float32,
        **launch,
    )
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    gate = torch.empty(B, Hq, device=q.device, dtype=torch.float32) if return_gate else None
    C.merge_splits(o_part, lse_part, out, gate_out=gate, split_p_start=num_d, tau=gate_tau)
    return (out, gate) if return_gate else out
