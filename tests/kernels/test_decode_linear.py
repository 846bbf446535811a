"""Triton ``decode_linear`` (1-3 weights sharing the decode batch's input in one launch; gate/up with the SiLU
gating fused) against ``kernels.reference.decode_linear``. CPU: interpreter, fp32 / fp16; GPU (``-m gpu``): bf16.
Shapes cross the tile boundaries (N and K not multiples of the tiles), batches 1-9 rows, with and without biases
(Qwen2's q/k/v), and the q/k/v widths of GQA groups 1 / 4 / 8."""

import os

import pytest
import torch
from kernel_checks import error_check

from kernels import reference
from kernels.triton_decode_linear import decode_linear_triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")
assert_error_within = error_check(floor=1e-5)

CASES = [  # M, K, widths of the weights, bias, gated
    (1, 64, (48,), False, False),
    (3, 100, (64, 16, 16), False, False),       # q / k / v of a GQA group of 4
    (2, 72, (40, 40, 40), True, False),         # group 1 with Qwen2-style biases
    (9, 96, (64, 8, 8), False, False),          # group 8
    (1, 130, (50, 50), False, True),            # gate / up
    (5, 64, (33, 33), True, True),
]


def make_case(case, dtype, device, seed):
    m, k, widths, bias, gated = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    weights = tuple((torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype) for n in widths)
    biases = tuple(torch.randn(n, generator=gen).to(device, dtype) for n in widths) if bias else None
    return x, weights, biases, gated


def exact(x, weights, biases, gated):
    x64 = x.double()
    outs = [x64 @ w.double().T + (b.double() if b is not None else 0) for w, b in
            zip(weights, biases or (None,) * len(weights))]
    return torch.nn.functional.silu(outs[0]) * outs[1] if gated else torch.cat(outs, -1)


@cpu_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_linear_matches_reference_cpu(case, dtype):
    x, weights, biases, gated = make_case(case, dtype, "cpu", seed=len(case[2]) * 31 + case[0])
    got = decode_linear_triton(x, weights, biases, gated=gated)
    ref = reference.decode_linear(x.float() if dtype == torch.float16 else x,
                                  tuple(w.float() for w in weights) if dtype == torch.float16 else weights,
                                  tuple(b.float() for b in biases) if biases and dtype == torch.float16 else biases,
                                  gated=gated).to(dtype)
    assert got.shape == ref.shape and got.dtype == dtype
    assert_error_within(f"{case} {dtype}", got, ref, exact(x, weights, biases, gated))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(1, 4096, (4096, 1024, 1024), False, False), (8, 4096, (512, 512), False, True)])
def test_decode_linear_matches_reference_gpu(case):
    x, weights, biases, gated = make_case(case, torch.bfloat16, "cuda", seed=3)
    got = decode_linear_triton(x, weights, biases, gated=gated)
    ref = reference.decode_linear(x, weights, biases, gated=gated)
    assert_error_within(f"{case}", got, ref, exact(x, weights, biases, gated))


def test_reference_is_the_separate_products():
    x, weights, biases, _ = make_case((2, 16, (8, 4, 4), True, False), torch.float32, "cpu", seed=0)
    out = reference.decode_linear(x, weights, biases)
    parts = torch.split(out, [8, 4, 4], dim=-1)
    for part, w, b in zip(parts, weights, biases):
        torch.testing.assert_close(part, torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(x=a["x"][None]), r"x must be \[M, K\]"),
    (lambda a: a.update(x=torch.zeros(65, 16)), "at most 64 rows"),
    (lambda a: a.update(weights=()), "expected 1 to 3 tensors"),
    (lambda a: a.update(weights=(torch.zeros(4, 15),)), r"weights\[0\] must be \[N, K=16\]"),
    (lambda a: a.update(weights=(torch.zeros(16, 4).T,)), r"weights\[0\] must have a unit last stride"),
    (lambda a: a.update(biases=(None,)), r"biases: expected None or one entry per weight \(3\)"),
    (lambda a: a.update(gated=True), "gated=True takes two weights of one shape"),
])
def test_bad_arguments_are_named(change, message):
    x, weights, _, _ = make_case((2, 16, (8, 4, 4), False, False), torch.float32, "cpu", seed=0)
    args = dict(x=x, weights=weights, biases=None, gated=False)
    change(args)
    with pytest.raises(ValueError, match=message):
        reference.decode_linear(**args)
