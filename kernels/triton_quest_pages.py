"""Quest page scoring and page selection in Triton (Tang et al., "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", ICML 2024, arXiv 2406.10774; METHODS.md D.1).

`quest_page_scores_triton`: per (query head, page) the upper bound U = sum_i max(q_i M_i, q_i m_i)
of q.k over the page's keys, from the per-page channel max M / min m (unscaled: ranking only).
One program per (page block, sequence, KV head) loads each page's M/m once for the G query heads
of the group. Pages past the sequence get -inf; the current (last, possibly partial) page +inf so
that it is always selected (Quest attends to it unconditionally; the budget counts it).

`quest_select_pages_triton`: top budget // page_size pages per head (the current page included),
expanded to ascending token slots, -1 padded. The k-largest search over the P = N / page_size
page scores is torch.topk (P is 16x smaller than the key count, 8K pages at 128K tokens); the
expansion of the chosen pages into slots, with the seq_lens cut, is one Triton kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _decode_common as C

_BLOCK_P = 32


@triton.jit
def _quest_page_scores_kernel(
    Q, PMax, PMin, SeqLens, Scores,
    num_pages_total, page_size,
    stride_qb, stride_qh,
    stride_xb, stride_xh, stride_xp,
    stride_nb, stride_nh, stride_np,
    stride_sb, stride_sh,
    Hkv,
    G: tl.constexpr, BLOCK_P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    used_pages = (seq_len + page_size - 1) // page_size
    current = used_pages - 1
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < num_pages_total
    d_mask = offs_d < D
    # only pages that hold tokens are read; the others are -inf whatever the tensors contain
    load_mask = (offs_p < used_pages)[:, None] & d_mask[None, :]
    mx = tl.load(PMax + b * stride_xb + kvh * stride_xh + offs_p[:, None] * stride_xp + offs_d[None, :],
                 mask=load_mask, other=0.0).to(tl.float32)
    mn = tl.load(PMin + b * stride_nb + kvh * stride_nh + offs_p[:, None] * stride_np + offs_d[None, :],
                 mask=load_mask, other=0.0).to(tl.float32)
    for g in tl.static_range(G):
        h = kvh * G + g
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        bound = tl.sum(tl.maximum(q[None, :] * mx, q[None, :] * mn), axis=1)
        bound = tl.where(offs_p < used_pages, bound, float("-inf"))
        bound = tl.where(offs_p == current, float("inf"), bound)
        tl.store(Scores + b * stride_sb + h * stride_sh + offs_p, bound, mask=p_mask)


def quest_page_scores_triton(q, page_max, page_min, seq_lens, page_size):
    """q: [B,Hq,D]; page_max, page_min: [B,Hkv,P,D] (any float dtype; min/max of the post-RoPE keys
    of each page); seq_lens: [B] in [1, P*page_size]; page_size >= 1.
    Returns scores [B,Hq,P] fp32: sum_i max(q_i M_i, q_i m_i); -inf for pages without tokens,
    +inf for the current page (the one holding slot seq_lens-1)."""
    C.check_float("q", q, 3, "[B,Hq,D]")
    C.check_float("page_max", page_max, 4, "[B,Hkv,P,D]")
    C.check_float("page_min", page_min, 4, "[B,Hkv,P,D]")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    B, Hq, D = q.shape
    for name, t in (("page_max", page_max), ("page_min", page_min)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
        if t.shape[0] != B or t.shape[3] != D:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match q [B={B},Hq={Hq},D={D}]; "
                             f"expected [B,Hkv,P,D]")
    if page_min.shape != page_max.shape:
        raise ValueError(f"page_min shape {tuple(page_min.shape)} must equal page_max shape {tuple(page_max.shape)}")
    C.check_head_dim(D)
    Hkv, P = page_max.shape[1], page_max.shape[2]
    G = C.check_gqa(Hq, Hkv)
    C.check_index_tensor("seq_lens", seq_lens, 1, "[B]", q.device)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but the batch is B={B}")
    C.check_seq_lens_values(seq_lens, P * page_size)
    q, page_max, page_min = (C.last_dim_contiguous(t) for t in (q, page_max, page_min))
    scores = torch.empty(B, Hq, P, device=q.device, dtype=torch.float32)
    _quest_page_scores_kernel[(triton.cdiv(P, _BLOCK_P), B * Hkv)](
        q, page_max, page_min, seq_lens, scores,
        P, page_size,
        q.stride(0), q.stride(1),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        scores.stride(0), scores.stride(1),
        Hkv,
        G=G, BLOCK_P=_BLOCK_P, D=D, BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
    )
    return scores


@triton.jit
def _expand_pages_kernel(
    Pages, SeqLens, Out,
    num_sel, num_pages_total, page_size, Hs,
    stride_pb, stride_ph, stride_ob, stride_oh,
    BLOCK: tl.constexpr,
):
    """out[b,h,e] = pages[b,h,e // page_size] * page_size + e % page_size, -1 where the page is
    the padding sentinel (>= num_pages_total) or the slot is past seq_lens[b]."""
    eb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hs).to(tl.int64)
    h = bh % Hs
    seq_len = tl.load(SeqLens + b)
    offs = eb * BLOCK + tl.arange(0, BLOCK)
    e_mask = offs < num_sel * page_size
    page = tl.load(Pages + b * stride_pb + h * stride_ph + offs // page_size, mask=e_mask, other=num_pages_total)
    slot = page * page_size + offs % page_size
    valid = (page < num_pages_total) & (slot < seq_len)
    tl.store(Out + b * stride_ob + h * stride_oh + offs, tl.where(valid, slot, -1), mask=e_mask)


def quest_select_pages_triton(scores, seq_lens, page_size, budget):
    """scores: [B,Hs,P] fp32 page scores (-inf = no tokens, the current page +inf); seq_lens: [B];
    page_size, budget: ints >= 1.
    Returns indices [B,Hs,K] int64, K = n * page_size with n = max(1, min(budget // page_size, P)):
    the slots of the n best pages in ascending order; -1 for pages without tokens and slots >= seq_lens."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3 or not scores.dtype.is_floating_point:
        raise ValueError(f"scores must be a float tensor [B,Hs,P], got "
                         f"{tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__}")
    for name, val in (("page_size", page_size), ("budget", budget)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    B, Hs, P = scores.shape
    C.check_index_tensor("seq_lens", seq_lens, 1, "[B]", scores.device)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but scores has batch B={B}")
    num_sel = max(1, min(budget // page_size, P))
    values, pages = torch.topk(scores, num_sel, dim=-1, sorted=False)
    # pages without tokens (-inf) become a sentinel past every real page so the sort moves them last
    pages = torch.where(values == float("-inf"), torch.full_like(pages, P), pages)
    pages = torch.sort(pages, dim=-1).values
    K = num_sel * page_size
    out = torch.empty(B, Hs, K, device=scores.device, dtype=torch.int64)
    block = min(1024, triton.next_power_of_2(K))
    _expand_pages_kernel[(triton.cdiv(K, block), B * Hs)](
        pages, seq_lens, out,
        num_sel, P, page_size, Hs,
        pages.stride(0), pages.stride(1), out.stride(0), out.stride(1),
        BLOCK=block, num_warps=4,
    )
    return out
