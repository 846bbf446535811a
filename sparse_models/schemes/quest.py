"""Quest: query-aware page selection (Tang et al., arXiv 2406.10774; METHODS.md D), a decode baseline.

The cache keeps per-page, per-channel key max/min: two ``StateBuffer``s, ``page_max`` / ``page_min``
[B, Hkv, ceil(N / page_size), D], declared below in ``CacheNeeds`` with the ``KeyState`` that keeps them in step
with the stored keys (whole pages by ``kernels.quest_page_minmax``, a decode token by :func:`fold_token`); both
caches allocate and update them from that description. Each query head scores pages by the upper bound
sum_i max(q_i M_i, q_i m_i), keeps the top ``budget // page_size`` (the current page always among
them) and attends to their tokens exactly. The first ``quest.dense_layers`` stay dense (role ``dense``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from kernels.fp8_kv import round_outward

from ..validation import check_int, check_layer_list, check_layers_exist, fail
from .base import Budget, CacheNeeds, Footprint, KeyState, Scheme, StateBuffer, covers_cache, exact_decode


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


def page_bounds(keys: torch.Tensor, lens: torch.Tensor, k_scale: torch.Tensor | None, page_size: int,
                dtype: torch.dtype, also: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_max, page_min) [B, Hkv, ceil(N / page_size), D] in ``dtype`` of the stored keys [B, Hkv, N, D] (the first
    ``lens[b]`` of row b; empty pages -inf / +inf): ``KeyState.rebuild``. An FP8 cache's (``k_scale``) bound the
    dequantised keys, rounded outward (kernels/fp8_kv.py ``round_outward``); otherwise a plain cast of the fp32
    bounds. ``also`` [B, Hkv, N, D]: a second version of the keys that attention reads for a while (an FP8 cache's
    recent keys in the model's dtype, ``kv_cache_recent_keys``); the bounds then hold for both versions."""
    page_max, page_min = kernels.quest_page_minmax(keys, lens, page_size, k_scale=k_scale)
    if also is not None:
        also_max, also_min = kernels.quest_page_minmax(also.float(), lens, page_size)
        page_max, page_min = torch.maximum(page_max, also_max), torch.minimum(page_min, also_min)
    if k_scale is not None:
        return round_outward(page_max, page_min, dtype)
    return page_max.to(dtype), page_min.to(dtype)


def fold_token(page_max: torch.Tensor, page_min: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               page_size: int, rows: torch.Tensor | None = None, also: torch.Tensor | None = None) -> None:
    """In place: the key ``k`` [B, Hkv, D] of the token at ``positions`` [B] joins its page's max / min
    (page_max, page_min [Bmax >= B, Hkv, P, D]); a page's first token replaces what the page held. ``rows``: the
    batch indices 0 .. B-1 (a preallocated arange keeps the engine's CUDA graph free of allocations). No host sync
    (``KeyState.fold``). A dequantised FP8 key (fp32) joins pages of a narrower dtype rounded outward (max up, min
    down), so that the page bound still holds for the key attention reads (kernels/fp8_kv.py ``round_outward``).
    ``also`` [B, Hkv, D]: the same token's key in a second version that attention reads for a while (an FP8 cache's
    recent keys, ``kv_cache_recent_keys``); both join."""
    rows = torch.arange(k.shape[0], device=k.device) if rows is None else rows
    page = positions // page_size
    fresh = (positions % page_size == 0)[:, None, None]
    if k.dtype == torch.float32 and page_max.dtype != torch.float32:
        k_up, k_down = round_outward(k, k, page_max.dtype)
    else:
        k_up = k_down = k.to(page_max.dtype)
    if also is not None:
        also_up, also_down = round_outward(also.float(), also.float(), page_max.dtype)
        k_up, k_down = torch.maximum(k_up, also_up), torch.minimum(k_down, also_down)
    page_max[rows, :, page] = torch.where(fresh, k_up, torch.maximum(page_max[rows, :, page], k_up))
    page_min[rows, :, page] = torch.where(fresh, k_down, torch.minimum(page_min[rows, :, page], k_down))


def quest_indices(q: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor, seq_lens: torch.Tensor,
                  page_size: int, budget: int) -> torch.Tensor:
    """q [B, Hq, D], page_max/min [B, Hkv, P, D] -> selected token slots [B, Hq, K], -1 padded."""
    scores = kernels.quest_page_scores(q, page_max, page_min, seq_lens, page_size)
    return kernels.quest_select_pages(scores, seq_lens, page_size, budget)


def quest_decode(view, q: torch.Tensor, row, step) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]: exact attention over the tokens of the selected pages."""
    if covers_cache(view, view.config.quest.budget):  # every page would be selected: exact attention
        return view.full(q)
    quest = view.config.quest
    indices = quest_indices(q, view.buffer("page_max"), view.buffer("page_min"), view.lens, quest.page_size,
                            quest.budget)
    return view.sparse(q, indices)


def quest_decode_roles(config, num_layers: int, anchors, family=None) -> list[tuple[str, None]]:
    check_layers_exist("quest.dense_layers", config.quest.dense_layers, num_layers)
    return [("dense" if layer in config.quest.dense_layers else "quest", None) for layer in range(num_layers)]


def _page_size(config) -> int:
    return config.quest.page_size


def _head_dim(config, head_dim: int) -> tuple[int]:
    return (head_dim,)


# the quest layers' key pages (fp32 in the model's dynamic cache, the model's dtype in the engine's static one)
CACHE = CacheNeeds(
    buffers=(StateBuffer("page_max", ("quest",), _page_size, _head_dim, float("-inf"), dynamic_dtype=torch.float32),
             StateBuffer("page_min", ("quest",), _page_size, _head_dim, float("inf"), dynamic_dtype=torch.float32)),
    key_state=(KeyState(("page_max", "page_min"), rebuild=page_bounds,
                        fold=lambda pages, k, positions, page_size, rows, also=None: fold_token(
                            *pages, k, positions, page_size, rows, also)),))


SCHEME = Scheme(
    name="quest",
    summary="Quest: per-head top pages by a key min/max upper bound (decode)",
    config_key="quest",
    config_cls=QuestConfig,
    decode_roles=quest_decode_roles,
    decode={"dense": exact_decode, "quest": quest_decode},
    cache=CACHE,
    budget=Budget("tokens of the selected pages = quest.budget (page size 16), the current page included",
                  lambda budget, given: {"quest_budget": budget}, reads=lambda config: config.quest.budget),
    footprint=Footprint(budget_roles=("quest",)),  # the full cache is kept: Quest saves reads, not memory
    display_name="Quest",
    order=20,
)
