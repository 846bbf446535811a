"""Triton Quest page scores and page selection against kernels.reference (CPU interpreter; GPU bf16)."""

import os
import zlib

import pytest
import torch

from kernels import reference
from kernels.triton_quest_pages import quest_page_scores_triton, quest_select_pages_triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")

CASES = [  # B, Hq, Hkv, N, D, page_size, seq_lens
    (2, 4, 4, 150, 32, 16, [150, 33]),
    (3, 6, 2, 200, 16, 4, [1, 200, 129]),
    (2, 8, 2, 97, 64, 16, [97, 16]),
    (2, 8, 1, 130, 16, 8, [130, 9]),
    (1, 5, 1, 70, 48, 16, [70]),
]


def make_case(case, dtype, device, seed):
    B, Hq, Hkv, N, D, ps, lens = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, N, D, generator=gen).to(device, dtype)
    seq_lens = torch.tensor(lens, device=device)
    page_max, page_min = reference.quest_page_minmax(k, seq_lens, ps)
    return q, page_max.to(dtype), page_min.to(dtype), seq_lens


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=cpu_only),
                                   pytest.param(torch.float16, marks=cpu_only)])
def test_page_scores_and_selection(case, dtype, monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (lambda t: t.fill_(float("nan")) if t.is_floating_point()
                                                          else t.fill_(-7))(real_empty(*a, **kw)))
    ps = case[5]
    q, pmax, pmin, seq_lens = make_case(case, dtype, "cpu", zlib.crc32(repr((case, dtype)).encode()))
    scores = quest_page_scores_triton(q, pmax, pmin, seq_lens, ps)
    exact = reference.quest_page_scores(q.double(), pmax.double(), pmin.double(), seq_lens, ps)
    assert scores.dtype == torch.float32 and not torch.isnan(scores).any()
    assert torch.equal(torch.isinf(scores) & (scores > 0), torch.isinf(exact) & (exact > 0)), "+inf: current page"
    assert torch.equal(torch.isinf(scores) & (scores < 0), torch.isinf(exact) & (exact < 0)), "-inf: empty pages"
    fin = torch.isfinite(exact)
    assert (scores[fin].double() - exact[fin]).abs().max() <= 1e-5 * (1 + exact[fin].abs().max())
    for budget in (1, ps, 3 * ps + 1, 5 * ps, 10_000):
        got = quest_select_pages_triton(scores, seq_lens, ps, budget)
        want = reference.quest_select_pages(scores, seq_lens, ps, budget)
        assert got.dtype == torch.int64 and torch.equal(got, want), f"budget {budget}"


@pytest.mark.gpu
def test_bf16_gpu():
    case = (3, 32, 8, 20000, 128, 16, [20000, 7777, 5])
    q, pmax, pmin, seq_lens = make_case(case, torch.bfloat16, "cuda", 3)
    scores = quest_page_scores_triton(q, pmax, pmin, seq_lens, 16)
    ref = reference.quest_page_scores(q, pmax, pmin, seq_lens, 16)
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert (scores[fin] - ref[fin]).abs().max() <= 1e-4 * (1 + ref[fin].abs().max())
    assert torch.equal(quest_select_pages_triton(ref, seq_lens, 16, 2048),
                       reference.quest_select_pages(ref, seq_lens, 16, 2048))


def test_bad_inputs_raise_clear_errors():
    q, pm = torch.zeros(2, 4, 16), torch.zeros(2, 2, 10, 16)
    lens = torch.tensor([5, 160])
    with pytest.raises(ValueError, match="page_size"):
        quest_page_scores_triton(q, pm, pm, lens, 0)
    with pytest.raises(ValueError, match="page_min shape"):
        quest_page_scores_triton(q, pm, torch.zeros(2, 2, 9, 16), lens, 16)
    with pytest.raises(ValueError, match="seq_lens values"):
        quest_page_scores_triton(q, pm, pm, torch.tensor([5, 161]), 16)
    with pytest.raises(ValueError, match="budget"):
        quest_select_pages_triton(torch.zeros(2, 4, 10), lens, 16, 0)
