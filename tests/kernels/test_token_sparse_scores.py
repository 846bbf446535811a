"""Triton token_sparse_scores (window stats + prefix mean or max probability) against kernels.reference, and the
reference against an explicit loop over the voting queries."""

import importlib

import pytest
import torch
from kernel_checks import DEVICE, case_seed

from kernels import reference
from kernels.triton_token_sparse_scores import token_sparse_scores_triton

CASES = [  # batch, Hq, Hkv, S, D, window
    (2, 4, 4, 60, 32, 8),    # G = 1
    (3, 6, 2, 45, 16, 20),   # G = 3, window crosses tiles
    (2, 8, 2, 70, 16, 5),    # G = 4
    (2, 8, 1, 50, 64, 17),   # G = 8
    (1, 5, 1, 40, 16, 50),   # window longer than the sequence: all zeros
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_matches_reference(case, dtype, reduce, poisoned_outputs):
    batch, hq, hkv, s, d, window = case
    gen = torch.Generator().manual_seed(case_seed(case, str(dtype), reduce))
    q = torch.randn(batch, hq, s, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(batch, hkv, s, d, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.randint(1, s + 1, (batch,), generator=gen)
    seq_lens[0] = s
    seq_lens = seq_lens.to(DEVICE)
    got = token_sparse_scores_triton(q, k, seq_lens, window, reduce)
    exact = reference.token_sparse_scores(q.double(), k.double(), seq_lens, window, reduce)
    ref = reference.token_sparse_scores(q, k, seq_lens, window, reduce)
    assert got.dtype == torch.float32 and not torch.isnan(got).any()
    got_err = (got.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    assert got_err <= 4 * ref_err + 1e-6, f"kernel error {got_err:.3e} vs reference error {ref_err:.3e}"
    assert (got[exact == 0] == 0).all()


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_key_splits_merge(monkeypatch, reduce):
    """Force several key splits so the log-sum-exp merge of partial statistics is exercised."""
    scores_module = importlib.import_module("kernels.triton_token_sparse_scores")
    monkeypatch.setattr(scores_module, "_num_key_splits", lambda *args: 4)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 6, 90, 16, generator=gen).to(DEVICE)
    k = torch.randn(2, 2, 90, 16, generator=gen).to(DEVICE)
    seq_lens = torch.tensor([90, 61], device=DEVICE)
    got = token_sparse_scores_triton(q, k, seq_lens, 12, reduce)
    exact = reference.token_sparse_scores(q.double(), k.double(), seq_lens, 12, reduce)
    assert (got.double() - exact).abs().max().item() < 1e-6


def test_bad_inputs():
    q, k = torch.randn(1, 4, 20, 16), torch.randn(1, 2, 20, 16)
    with pytest.raises(ValueError, match="window"):
        token_sparse_scores_triton(q, k, torch.tensor([20]), 0)
    with pytest.raises(ValueError, match="seq_lens has values"):
        token_sparse_scores_triton(q, k, torch.tensor([21]), 4)
    with pytest.raises(TypeError, match="k.dtype"):
        token_sparse_scores_triton(q, k.double(), torch.tensor([20]), 4)
    with pytest.raises(ValueError, match="k shape"):
        token_sparse_scores_triton(q, k[:, :, :10], torch.tensor([20]), 4)
    with pytest.raises(ValueError, match="reduce='sum' is invalid: expected one of mean, max"):
        token_sparse_scores_triton(q, k, torch.tensor([20]), 4, "sum")
    with pytest.raises(ValueError, match="reduce='sum' is invalid: expected one of mean, max"):
        reference.token_sparse_scores(q, k, torch.tensor([20]), 4, "sum")


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_reference_matches_a_loop_over_the_voters(group, reduce):
    """Each prefix key's score is the mean (max) over the last W queries of its causal softmax probability;
    ragged lengths, one shorter than the window (nothing scores)."""
    gen = torch.Generator().manual_seed(50 + group)
    q = torch.randn(3, 2 * group, 33, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(3, 2, 33, 8, generator=gen, dtype=torch.float64)
    lens, window = [33, 20, 5], 7
    got = reference.token_sparse_scores(q, k, torch.tensor(lens), window, reduce)
    for b, n in enumerate(lens):
        for h in range(2 * group):
            rows = [torch.softmax(k[b, h // group, :i + 1] @ q[b, h, i] / 8 ** 0.5, 0) for i in range(max(0, n - window), n)]
            expect = torch.zeros(33, dtype=torch.float64)
            for t in range(max(0, n - window)):
                votes = torch.stack([row[t] for row in rows])
                expect[t] = votes.max() if reduce == "max" else votes.mean()
            torch.testing.assert_close(got[b, h], expect)
    assert got[2].abs().max() == 0


def test_max_and_mean_rank_differently():
    """Guard: a key that one voter attends to sharply ranks higher under max than under mean."""
    q = torch.zeros(1, 1, 12, 4, dtype=torch.float64)
    k = torch.zeros(1, 1, 12, 4, dtype=torch.float64)
    k[0, 0, 2, 0] = 1.0               # key 2: one query's sharp target
    k[0, 0, 5, 1] = 1.0               # key 5: every query's mild target
    q[0, 0, 8:, 1] = 1.8
    q[0, 0, 11, 0] = 4.0              # only the last window query looks at key 2, strongly
    mean = reference.token_sparse_scores(q, k, torch.tensor([12]), 4, "mean")[0, 0]
    top = reference.token_sparse_scores(q, k, torch.tensor([12]), 4, "max")[0, 0]
    assert mean[5] > mean[2] and top[2] > top[5]


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_bf16_gpu(group, reduce):
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(2, 2 * group, 3000, 128, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(2, 2, 3000, 128, generator=gen).to(DEVICE, torch.bfloat16)
    seq_lens = torch.tensor([3000, 1700], device=DEVICE)
    got = token_sparse_scores_triton(q, k, seq_lens, 128, reduce=reduce)
    exact = reference.token_sparse_scores(q.double(), k.double(), seq_lens, 128, reduce)
    ref = reference.token_sparse_scores(q, k, seq_lens, 128, reduce)
    got_err = (got.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    assert got_err <= 4 * ref_err + 1e-6
