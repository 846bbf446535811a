"""Exact top-k slot selection split across programs: a radix select whose passes all run on every SM.

Used by the TidalDecode selection layer (kernels/triton_decode_attention.py). The old path
(kernels/_decode_topk.py) runs one program per row: 32 programs for 32 heads at batch 1, a few GB/s
per pass. Here every pass is a grid of (chunk, row) programs over the fp32 selection scores, in the
manner of RAFT's "AIR top-k" radix select (Zhang et al., "Parallel Top-K Algorithms on GPU: A
Comprehensive Study and New Methods", SC 2023, section 4): each program histograms one digit of the
order-preserving uint32 keys of its chunk (only keys that still match the prefix found so far) and
adds its non-zero bins to the row's global histogram with atomics; the next pass's programs each
re-derive the prefix from those histograms (a few hundred integers), so no extra launch picks the
digit. With LEVELS = 32 / BITS digits the k-th largest key T and the number of ties at T to keep
are exact.

The first digit's histogram is built by the producer of the scores itself: the attention split
kernel (per-head selection) or the group-probability kernel (per-KV-group selection) counts the
top digit of every score it writes (`hist_level0`), so the attention's key chunks are the first
pass. The remaining passes read the scores back (16 MiB at 32 heads x 128K, L2-resident in part).

Output (same contract as kernels/_decode_topk.py): per row, the slots with key > T plus the first
`ties` slots with key == T, ascending (compacted with per-chunk counts and a prefix over the
chunks, no sort), then the current slot seq_len-1, then -1 padding up to `budget`. -inf scores
(slots past the sequence, the current slot) are never selected; a row with at most k finite scores
keeps all of them.

Buffers: hist[R, LEVELS, 2**BITS] int32 (zeroed per call), counts[R, S, 2] int32. Launches after
the producer: LEVELS-1 histogram passes, one count pass, one write pass (all CUDA-graph safe: the
grid depends on shapes only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _decode_common as C

# Radix digit width and passes: 4 passes of 256 bins (8 bits). The first digit (sign + 7 exponent
# bits) separates little for logits of similar magnitude, the later ones do the work.
BITS = 8
NUM_BINS = 1 << BITS
LEVELS = 32 // BITS
_BLOCK = 1024
_NUM_WARPS = 4


@triton.jit
def order_key(x):
    """fp32 -> uint32 with the same order (negative floats reversed, positive ones above them)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def neg_inf_key():
    """order_key(-inf): scores at or below it are not selectable."""
    return tl.full((), 0x007FFFFF, tl.uint32)


@triton.jit
def pick_digit(hist, k, NB: tl.constexpr):
    """Among the counted keys, the digit t of the k-th largest (k >= 1) and k's rank within t."""
    bins = tl.arange(0, NB)
    cum = tl.cumsum(hist, axis=0)
    total = tl.sum(hist, axis=0)
    at_or_above = total - cum + hist
    t = tl.max(tl.where(at_or_above >= k, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > t, hist, 0), axis=0)
    return t, k - above


@triton.jit
def resolve_prefix(hist_row, K, UPTO: tl.constexpr, BITS_: tl.constexpr):
    """From the row's histograms of levels 0..UPTO-1: (prefix of the k-th largest key's first
    UPTO digits, its rank among keys sharing that prefix, number of finite keys). With K == 0 or
    n_valid <= K the prefix is meaningless (callers check n_valid first)."""
    NB: tl.constexpr = 1 << BITS_
    bins = tl.arange(0, NB)
    h0 = tl.load(hist_row + bins)
    n_valid = tl.sum(h0, axis=0)
    k_rem = tl.maximum(K, 1)
    prefix = tl.full((), 0, tl.uint32)
    for level in tl.static_range(UPTO):
        h = tl.load(hist_row + level * NB + bins)
        digit, k_rem = pick_digit(h, k_rem, NB)
        prefix = (prefix << BITS_) | digit.to(tl.uint32)
    return prefix, k_rem, n_valid


@triton.jit
def threshold_and_ties(hist_row, K, LEVELS_: tl.constexpr, BITS_: tl.constexpr):
    """(T, ties): select keys > T plus the first `ties` keys == T, in slot order."""
    prefix, k_rem, n_valid = resolve_prefix(hist_row, K, LEVELS_, BITS_)
    none = K == 0
    keep_all = n_valid <= K
    threshold = tl.where(none, tl.full((), 0xFFFFFFFF, tl.uint32),
                         tl.where(keep_all, neg_inf_key(), prefix))
    ties = tl.where(none | keep_all, 0, k_rem)
    return threshold, ties


@triton.jit
def _hist_pass_kernel(
    Scores, Hist, N, K, chunk, stride_sr,
    LEVEL: tl.constexpr, BITS_: tl.constexpr, LEVELS_: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (chunk, row): histogram of digit LEVEL of the chunk's keys that match the prefix of
    levels 0..LEVEL-1 (LEVEL 0: every finite key), added into hist[row, LEVEL]."""
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    NB: tl.constexpr = 1 << BITS_
    hist_row = Hist + r * (LEVELS_ * NB)
    prefix, k_rem, n_valid = resolve_prefix(hist_row, K, LEVEL, BITS_)
    if ((n_valid > K) & (K > 0)) | (LEVEL == 0):  # rows with at most K finite keys keep them all
        row = Scores + r * stride_sr
        start = c * chunk
        end = tl.minimum(start + chunk, N)
        acc = tl.zeros([NB], tl.int32)
        for n0 in range(start, end, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            key = order_key(tl.load(row + offs, mask=offs < end, other=float("-inf")))
            match = key > neg_inf_key()
            if LEVEL > 0:
                match = match & ((key >> (32 - BITS_ * LEVEL)) == prefix)
            digit = ((key >> (32 - BITS_ * (LEVEL + 1))) & (NB - 1)).to(tl.int32)
            acc += tl.histogram(digit, NB, mask=match)
        bins = tl.arange(0, NB)
        tl.atomic_add(hist_row + LEVEL * NB + bins, acc, mask=acc > 0)


@triton.jit
def _count_kernel(
    Scores, Hist, Counts, N, K, chunk, num_chunks, stride_sr,
    BITS_: tl.constexpr, LEVELS_: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (chunk, row): counts[row, chunk] = (keys > T, keys == T) of the chunk."""
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    NB: tl.constexpr = 1 << BITS_
    threshold, ties = threshold_and_ties(Hist + r * (LEVELS_ * NB), K, LEVELS_, BITS_)
    row = Scores + r * stride_sr
    start = c * chunk
    end = tl.minimum(start + chunk, N)
    n_gt = 0
    n_eq = 0
    for n0 in range(start, end, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        key = order_key(tl.load(row + offs, mask=offs < end, other=float("-inf")))
        valid = key > neg_inf_key()
        n_gt += tl.sum((valid & (key > threshold)).to(tl.int32), axis=0)
        n_eq += tl.sum((valid & (key == threshold)).to(tl.int32), axis=0)
    base = Counts + (r * num_chunks + c) * 2
    tl.store(base, n_gt)
    tl.store(base + 1, n_eq)


@triton.jit
def _write_kernel(
    Scores, Hist, Counts, SeqLens, Out, N, K, budget, chunk, num_chunks, rows_per_seq,
    stride_sr, stride_or,
    BITS_: tl.constexpr, LEVELS_: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (chunk, row): writes the chunk's winners at their ascending positions (after the
    winners of earlier chunks); the last chunk also writes the current slot and the -1 padding."""
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    NB: tl.constexpr = 1 << BITS_
    threshold, ties = threshold_and_ties(Hist + r * (LEVELS_ * NB), K, LEVELS_, BITS_)
    offs_s = tl.arange(0, BLOCK_S)
    cnt = Counts + r * num_chunks * 2 + offs_s * 2
    s_mask = offs_s < num_chunks
    gt = tl.load(cnt, mask=s_mask, other=0)
    eq = tl.load(cnt + 1, mask=s_mask, other=0)
    gt_before = tl.sum(tl.where(offs_s < c, gt, 0), axis=0)
    eq_before = tl.sum(tl.where(offs_s < c, eq, 0), axis=0)
    count = gt_before + tl.minimum(eq_before, ties)
    ties_seen = eq_before
    row = Scores + r * stride_sr
    out_row = Out + r * stride_or
    start = c * chunk
    end = tl.minimum(start + chunk, N)
    for n0 in range(start, end, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        key = order_key(tl.load(row + offs, mask=offs < end, other=float("-inf")))
        valid = key > neg_inf_key()
        eq_i = (valid & (key == threshold)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(eq_i, axis=0) - eq_i
        sel = (valid & (key > threshold)) | ((eq_i != 0) & (tie_rank < ties))
        sel_i = sel.to(tl.int32)
        pos = count + tl.cumsum(sel_i, axis=0) - sel_i
        tl.store(out_row + pos, offs.to(tl.int64), mask=sel)
        count += tl.sum(sel_i, axis=0)
        ties_seen += tl.sum(eq_i, axis=0)
    if c == num_chunks - 1:
        b = r // rows_per_seq
        seq_len = tl.load(SeqLens + b).to(tl.int64)
        total = tl.sum(gt, axis=0) + tl.minimum(tl.sum(eq, axis=0), ties)
        for p0 in range(total, budget, BLOCK):
            offs = p0 + tl.arange(0, BLOCK)
            tl.store(out_row + offs, tl.where(offs == total, seq_len - 1, -1), mask=offs < budget)


def alloc_hist(rows: int, device) -> torch.Tensor:
    """Zeroed hist[rows, LEVELS, NUM_BINS] int32 (the atomics add into it)."""
    return torch.zeros(rows, LEVELS, NUM_BINS, device=device, dtype=torch.int32)


def plan_chunks(N: int, rows: int, device) -> tuple[int, int]:
    """(num_chunks, chunk) for the passes: about 4 programs per SM in all, chunks of whole blocks."""
    return C.plan_splits(N, rows, device, _BLOCK)


def split_topk_slots(scores: torch.Tensor, seq_lens: torch.Tensor, budget: int,
                     hist: torch.Tensor | None = None) -> torch.Tensor:
    """scores[B,Hs,N] fp32 (contiguous rows; -inf = not selectable, including the current slot)
    -> indices[B,Hs,budget] int64: the top-(budget-1) slots ascending, then seq_lens[b]-1, then -1.

    hist: the [B*Hs, LEVELS, NUM_BINS] buffer from alloc_hist with level 0 already filled by the
    producer of `scores` (see hist_level0 in the attention kernels); None builds level 0 here.
    """
    B, Hs, N = scores.shape
    R = B * Hs
    K = budget - 1
    rows = scores.reshape(R, N)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(B, Hs, budget, device=scores.device, dtype=torch.int64)
    num_chunks, chunk = plan_chunks(N, R, scores.device)
    grid = (num_chunks, R)
    first = 1
    if hist is None:
        hist = alloc_hist(R, scores.device)
        first = 0
    elif tuple(hist.shape) != (R, LEVELS, NUM_BINS) or hist.dtype != torch.int32:
        raise ValueError(f"hist must be int32 [{R}, {LEVELS}, {NUM_BINS}], got {hist.dtype} {tuple(hist.shape)}")
    common = dict(BITS_=BITS, LEVELS_=LEVELS, BLOCK=_BLOCK, num_warps=_NUM_WARPS)
    for level in range(first, LEVELS):
        _hist_pass_kernel[grid](rows, hist, N, K, chunk, rows.stride(0), LEVEL=level, **common)
    counts = torch.empty(R, num_chunks, 2, device=scores.device, dtype=torch.int32)
    _count_kernel[grid](rows, hist, counts, N, K, chunk, num_chunks, rows.stride(0), **common)
    _write_kernel[grid](rows, hist, counts, seq_lens, out, N, K, budget, chunk, num_chunks, Hs,
                        rows.stride(0), budget, BLOCK_S=max(2, triton.next_power_of_2(num_chunks)), **common)
    return out
