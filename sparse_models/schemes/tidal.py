"""TidalDecode: position-persistent sparse decode (Yang et al., arXiv 2410.05076; METHODS.md B).

Selection layers run full attention and choose the top-(budget - 1) past positions plus the current
one (per query head, the paper's choice; per KV group, or the union of a group's / all heads' lists, and
a recent window, podkit's options: ``TidalConfig``); the layers above read only those positions until
the next selection layer. Prefill is dense. KV-cache correction (paper §3.3) lives
in the model loop (``sparse_models.modeling_common``) and the engine: every T steps the last T tokens
are re-run with full attention and their K/V overwritten.

Decode roles: ``full`` (``tidal.full_layers``), ``full+select`` (selection layers),
``sparse-over-selected`` (the others, reading the closest selection layer below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..validation import ConfigError, check_int, check_layer_list, check_layers_exist, fail
from .base import Budget, CacheNeeds, Footprint, Scheme, covers_cache, exact_decode

# tidal.selection's values (kernels.reference.select_topk_positions' modes); the first is the paper's
SELECTIONS = ("query_head", "kv_group", "group_union", "all_union")


@dataclass
class TidalConfig:
    """TidalDecode: position-persistent sparse decode (Yang et al., arXiv 2410.05076).

    ``full_layers`` run dense decode; each of ``selection_layers`` runs full attention and selects
    the top-(budget-1) past positions plus the current one; every other layer attends only to the
    positions selected by the closest selection layer below it. ``selection_layers=None`` means
    layer 2 and the model family's re-selection layer (13 for Llama-3/3.1, 7 for Llama-2; for other
    families the layer at the same relative depth, 13/32, unless a calibration file says otherwise:
    ``sparse_models.calibration.tidal_reselection``). ``budget`` counts the current token.
    ``selection`` (METHODS.md B.2; all but the first are podkit's design-space options beyond the paper):
    ``"query_head"`` is the paper's (each query head its own list, [B, Hq, budget]); ``"kv_group"`` selects
    one list per KV head from the summed probabilities of its query heads (fewer bytes read);
    ``"group_union"`` one list per KV head, the union of its G query heads' own top lists grown until it
    holds the budget (each slot ranked by its best rank over the group); ``"all_union"`` the same over all
    query heads of the layer, one list shared by every KV head (both [B, Hkv, budget]).
    ``recent_share`` in [0, 1): with a share > 0 the last ``max(1, round(recent_share * budget))`` slots
    (the current token included) are always read and the selection fills the rest from the older slots;
    0.0 keeps only the current token fixed (the paper's rule). ``recent_slots`` gives the window.
    ``correction_period``: every T decode steps, recompute the K/V of the last T sparse-decoded tokens
    with full attention (paper §3.3, "KV cache correction"); ``None`` disables it (paper default).
    """

    budget: int = 2048
    full_layers: list[int] = field(default_factory=lambda: [0, 1])
    selection_layers: list[int] | None = None
    selection: str = "query_head"
    correction_period: int | None = None
    recent_share: float = 0.0

    def __post_init__(self) -> None:
        check_int("tidal.budget", self.budget, 2)
        check_layer_list("tidal.full_layers", self.full_layers)
        check_layer_list("tidal.selection_layers", self.selection_layers)
        if self.selection_layers is not None:
            if not self.selection_layers:
                fail("tidal.selection_layers", self.selection_layers, "expected at least one selection layer, or null")
            overlap = set(self.selection_layers) & set(self.full_layers)
            if overlap:
                fail("tidal.selection_layers", self.selection_layers,
                      f"layers {sorted(overlap)} are also in tidal.full_layers; a layer is full or selection, not both")
        if not isinstance(self.selection, str) or self.selection not in SELECTIONS:
            fail("tidal.selection", self.selection,
                 "expected 'query_head' (paper), 'kv_group', 'group_union' or 'all_union'")
        share = self.recent_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share < 1.0:
            fail("tidal.recent_share", share, "expected a number in [0, 1) (0: only the current token is fixed)")
        if self.correction_period is not None:
            check_int("tidal.correction_period", self.correction_period, 1)


def recent_slots(tidal: TidalConfig) -> int:
    """Slots at the end of each sequence a selection always keeps, the current one included: 1 (the paper's
    rule) for ``recent_share`` 0, else ``max(1, round(recent_share * budget))`` (at most the budget, as the
    share is < 1)."""
    if tidal.recent_share <= 0:
        return 1
    return max(1, min(tidal.budget, round(tidal.recent_share * tidal.budget)))


def default_reselection_layer(num_layers: int, model_family: str | None = None) -> int:
    """TidalDecode's re-selection layer: 13 for Llama-3/3.1 (32 layers), 7 for Llama-2, else 13/32 depth."""
    if model_family == "llama3" and num_layers == 32:
        return 13
    if model_family == "llama2" and num_layers == 32:
        return 7
    return max(3, min(num_layers - 1, math.floor(num_layers * 13 / 32)))


def tidal_selection_layers(config, num_layers: int, family: str | None = None) -> list[int]:
    """The TidalDecode selection layers: the configured ones, else layer 2 + the re-selection layer."""
    tidal = config.tidal
    if tidal.selection_layers is not None:
        bad = [layer for layer in tidal.selection_layers if layer >= num_layers]
        if bad:
            raise ConfigError(f"tidal.selection_layers={tidal.selection_layers} is invalid: layers {bad} do not exist "
                              f"in a model with {num_layers} layers")
        return sorted(tidal.selection_layers)
    candidates = {2, default_reselection_layer(num_layers, family)}
    layers = sorted(layer for layer in candidates if layer < num_layers and layer not in tidal.full_layers)
    if not layers:
        first_free = next((layer for layer in range(num_layers) if layer not in tidal.full_layers), None)
        if first_free is None:
            raise ConfigError(f"tidal.full_layers={tidal.full_layers} is invalid: it covers all {num_layers} layers, "
                              f"leaving none for selection")
        layers = [first_free]
    return layers


def tidal_decode_roles(config, num_layers: int, anchors, family: str | None = None) -> list[tuple[str, int | None]]:
    """Per layer (role, selection source): full layers, selection layers, sparse layers over the
    closest selection layer below (``full`` while there is none yet)."""
    check_layers_exist("tidal.full_layers", config.tidal.full_layers, num_layers)
    selection = tidal_selection_layers(config, num_layers, family)
    roles = []
    for layer in range(num_layers):
        below = [s for s in selection if s <= layer]
        if layer in config.tidal.full_layers:
            roles.append(("full", None))
        elif layer in selection:
            roles.append(("full+select", None))
        elif below:
            roles.append(("sparse-over-selected", below[-1]))
        else:
            roles.append(("full", None))  # no selection layer below yet: nothing to be sparse over
    return roles


def select_decode(view, q: torch.Tensor, row, step) -> torch.Tensor:
    """Selection layer: exact attention; the chosen positions [B, Hs, budget] (Hs = Hq or Hkv, by
    ``tidal.selection``) go to ``step.selected``."""
    tidal = view.config.tidal
    if covers_cache(view, tidal.budget):  # every slot would be selected: exact attention, no budget-sized list
        return view.full(q)
    out, step.selected[row.layer] = view.select(q, tidal.budget, tidal.selection, recent_slots(tidal))
    return out


def sparse_decode(view, q: torch.Tensor, row, step) -> torch.Tensor:
    """Sparse layer: attention over the positions its selection layer chose -> [B, Hq, D]."""
    if covers_cache(view, view.config.tidal.budget):  # the selection layer selected nothing (see select_decode)
        return view.full(q)
    return view.sparse(q, step.selected[row.selection_source])


DECODE = {"full": exact_decode, "full+select": select_decode, "sparse-over-selected": sparse_decode}
BUDGET_ROLES = ("sparse-over-selected",)  # full and selection layers read every position
BUDGET = Budget("positions read per sparse layer = tidal.budget, the current token included",
                lambda budget, given: {"tidal_budget": budget}, reads=lambda config: config.tidal.budget)

SCHEME = Scheme(
    name="tidal",
    summary="TidalDecode: full attention + top-k selection at a few layers, sparse attention elsewhere (decode)",
    config_key="tidal",
    config_cls=TidalConfig,
    decode_roles=tidal_decode_roles,
    decode=DECODE,
    cache=CacheNeeds(correction_period=lambda config: config.tidal.correction_period),
    budget=BUDGET,
    footprint=Footprint(budget_roles=BUDGET_ROLES),
    display_name="TidalDecode",
    order=10,
)
