"""POD stage 1 on a real model: capture post-RoPE q/k on calibration samples, compare layers, group.

The math lives in :mod:`sparse_models.calibration.pod_similarity` (eval uses it too); this module
feeds it a model and calibration token ids, and writes ``blocks.json`` + ``similarity.png``.

q/k capture: ``sparse_models.capture_attention_inputs`` for podkit model classes (the pipeline's
dense reference is one); for any other transformers model (a plain ``LlamaForCausalLM``)
:func:`capture_with_attention_interface` records the q/k that transformers' attention interface
receives (post-RoPE, un-repeated KV heads) while running SDPA -- the same tensors.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from sparse_models.calibration import pod_similarity

CAPTURE_ATTENTION_NAME = "podkit_capture_sdpa"


def capture_with_attention_interface(model, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run ``model`` on ``input_ids [B,S]`` and return ``{layer: (q[B,Hq,S,D], k[B,Hkv,S,D])}`` post-RoPE."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query.detach(), key.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_ATTENTION_NAME, capture)
    AttentionMaskInterface.register(CAPTURE_ATTENTION_NAME, sdpa_mask)  # else the mask arrives as None
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_ATTENTION_NAME)
    try:
        with torch.no_grad():
            model(input_ids=input_ids.to(model.device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return captured


def capture_function(model):
    """The q/k capture to use for ``model``: podkit's own when it is a podkit class."""
    if hasattr(model, "sparse_config"):  # a podkit class
        from sparse_models import capture_attention_inputs

        return lambda ids: capture_attention_inputs(model, ids.to(model.device))
    return lambda ids: capture_with_attention_interface(model, ids)


def run_exploration(model, samples: torch.Tensor, *, last_queries: int, delta: float, compare_with: str,
                    out_dir: str | Path, batch_size: int = 1, metadata: dict | None = None, log=print) -> dict:
    """Explore on ``samples [N, S]``; writes ``out_dir/blocks.json`` and ``out_dir/similarity.png``.

    Returns ``{"anchor_layers", "similarity", "blocks_file", "heatmap", "seconds"}``.
    """
    config = model.config
    num_layers, num_kv_heads = config.num_hidden_layers, config.num_key_value_heads
    start = time.perf_counter()
    batches = [samples[i:i + batch_size] for i in range(0, samples.shape[0], batch_size)]
    was_training = model.training
    model.eval()
    with contextlib.ExitStack():
        result = pod_similarity.explore(batches, capture_function(model), num_layers=num_layers,
                                        num_kv_heads=num_kv_heads, last_queries=last_queries, delta=delta,
                                        compare_with=compare_with)
    model.train(was_training)
    seconds = time.perf_counter() - start
    out_dir = Path(out_dir)
    meta = {"delta": delta, "compare_with": compare_with, "calibration_samples": int(samples.shape[0]),
            "calibration_length": int(samples.shape[1]), "last_queries": last_queries,
            "similarity_measure": "1 - JSD (log base 2), mean over the G query heads of each KV head, queries, samples",
            **(metadata or {})}
    blocks_file = pod_similarity.write_blocks_json(out_dir / "blocks.json", result["anchor_layers"],
                                                   result["similarity"], **meta)
    heatmap = pod_similarity.plot_similarity_heatmap(result["similarity"], result["anchor_layers"],
                                                     out_dir / "similarity.png")
    shared = sum(a != layer for layer, row in enumerate(result["anchor_layers"]) for a in row)
    total = num_layers * num_kv_heads
    log(f"[explore] {samples.shape[0]} samples x {samples.shape[1]} tokens, last {last_queries} queries, "
        f"delta={delta} ({compare_with}): {total - shared} anchor / {shared} shared (layer, KV head) units "
        f"of {total}, {seconds:.1f}s -> {blocks_file}")
    return {"anchor_layers": result["anchor_layers"], "similarity": result["similarity"],
            "blocks_file": blocks_file, "heatmap": heatmap, "seconds": seconds}
