"""``pod.protect_units: auto`` in the pipeline's explore stage (train/pipeline.py ``_auto_units``).

1. Candidate map: the exploration's greedy blocks at ``pod.unit_selection.candidate_delta``, lowered over the
   exploration's similarity when that map alone would not meet ``pod.min_kv_saving``
   (``pod_similarity.delta_for_kv_saving``), so there are shared units to give back; a reused blocks file
   without similarity matrices is the candidate as it is.
2. Data: ``pod.unit_selection.samples`` recall episodes (``episodes.recall_samples``) over rows of the training
   mixture decoded to text: training prose, not an evaluated text.
3. Gates (``optimise.optimise_gates``) on the frozen dense model, then the selection under the budget
   (``budget.select_units``).

Writes ``exploration/unit_gates.{json,png}`` and ``exploration/blocks_trained.json`` (the map that is trained,
with the chosen units as its ``protect_units``). Runs on one process (rank 0); the pipeline broadcasts the map.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sparse_models.calibration.pod_similarity import (
    delta_for_kv_saving,
    greedy_blocks,
    kv_saving_fraction,
    read_blocks_json,
    shared_units,
    write_blocks_json,
)
from train.recipe_schema import unit_selection_settings
from train.unit_selection.budget import rank_units, select_units
from train.unit_selection.episodes import recall_samples
from train.unit_selection.gated_forward import GatedPodForward
from train.unit_selection.optimise import optimise_gates
from train.unit_selection.report import gates_payload, write_unit_gates


def candidate_map(recipe, anchors: list[list[int]], source: dict, target: float, seq_len: int
                  ) -> tuple[list[list[int]], float | None]:
    """``(candidate anchor map, its delta or None)`` (module docstring, step 1)."""
    p, delta = recipe.pod, unit_selection_settings(recipe.pod).candidate_delta
    if "similarity" not in source:
        return [list(row) for row in anchors], source.get("delta")
    similarity = torch.tensor(source["similarity"])
    compare_with = source.get("compare_with", p.compare_with)
    candidate = greedy_blocks(similarity, delta, compare_with)
    if kv_saving_fraction(candidate, seq_len, p.sink_tokens, p.recent_window) < target:
        try:
            delta, candidate = delta_for_kv_saving(similarity, target, seq_len=seq_len, sink=p.sink_tokens,
                                                   recent=p.recent_window, start_delta=delta,
                                                   compare_with=compare_with)
        except ValueError as error:
            raise SystemExit(f"pod.protect_units=auto: pod.min_kv_saving={target}: {error}") from None
    return candidate, delta


def training_prose(recipe, tokenizer, length: int, count: int, log) -> list[str]:
    """``count`` rows of ``length`` tokens of the training mixture, decoded to text."""
    from train.data import training_rows

    rows = training_rows(recipe, tokenizer, context_length=length, num_rows=count, log=log, describe=False)
    return [tokenizer.decode(rows[i]["input_ids"], skip_special_tokens=True) for i in range(len(rows))]


def select_protected_units(recipe, model, tokenizer, anchors: list[list[int]], blocks_path, log
                           ) -> tuple[list[list[int]], Path]:
    """Run the selection with ``model`` (the dense base model, on its device) and write its outputs; returns
    ``(final anchor map, path of blocks_trained.json)``."""
    p, settings = recipe.pod, unit_selection_settings(recipe.pod)
    target, seq_len = p.min_kv_saving, recipe.data.context_length
    source = read_blocks_json(blocks_path) if blocks_path and Path(blocks_path).is_file() else {}
    candidate, delta = candidate_map(recipe, anchors, source, target, seq_len)
    if not shared_units(candidate):
        raise SystemExit(f"pod.protect_units=auto: the candidate block map (delta {delta}) has no shared unit; lower "
                         f"pod.unit_selection.candidate_delta")
    length = settings.length or seq_len
    started = time.perf_counter()
    prose = training_prose(recipe, tokenizer, length, settings.samples, log)
    try:
        ids, loss_mask = recall_samples(tokenizer, prose, length=length, count=settings.samples, seed=settings.seed)
    except ValueError as error:
        raise SystemExit(f"pod.protect_units=auto: {error}") from None
    log(f"[units] candidate map (delta {delta}): {len(shared_units(candidate))} shared units, KV saved "
        f"{kv_saving_fraction(candidate, seq_len, p.sink_tokens, p.recent_window):.1%} at {seq_len}; gates on "
        f"{len(ids)} recall episodes of {length} tokens ({int(loss_mask.sum())} answer positions), "
        f"{settings.steps} steps")
    gated = GatedPodForward(model, candidate, sink=p.sink_tokens, recent=p.recent_window, sharing=p.sharing)
    result = optimise_gates(gated, ids, loss_mask, steps=settings.steps, lr=settings.lr,
                            l1_weight=settings.l1_weight, batch_size=settings.batch_size, seed=settings.seed, log=log)
    alpha = result["alpha"]
    try:
        chosen, final = select_units(candidate, alpha, min_kv_saving=target, seq_len=seq_len, sink=p.sink_tokens,
                                     recent=p.recent_window)
    except ValueError as error:
        raise SystemExit(f"pod.protect_units=auto: {error}") from None
    out = Path(recipe.train.output_dir) / "exploration"
    saving = kv_saving_fraction(final, seq_len, p.sink_tokens, p.recent_window)
    payload = gates_payload(alpha, candidate, final, rank_units(candidate, alpha), chosen, result["curve"],
                            candidate_delta=delta, min_kv_saving=target, kv_saving=saving,
                            candidate_kv_saving=kv_saving_fraction(candidate, seq_len, p.sink_tokens, p.recent_window),
                            seq_len=seq_len, sink=p.sink_tokens, recent=p.recent_window,
                            settings=vars(settings), episodes=len(ids), episode_length=length,
                            data="podkit:recall episodes (train/corpus/recall.py) over the training mixture's prose",
                            seconds=round(time.perf_counter() - started, 1), source_blocks=str(blocks_path))
    gates_json, _ = write_unit_gates(out, payload)
    metadata = {k: v for k, v in source.items() if k in ("compare_with", "model", "samples", "last_queries")}
    path = write_blocks_json(out / "blocks_trained.json", final, torch.tensor(source["similarity"])
                             if "similarity" in source else None, **metadata, delta=delta,
                             source_blocks=str(blocks_path), protect_units=[list(u) for u in chosen],
                             already_anchors=[], min_kv_saving=target, unit_selection=str(gates_json))
    log(f"[units] {len(chosen)} unit(s) keep their own distant keys (highest alpha first: {chosen[:8]}"
        f"{' ...' if len(chosen) > 8 else ''}); shared units {len(shared_units(candidate))} -> "
        f"{len(shared_units(final))}, KV saved {saving:.1%} >= {target:.1%} -> {gates_json}")
    return final, path
