"""Token Sparse Attention in the engine's prefill (Jo et al., arXiv 2602.03216; METHODS.md C.1).

The paper's selection (window scores, pooling, Dynamic Token Coverage, per-head top-k + window) is
``sparse_models.schemes.token_sparse`` — the same code the model class runs, so both paths keep the
same tokens. The engine adds one benchmark knob: ``keep_ratio`` replaces Dynamic Token Coverage by a
fixed fraction of each sequence's prefix (the e2e benchmark sweeps 0.5 / 0.25 this way); sequences
with length <= min_tokens + window stay dense, as in the paper's skip rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import kernels

from ..schemes.token_sparse import LayerSparsity, TokenSparseConfig, TokenSparseStats, token_sparse_prefill


def fixed_ratio_indices(q: torch.Tensor, k: torch.Tensor, lens: torch.Tensor, cfg: TokenSparseConfig,
                        keep_ratio: float):
    """Kept positions [B, Hq, K] (ascending, -1 padded) and kept counts [B]: per head the top
    ceil(keep_ratio * prefix) prefix tokens by pooled window score, plus the window."""
    batch, num_heads, s, _ = q.shape
    window = cfg.window
    scores = kernels.token_sparse_scores(q, k, lens, window).float()
    if cfg.pool_kernel > 1:
        scores = F.avg_pool1d(scores.reshape(batch * num_heads, 1, s), cfg.pool_kernel, stride=1,
                              padding=cfg.pool_kernel // 2).reshape(batch, num_heads, s)
    rows, kept, sparse = [], [], []
    for b, n in enumerate(lens.tolist()):
        prefix = max(n - window, 0)
        if n <= cfg.min_tokens + window or prefix == 0:
            rows.append(torch.arange(n, device=q.device)[None, :].expand(num_heads, n))
            kept.append(n)
            sparse.append(False)
            continue
        k_keep = max(1, min(prefix, math.ceil(keep_ratio * prefix)))
        top = torch.topk(scores[b, :, :prefix], k_keep, dim=-1).indices
        win = torch.arange(prefix, n, device=q.device)[None, :].expand(num_heads, -1)
        rows.append(torch.sort(torch.cat([top, win], dim=-1), dim=-1).values)
        kept.append(k_keep + n - prefix)
        sparse.append(k_keep < prefix)
    width = max(r.shape[1] for r in rows)
    indices = torch.full((batch, num_heads, width), -1, dtype=torch.long, device=q.device)
    for b, r in enumerate(rows):
        indices[b, :, :r.shape[1]] = r
    return indices, kept, sparse


def token_sparse_attention(q, k, v, lens, cfg: TokenSparseConfig, layer: int, stats: TokenSparseStats | None,
                           keep_ratio: float | None = None, scale: float | None = None) -> torch.Tensor:
    """One Token Sparse prefill layer: q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D]."""
    if keep_ratio is None:
        return token_sparse_prefill(q, k, v, lens, cfg, layer, stats)
    indices, kept, sparse = fixed_ratio_indices(q, k, lens, cfg, keep_ratio)
    if stats is not None:
        stats.layers[layer] = LayerSparsity(layer, lens.tolist(), kept, sparse)
    if not any(sparse):
        return kernels.prefill_attention(q, k, v, torch.zeros_like(lens), lens, scale=scale)
    return kernels.sparse_prefill_attention(q, k, v, indices, scale=scale)
