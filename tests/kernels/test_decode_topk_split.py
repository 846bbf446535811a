"""The split radix top-k (kernels/_decode_topk_split.py) and the selection layer that fuses its first
pass into the attention's key chunks (kernels/triton_decode_attention.py, topk_impl="split").

Exactness is checked against torch.topk (the same index set; ties: the lowest slots, every strictly
larger slot kept), the reference selection (kernels/reference.py), and the old path (topk_impl=
"legacy"), which ranks the same fp32 scores and so must agree bit for bit. Chunks and blocks are
shrunk (monkeypatched) so that small interpreter shapes still cross many chunk and block boundaries.
"""

import os
import zlib

import pytest
import torch
from kernel_checks import DEVICE

from kernels import _decode_common, reference
from kernels import _decode_topk_split as TS
from kernels.triton_decode_attention import decode_attention_triton, selection_decode_attention_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")


@pytest.fixture
def many_chunks(monkeypatch):
    """Passes over 64-score blocks, planned as if for 4 SMs: several chunks per row on CPU."""
    monkeypatch.setattr(TS, "_BLOCK", 64)
    monkeypatch.setattr(_decode_common, "num_sms", lambda device: 4)


def selection_scores(B, H, N, seq_lens, gen, integer=False):
    s = torch.randint(-3, 3, (B, H, N), generator=gen).float() if integer else torch.randn(B, H, N, generator=gen) * 4
    slots = torch.arange(N)[None, None, :]
    s = s.masked_fill(slots >= seq_lens[:, None, None], float("-inf"))
    s[torch.arange(B), :, seq_lens - 1] = float("-inf")  # the current slot is appended, not ranked
    return s


def assert_topk_set(idx, scores, seq_lens, budget):
    """idx [B,H,budget] against torch.topk of scores: ascending winners, then the current slot, then -1;
    strictly larger values all kept; ties at the k-th value resolved by lowest slot."""
    B, H, N = scores.shape
    for b in range(B):
        cur = int(seq_lens[b]) - 1
        k = min(budget - 1, cur)  # finite scores: slots [0, cur)
        for h in range(H):
            row = idx[b, h].tolist()
            assert row[:k] == sorted(row[:k]) and row[k] == cur and row[k + 1:] == [-1] * (budget - k - 1)
            chosen = torch.tensor(row[:k], dtype=torch.int64)
            if k == 0:
                continue
            vals, top = torch.topk(scores[b, h], k)
            assert torch.isfinite(vals).all()
            got_vals = scores[b, h, chosen]
            assert torch.equal(got_vals.sort().values, vals.sort().values), "same values as torch.topk"
            kth = vals.min()
            strict = set(top[vals > kth].tolist())
            assert strict <= set(row[:k]), "every slot above the k-th value is kept"
            all_ties = (scores[b, h] == kth).nonzero().flatten()
            ties = chosen[got_vals == kth]
            assert torch.equal(ties, all_ties[: ties.numel()]), "ties resolved by lowest slot"


@pytest.mark.parametrize("budget", [1, 64, 301, 900])
def test_split_topk_matches_reference_and_torch_topk(budget, many_chunks):
    gen = torch.Generator().manual_seed(budget)
    seq_lens = torch.tensor([800, 500, 1, 65])  # budget > some rows' lengths; a row with only its own token
    s = selection_scores(4, 2, 800, seq_lens, gen)
    got = TS.split_topk_slots(s.to(DEVICE), seq_lens.to(DEVICE), budget).cpu()
    assert torch.equal(got, reference.select_topk_positions(s, seq_lens, budget))
    assert_topk_set(got, s, seq_lens, budget)


def test_split_topk_ties(many_chunks):
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.tensor([900, 333])
    s = selection_scores(2, 2, 900, seq_lens, gen, integer=True)  # 6 distinct values: heavy ties
    for budget in (200, 334):
        got = TS.split_topk_slots(s.to(DEVICE), seq_lens.to(DEVICE), budget).cpu()
        assert_topk_set(got, s, seq_lens, budget)


def test_split_topk_extreme_and_equal_values(many_chunks):
    """Negative / tiny / huge magnitudes (all four radix digits decide), and rows of one value."""
    gen = torch.Generator().manual_seed(9)
    seq_lens = torch.tensor([500, 500])
    s = selection_scores(2, 2, 500, seq_lens, gen)
    s[0, 0, :499] = torch.randn(499, generator=gen) * 1e-30
    s[0, 1, :499] = -torch.rand(499, generator=gen) * 1e30
    s[1, 0, :499] = 1.0 + torch.arange(499) * 2 ** -23  # neighbouring floats: only the last digit differs
    s[1, 1, :499] = -2.5
    got = TS.split_topk_slots(s.to(DEVICE), seq_lens.to(DEVICE), 100).cpu()
    assert_topk_set(got, s, seq_lens, 100)
    assert got[1, 1, :99].tolist() == list(range(99))


def test_split_topk_bad_hist():
    s = torch.zeros(1, 2, 10)
    with pytest.raises(ValueError, match="hist must be int32"):
        TS.split_topk_slots(s, torch.tensor([10]), 4, hist=torch.zeros(2, 4, 16, dtype=torch.int32))


SELECTION_CASES = [  # B, Hq, Hkv, N, D, seq_lens: ragged batches, lengths off the 64-key tiles
    (2, 4, 4, 300, 16, [300, 61]),        # G = 1
    (3, 6, 2, 260, 16, [1, 260, 129]),    # G = 3, a sequence with only its own token
    (2, 8, 2, 197, 32, [128, 197]),       # G = 4, one length exactly two tiles
    (2, 8, 1, 230, 16, [230, 3]),         # G = 8
]


def make_inputs(case, seed, dtype=torch.float32):
    B, Hq, Hkv, N, D, lens = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=gen).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, N, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, N, D, generator=gen).to(DEVICE, dtype)
    return q, k, v, torch.tensor(lens, device=DEVICE)


@pytest.mark.parametrize("case", SELECTION_CASES)
def test_fused_selection_is_topk_of_the_kernel_logits(case, many_chunks):
    """Per query head: the fused histogram pass + split select pick exactly the reference selection
    (torch.topk) of the kernel's own logits; the attention output is that of the plain decode."""
    q, k, v, seq_lens = make_inputs(case, zlib.crc32(repr(case).encode()))
    budget = 97
    out, idx = selection_decode_attention_triton(q, k, v, seq_lens, budget)
    out_dense, scores = decode_attention_triton(q, k, v, seq_lens, return_scores=True)
    assert torch.equal(out, out_dense)
    assert torch.equal(idx.cpu(), reference.select_topk_positions(scores.cpu(), seq_lens.cpu(), budget))


@pytest.mark.parametrize("case", SELECTION_CASES[1:])
def test_fused_group_selection_equals_legacy(case, many_chunks):
    """Per KV group (summed probabilities; histogram fused into the group kernel): the same indices
    as the old top-k path over the same scores."""
    q, k, v, seq_lens = make_inputs(case, zlib.crc32(repr(("group", case)).encode()))
    out, idx = selection_decode_attention_triton(q, k, v, seq_lens, 97, per_kv_group=True)
    out_old, idx_old = selection_decode_attention_triton(q, k, v, seq_lens, 97, per_kv_group=True,
                                                         topk_impl="legacy")
    assert torch.equal(out, out_old) and torch.equal(idx, idx_old)


def test_fused_selection_fp16_against_reference(many_chunks):
    q, k, v, seq_lens = make_inputs((2, 8, 2, 197, 32, [197, 90]), 5, torch.float16)
    out, idx = selection_decode_attention_triton(q, k, v, seq_lens, 40)
    ref_out, ref_idx = reference.selection_decode_attention(q, k, v, seq_lens, 40)
    assert (out.float() - ref_out.float()).abs().max() < 2e-3
    _, logits = reference.decode_attention(q, k, v, seq_lens, return_scores=True)
    for b in range(2):
        for h in range(8):
            diff = set(idx[b, h].tolist()) ^ set(ref_idx[b, h].tolist())
            floor = logits[b, h, [i for i in ref_idx[b, h].tolist() if 0 <= i < int(seq_lens[b]) - 1]].min()
            assert all(abs(logits[b, h, i] - floor) < 1e-3 for i in diff), "differences only at near-ties"


@pytest.mark.parametrize("per_kv_group", [False, True])
def test_budget_at_least_length_selects_everything_and_equals_dense(per_kv_group):
    """k = length: every slot selected, so a sparse decode over the selection equals the dense one."""
    from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton
    q, k, v, seq_lens = make_inputs((2, 8, 2, 150, 16, [150, 150]), 21)
    out, idx = selection_decode_attention_triton(q, k, v, seq_lens, 150, per_kv_group=per_kv_group)
    assert torch.equal(idx.cpu(), torch.arange(150).expand_as(idx.cpu()))
    sparse = sparse_decode_attention_triton(q, k, v, idx)  # one list per query head or per KV head
    assert (sparse - out).abs().max() < 1e-5
    assert (out - reference.decode_attention(q, k, v, seq_lens)).abs().max() < 1e-5


def test_topk_impl_switch(monkeypatch):
    q, k, v, seq_lens = make_inputs((1, 2, 1, 40, 16, [40]), 1)
    with pytest.raises(ValueError, match="topk_impl must be one of"):
        selection_decode_attention_triton(q, k, v, seq_lens, 4, topk_impl="radix")
    monkeypatch.setenv("PODKIT_SELECTION_TOPK", "sort")
    with pytest.raises(ValueError, match="PODKIT_SELECTION_TOPK must be one of"):
        selection_decode_attention_triton(q, k, v, seq_lens, 4)
    monkeypatch.setenv("PODKIT_SELECTION_TOPK", "legacy")
    assert torch.equal(selection_decode_attention_triton(q, k, v, seq_lens, 4)[1],
                       selection_decode_attention_triton(q, k, v, seq_lens, 4, topk_impl="split")[1])


def test_auto_topk_takes_the_faster_path_per_mode(monkeypatch):
    """The default: split per KV group, legacy per head (the H200 measurements in triton_decode_attention.py)."""
    from kernels import triton_decode_attention as DA
    monkeypatch.delenv("PODKIT_SELECTION_TOPK", raising=False)
    assert DA._resolve_topk_impl(None, per_kv_group=True) == "split"
    assert DA._resolve_topk_impl(None, per_kv_group=False) == "legacy"
    assert DA._resolve_topk_impl("split", per_kv_group=False) == "split"
    q, k, v, seq_lens = make_inputs((2, 4, 2, 70, 16, [70, 41]), 3)
    for per_kv_group in (False, True):
        auto = selection_decode_attention_triton(q, k, v, seq_lens, 9, per_kv_group=per_kv_group)[1]
        for impl in ("split", "legacy"):
            assert torch.equal(auto, selection_decode_attention_triton(q, k, v, seq_lens, 9, per_kv_group=per_kv_group,
                                                                       topk_impl=impl)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("per_kv_group", [False, True])
def test_split_selection_gpu_long_rows(per_kv_group):
    """bf16, 32 heads over 8 KV heads, 40K slots, budget 2048: the fused split path and the old path
    rank the same fp32 scores, so they must agree exactly; per head it is also torch.topk's set."""
    q, k, v, seq_lens = make_inputs((2, 32, 8, 40000, 128, [40000, 17000]), 13, torch.bfloat16)
    out, idx = selection_decode_attention_triton(q, k, v, seq_lens, 2048, per_kv_group=per_kv_group)
    out_old, idx_old = selection_decode_attention_triton(q, k, v, seq_lens, 2048, per_kv_group=per_kv_group,
                                                         topk_impl="legacy")
    assert torch.equal(out, out_old) and torch.equal(idx, idx_old)
    if not per_kv_group:
        _, scores = decode_attention_triton(q, k, v, seq_lens, return_scores=True)
        scores[torch.arange(2, device=DEVICE), :, seq_lens - 1] = float("-inf")
        assert torch.equal(idx.cpu(), reference.select_topk_positions(scores.cpu(), seq_lens.cpu(), 2048))
