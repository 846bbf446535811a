"""Triton sparse_decode_attention (per-head Hs=Hq and per-group Hs=Hkv lists) against kernels.reference.

CPU: interpreter, fp32 / fp16; GPU (``-m gpu``): bf16. Lists are unsorted, -1 padded (some fully -1),
cross tile and chunk boundaries; outputs are NaN-poisoned before the call.
"""

import os
import zlib

import pytest
import torch
from kernel_checks import error_check

from kernels import reference
from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")

CASES = [  # B, Hq, Hkv, N, D, K
    (2, 4, 4, 150, 32, 70),   # G = 1
    (3, 6, 2, 200, 16, 130),  # G = 3
    (2, 8, 2, 97, 64, 33),    # G = 4
    (2, 8, 1, 130, 16, 65),   # G = 8
    (1, 5, 1, 70, 48, 64),    # G = 5, D not a power of two
]


assert_error_within = error_check(floor=1e-6)


def make_case(case, per_group, dtype, device, seed):
    B, Hq, Hkv, N, D, K = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, N, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, N, D, generator=gen).to(device, dtype)
    Hs = Hkv if per_group else Hq
    idx = torch.stack([torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(Hs)]) for _ in range(B)])
    idx[0, :, K // 2:] = -1                        # ragged list lengths
    idx[-1, 0, :] = -1                             # one list with nothing: output 0
    idx[0, -1, 3] = -1                             # a hole in the middle
    return q, k, v, idx.to(device)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=cpu_only),
                                   pytest.param(torch.float16, marks=cpu_only)])
def test_matches_reference(case, per_group, dtype, poisoned_outputs):
    q, k, v, idx = make_case(case, per_group, dtype, "cpu", zlib.crc32(repr((case, per_group, dtype)).encode()))
    for indices in (idx, idx.to(torch.int32)):
        out = sparse_decode_attention_triton(q, k, v, indices, scale=0.2)
        exact = reference.sparse_decode_attention(q.double(), k.double(), v.double(), idx, scale=0.2)
        ref = reference.sparse_decode_attention(q, k, v, idx, scale=0.2)
        assert out.dtype == dtype and not torch.isnan(out).any()
        assert_error_within("out", out, ref, exact)
    empty_list = (idx < 0).all(-1)  # [B, Hs]
    if per_group and k.shape[1] != q.shape[1]:
        empty_list = empty_list.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    assert (out[empty_list] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("per_group", [False, True])
def test_bf16_gpu(G, per_group):
    Hkv = 8 if G < 8 else 4
    case = (3, G * Hkv, Hkv, 6000, 128, 2048)
    q, k, v, idx = make_case(case, per_group, torch.bfloat16, "cuda", G)
    out = sparse_decode_attention_triton(q, k, v, idx.to(torch.int32))
    exact = reference.sparse_decode_attention(q.double(), k.double(), v.double(), idx)
    ref = reference.sparse_decode_attention(q, k, v, idx)
    assert_error_within("out", out, ref, exact)


def test_bad_inputs_raise_clear_errors():
    q, k, v = torch.zeros(2, 4, 16), torch.zeros(2, 2, 40, 16), torch.zeros(2, 2, 40, 16)
    ok = torch.zeros(2, 4, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="Hs = Hq"):
        sparse_decode_attention_triton(q, k, v, torch.zeros(2, 3, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="int32, int64"):
        sparse_decode_attention_triton(q, k, v, ok.float())
    with pytest.raises(ValueError, match=r"slot in \[0, N=40\)"):
        sparse_decode_attention_triton(q, k, v, ok + 40)
    with pytest.raises(ValueError, match="-1"):
        sparse_decode_attention_triton(q, k, v, ok - 2)
    with pytest.raises(TypeError, match="v_cache has dtype"):
        sparse_decode_attention_triton(q, k, v.half(), ok)
