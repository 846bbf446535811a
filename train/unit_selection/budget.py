"""Selection under the KV budget: the learned gates decide which shared units keep their own distant keys.

DuoAttention (Xiao et al. 2024, arXiv 2410.10819, §3.3) keeps full attention for the heads with the largest
gates up to a target sparsity. Here the candidate map's shared units are ranked by ``alpha`` (ties: lower layer,
then KV head) and made anchors in that order (``pod_similarity.protect_units``: the unit splits its block, so
blocks stay runs of consecutive layers) while the map still saves at least ``min_kv_saving`` of the dense KV
cache at ``seq_len`` (``pod_similarity.kv_saving_fraction``). Each split adds one anchor, so the saving falls by
the same step each time and the first unit that would cross the budget ends the selection.
"""

from __future__ import annotations

import torch

from sparse_models.calibration.pod_similarity import kv_saving_fraction, protect_units, shared_units


def rank_units(anchor_layers: list[list[int]], alpha: torch.Tensor) -> list[tuple[int, int]]:
    """The shared units of ``anchor_layers``, highest gate ``alpha[L, Hkv]`` first."""
    return sorted(shared_units(anchor_layers), key=lambda unit: (-float(alpha[unit]), unit))


def select_units(anchor_layers: list[list[int]], alpha: torch.Tensor, *, min_kv_saving: float, seq_len: int,
                 sink: int, recent: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """``(protected units in rank order, final anchor map)``: the most units by ``rank_units`` whose protection
    keeps ``kv_saving_fraction >= min_kv_saving``. Raises ``ValueError`` with the candidate's saving when the
    candidate map itself saves less than the budget (nothing can be given back)."""
    saving = kv_saving_fraction(anchor_layers, seq_len, sink, recent)
    if saving < min_kv_saving:
        raise ValueError(f"the candidate block map saves {saving:.1%} of the KV cache at {seq_len} tokens, below the "
                         f"budget {min_kv_saving:.1%}: no unit can keep its own keys; lower the candidate delta "
                         f"(pod.unit_selection.candidate_delta) or pod.min_kv_saving")
    chosen: list[tuple[int, int]] = []
    final = [list(row) for row in anchor_layers]
    for unit in rank_units(anchor_layers, alpha):
        trial, _ = protect_units(final, [unit])
        if kv_saving_fraction(trial, seq_len, sink, recent) < min_kv_saving:
            break
        chosen.append(unit)
        final = trial
    return chosen, final
