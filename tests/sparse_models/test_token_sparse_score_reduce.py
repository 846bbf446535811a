"""Token Sparse's ``score_reduce`` option (schemes/token_sparse.py, METHODS.md C.1): each head ranks its tokens by the
max over the window's queries of their softmax probability instead of the mean, inside the budget that the mean's
attention mass sizes.

Checked against the per-sequence reference of test_token_sparse_kept_regions.py (explicit loops, float64, written
from the rule's description), with GQA groups 1 / 3 / 4 / 8 over a ragged batch; the budget is the mean rule's
(same kept counts); a budget that keeps every token is dense attention; bad values fail in the config with the
field's name; the model's forward and the engine's prefill keep the same tokens with it on.
"""

from __future__ import annotations

import pytest
import torch
from test_token_sparse_kept_regions import (
    BASE,
    LENS,
    OPTIONS,
    _spy,
    dense_attention,
    kept_lists,
    random_qk,
    reference_kept,
)

from sparse_models.config import ConfigError, SparseAttentionConfig
from sparse_models.schemes.token_sparse import TokenSparseConfig, token_sparse_indices, token_sparse_prefill


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("keep_ratio", [None, 0.4])
@pytest.mark.parametrize("options", [{}, dict(keep_window=False), dict(sink_tokens=3)])
def test_max_ranking_matches_the_reference_inside_the_means_budget(group, keep_ratio, options):
    q, k, _ = random_qk(500 + group, group, 3, max(LENS))
    lens = torch.tensor(LENS)
    mean_cfg = TokenSparseConfig(coverage=0.2, **BASE, **options)
    max_cfg = TokenSparseConfig(coverage=0.2, score_reduce="max", **BASE, **options)
    idx_mean, kept_mean, sparse_mean = token_sparse_indices(q, k, lens, mean_cfg, keep_ratio)
    idx, kept, sparse = token_sparse_indices(q, k, lens, max_cfg, keep_ratio)
    got = kept_lists(idx)
    assert got == reference_kept(q, k, lens, max_cfg, keep_ratio)
    assert torch.equal(kept, kept_mean) and torch.equal(sparse, sparse_mean)  # the same budget
    assert sparse.tolist() == [True, True, False]
    assert got[2] == [list(range(LENS[2]))] * q.shape[1]  # too short: dense
    assert got != kept_lists(idx_mean)  # guard: the ranking really changes what is kept


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("options", [{}, dict(keep_window=False, sink_tokens=3)])
def test_a_budget_that_keeps_every_token_is_dense(group, options):
    q, k, v = random_qk(600 + group, group, 3, max(LENS))
    lens = torch.tensor(LENS)
    cfg = TokenSparseConfig(coverage=0.2, score_reduce="max", **BASE, **options)
    idx, kept, sparse = token_sparse_indices(q, k, lens, cfg, 1.0)
    assert not bool(sparse.any()) and kept.tolist() == LENS
    out = token_sparse_prefill(q, k, v, lens, cfg, layer=0, keep_ratio=1.0)
    dense = dense_attention(q, k, v, lens)
    for b, n in enumerate(LENS):
        torch.testing.assert_close(out[b, :, :n], dense[b, :, :n], atol=1e-5, rtol=1e-4)
    partial = token_sparse_prefill(q, k, v, lens, cfg, layer=0, keep_ratio=0.5)
    assert not torch.allclose(partial[0, :, :LENS[0]], dense[0, :, :LENS[0]], atol=1e-3)  # guard


@pytest.mark.parametrize("value", ["sum", "MAX", None, 1])
def test_bad_values_name_the_field(value):
    with pytest.raises(ConfigError) as err:
        SparseAttentionConfig().with_overrides(token_sparse_score_reduce=value)
    assert f"token_sparse.score_reduce={value!r} is invalid: expected one of 'mean', 'max'" in str(err.value)


def test_the_override_reaches_the_config_and_round_trips():
    assert TokenSparseConfig().score_reduce == "mean"  # the paper's rule by default
    cfg = SparseAttentionConfig().with_overrides(token_sparse_score_reduce="max")
    assert cfg.token_sparse.score_reduce == "max"
    assert SparseAttentionConfig.from_dict(cfg.to_dict()).token_sparse == cfg.token_sparse


@pytest.mark.parametrize("group", [1, 4])
def test_model_and_engine_keep_the_same_tokens(monkeypatch, group):
    from test_engine import podkit_model, random_prompts

    from sparse_models.engine import GenerationEngine

    heads = {1: (4, 4), 4: (8, 2)}[group]
    model = podkit_model(*heads, seed=40 + group)
    prompts = random_prompts([31, 24, 17], seed=50 + group)
    seen = _spy(monkeypatch)
    on = OPTIONS | dict(token_sparse_score_reduce="max")
    layers = len(OPTIONS["token_sparse_sparse_layers"])

    def model_kept(overrides):
        model.set_sparse_attention(SparseAttentionConfig(), **overrides)
        seen.clear()
        with torch.no_grad():
            for p in prompts:
                model(torch.tensor([p]))
        return [[rows[0] for _, rows in seen[i::layers]] for i in range(layers)]

    engine = GenerationEngine(model, sparse_config=SparseAttentionConfig(), max_batch_size=3, max_seq_len=48, **on)
    seen.clear()
    engine.prefill(prompts)
    from_engine = [rows for _, rows in seen]
    from_model = model_kept(on)
    assert from_model == from_engine
    assert model_kept(OPTIONS) != from_model  # guard: the option changes what is kept
