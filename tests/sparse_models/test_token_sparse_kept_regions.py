"""Token Sparse's kept regions beyond the paper (schemes/token_sparse.py, METHODS.md C.1): ``sink_tokens`` (the first
N tokens kept by every head, inside the budget) and ``keep_window=False`` (the last ``window`` tokens compete for the
budget instead of being always kept).

Checked against a per-sequence reference written here from the rule's description (dense softmax over explicit
loops, float64), not from the implementation: the defaults are the paper's rule, the sink sits inside the budget,
``keep_window=False`` ranks and sizes the budget over the whole sequence, a budget that keeps every token is dense
attention, bad values fail in the config with the field's name, and the model's forward and the engine's prefill
(which both run ``token_sparse_prefill``) keep the same tokens and generate the same greedy tokens with the options on.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kernels
from sparse_models.config import ConfigError, SparseAttentionConfig
from sparse_models.schemes import token_sparse as ts
from sparse_models.schemes.token_sparse import TokenSparseConfig, token_sparse_indices, token_sparse_prefill

HKV, D = 2, 16


def random_qk(seed: int, group: int, batch: int, s: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HKV * group, s, D, generator=gen)
    k = torch.randn(batch, HKV, s, D, generator=gen)
    v = torch.randn(batch, HKV, s, D, generator=gen)
    return q, k, v


def reference_kept(q, k, lens, cfg: TokenSparseConfig, keep_ratio=None) -> list[list[list[int]]]:
    """Per sequence and head, the kept positions, one sequence at a time.

    Scores: the mean over the last ``window`` queries of their causal softmax probabilities (window keys scored
    only without ``keep_window``); an average pool of width ``pool_kernel`` (zero padding); the ranked span is the
    prefix with ``keep_window``, else the whole sequence; the budget is coverage's (or ceil(ratio * span)), at least
    ``min_tokens``, at least ``sink_tokens``, at most the span; each head keeps the first ``sink_tokens`` of the span
    and fills the rest of the budget with its top pooled scores (with ``score_reduce="max"`` the pooled max over the
    window's queries instead; the budget stays the mean's); plus the window with ``keep_window``."""
    heads = q.shape[1]
    group = heads // k.shape[1]
    w, half = cfg.window, cfg.pool_kernel // 2
    out = []
    for b, n in enumerate(lens.tolist()):
        if n <= cfg.min_tokens + w or (cfg.coverage == 0 and keep_ratio is None):
            out.append([list(range(n))] * heads)
            continue
        prefix = n - w
        span = prefix if cfg.keep_window else n
        scores = torch.zeros(heads, n, dtype=torch.float64)
        top = torch.zeros(heads, n, dtype=torch.float64)
        for h in range(heads):
            for i in range(prefix, n):
                logits = q[b, h, i].double() @ k[b, h // group, :i + 1].double().T * D ** -0.5
                probs = torch.softmax(logits, -1)
                scores[h, :i + 1] += probs / w
                top[h, :i + 1] = torch.maximum(top[h, :i + 1], probs)
        if cfg.keep_window:
            scores[:, prefix:] = 0.0
            top[:, prefix:] = 0.0

        def pool(x):
            return torch.stack([x[:, max(0, t - half):t + half + 1].sum(-1) / cfg.pool_kernel
                                for t in range(span)], dim=1)  # [heads, span]

        pooled = pool(scores)
        ranking = pool(top) if cfg.score_reduce == "max" else pooled
        if keep_ratio is not None:
            budget = max(1, math.ceil(keep_ratio * span))
        else:
            mean = pooled.mean(0)
            cum = torch.cumsum(torch.sort(mean / mean.sum()).values, 0)
            budget = max(cfg.min_tokens, span - (int((cum < cfg.coverage).sum()) + 1))
        budget = min(max(budget, cfg.sink_tokens), span)
        sink = list(range(min(cfg.sink_tokens, span)))
        rows = []
        for h in range(heads):
            rest = sorted(range(len(sink), span), key=lambda t: -float(ranking[h, t]))
            kept = sink + rest[:budget - len(sink)]
            rows.append(sorted(kept + (list(range(prefix, n)) if cfg.keep_window else [])))
        out.append(rows)
    return out


def kept_lists(idx: torch.Tensor) -> list[list[list[int]]]:
    return [[[i for i in row if i >= 0] for row in seq] for seq in idx.tolist()]


def dense_attention(q, k, v, lens):
    """Causal attention per sequence over its first lens[b] positions (zeros at padding), explicit softmax."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for b, n in enumerate(lens.tolist()):
        kk = k[b, :, :n].repeat_interleave(group, 0)
        vv = v[b, :, :n].repeat_interleave(group, 0)
        logits = q[b, :, :n] @ kk.transpose(-1, -2) * D ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out[b, :, :n] = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) @ vv
    return out


BASE = dict(window=4, min_tokens=6, pool_kernel=3)
LENS = [40, 29, 9]  # the last is too short to compress: dense


# ------------------------------------------------------------------------------------------ defaults


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("keep_ratio", [None, 0.4])
def test_defaults_are_the_papers_rule(group, keep_ratio):
    defaults = TokenSparseConfig()
    assert (defaults.sink_tokens, defaults.keep_window) == (0, True)
    assert SparseAttentionConfig().token_sparse == defaults
    q, k, _ = random_qk(100 + group, group, 3, max(LENS))
    lens = torch.tensor(LENS)
    cfg = TokenSparseConfig(coverage=0.2, **BASE)
    explicit = TokenSparseConfig(coverage=0.2, sink_tokens=0, keep_window=True, **BASE)
    idx, kept, sparse = token_sparse_indices(q, k, lens, cfg, keep_ratio)
    idx2, kept2, sparse2 = token_sparse_indices(q, k, lens, explicit, keep_ratio)
    assert torch.equal(idx, idx2) and torch.equal(kept, kept2) and torch.equal(sparse, sparse2)
    expected = reference_kept(q, k, lens, cfg, keep_ratio)
    assert kept_lists(idx) == expected
    assert kept.tolist() == [len(seq[0]) for seq in expected]
    assert sparse.tolist() == [True, True, False]
    for b, n in enumerate(LENS[:2]):  # the paper's rule: every head keeps the whole window
        assert all(set(range(n - 4, n)) <= set(row) for row in expected[b])


# ------------------------------------------------------------------------------------------ sink_tokens


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("sink", [1, 3, 5])
@pytest.mark.parametrize("keep_window", [True, False])
def test_sink_tokens_are_kept_by_every_head_inside_the_budget(group, sink, keep_window):
    q, k, _ = random_qk(200 + 10 * group + sink, group, 3, max(LENS))
    lens = torch.tensor(LENS)
    plain = TokenSparseConfig(coverage=0.2, keep_window=keep_window, **BASE)
    cfg = TokenSparseConfig(coverage=0.2, keep_window=keep_window, sink_tokens=sink, **BASE)
    idx0, kept0, _ = token_sparse_indices(q, k, lens, plain)
    idx, kept, sparse = token_sparse_indices(q, k, lens, cfg)
    got = kept_lists(idx)
    assert got == reference_kept(q, k, lens, cfg)
    assert torch.equal(kept, kept0)  # the budget (5+ here) is larger than the sink: kept counts do not change
    assert sparse.tolist() == [True, True, False]
    for b in range(2):
        for row in got[b]:
            assert set(range(sink)) <= set(row)
            assert len(row) == kept[b].item()
    # guard: without the sink some head drops one of the first positions, so the option is what keeps them
    assert any(not set(range(sink)) <= set(row) for b in range(2) for row in kept_lists(idx0)[b])


@pytest.mark.parametrize("keep_window", [True, False])
def test_a_sink_larger_than_the_budget_raises_it(keep_window):
    q, k, _ = random_qk(7, 3, 2, 40)
    lens = torch.tensor([40, 33])
    cfg = TokenSparseConfig(coverage=0.0, keep_window=keep_window, sink_tokens=12, **BASE)
    idx, kept, sparse = token_sparse_indices(q, k, lens, cfg, keep_ratio=0.1)  # ratio budget: 4 tokens at most
    window = 4 if keep_window else 0
    assert kept.tolist() == [12 + window, 12 + window]
    assert sparse.tolist() == [True, True]
    for b, n in enumerate([40, 33]):
        expected = list(range(12)) + list(range(n - window, n))
        assert all(row == expected for row in kept_lists(idx)[b])


# ------------------------------------------------------------------------------------------ keep_window


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("keep_ratio", [None, 0.5])
def test_without_keep_window_the_window_competes_for_the_budget(group, keep_ratio):
    q, k, _ = random_qk(300 + group, group, 3, max(LENS))
    lens = torch.tensor(LENS)
    on = TokenSparseConfig(coverage=0.2, **BASE)
    off = TokenSparseConfig(coverage=0.2, keep_window=False, **BASE)
    idx_on, _, _ = token_sparse_indices(q, k, lens, on, keep_ratio)
    idx, kept, sparse = token_sparse_indices(q, k, lens, off, keep_ratio)
    got = kept_lists(idx)
    assert got == reference_kept(q, k, lens, off, keep_ratio)
    assert got != kept_lists(idx_on)
    assert sparse.tolist() == [True, True, False]
    assert got[2] == [list(range(LENS[2]))] * (HKV * group)  # too short: dense, as with the window kept
    for b, n in enumerate(LENS[:2]):
        if keep_ratio is not None:  # the budget is sized over the whole sequence, the window included
            assert kept[b].item() == math.ceil(keep_ratio * n)
        assert kept[b].item() < n
        for row in got[b]:
            assert len(row) == kept[b].item()  # the budget, no window appended
            assert all(0 <= i < n for i in row)
    # where it matters: some head drops a window position
    assert any(not set(range(n - 4, n)) <= set(row) for b, n in enumerate(LENS[:2]) for row in got[b])


def test_window_key_scores_complete_each_querys_distribution():
    """With the window's own keys scored, a head's scores are mean softmax rows: they sum to 1 per sequence."""
    q, k, _ = random_qk(11, 3, 2, 30)
    lens = torch.tensor([30, 21])
    scores = kernels.token_sparse_scores(q, k, lens, 4).float() + ts._window_key_scores(q, k, lens, 4, chunk=8)
    torch.testing.assert_close(scores.sum(-1), torch.ones(2, HKV * 3), atol=1e-5, rtol=0)
    assert scores[1, :, 21:].abs().max() == 0  # padding


# ------------------------------------------------------------------------------------------ dense when all kept


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("options", [dict(keep_window=False), dict(sink_tokens=3), dict(sink_tokens=3, keep_window=False),
                                     dict(sink_tokens=64, keep_window=False)])
def test_a_budget_that_keeps_every_token_is_dense(group, options):
    q, k, v = random_qk(400 + group, group, 3, max(LENS))
    lens = torch.tensor(LENS)
    cfg = TokenSparseConfig(coverage=0.2, **BASE, **options)
    dense = dense_attention(q, k, v, lens)
    ratio = None if options.get("sink_tokens") == 64 else 1.0  # a sink past the sequence covers it all too
    idx, kept, sparse = token_sparse_indices(q, k, lens, cfg, ratio)
    assert not bool(sparse.any()) and kept.tolist() == LENS
    out = token_sparse_prefill(q, k, v, lens, cfg, layer=0, keep_ratio=ratio)
    for b, n in enumerate(LENS):
        torch.testing.assert_close(out[b, :, :n], dense[b, :, :n], atol=1e-5, rtol=1e-4)
    # guard: a budget below the sequence (and a sink inside it) is not dense
    smaller = dataclasses.replace(cfg, sink_tokens=min(cfg.sink_tokens, 3))
    partial = token_sparse_prefill(q, k, v, lens, smaller, layer=0, keep_ratio=0.5)
    assert not torch.allclose(partial[0, :, :LENS[0]], dense[0, :, :LENS[0]], atol=1e-3)


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("key, value, message", [
    ("token_sparse_sink_tokens", -1, "token_sparse.sink_tokens=-1 is invalid: expected an integer >= 0"),
    ("token_sparse_sink_tokens", 2.5, "token_sparse.sink_tokens=2.5 is invalid: expected an integer >= 0"),
    ("token_sparse_sink_tokens", True, "token_sparse.sink_tokens=True is invalid: expected an integer >= 0"),
    ("token_sparse_keep_window", "yes", "token_sparse.keep_window='yes' is invalid: expected True or False"),
    ("token_sparse_keep_window", 1, "token_sparse.keep_window=1 is invalid: expected True or False"),
    ("token_sparse_keep_window", None, "token_sparse.keep_window=None is invalid: expected True or False"),
])
def test_bad_kept_region_values_name_the_field(key, value, message):
    with pytest.raises(ConfigError) as err:
        SparseAttentionConfig().with_overrides(**{key: value})
    assert message in str(err.value)


def test_kept_region_overrides_reach_the_config():
    cfg = SparseAttentionConfig().with_overrides(token_sparse_sink_tokens=4, token_sparse_keep_window=False)
    assert (cfg.token_sparse.sink_tokens, cfg.token_sparse.keep_window) == (4, False)
    assert SparseAttentionConfig.from_dict(cfg.to_dict()).token_sparse == cfg.token_sparse


# ------------------------------------------------------------------------------------------ model vs engine


HEADS = {1: (4, 4), 3: (6, 2), 4: (8, 2)}
OPTIONS = dict(prefill_scheme="token_sparse", token_sparse_window=4, token_sparse_min_tokens=4,
               token_sparse_coverage=0.3, token_sparse_sparse_layers=[2, 3])


def _spy(monkeypatch) -> list:
    """Record every kept-index tensor ``token_sparse_prefill`` computes (model and engine alike call it)."""
    seen, original = [], ts.token_sparse_indices

    def spy(q, k, seq_lens, cfg, keep_ratio=None):
        out = original(q, k, seq_lens, cfg, keep_ratio)
        seen.append((seq_lens.tolist(), kept_lists(out[0])))
        return out

    monkeypatch.setattr(ts, "token_sparse_indices", spy)
    return seen


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("options", [dict(token_sparse_sink_tokens=3), dict(token_sparse_keep_window=False),
                                     dict(token_sparse_sink_tokens=3, token_sparse_keep_window=False)])
def test_model_and_engine_keep_the_same_tokens_with_the_options(monkeypatch, group, options):
    from test_engine import podkit_model, random_prompts

    from sparse_models.engine import GenerationEngine

    model = podkit_model(*HEADS[group], seed=20 + group)
    prompts = random_prompts([31, 24, 17], seed=30 + group)
    seen = _spy(monkeypatch)

    def model_kept(overrides):
        model.set_sparse_attention(SparseAttentionConfig(), **overrides)
        seen.clear()
        with torch.no_grad():
            for p in prompts:  # one prompt at a time: no padding involved
                model(torch.tensor([p]))
        return [[rows[0] for _, rows in seen[i::len(OPTIONS["token_sparse_sparse_layers"])]]
                for i in range(len(OPTIONS["token_sparse_sparse_layers"]))]  # [layer][prompt] -> heads

    def engine_kept(overrides):
        engine = GenerationEngine(model, sparse_config=SparseAttentionConfig(), max_batch_size=3, max_seq_len=48,
                                  **overrides)
        seen.clear()
        engine.prefill(prompts)  # one ragged batch
        return [rows for _, rows in seen]  # [layer][prompt] -> heads

    on = OPTIONS | options
    from_model, from_engine = model_kept(on), engine_kept(on)
    assert len(from_model) == len(from_engine) == 2
    assert from_model == from_engine
    # guard: the options change what is kept (on both paths), so agreement above is not the defaults' agreement
    assert model_kept(OPTIONS) != from_model and engine_kept(OPTIONS) != from_engine
    if "token_sparse_sink_tokens" in options:
        assert all(set(range(3)) <= set(row) for layer in from_engine for seq in layer for row in seq)

    # and the greedy tokens after the prefill agree (decode is dense in both)
    model.set_sparse_attention(SparseAttentionConfig(), **on)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    engine = GenerationEngine(model, sparse_config=SparseAttentionConfig(), max_batch_size=3, max_seq_len=48, **on)
    assert engine.generate(prompts, max_new_tokens=5).tokens == expected


def test_engine_with_a_full_budget_and_the_options_equals_dense():
    from test_engine import podkit_model, random_prompts

    from sparse_models.engine import GenerationEngine

    model = podkit_model(6, 2, seed=5)
    prompts = random_prompts([33, 21], seed=6)
    on = OPTIONS | dict(token_sparse_sink_tokens=3, token_sparse_keep_window=False)
    dense = GenerationEngine(model, max_batch_size=2, max_seq_len=48).generate(prompts, max_new_tokens=5)
    full = GenerationEngine(model, max_batch_size=2, max_seq_len=48, token_sparse_keep_ratio=1.0, **on)
    assert full.generate(prompts, max_new_tokens=5).tokens == dense.tokens
    sparse = GenerationEngine(model, max_batch_size=2, max_seq_len=48, token_sparse_keep_ratio=0.3, **on)
    assert sparse.generate(prompts, max_new_tokens=5).tokens != dense.tokens  # guard: 0.3 really drops tokens
