"""TidalDecode's token selection on CUDA (``kernels.select_topk_positions``): the reference's rule
(kernels/reference.py, METHODS.md B.2), with the union modes' per-head top-k taken by the split radix top-k
(kernels/_decode_topk_split.py).

The union lists (``group_union`` / ``all_union``) need each head's k best slots in rank order. In torch that
is either ``torch.topk`` (one block per row: 32 rows for 32 heads at batch 1) or a sort of every slot of every
head; the split radix select spreads each pass over every SM, and only the k winners per head are then sorted
(BENCHMARKS.md, "TidalDecode's union lists from each head's top-k"). The other modes are the reference's.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels._decode_topk_split import split_topk_slots


def split_head_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each head's k best slots, best first (equal logits: the lower slot first), as ``head_top_k`` of
    ``reference.select_topk_positions``.

    Args:
        logits: [B, H, N] fp32, -inf where a slot is not selectable (not older, past the sequence).
        k: slots per head, 1 <= k < N.
    Returns:
        [B, H, k] int64. A head with fewer than k selectable slots ends with slot N - 1 (never older: the
        current token sits at or before it), repeated: the union ranks those last and pads them to -1.
    """
    batch, heads, n = logits.shape
    logits = (logits + 0.0).contiguous()  # -0.0 -> +0.0: the radix keys put -0.0 below +0.0, the sort ties them
    # seq_lens = N: the split top-k then scans every slot and appends slot N - 1 after the selected ones
    last = torch.full((batch,), n, dtype=torch.int64, device=logits.device)
    chosen = split_topk_slots(logits, last, k + 1)[..., :k]  # ascending, then N - 1, then -1
    chosen = torch.where(chosen < 0, torch.full_like(chosen, n - 1), chosen)
    keys = reference._head_order_keys(torch.gather(logits, -1, chosen), chosen, n)
    return chosen.gather(-1, torch.argsort(keys, dim=-1, descending=True))


def select_topk_positions_triton(scores, seq_lens, budget, **options):
    """``reference.select_topk_positions`` (same arguments and result) with :func:`split_head_top_k`."""
    return reference.select_topk_positions(scores, seq_lens, budget, head_top_k=split_head_top_k, **options)
