"""The Triton radix top-k used by the selection layer (kernels/_decode_topk.py) against
kernels.reference.select_topk_positions, including ties, negative values and short rows."""

import os

import pytest
import torch
from kernel_checks import DEVICE

from kernels import reference
from kernels._decode_topk import topk_slots_with_current

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")


def selection_scores(B, H, N, seq_lens, gen, integer=False):
    s = torch.randint(-4, 4, (B, H, N), generator=gen).float() if integer else torch.randn(B, H, N, generator=gen) * 5
    slots = torch.arange(N)[None, None, :]
    s = s.masked_fill(slots >= seq_lens[:, None, None], float("-inf"))
    s[torch.arange(B), :, seq_lens - 1] = float("-inf")  # the current slot is appended, not ranked
    return s


@pytest.mark.parametrize("budget", [1, 2, 64, 1025, 3000])
def test_matches_reference(budget):
    gen = torch.Generator().manual_seed(budget)
    seq_lens = torch.tensor([2500, 700, 1, 1024])
    s = selection_scores(4, 3, 2500, seq_lens, gen)
    got = topk_slots_with_current(s.to(DEVICE), seq_lens.to(DEVICE), budget).cpu()
    assert torch.equal(got, reference.select_topk_positions(s, seq_lens, budget))


def test_ties_keep_exactly_k_and_the_lowest_slots():
    gen = torch.Generator().manual_seed(5)
    seq_lens = torch.tensor([900])
    s = selection_scores(1, 2, 900, seq_lens, gen, integer=True)
    budget = 200
    got = topk_slots_with_current(s.to(DEVICE), seq_lens.to(DEVICE), budget).cpu()
    for h in range(2):
        chosen = got[0, h, :-1]
        assert (chosen >= 0).all() and torch.equal(chosen, chosen.sort().values)
        assert got[0, h, -1] == 899
        values = s[0, h, chosen]
        threshold = values.min()
        assert (s[0, h] > threshold).sum() <= budget - 1 <= (s[0, h] >= threshold).sum()
        assert (values > threshold).sum() == (s[0, h] > threshold).sum(), "every strictly larger slot is kept"
        ties = chosen[values == threshold]
        all_ties = (s[0, h] == threshold).nonzero().flatten()
        assert torch.equal(ties, all_ties[: ties.numel()]), "ties resolved by lowest slot"


@pytest.mark.parametrize("bits", [2, 8])
def test_other_digit_widths_and_torch_path_agree(bits):
    from kernels._decode_topk import topk_slots_torch
    gen = torch.Generator().manual_seed(bits)
    seq_lens = torch.tensor([1300, 40])
    s = selection_scores(2, 2, 1300, seq_lens, gen)
    want = reference.select_topk_positions(s, seq_lens, 300)
    got = topk_slots_with_current(s.to(DEVICE), seq_lens.to(DEVICE), 300, _bits=bits).cpu()
    assert torch.equal(got, want)
    assert torch.equal(topk_slots_torch(s, seq_lens, 300), want)
