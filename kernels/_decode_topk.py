"""Exact top-k slot selection per row for the TidalDecode selection layer: the "legacy" path.

The selection layer's default is now kernels/_decode_topk_split.py (every pass on every SM, the
first one fused into the attention); this module stays for comparison (topk_impl="legacy" or
PODKIT_SELECTION_TOPK=legacy).

`topk_slots_with_current`: one Triton launch, one program per row (sequence x selection head).
The fp32 scores are mapped to order-preserving uint32 keys; 32 / BITS passes over the row build
2**BITS-bin histograms of successive digits of the keys that still tie with the prefix found so far
(radix select, as in RAFT's select_k, which the TidalDecode and Quest CUDA kernels use), giving the
exact k-th largest key T and how many keys equal to T to keep. A final pass writes the slots with
key > T, plus the first such ties in slot order, compacted with a prefix sum: the output is
ascending without a sort. Rows with at most k valid (finite) entries skip the radix passes and keep
every valid slot. -inf entries are never selected.

`topk_slots_torch`: torch.topk(sorted=False) + a sort of the winners' slots.

`select_slots` picks between them by row length, from H200 measurements of every variant
(`eval/bench/kernels_decode.py --topk-variants`; BENCHMARKS.md, "Kernels (issue 3; H200, 2026-11-29)", the
TidalDecode selection layer; raw benchmarks/h200_2026-11-29/kernels_decode.json): the radix select wins for short
rows and loses at 32K and beyond, hence radix up to 16K slots and torch.topk above.

One program per row leaves most of the GPU idle at batch 1 and runs the histogram passes at a few
GB/s, so the radix kernel only wins for short rows. Every variant returned the same indices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._decode_topk_split import order_key, pick_digit  # the radix helpers both selection paths use

_BLOCK = 1024
# Radix digit width: 32 / _BITS histogram passes of 2**_BITS bins (8 and 4 timed on the H200).
_BITS = 4


@triton.jit
def _topk_rows_kernel(
    Scores, SeqLens, Out,
    N, K, budget, rows_per_seq,
    stride_sr, stride_or,
    BLOCK: tl.constexpr, BITS: tl.constexpr,
):
    """Row r: out[r] = ascending slots of the K largest finite scores, then seq_len-1 (the current
    slot, whose score the caller set to -inf), then -1 up to `budget` entries."""
    r = tl.program_id(0)
    b = r // rows_per_seq
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = Scores + r.to(tl.int64) * stride_sr
    out_row = Out + r.to(tl.int64) * stride_or
    neg_inf_key = order_key(tl.full([BLOCK], float("-inf"), tl.float32))

    NUM_BINS: tl.constexpr = 1 << BITS
    LEVELS: tl.constexpr = 32 // BITS
    # pass 0: valid count and histogram of the top digit
    hist = tl.zeros([NUM_BINS], tl.int32)
    n_valid = 0
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < N, other=float("-inf"))
        key = order_key(x)
        valid = key > neg_inf_key
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        hist += tl.histogram((key >> (32 - BITS)).to(tl.int32), NUM_BINS, mask=valid)

    threshold = tl.full((), 0x007FFFFF, tl.uint32)  # key of -inf: with n_valid <= K all valid keys are above
    ties = 0
    if n_valid > K:
        digit, k_rem = pick_digit(hist, K, NUM_BINS)
        prefix = digit.to(tl.uint32)
        for level in tl.static_range(1, LEVELS):
            hist = tl.zeros([NUM_BINS], tl.int32)
            for n0 in range(0, N, BLOCK):
                offs = n0 + tl.arange(0, BLOCK)
                x = tl.load(row + offs, mask=offs < N, other=float("-inf"))
                key = order_key(x)
                match = (key > neg_inf_key) & ((key >> (32 - BITS * level)) == prefix)
                hist += tl.histogram(((key >> (32 - BITS * (level + 1))) & (NUM_BINS - 1)).to(tl.int32),
                                     NUM_BINS, mask=match)
            digit, k_rem = pick_digit(hist, k_rem, NUM_BINS)
            prefix = (prefix << BITS) | digit.to(tl.uint32)
        threshold = prefix
        ties = k_rem

    # final pass: compact the winners in slot order
    count = 0
    ties_seen = 0
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < N, other=float("-inf"))
        key = order_key(x)
        valid = key > neg_inf_key
        eq = (valid & (key == threshold)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(eq, axis=0) - eq
        sel = (valid & (key > threshold)) | ((eq != 0) & (tie_rank < ties))
        sel_i = sel.to(tl.int32)
        pos = count + tl.cumsum(sel_i, axis=0) - sel_i
        tl.store(out_row + pos, offs.to(tl.int64), mask=sel)
        count += tl.sum(sel_i, axis=0)
        ties_seen += tl.sum(eq, axis=0)

    tail = count + tl.arange(0, BLOCK)
    tl.store(out_row + tail, tl.where(tail == count, seq_len - 1, -1).to(tl.int64), mask=tail < budget)
    for p0 in range(count + BLOCK, budget, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        tl.store(out_row + offs, tl.full([BLOCK], -1, tl.int64), mask=offs < budget)


def topk_slots_with_current(scores: torch.Tensor, seq_lens: torch.Tensor, budget: int,
                            _bits: int = _BITS) -> torch.Tensor:
    """scores[B,Hs,N] fp32 (contiguous rows; -inf = not selectable, including the current slot)
    -> indices[B,Hs,budget] int64: the top-(budget-1) slots ascending, then seq_lens[b]-1, then -1."""
    B, Hs, N = scores.shape
    out = torch.empty(B, Hs, budget, device=scores.device, dtype=torch.int64)
    rows = scores.reshape(B * Hs, N)
    _topk_rows_kernel[(B * Hs,)](
        rows, seq_lens, out,
        N, budget - 1, budget, Hs,
        rows.stride(0), budget,
        BLOCK=_BLOCK, BITS=_bits, num_warps=8,
    )
    return out


def topk_slots_torch(scores: torch.Tensor, seq_lens: torch.Tensor, budget: int) -> torch.Tensor:
    """Same contract as topk_slots_with_current, with torch.topk(sorted=False) + a sort of the
    winners' slots (the first version; kept for the sizes where it measured faster)."""
    B, Hs, N = scores.shape
    k_top = min(budget - 1, N)
    current = (seq_lens.to(torch.int64) - 1).view(B, 1, 1).expand(B, Hs, 1)
    if k_top > 0:
        values, idx = torch.topk(scores, k_top, dim=-1, sorted=False)
        # -inf winners are slots that do not exist: push them past every real slot so that the
        # sort leaves them at the end, then mark them -1
        idx = torch.where(values == float("-inf"), torch.full_like(idx, N), idx)
        chosen = torch.cat([idx, current], dim=-1)
    else:
        chosen = current.clone()
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen >= N, torch.full_like(chosen, -1), chosen)
    if chosen.shape[-1] < budget:
        pad = torch.full((B, Hs, budget - chosen.shape[-1]), -1, device=chosen.device, dtype=chosen.dtype)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen


# Rows up to this length use the radix kernel, longer ones torch.topk (table above).
RADIX_MAX_ROW = 16384


def select_slots(scores: torch.Tensor, seq_lens: torch.Tensor, budget: int) -> torch.Tensor:
    """top-(budget-1) slots ascending + the current slot + -1 padding, by the faster measured path."""
    if scores.shape[-1] <= RADIX_MAX_ROW:
        return topk_slots_with_current(scores, seq_lens, budget)
    return topk_slots_torch(scores, seq_lens, budget)
