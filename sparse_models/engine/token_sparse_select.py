"""Token Sparse Attention's per-head token selection for one prefill layer (Jo et al., arXiv 2602.03216).

methods.md C.1 steps 2-5: window scores (``kernels.token_sparse_scores``: mean softmax probability of
each prefix key over the last ``window`` queries), average-pool smoothing, Dynamic Token Coverage (the
layer keeps the smallest prefix set whose dropped tail mass stays below ``coverage``, at least
``min_tokens``; one count per sequence, shared by its heads), per-head top-k + the window.

``keep_ratio`` replaces Dynamic Token Coverage by a fixed fraction of the prefix (benchmarks sweep
0.5 / 0.25 this way). Sequences with length <= min_tokens + window are left dense (all positions kept).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import kernels


def token_sparse_indices(q: torch.Tensor, k: torch.Tensor, lens: torch.Tensor, *, window: int, min_tokens: int,
                         pool_kernel: int, coverage: float, keep_ratio: float | None = None):
    """Kept positions per query head.

    Args:
        q: [B, Hq, S, D]; k: [B, Hkv, S, D] (post-RoPE, positions 0..S-1); lens: [B] valid lengths.
    Returns:
        (indices [B, Hq, K] int64 ascending, -1 padded; kept_fraction [B] float, kept / valid tokens).
    """
    batch, num_heads, s, _ = q.shape
    scores = kernels.token_sparse_scores(q, k, lens, window).float()  # [B, Hq, S]
    if pool_kernel > 1:
        scores = F.avg_pool1d(scores.reshape(batch * num_heads, 1, s), pool_kernel, stride=1,
                              padding=pool_kernel // 2).reshape(batch, num_heads, s)
    rows, kept = [], []
    lens_host = lens.tolist()
    for b, n in enumerate(lens_host):
        prefix = max(n - window, 0)
        positions = torch.arange(n, device=q.device)
        if n <= min_tokens + window or prefix == 0:
            rows.append(positions[None, :].expand(num_heads, n))
            kept.append(1.0)
            continue
        s_b = scores[b, :, :prefix]
        if keep_ratio is not None:
            k_keep = max(1, min(prefix, math.ceil(keep_ratio * prefix)))
        else:
            mean = s_b.mean(0)
            mean = mean / mean.sum().clamp(min=1e-30)
            cum = torch.cumsum(torch.sort(mean).values, 0)
            k_sparse = int((cum < coverage).sum()) + 1
            k_keep = max(min_tokens, prefix - k_sparse)
            k_keep = min(k_keep, prefix)
        top = torch.topk(s_b, k_keep, dim=-1).indices
        win = torch.arange(prefix, n, device=q.device)[None, :].expand(num_heads, -1)
        rows.append(torch.sort(torch.cat([top, win], dim=-1), dim=-1).values)
        kept.append((k_keep + (n - prefix)) / n)
    width = max(r.shape[1] for r in rows)
    indices = torch.full((batch, num_heads, width), -1, dtype=torch.long, device=q.device)
    for b, r in enumerate(rows):
        indices[b, :, :r.shape[1]] = r
    return indices, torch.tensor(kept)
