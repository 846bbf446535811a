"""Triton prefill_attention (causal, ragged offsets / KV lengths, LSE) against kernels.reference.

CPU: TRITON_INTERPRET=1 (fp32, fp16); GPU (``-m gpu``): bf16 at larger sizes. Tolerance: the
kernel's error against the fp64 reference is within a small factor of the same-dtype torch
reference's error (plus a tiny floor for fp32, where both are ~1e-7).
"""

import pytest
import torch
from kernel_checks import DEVICE, case_seed, error_check

from kernels import reference
from kernels.triton_prefill_attention import prefill_attention_triton

assert_error_within = error_check(floor=1e-5)


def make_inputs(batch, hq, hkv, s, n, d, dtype, gen):
    q = torch.randn(batch, hq, s, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(batch, hkv, n, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(batch, hkv, n, d, generator=gen).to(DEVICE, dtype)
    return q, k, v


CPU_CASES = [  # batch, Hq, Hkv, S, N, D
    (2, 4, 4, 37, 37, 32),   # G = 1, prompt chunk = whole sequence
    (3, 6, 2, 20, 45, 16),   # G = 3, chunked prefill with offsets
    (2, 8, 2, 33, 50, 64),   # G = 4
    (2, 8, 1, 17, 40, 16),   # G = 8
    (1, 5, 1, 24, 24, 48),   # G = 5, D not a power of two
]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(case, dtype, poisoned_outputs):
    gen = torch.Generator().manual_seed(case_seed(case, str(dtype)))
    batch, hq, hkv, s, n, d = case
    q, k, v = make_inputs(batch, hq, hkv, s, n, d, dtype, gen)
    q_offsets = torch.randint(0, n - s + 1, (batch,), generator=gen)
    # ragged: some sequences end inside the chunk (padding rows), one is complete
    kv_lens = torch.minimum(q_offsets + torch.randint(1, s + 1, (batch,), generator=gen), torch.tensor(n))
    kv_lens[0] = n
    q_offsets[0] = n - s
    q_offsets, kv_lens = q_offsets.to(DEVICE), kv_lens.to(DEVICE)
    out, lse = prefill_attention_triton(q, k, v, q_offsets, kv_lens, return_lse=True)
    exact_out, exact_lse = reference.prefill_attention(q.double(), k.double(), v.double(), q_offsets, kv_lens,
                                                       return_lse=True)
    ref_out, ref_lse = reference.prefill_attention(q, k, v, q_offsets, kv_lens, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(exact_lse)), "padding rows must have lse = -inf"
    assert_error_within("out", out, ref_out, exact_out)
    finite = torch.isfinite(exact_lse)
    assert_error_within("lse", lse[finite], ref_lse[finite], exact_lse[finite], floor=1e-4)
    padding = ~finite
    assert (out[padding] == 0).all(), "rows at positions >= kv_lens must be 0"


def test_scale_and_no_lse(poisoned_outputs):
    gen = torch.Generator().manual_seed(7)
    q, k, v = make_inputs(2, 4, 2, 19, 19, 16, torch.float32, gen)
    offsets = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    lens = torch.tensor([19, 11], device=DEVICE)
    out = prefill_attention_triton(q, k, v, offsets, lens, scale=0.3)
    exact = reference.prefill_attention(q.double(), k.double(), v.double(), offsets, lens, scale=0.3)
    assert (out.double() - exact).abs().max().item() < 1e-5


def _grads_against_exact(q, k, v, q_offsets, kv_lens, gen):
    """(kernel, same-dtype reference, fp64 reference) of (out, dq, dk, dv) for one random upstream gradient."""
    dout = torch.randn(q.shape, generator=gen).to(DEVICE, q.dtype)
    runs = []
    for fn, dtype in ((prefill_attention_triton, q.dtype), (reference.prefill_attention, q.dtype),
                      (reference.prefill_attention, torch.float64)):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*inputs, q_offsets, kv_lens)
        runs.append((out, *torch.autograd.grad(out, inputs, dout.to(dtype))))
    return runs


@pytest.mark.parametrize("group, dtype", [(1, torch.float32), (3, torch.float32), (4, torch.float16)])
def test_gradients_of_a_fresh_prefill(group, dtype, poisoned_outputs, monkeypatch):
    """Training (q_offsets 0, N = S, right padding through kv_lens): the fused SDPA path, gradients of q, k, v
    as the fp64 reference's; with return_lse (the reference) the LSE equals the forward-only kernel's."""
    import kernels.triton_prefill_attention as module

    calls = []
    real = module.dense_causal_attention_sdpa
    monkeypatch.setattr(module, "dense_causal_attention_sdpa", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(11 + group)
    q, k, v = make_inputs(2, 2 * group, 2, 41, 41, 16, dtype, gen)
    offsets = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    lens = torch.tensor([41, 23], device=DEVICE)
    got, ref, exact = _grads_against_exact(q, k, v, offsets, lens, gen)
    for name, g, r, e in zip(("out", "dq", "dk", "dv"), got, ref, exact):
        assert not torch.isnan(g).any(), name
        assert_error_within(name, g, r, e, floor=1e-5)
    assert (got[0][:, :, 23:][1] == 0).all() and (got[1][1, :, 23:] == 0).all(), "padding rows: out 0, dq 0"
    assert calls == [1]
    out, lse = prefill_attention_triton(q.requires_grad_(), k, v, offsets, lens, return_lse=True)
    assert out.requires_grad and calls == [1]
    with torch.no_grad():
        _, lse_no_grad = prefill_attention_triton(q, k, v, offsets, lens, return_lse=True)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_no_grad))
    finite = torch.isfinite(lse)
    assert (lse[finite] - lse_no_grad[finite]).abs().max().item() < 1e-4


def test_gradients_of_a_chunk_after_a_past():
    """With q_offsets > 0 (no training path does this) gradients still flow (the PyTorch reference)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_inputs(2, 4, 2, 9, 20, 16, torch.float32, gen)
    got, _, exact = _grads_against_exact(q, k, v, torch.tensor([11, 4], device=DEVICE),
                                         torch.tensor([20, 10], device=DEVICE), gen)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, exact):
        assert (g.double() - e).abs().max().item() < 1e-5, name


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda a: a.update(k=a["k"].half()), TypeError, "k.dtype"),
        (lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q.dtype"),
        (lambda a: a.update(k=a["k"][:, :, :, :8].contiguous(), v=a["v"][:, :, :, :8].contiguous()), ValueError,
         "k shape"),
        (lambda a: a.update(kv_lens=torch.tensor([40, 3])), ValueError, "kv_lens has values"),
        (lambda a: a.update(q_offsets=torch.tensor([-1, 0])), ValueError, "q_offsets has values"),
        (lambda a: a.update(kv_lens=torch.tensor([3.0, 3.0])), TypeError, "kv_lens.dtype"),
        (lambda a: a.update(q=torch.randn(2, 5, 8, 16)), ValueError, "multiple of the KV head count"),
        (lambda a: a.update(scale=-1.0), ValueError, "scale"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, error, match):
    args = dict(q=torch.randn(2, 4, 8, 16), k=torch.randn(2, 2, 12, 16), v=torch.randn(2, 2, 12, 16),
                q_offsets=torch.tensor([0, 4]), kv_lens=torch.tensor([12, 8]), scale=None)
    mutate(args)
    with pytest.raises(error, match=match):
        prefill_attention_triton(args["q"], args["k"], args["v"], args["q_offsets"], args["kv_lens"],
                                 scale=args["scale"])


def test_value_range_checks_follow_the_skip_switch(monkeypatch):
    """The per-sequence range checks read the tensor on the host (a device sync per call on CUDA): like the
    decode kernels' checks they are left out under PODKIT_SKIP_VALUE_CHECKS=1, while shape / dtype checks stay."""
    from kernels._prefill_common import check_int_vector

    lens = torch.tensor([40, 3])
    with pytest.raises(ValueError, match="kv_lens has values"):
        check_int_vector("kv_lens", lens, 2, lens.device, low=0, high=12)
    monkeypatch.setenv("PODKIT_SKIP_VALUE_CHECKS", "1")
    assert check_int_vector("kv_lens", lens, 2, lens.device, low=0, high=12).tolist() == [40, 3]
    with pytest.raises(ValueError, match="shape"):
        check_int_vector("kv_lens", lens, 3, lens.device, low=0, high=12)


def _ragged_gqa_case(group, seed):
    """bf16 inputs of a ragged batch: 700 queries over 1000 keys, offsets [300, 100], kv_lens [1000, 513]."""
    gen = torch.Generator().manual_seed(seed)
    batch, hkv, s, n, d = 2, 2, 700, 1000, 128
    q, k, v = make_inputs(batch, hkv * group, hkv, s, n, d, torch.bfloat16, gen)
    return q, k, v, torch.tensor([n - s, 100], device=DEVICE), torch.tensor([n, 513], device=DEVICE)


def _assert_matches_exact(out, lse, q, k, v, q_offsets, kv_lens):
    exact_out, exact_lse = reference.prefill_attention(q.double(), k.double(), v.double(), q_offsets, kv_lens,
                                                       return_lse=True)
    ref_out = reference.prefill_attention(q, k, v, q_offsets, kv_lens)
    assert_error_within("out", out, ref_out, exact_out, factor=3.0)
    finite = torch.isfinite(exact_lse)
    assert (lse[finite].double() - exact_lse[finite]).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_bf16_gpu(group, poisoned_outputs):
    q, k, v, q_offsets, kv_lens = _ragged_gqa_case(group, seed=group)
    out, lse = prefill_attention_triton(q, k, v, q_offsets, kv_lens, return_lse=True)
    _assert_matches_exact(out, lse, q, k, v, q_offsets, kv_lens)


def _forward_tile_ids():
    from kernels._prefill_common import forward_tile_candidates

    base, hopper = forward_tile_candidates()
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in base + hopper]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", _forward_tile_ids(), ids=lambda t: "m{}_n{}_w{}_s{}".format(*t))
def test_every_tile_candidate_gpu(tile, poisoned_outputs):
    """The autotuner may pick any candidate (sm_90 ones included) for some length: each one, launched directly,
    is correct on a ragged GQA batch whose lengths cross its blocks. A tile that does not fit the GPU's shared
    memory is skipped, as the autotuner skips it."""
    from triton.runtime.errors import OutOfResources

    from kernels.triton_prefill_attention import launch_prefill_kernel

    group = 4
    q, k, v, q_offsets, kv_lens = _ragged_gqa_case(group, seed=sum(tile))
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=DEVICE)
    try:
        launch_prefill_kernel(q, k, v, out, lse, q_offsets.to(torch.int32), kv_lens.to(torch.int32), group,
                              q.shape[-1] ** -0.5, True, tile=tile)
    except OutOfResources as exc:
        pytest.skip(f"tile does not fit this GPU: {exc}")
    _assert_matches_exact(out, lse, q, k, v, q_offsets, kv_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4])
def test_bf16_gradients_gpu(group, poisoned_outputs):
    gen = torch.Generator().manual_seed(20 + group)
    q, k, v = make_inputs(2, 2 * group, 2, 1000, 1000, 128, torch.bfloat16, gen)
    got, ref, exact = _grads_against_exact(q, k, v, torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                           torch.tensor([1000, 613], device=DEVICE), gen)
    for name, g, r, e in zip(("out", "dq", "dk", "dv"), got, ref, exact):
        assert_error_within(name, g, r, e, factor=4.0)  # the fused SDPA rounds P to bf16, the reference does not
