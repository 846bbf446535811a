"""Held-out perplexity and KV bytes for the pipeline's report.

Perplexity = exp(mean next-token NLL) over non-overlapping windows ``[W, S]`` of held-out text
(each window scored from its start, no BOS), the same windows for every model. KV bytes are
measured, not computed: a prefill of one window with ``use_cache=True`` and the POD cache's
``kv_bytes()`` (distant keys of non-anchor (layer, KV head) units are really not stored), next to
the closed form of :func:`sparse_models.calibration.pod_similarity.kv_saving_fraction`.
"""

from __future__ import annotations

import math
import time

import torch


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 1, desc: str | None = None,
               chunk_tokens: int | None = 4096) -> dict:
    """``{"ppl", "nll", "tokens", "seconds"}`` of ``model`` on ``windows [W, S]`` int64.

    ``desc``: label of a progress bar over the windows (stderr; a CPU model takes minutes); None: no bar.
    The LM head runs ``chunk_tokens`` positions at a time (train/losses.py), so a long window never
    holds its full ``[S, vocab]`` fp32 logits."""
    from tqdm.auto import tqdm

    from train.losses import ObjectiveWeights, chunked_objective_loss
    from train.teacher import final_hidden_states, podkit_model_of

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    head = podkit_model_of(model).get_output_embeddings()
    total_nll, total_tokens = 0.0, 0
    start = time.perf_counter()
    for i in tqdm(range(0, windows.shape[0], batch_size), desc=desc, unit="batch" if batch_size > 1 else "window",
                  disable=desc is None, mininterval=1.0):
        ids = windows[i:i + batch_size].to(device)
        hidden = final_hidden_states(model, ids)  # podkit or any transformers causal LM
        terms = chunked_objective_loss(hidden, ids, head, weights=ObjectiveWeights(1.0, 0.0), chunk_tokens=chunk_tokens)
        total_nll += terms.lm * terms.tokens
        total_tokens += terms.tokens
    if was_training:
        model.train()
    mean = total_nll / total_tokens
    return {"ppl": math.exp(mean), "nll": mean, "tokens": total_tokens, "seconds": time.perf_counter() - start}


@torch.no_grad()
def measured_kv_bytes(model, window: torch.Tensor) -> dict:
    """Prefill ``window [S]`` with a cache and report the cache's bytes against a dense cache."""
    model.eval()
    device = next(model.parameters()).device
    out = model(input_ids=window[None].to(device), use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    report = cache.kv_bytes()
    return {"tokens": int(window.numel()), "kv_bytes": int(report.total), "dense_kv_bytes": int(report.dense),
            "saving": float(report.saving)}
