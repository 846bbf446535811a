"""Tiny random podkit models (from tests/tiny_models.py, the one factory) and helpers shared by the sparse_models
tests."""

from __future__ import annotations

import torch

from sparse_models import SparseAttentionConfig
from tests.tiny_models import GQA_SHAPES as _ALL_SHAPES
from tests.tiny_models import SHARP_QK_STD, VOCAB, tiny_config  # noqa: F401 - re-exported
from tests.tiny_models import tiny_model as _factory_model

GQA_SHAPES = {g: _ALL_SHAPES[g] for g in (1, 3, 4)}  # the groups these tests sweep (the factory has 8 too)


def tiny_model(group: int = 3, layers: int = 4, sparse: SparseAttentionConfig | dict | None = None,
               seed: int = 0):
    """tests/tiny_models.py's podkit model, q/k redrawn from N(0, 0.35): sharper, less uniform attention."""
    return _factory_model(group, layers, sparse, seed, qk_std=SHARP_QK_STD)


def pod_anchor_map(layers: int, kv_heads: int) -> list[list[int]]:
    """Head-wise blocks: even heads [0, 0, 2, 2, ...], odd heads [0, 1, 1, 3, 3, ...]."""
    rows = []
    for layer in range(layers):
        row = []
        for h in range(kv_heads):
            if h % 2 == 0:
                row.append(layer - layer % 2)
            else:
                row.append(0 if layer == 0 else layer - (layer + 1) % 2)
        rows.append(row)
    return rows


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask


def random_prompts(lengths, seed=None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def run_model(model, prompts, continuations):
    """Prefill (left-padded batch) then teacher-forced decode. Returns (prompt logits per row [n_b, V],
    list over steps of [B, V])."""
    ids, mask = left_padded(prompts)
    cache = model.new_cache()
    out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
    width = ids.shape[1]
    prompt_logits = [out.logits[b, width - len(p):] for b, p in enumerate(prompts)]
    steps = []
    for t in range(len(continuations[0])):
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
        tok = torch.tensor([[c[t]] for c in continuations])
        out = model(tok, attention_mask=mask, cache=cache, use_cache=True)
        steps.append(out.logits[:, -1])
    return prompt_logits, steps, cache
