"""Triton token_sparse_scores (window stats + prefix mean probability) against kernels.reference."""

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
def test_matches_reference(case, dtype, poisoned_outputs):
    batch, hq, hkv, s, d, window = case
    gen = torch.Generator().manual_seed(case_seed(case, str(dtype)))
    q = torch.randn(batch, hq, s, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(batch, hkv, s, d, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.randint(1, s + 1, (batch,), generator=gen)
    seq_lens[0] = s
    seq_lens = seq_lens.to(DEVICE)
    got = token_sparse_scores_triton(q, k, seq_lens, window)
    exact = reference.token_sparse_scores(q.double(), k.double(), seq_lens, window)
    ref = reference.token_sparse_scores(q, k, seq_lens, window)
    assert got.dtype == torch.float32 and not torch.isnan(got).any()
    got_err = (got.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    assert got_err <= 4 * ref_err + 1e-6, f"kernel error {got_err:.3e} vs reference error {ref_err:.3e}"
    assert (got[exact == 0] == 0).all()


def test_key_splits_merge(monkeypatch):
    """Force several key splits so the log-sum-exp merge of partial statistics is exercised."""
    scores_module = importlib.import_module("kernels.triton_token_sparse_scores")
    monkeypatch.setattr(scores_module, "_num_key_splits", lambda *args: 4)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 6, 90, 16, generator=gen).to(DEVICE)
    k = torch.randn(2, 2, 90, 16, generator=gen).to(DEVICE)
    seq_lens = torch.tensor([90, 61], device=DEVICE)
    got = token_sparse_scores_triton(q, k, seq_lens, 12)
    exact = reference.token_sparse_scores(q.double(), k.double(), seq_lens, 12)
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


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_bf16_gpu(group):
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(2, 2 * group, 3000, 128, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(2, 2, 3000, 128, generator=gen).to(DEVICE, torch.bfloat16)
    seq_lens = torch.tensor([3000, 1700], device=DEVICE)
    got = token_sparse_scores_triton(q, k, seq_lens, 128)
    exact = reference.token_sparse_scores(q.double(), k.double(), seq_lens, 128)
    ref = reference.token_sparse_scores(q, k, seq_lens, 128)
    got_err = (got.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    assert got_err <= 4 * ref_err + 1e-6
