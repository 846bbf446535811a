"""Triton sparse_prefill_attention (Token Sparse: per-head position lists) against kernels.reference.

Lists are strictly ascending and -1 padded, per query head (Hs = Hq) or per GQA group (Hs = Hkv,
compared with the reference on the list repeated for the G heads). Blocks of list entries cross
the 16-entry interpreter tiles; some lists are full (keep everything = dense causal).
"""

import pytest
import torch
from kernel_checks import DEVICE, case_seed, error_check

from kernels import reference
from kernels.triton_sparse_prefill_attention import sparse_prefill_attention_triton


def random_lists(batch, heads, s, k, gen, full_first=True):
    idx = torch.full((batch, heads, k), -1, dtype=torch.int64)
    for b in range(batch):
        for h in range(heads):
            n = k if (full_first and b == 0 and h == 0) else int(torch.randint(1, k + 1, (), generator=gen))
            idx[b, h, :n] = torch.randperm(s, generator=gen)[:n].sort().values
    return idx


assert_error_within = error_check(floor=1e-5)


CASES = [  # batch, Hq, Hkv, S, K, D, per_kv_group
    (2, 4, 4, 60, 37, 32, False),  # G = 1
    (2, 6, 2, 45, 20, 16, False),  # G = 3
    (2, 8, 2, 50, 33, 16, True),   # G = 4, one list per GQA group
    (2, 8, 1, 40, 40, 64, False),  # G = 8, K = S (every position may be kept)
    (1, 5, 1, 35, 18, 16, True),   # G = 5
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(case, dtype, poisoned_outputs):
    batch, hq, hkv, s, k, d, per_group = case
    gen = torch.Generator().manual_seed(case_seed(case, str(dtype)))
    q = torch.randn(batch, hq, s, d, generator=gen).to(DEVICE, dtype)
    kk = torch.randn(batch, hkv, s, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(batch, hkv, s, d, generator=gen).to(DEVICE, dtype)
    lists = random_lists(batch, hkv if per_group else hq, s, k, gen).to(DEVICE)
    out = sparse_prefill_attention_triton(q, kk, v, lists.to(torch.int32))
    per_head = lists.repeat_interleave(hq // hkv, dim=1) if per_group else lists
    exact = reference.sparse_prefill_attention(q.double(), kk.double(), v.double(), per_head)
    ref = reference.sparse_prefill_attention(q, kk, v, per_head)
    assert out.dtype == dtype and not torch.isnan(out).any()
    assert_error_within("out", out, ref, exact)
    kept = torch.zeros(batch, hq, s + 1, dtype=torch.bool, device=DEVICE)
    kept.scatter_(2, torch.where(per_head >= 0, per_head, s), True)
    assert (out[~kept[..., :s]] == 0).all(), "unlisted rows must be exactly 0"


def test_full_list_equals_dense_causal():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 30, 16, generator=gen).to(DEVICE) for _ in range(3))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    lists = torch.arange(30, device=DEVICE).expand(2, 4, 30).contiguous()
    out = sparse_prefill_attention_triton(q, k, v, lists)
    dense = reference.prefill_attention(q, k, v, torch.zeros(2, dtype=torch.long, device=DEVICE),
                                        torch.full((2,), 30, device=DEVICE))
    assert (out - dense).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "lists, match",
    [
        ([[3, 1, 5, -1]], "strictly ascending"),
        ([[1, -1, 5, -1]], "strictly ascending"),
        ([[1, 2, 2, -1]], "strictly ascending"),
        ([[1, 2, 12, -1]], "allowed are positions"),
        ([[-2, 1, 3, -1]], "allowed are positions"),
    ],
)
def test_bad_lists_raise(lists, match):
    q, k, v = torch.randn(1, 2, 12, 16), torch.randn(1, 1, 12, 16), torch.randn(1, 1, 12, 16)
    idx = torch.tensor(lists).expand(1, 2, 4).contiguous()
    with pytest.raises(ValueError, match=match):
        sparse_prefill_attention_triton(q, k, v, idx)


def test_bad_shapes_raise():
    q, k, v = torch.randn(1, 6, 12, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    with pytest.raises(ValueError, match="Hs = Hq"):
        sparse_prefill_attention_triton(q, k, v, torch.zeros(1, 3, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="indices.dtype"):
        sparse_prefill_attention_triton(q, k, v, torch.zeros(1, 6, 4))
    with pytest.raises(ValueError, match="k shape"):
        sparse_prefill_attention_triton(q, k[:, :, :10], v[:, :, :10], torch.zeros(1, 6, 4, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_bf16_gpu(group):
    gen = torch.Generator().manual_seed(group)
    batch, hkv, s, k, d = 2, 2, 900, 500, 128
    q = torch.randn(batch, hkv * group, s, d, generator=gen).to(DEVICE, torch.bfloat16)
    kk = torch.randn(batch, hkv, s, d, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(batch, hkv, s, d, generator=gen).to(DEVICE, torch.bfloat16)
    lists = random_lists(batch, hkv * group, s, k, gen).to(DEVICE)
    out = sparse_prefill_attention_triton(q, kk, v, lists)
    exact = reference.sparse_prefill_attention(q.double(), kk.double(), v.double(), lists)
    ref = reference.sparse_prefill_attention(q, kk, v, lists)
    assert_error_within("out", out, ref, exact, factor=3.0)
