"""Token Sparse's fixed kept fraction (``keep_ratio``, the engine's benchmark knob; schemes/token_sparse.py)
against a plain per-sequence reference, and through the engine: the kept count, the per-head choice (top
pooled window scores of the prefix, plus the window) and the dense fallback for short sequences."""

import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from sparse_models.schemes.token_sparse import TokenSparseConfig, token_sparse_indices


def reference_indices(q, k, lens, cfg, keep_ratio):
    """Per sequence and head: top ceil(keep_ratio * prefix) pooled scores of the prefix + the window."""
    batch, heads, s, _ = q.shape
    scores = kernels.token_sparse_scores(q, k, lens, cfg.window).float()
    pooled = F.avg_pool1d(scores.reshape(batch * heads, 1, s), cfg.pool_kernel, stride=1,
                          padding=cfg.pool_kernel // 2).reshape(batch, heads, s)
    rows = []
    for b, n in enumerate(lens.tolist()):
        prefix = max(n - cfg.window, 0)
        if n <= cfg.min_tokens + cfg.window:
            rows.append([list(range(n))] * heads)
            continue
        keep = max(1, min(prefix, math.ceil(keep_ratio * prefix)))
        rows.append([sorted(torch.topk(pooled[b, h, :prefix], keep).indices.tolist() + list(range(prefix, n)))
                     for h in range(heads)])
    return rows


@pytest.mark.parametrize("keep_ratio", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_keep_ratio_matches_the_reference(keep_ratio, group):
    gen = torch.Generator().manual_seed(int(keep_ratio * 100) + group)
    hkv, s = 2, 45
    q = torch.randn(3, hkv * group, s, 16, generator=gen)
    k = torch.randn(3, hkv, s, 16, generator=gen)
    lens = torch.tensor([45, 30, 9])  # the last is too short: dense
    cfg = TokenSparseConfig(window=4, min_tokens=6, coverage=0.0, pool_kernel=3)  # coverage is ignored with a ratio
    idx, kept, sparse = token_sparse_indices(q, k, lens, cfg, keep_ratio)
    expected = reference_indices(q, k, lens, cfg, keep_ratio)
    for b in range(3):
        for h in range(hkv * group):
            got = [i for i in idx[b, h].tolist() if i >= 0]
            assert got == expected[b][h], (b, h)
        assert kept[b].item() == len(expected[b][0])
    assert sparse.tolist() == [keep_ratio < 1, keep_ratio < 1, False]


def test_engine_prefill_with_a_keep_ratio_reports_what_it_kept():
    from test_engine import podkit_model, random_prompts

    from sparse_models.engine import GenerationEngine

    model = podkit_model(6, 2, seed=3)
    overrides = dict(prefill_scheme="token_sparse", token_sparse_window=4, token_sparse_min_tokens=4,
                     token_sparse_sparse_layers=[2, 3])
    engine = GenerationEngine(model, max_batch_size=2, max_seq_len=64, token_sparse_keep_ratio=0.5, **overrides)
    stats = {}
    engine.prefill(random_prompts([40, 20], seed=4), stats=stats)
    layers = stats["token_sparse"].layers
    assert sorted(layers) == [2, 3]
    assert layers[2].kept == [18 + 4, 8 + 4]  # ceil(0.5 * prefix) + window
    full = GenerationEngine(model, max_batch_size=2, max_seq_len=64, token_sparse_keep_ratio=1.0, **overrides)
    dense = GenerationEngine(model, max_batch_size=2, max_seq_len=64)
    prompts = random_prompts([40, 20], seed=5)
    assert full.generate(prompts, max_new_tokens=3).tokens == dense.generate(prompts, max_new_tokens=3).tokens
