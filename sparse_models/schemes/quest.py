"""Quest: query-aware page selection (Tang et al., arXiv 2406.10774; METHODS.md D), a decode baseline.

The cache keeps per-page, per-channel key max/min (``SparseKVCache.page_max/page_min``, the engine's
``StaticCache.page_max/page_min``). Each query head scores pages by the upper bound
sum_i max(q_i M_i, q_i m_i), keeps the top ``budget // page_size`` (the current page always among
them) and attends to their tokens exactly. The first ``quest.dense_layers`` stay dense (role ``dense``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels

from ..validation import check_int, check_layer_list, check_layers_exist, fail
from .base import Budget, CacheNeeds, Footprint, Scheme, covers_cache, exact_decode


@dataclass
class QuestConfig:
    """Quest: query-aware page selection (Tang et al., arXiv 2406.10774), a decode baseline.

    Pages of ``page_size`` tokens keep per-channel key min/max; each head keeps the top
    ``budget // page_size`` pages by the upper bound sum_i max(q_i M_i, q_i m_i), the current page
    always included. ``dense_layers`` run dense decode (paper: the first two).
    """

    page_size: int = 16
    budget: int = 2048
    dense_layers: list[int] = field(default_factory=lambda: [0, 1])

    def __post_init__(self) -> None:
        check_int("quest.page_size", self.page_size, 1)
        check_int("quest.budget", self.budget, 1)
        if self.budget < self.page_size:
            fail("quest.budget", self.budget, f"expected at least one page (quest.page_size={self.page_size})")
        check_layer_list("quest.dense_layers", self.dense_layers)


def quest_indices(q: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor, seq_lens: torch.Tensor,
                  page_size: int, budget: int) -> torch.Tensor:
    """q [B, Hq, D], page_max/min [B, Hkv, P, D] -> selected token slots [B, Hq, K], -1 padded."""
    scores = kernels.quest_page_scores(q, page_max, page_min, seq_lens, page_size)
    return kernels.quest_select_pages(scores, seq_lens, page_size, budget)


def quest_decode(view, q: torch.Tensor, row, step) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]: exact attention over the tokens of the selected pages."""
    if covers_cache(view, view.config.quest.budget):  # every page would be selected: exact attention
        return view.full(q)
    page_max, page_min, page_size = view.key_pages()
    return view.sparse(q, quest_indices(q, page_max, page_min, view.lens, page_size, view.config.quest.budget))


def quest_decode_roles(config, num_layers: int, anchors, family=None) -> list[tuple[str, None]]:
    check_layers_exist("quest.dense_layers", config.quest.dense_layers, num_layers)
    return [("dense" if layer in config.quest.dense_layers else "quest", None) for layer in range(num_layers)]


SCHEME = Scheme(
    name="quest",
    summary="Quest: per-head top pages by a key min/max upper bound (decode)",
    config_key="quest",
    config_cls=QuestConfig,
    decode_roles=quest_decode_roles,
    decode={"dense": exact_decode, "quest": quest_decode},
    cache=CacheNeeds(page_roles=("quest",), page_size=lambda config: config.quest.page_size),
    budget=Budget("tokens of the selected pages = quest.budget (page size 16), the current page included",
                  lambda budget, given: {"quest_budget": budget}, reads=lambda config: config.quest.budget),
    footprint=Footprint(budget_roles=("quest",)),  # the full cache is kept: Quest saves reads, not memory
    display_name="Quest",
    order=20,
)
