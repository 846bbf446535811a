"""Quest: query-aware page selection (Tang et al., arXiv 2406.10774), a decode baseline.

The cache keeps per-page, per-channel key max/min (``SparseKVCache.page_max/page_min``). Each query
head scores pages by the upper bound sum_i max(q_i M_i, q_i m_i), keeps the top
``budget // page_size`` (the current page always among them) and attends to their tokens exactly.
The first ``quest.dense_layers`` stay dense (plan role ``dense``).
"""

from __future__ import annotations

import torch

import kernels

from ..config import QuestConfig


def quest_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                 page_max: torch.Tensor, page_min: torch.Tensor, cfg: QuestConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] -> (out [B, Hq, D], selected token slots [B, Hq, K])."""
    scores = kernels.quest_page_scores(q, page_max, page_min, seq_lens, cfg.page_size)
    indices = kernels.quest_select_pages(scores, seq_lens, cfg.page_size, cfg.budget)
    return kernels.sparse_decode_attention(q, k_cache, v_cache, indices), indices
