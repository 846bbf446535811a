"""Triton decode_attention / selection_decode_attention against kernels.reference.

CPU: TRITON_INTERPRET=1 in fp32 and fp16 (the interpreter gets bf16 tl.dot wrong); GPU (``-m gpu``):
bf16 at larger sizes. Outputs are compared with an fp64 reference: the kernel's error must stay
within a small factor of the same-dtype torch reference's error. Buffers the launcher allocates
start as NaN so that an unwritten chunk or score slot shows up. Selections must equal the
reference's except where two candidates' logits are within the accumulation noise of each other.
"""

import os
import zlib

import pytest
import torch
from kernel_checks import error_check

from kernels import reference
from kernels.triton_decode_attention import decode_attention_triton, selection_decode_attention_triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")
CPU_DTYPES = [pytest.param(torch.float32, marks=cpu_only), pytest.param(torch.float16, marks=cpu_only)]

CPU_CASES = [  # B, Hq, Hkv, N, D, seq_lens (ragged; N crosses 64-key tiles and several chunks)
    (2, 4, 4, 150, 32, [150, 61]),          # G = 1
    (3, 6, 2, 200, 16, [1, 200, 129]),      # G = 3, a sequence with only its own token
    (2, 8, 2, 97, 64, [64, 97]),            # G = 4, length exactly one tile
    (2, 8, 1, 130, 16, [130, 3]),           # G = 8
    (1, 5, 1, 70, 48, [70]),                # G = 5, D not a power of two
]


assert_error_within = error_check(floor=1e-6)


def make_inputs(case, dtype, device, seed):
    B, Hq, Hkv, N, D, lens = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, N, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, N, D, generator=gen).to(device, dtype)
    return q, k, v, torch.tensor(lens, device=device)


def assert_same_selection(idx, ref_idx, scores, seq_lens, tol):
    """Equal up to near-ties: every slot in one selection but not the other must have a selection
    score within `tol` of the other selection's weakest member."""
    assert idx.shape == ref_idx.shape and idx.dtype == torch.int64
    B, Hs, budget = idx.shape
    for b in range(B):
        cur = int(seq_lens[b]) - 1
        for h in range(Hs):
            got, want = idx[b, h].tolist(), ref_idx[b, h].tolist()
            real = [i for i in got if i >= 0]
            assert real == sorted(real) and got[len(real):] == [-1] * (budget - len(real)), "ascending, -1 last"
            assert cur in real, "the current slot is always selected"
            assert len(real) == min(budget, cur + 1)
            if got == want:
                continue
            s = scores[b, h]
            extra = set(got) - set(want)
            missing = set(want) - set(got)
            floor = min(s[i].item() for i in set(want) - {cur, -1})
            for i in extra | missing:
                assert abs(s[i].item() - floor) <= tol, f"b={b} h={h}: slot {i} differs beyond a near-tie"


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_decode_matches_reference(case, dtype, scale, poisoned_outputs):
    q, k, v, seq_lens = make_inputs(case, dtype, "cpu", zlib.crc32(repr((case, dtype, scale)).encode()))
    out, scores = decode_attention_triton(q, k, v, seq_lens, scale=scale, return_scores=True)
    exact, exact_scores = reference.decode_attention(q.double(), k.double(), v.double(), seq_lens,
                                                     scale=scale, return_scores=True)
    ref, ref_scores = reference.decode_attention(q, k, v, seq_lens, scale=scale, return_scores=True)
    assert out.dtype == dtype and scores.dtype == torch.float32 and scores.shape == exact_scores.shape
    assert not torch.isnan(out).any() and not torch.isnan(scores).any()
    assert_error_within("out", out, ref, exact)
    assert torch.equal(torch.isinf(scores), torch.isinf(exact_scores)), "-inf exactly at slots >= seq_lens"
    fin = torch.isfinite(exact_scores)
    assert_error_within("scores", scores[fin], ref_scores[fin], exact_scores[fin], floor=1e-5)
    assert torch.equal(out, decode_attention_triton(q, k, v, seq_lens, scale=scale)), "scores must not change out"


@pytest.mark.parametrize("case", CPU_CASES[1:4])
@pytest.mark.parametrize("per_kv_group", [False, True])
@pytest.mark.parametrize("budget", [1, 17, 400])
def test_selection_matches_reference(case, per_kv_group, budget, poisoned_outputs):
    dtype = torch.float32
    if not INTERPRETING:
        pytest.skip("CPU cases run the Triton interpreter")
    q, k, v, seq_lens = make_inputs(case, dtype, "cpu", zlib.crc32(repr((case, per_kv_group, budget)).encode()))
    out, idx = selection_decode_attention_triton(q, k, v, seq_lens, budget, per_kv_group=per_kv_group)
    exact = reference.decode_attention(q.double(), k.double(), v.double(), seq_lens)
    ref_out, ref_idx = reference.selection_decode_attention(q, k, v, seq_lens, budget, per_kv_group=per_kv_group)
    assert_error_within("out", out, ref_out, exact)
    Hs = k.shape[1] if per_kv_group else q.shape[1]
    assert idx.shape == (q.shape[0], Hs, budget)
    _, logits = reference.decode_attention(q, k, v, seq_lens, return_scores=True)
    if per_kv_group:
        probs = torch.softmax(logits, -1)
        sel_scores = probs.view(q.shape[0], Hs, -1, logits.shape[-1]).sum(2)
    else:
        sel_scores = logits
    assert_same_selection(idx, ref_idx, sel_scores, seq_lens, tol=1e-5)


def test_selection_short_sequences_select_everything():
    if not INTERPRETING:
        pytest.skip("CPU cases run the Triton interpreter")
    q, k, v, seq_lens = make_inputs((2, 4, 2, 40, 16, [5, 40]), torch.float32, "cpu", 7)
    _, idx = selection_decode_attention_triton(q, k, v, seq_lens, 8)
    assert idx[0, :, :5].tolist() == [[0, 1, 2, 3, 4]] * 4 and (idx[0, :, 5:] == -1).all()
    assert (idx[1, :, -1] == 39).all() and (idx[1] >= 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 3, 4, 5, 8])
def test_decode_bf16_gpu(G):
    Hkv = 8 if G < 5 else 2
    case = (3, G * Hkv, Hkv, 5000, 128, [5000, 1777, 1])
    q, k, v, seq_lens = make_inputs(case, torch.bfloat16, "cuda", G)
    out, scores = decode_attention_triton(q, k, v, seq_lens, return_scores=True)
    exact, exact_scores = reference.decode_attention(q.double(), k.double(), v.double(), seq_lens, return_scores=True)
    ref = reference.decode_attention(q, k, v, seq_lens)
    assert_error_within("out", out, ref, exact)
    fin = torch.isfinite(exact_scores)
    assert (scores[fin].double() - exact_scores[fin]).abs().max() < 1e-3
    assert torch.equal(torch.isinf(scores), torch.isinf(exact_scores))


@pytest.mark.gpu
@pytest.mark.parametrize("per_kv_group", [False, True])
def test_selection_bf16_gpu(per_kv_group):
    case = (2, 32, 8, 9000, 128, [9000, 3000])
    q, k, v, seq_lens = make_inputs(case, torch.bfloat16, "cuda", 11)
    out, idx = selection_decode_attention_triton(q, k, v, seq_lens, 2048, per_kv_group=per_kv_group)
    ref_out, ref_idx = reference.selection_decode_attention(q, k, v, seq_lens, 2048, per_kv_group=per_kv_group)
    exact = reference.decode_attention(q.double(), k.double(), v.double(), seq_lens)
    assert_error_within("out", out, ref_out, exact)
    _, logits = reference.decode_attention(q, k, v, seq_lens, return_scores=True)
    sel = torch.softmax(logits, -1).view(2, 8, 4, -1).sum(2) if per_kv_group else logits
    tol = 1e-6 if per_kv_group else 1e-3
    assert_same_selection(idx.cpu(), ref_idx.cpu(), sel.cpu(), seq_lens.cpu(), tol=tol)


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(2, 4, 16, dtype=torch.float64)), "dtype"),
    (dict(q=torch.zeros(2, 4, 16, 1)), "3 dims"),
    (dict(k=torch.zeros(2, 3, 40, 16), v=torch.zeros(2, 3, 40, 16)), "multiple"),
    (dict(k=torch.zeros(2, 2, 40, 8)), "k_cache shape"),
    (dict(v=torch.zeros(2, 2, 41, 16)), "v_cache shape"),
    (dict(v=torch.zeros(2, 2, 40, 16, dtype=torch.float16)), "v_cache has dtype"),
    (dict(seq_lens=torch.tensor([41, 3])), "seq_lens values"),
    (dict(seq_lens=torch.tensor([0, 3])), "seq_lens values"),
    (dict(seq_lens=torch.tensor([3.0, 3.0])), "seq_lens has dtype"),
    (dict(seq_lens=torch.tensor([3])), "entries"),
])
def test_bad_inputs_raise_clear_errors(bad, match):
    args = dict(q=torch.zeros(2, 4, 16), k=torch.zeros(2, 2, 40, 16), v=torch.zeros(2, 2, 40, 16),
                seq_lens=torch.tensor([40, 3]))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        decode_attention_triton(args["q"], args["k"], args["v"], args["seq_lens"])


def test_bad_budget():
    q, k, v, seq_lens = torch.zeros(1, 2, 16), torch.zeros(1, 1, 8, 16), torch.zeros(1, 1, 8, 16), torch.tensor([8])
    with pytest.raises(ValueError, match="budget"):
        selection_decode_attention_triton(q, k, v, seq_lens, 0)
