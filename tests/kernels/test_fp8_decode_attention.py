"""FP8 KV caches (kernels/fp8_kv.py) in the decode kernels: full, selection and sparse decode read float8_e4m3fn
K/V with per-token fp32 scales and dequantise in registers.

Two comparisons per case. (1) Kernel vs reference on the same FP8 cache: the kernel's error against the fp64
reference (dequantised in fp64) stays within a small factor of the same-dtype reference's, as for bf16 caches.
(2) FP8 vs the unquantised cache: the reference on the FP8 cache agrees with the reference on the original K/V
within a bound measured on these inputs (unit-normal q, K, V): FP8_AGREEMENT. CPU: interpreter, fp32 / fp16 (the
interpreter gets bf16 tl.dot wrong), ragged batches, GQA groups 1 / 3 / 4 / 8, lengths across the 64-key tiles and
several chunks; launcher buffers start as NaN, and the scales of slots a kernel must not read are NaN too.
GPU (``-m gpu``): bf16 at larger sizes.
"""

import os

import pytest
import torch
from kernel_checks import case_seed, error_check

from kernels import fp8_kv, reference
from kernels.triton_decode_attention import decode_attention_triton, selection_decode_attention_triton
from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")
CPU_DTYPES = [pytest.param(torch.float32, marks=cpu_only), pytest.param(torch.float16, marks=cpu_only)]

CASES = [  # B, Hq, Hkv, N, D, seq_lens (ragged)
    (2, 4, 4, 150, 32, [150, 61]),       # G = 1
    (3, 6, 2, 200, 16, [1, 200, 129]),   # G = 3, a sequence with only its own token
    (2, 8, 2, 97, 64, [64, 97]),         # G = 4, one length exactly a tile
    (2, 8, 1, 130, 16, [130, 3]),        # G = 8
]
# FP8 vs unquantised cache, per (sequence, query head): ||out_fp8 - out||_2 <= FP8_REL_L2 * ||out||_2. Measured with
# the reference over these cases and the sparse lists below, seeds 0..19 (2026-12-03): at most 0.082, on short rows
# (a row of one key is that value's round trip, <= 2^-4 per element; longer rows average the errors down). 2^-3
# leaves 1.5x room.
FP8_REL_L2 = 2.0 ** -3

assert_error_within = error_check(floor=1e-6)


def fp8_inputs(case, dtype, device, seed):
    """q, the original K/V, their FP8 copies and scales, seq_lens. The references read every slot (masked
    afterwards), so they get the scales; the kernels get ``unread(scales)``, NaN past seq_lens."""
    B, Hq, Hkv, N, D, lens = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, N, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, N, D, generator=gen).to(device, dtype)
    seq_lens = torch.tensor(lens, device=device)
    (k8, ks), (v8, vs) = fp8_kv.quantize_kv(k), fp8_kv.quantize_kv(v)
    return q, (k, v), (k8, v8, ks, vs), seq_lens


def unread(scale, seq_lens):
    """The scales with NaN at slots >= seq_lens, which a kernel must not read (a read would poison its output)."""
    past = torch.arange(scale.shape[-1], device=scale.device)[None, None, :] >= seq_lens[:, None, None]
    return scale.masked_fill(past, float("nan"))


def assert_agrees_with_unquantised(out_fp8, out):
    norm = out.double().norm(dim=-1)
    rel = (out_fp8.double() - out.double()).norm(dim=-1)[norm > 0] / norm[norm > 0]
    assert rel.max() <= FP8_REL_L2, f"FP8 vs unquantised cache: relative L2 error {rel.max():.3e} > {FP8_REL_L2}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fp8_decode_matches_reference(case, dtype, poisoned_outputs):
    q, (k, v), (k8, v8, ks, vs), seq_lens = fp8_inputs(case, dtype, "cpu", case_seed(case, dtype))
    kw = dict(k_scale=ks, v_scale=vs, return_scores=True)
    out, scores = decode_attention_triton(q, k8, v8, seq_lens, k_scale=unread(ks, seq_lens),
                                          v_scale=unread(vs, seq_lens), return_scores=True)
    exact, exact_scores = reference.decode_attention(q.double(), k8, v8, seq_lens, **kw)
    ref, ref_scores = reference.decode_attention(q, k8, v8, seq_lens, **kw)
    assert out.dtype == dtype and not torch.isnan(out).any() and not torch.isnan(scores).any()
    assert_error_within("out", out, ref, exact)
    assert torch.equal(torch.isinf(scores), torch.isinf(exact_scores)), "-inf exactly at slots >= seq_lens"
    fin = torch.isfinite(exact_scores)
    assert_error_within("scores", scores[fin], ref_scores[fin], exact_scores[fin], floor=1e-5)
    assert_agrees_with_unquantised(out, reference.decode_attention(q.double(), k.double(), v.double(), seq_lens))


@pytest.mark.parametrize("case", CASES[1:3])
@pytest.mark.parametrize("per_kv_group", [False, True])
def test_fp8_selection_matches_reference(case, per_kv_group, poisoned_outputs):
    if not INTERPRETING:
        pytest.skip("CPU cases run the Triton interpreter")
    q, _, (k8, v8, ks, vs), seq_lens = fp8_inputs(case, torch.float32, "cpu", case_seed(case, per_kv_group))
    kw = dict(per_kv_group=per_kv_group, k_scale=ks, v_scale=vs)
    out, idx = selection_decode_attention_triton(q, k8, v8, seq_lens, 17, per_kv_group=per_kv_group,
                                                 k_scale=unread(ks, seq_lens), v_scale=unread(vs, seq_lens))
    ref_out, ref_idx = reference.selection_decode_attention(q, k8, v8, seq_lens, 17, **kw)
    exact = reference.decode_attention(q.double(), k8, v8, seq_lens, k_scale=ks, v_scale=vs)
    assert_error_within("out", out, ref_out, exact)
    assert torch.equal(idx, ref_idx)  # random fp32 logits: no near-ties at these sizes


def sparse_lists(case, per_group, seed):
    """Unsorted, -1 padded lists of valid slots (ragged lengths, a hole, one empty list); slots past seq_lens
    never appear, so their NaN scales must stay unread."""
    B, Hq, Hkv, N, D, lens = case
    gen = torch.Generator().manual_seed(seed)
    Hs = Hkv if per_group else Hq
    K = 40
    idx = torch.full((B, Hs, K), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(Hs):
            perm = torch.randperm(lens[b], generator=gen)[:K]
            idx[b, h, :perm.numel()] = perm
    idx[0, :, K // 2:] = -1
    idx[-1, 0, :] = -1
    idx[0, -1, 3] = -1
    return idx


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fp8_sparse_decode_matches_reference(case, per_group, dtype, poisoned_outputs):
    q, (k, v), (k8, v8, ks, vs), seq_lens = fp8_inputs(case, dtype, "cpu", case_seed(case, per_group, dtype))
    idx = sparse_lists(case, per_group, case_seed(case, per_group))
    kw = dict(scale=0.2, k_scale=ks, v_scale=vs)
    out = sparse_decode_attention_triton(q, k8, v8, idx.to(torch.int32), scale=0.2, k_scale=unread(ks, seq_lens),
                                         v_scale=unread(vs, seq_lens))
    exact = reference.sparse_decode_attention(q.double(), k8, v8, idx, **kw)
    ref = reference.sparse_decode_attention(q, k8, v8, idx, **kw)
    assert out.dtype == dtype and not torch.isnan(out).any()
    assert_error_within("out", out, ref, exact)
    assert_agrees_with_unquantised(out, reference.sparse_decode_attention(q.double(), k.double(), v.double(), idx,
                                                                          scale=0.2))


def gpu_case(G: int) -> tuple:
    """The GPU cases' shape: 3 ragged rows up to 5000 positions, D 128, GQA group ``G``."""
    Hkv = 8 if G < 8 else 4
    return (3, G * Hkv, Hkv, 5000, 128, [5000, 1777, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_fp8_decode_and_sparse_bf16_gpu(G):
    case = gpu_case(G)
    q, (k, v), (k8, v8, ks, vs), seq_lens = fp8_inputs(case, torch.bfloat16, "cuda", G)
    kw = dict(k_scale=ks, v_scale=vs)
    out = decode_attention_triton(q, k8, v8, seq_lens, **kw)
    assert_error_within("out", out, reference.decode_attention(q, k8, v8, seq_lens, **kw),
                        reference.decode_attention(q.double(), k8, v8, seq_lens, **kw))
    assert_agrees_with_unquantised(out, decode_attention_triton(q, k, v, seq_lens))
    for per_group in (False, True):
        idx = sparse_lists(case, per_group, G).cuda()
        out = sparse_decode_attention_triton(q, k8, v8, idx, **kw)
        assert_error_within("sparse out", out, reference.sparse_decode_attention(q, k8, v8, idx, **kw),
                            reference.sparse_decode_attention(q.double(), k8, v8, idx, **kw))


def _fp8_args():
    q = torch.zeros(2, 4, 16)
    (k8, ks), (v8, vs) = fp8_kv.quantize_kv(torch.randn(2, 2, 40, 16)), fp8_kv.quantize_kv(torch.randn(2, 2, 40, 16))
    return dict(q=q, k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("bad, error, match", [
    (dict(k_scale=None), ValueError, "k_cache is float8_e4m3fn but k_scale is None"),
    (dict(v_scale=torch.ones(2, 2, 40, dtype=torch.bfloat16)), TypeError, "v_scale must be a float32 tensor"),
    (dict(k_scale=torch.ones(2, 2, 39)), ValueError, r"k_scale shape \(2, 2, 39\) must be \(2, 2, 40\)"),
    (dict(v_cache=torch.zeros(2, 2, 40, 16), v_scale=None), TypeError, "must all be float8_e4m3fn"),
])
def test_bad_fp8_inputs_name_the_argument(bad, error, match):
    args = _fp8_args()
    args.update(bad)
    seq_lens, idx = torch.tensor([40, 3]), torch.zeros(2, 4, 5, dtype=torch.int64)
    q, k8, v8 = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    with pytest.raises(error, match=match):
        decode_attention_triton(q, k8, v8, seq_lens, **args)
    with pytest.raises(error, match=match):
        sparse_decode_attention_triton(q, k8, v8, idx, **args)
    if bad.get("v_cache") is None:  # the reference checks each cache with its scale (no pair rule)
        with pytest.raises(error, match=match):
            reference.decode_attention(q, k8, v8, seq_lens, **args)


@cpu_only
@pytest.mark.parametrize("case", CASES[1:3])
def test_fp8_quest_pages_bound_the_dequantised_keys(case):
    """Quest over an FP8 cache: bf16 page max / min of the dequantised keys, rounded outward, bound every key
    channel by channel, so the unchanged page-score kernel's U >= q.k for every key attention reads."""
    from kernels.triton_quest_pages import quest_page_scores_triton

    q, _, (k8, _, ks, _), seq_lens = fp8_inputs(case, torch.float32, "cpu", case_seed(case, "quest"))
    page_size = 16
    pmax, pmin = reference.quest_page_minmax(k8, seq_lens, page_size, k_scale=ks)
    pmax16, pmin16 = fp8_kv.round_outward(pmax, pmin, torch.bfloat16)
    keys = fp8_kv.dequantize_kv(k8, ks)  # [B, Hkv, N, D] fp32
    B, Hkv, N, D = keys.shape
    pages = -(-N // page_size)
    page_of = torch.arange(N) // page_size
    valid = torch.arange(N)[None, :] < seq_lens[:, None]  # [B, N]
    for b in range(B):
        kb = keys[b][:, valid[b]]  # [Hkv, n, D]
        pages_b = page_of[valid[b]]
        assert (pmax16[b][:, pages_b].float() >= kb).all() and (pmin16[b][:, pages_b].float() <= kb).all()
    scores = quest_page_scores_triton(q.bfloat16().float(), pmax16, pmin16, seq_lens, page_size)  # [B, Hq, P]
    logits = torch.einsum("bhd,bhnd->bhn", q.bfloat16().float(), keys.repeat_interleave(q.shape[1] // Hkv, 1))
    bound = scores.gather(2, page_of[None, None, :].expand(B, q.shape[1], N).clamp(max=pages - 1))
    slack = 1e-5 * logits.abs().amax()
    assert (bound[valid[:, None, :].expand_as(bound)] >= logits[valid[:, None, :].expand_as(bound)] - slack).all()


@cpu_only
def test_fp8_prefill_append_decode_round_trip():
    """The path the cache integration will call: the prefill quantises the prompts into an FP8 cache (ragged
    lengths), each decode step appends its token (quantised in the append kernel) and decodes; every step agrees
    with the same steps on the unquantised cache within FP8_REL_L2."""
    from kernels.triton_cache_append import append_kv_triton
    from kernels.triton_fp8_quantize import quantize_kv_triton

    B, Hq, Hkv, N, D, prompt, steps = 2, 6, 2, 80, 32, [50, 13], 3
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(B, Hkv, N, D, generator=gen), torch.randn(B, Hkv, N, D, generator=gen)
    k8, v8 = torch.zeros(B, Hkv, N, D, dtype=torch.float8_e4m3fn), torch.zeros(B, Hkv, N, D, dtype=torch.float8_e4m3fn)
    ks, vs = torch.ones(B, Hkv, N), torch.ones(B, Hkv, N)
    for b, n in enumerate(prompt):  # the prefill writes each prompt's slots [0, n)
        (k8[b, :, :n], ks[b, :, :n]), (v8[b, :, :n], vs[b, :, :n]) = quantize_kv_triton(k[b, :, :n]), \
            quantize_kv_triton(v[b, :, :n])
    lens = torch.tensor(prompt)
    for _ in range(steps):
        pos = lens.clone()
        rows = torch.arange(B)
        append_kv_triton(k8, v8, k[rows, :, pos], v[rows, :, pos], pos, key_scale=ks, value_scale=vs)
        lens = lens + 1
        q = torch.randn(B, Hq, D, generator=gen)
        out = decode_attention_triton(q, k8, v8, lens, k_scale=ks, v_scale=vs)
        assert_agrees_with_unquantised(out, reference.decode_attention(q.double(), k.double(), v.double(), lens))
    valid = torch.arange(N)[None, None, :] < lens[:, None, None]
    back = fp8_kv.dequantize_kv(k8, ks)
    within = ((back - k).abs() <= 2 ** -4 * k.abs() + 2 ** -10 * ks[..., None]).all(-1)  # [B, Hkv, N]
    assert within[valid.expand_as(within)].all()


def recent_ring(k, seq_lens, window, gen):
    """The ring of recent keys [B, Hkv, W, D] an FP8 cache keeps: the original keys of positions
    [seq_lens - W, seq_lens) at slot position % W, and random values in slots a kernel must not read."""
    B, Hkv, N, D = k.shape
    ring = torch.randn(B, Hkv, window, D, generator=gen).to(k.device, k.dtype) * 100  # a stale slot's read shows
    for b, n in enumerate(seq_lens.tolist()):
        for p in range(max(n - window, 0), n):
            ring[b, :, p % window] = k[b, :, p]
    return ring


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [5, 64])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_recent_keys_decode_and_selection_match_reference(case, window, dtype, poisoned_outputs):
    """Recent keys (kernels/fp8_kv.py): the kernels read the newest ``window`` positions' keys from the ring, as the
    reference does, and that is the unquantised key: a window covering the sequence leaves only the values' FP8."""
    q, (k, v), (k8, v8, ks, vs), seq_lens = fp8_inputs(case, dtype, "cpu", case_seed(case, dtype) + window)
    ring = recent_ring(k, seq_lens, window, torch.Generator().manual_seed(window))
    kw = dict(k_scale=ks, v_scale=vs, k_recent=ring, return_scores=True)
    out, scores = decode_attention_triton(q, k8, v8, seq_lens, k_scale=unread(ks, seq_lens),
                                          v_scale=unread(vs, seq_lens), k_recent=ring, return_scores=True)
    exact, exact_scores = reference.decode_attention(q.double(), k8, v8, seq_lens, **{**kw, "k_recent": ring.double()})
    ref, ref_scores = reference.decode_attention(q, k8, v8, seq_lens, **kw)
    assert_error_within("out", out, ref, exact)
    fin = torch.isfinite(exact_scores)
    assert_error_within("scores", scores[fin], ref_scores[fin], exact_scores[fin], floor=1e-5)
    # the logits of the newest positions are the unquantised keys'
    plain = reference.decode_attention(q, k, v, seq_lens, return_scores=True)[1]
    for b, n in enumerate(seq_lens.tolist()):
        newest = slice(max(n - window, 0), n)
        torch.testing.assert_close(ref_scores[b, :, newest], plain[b, :, newest])
    selected = selection_decode_attention_triton(q, k8, v8, seq_lens, 8, k_scale=ks, v_scale=vs, k_recent=ring)[1]
    assert torch.equal(selected, reference.selection_decode_attention(q, k8, v8, seq_lens, 8, k_scale=ks, v_scale=vs,
                                                                      k_recent=ring)[1])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_recent_keys_sparse_decode_matches_reference(case, per_group, dtype, poisoned_outputs):
    window = 7
    q, (k, v), (k8, v8, ks, vs), seq_lens = fp8_inputs(case, dtype, "cpu", case_seed(case, dtype) + 7)
    ring = recent_ring(k, seq_lens, window, torch.Generator().manual_seed(3))
    indices = sparse_lists(case, per_group, seed=case_seed(case, dtype))
    # the newest positions listed too, so that every list reads some of the ring
    newest = (seq_lens - 1).clamp(min=0)[:, None, None].expand(-1, indices.shape[1], 1)
    indices = torch.cat([indices, newest.to(indices.dtype)], dim=2)
    kw = dict(k_scale=ks, v_scale=vs, k_recent=ring, seq_lens=seq_lens)
    out = sparse_decode_attention_triton(q, k8, v8, indices, **kw)
    exact = reference.sparse_decode_attention(q.double(), k8, v8, indices, **{**kw, "k_recent": ring.double()})
    assert_error_within("out", out, reference.sparse_decode_attention(q, k8, v8, indices, **kw), exact)
    without = reference.sparse_decode_attention(q, k8, v8, indices, k_scale=ks, v_scale=vs)
    assert not torch.allclose(without, reference.sparse_decode_attention(q, k8, v8, indices, **kw))


@pytest.mark.parametrize("bad, error, match", [
    (dict(k_recent="ring"), TypeError, r"k_recent must be a float tensor"),
    (dict(k_recent=torch.zeros(2, 2, 4, 8)), ValueError, r"k_recent shape \(2, 2, 4, 8\) must be \[B=2, Hkv=2, W >= 1, D=16\]"),
    (dict(k_recent=torch.zeros(2, 2, 0, 16)), ValueError, r"W >= 1"),
])
def test_bad_recent_keys_name_the_argument(bad, error, match):
    q, (k, v), (k8, v8, ks, vs), seq_lens = fp8_inputs((2, 4, 2, 20, 16, [20, 5]), torch.float32, "cpu", 0)
    for op in (decode_attention_triton, reference.decode_attention):
        with pytest.raises(error, match=match):
            op(q, k8, v8, seq_lens, k_scale=ks, v_scale=vs, **bad)
    with pytest.raises(ValueError, match=r"k_recent is given but k_cache has dtype torch.float32"):
        reference.decode_attention(q, k, v, seq_lens, k_recent=torch.zeros(2, 2, 4, 16))
    with pytest.raises(ValueError, match=r"k_recent needs seq_lens"):
        sparse_decode_attention_triton(q, k8, v8, torch.zeros(2, 2, 3, dtype=torch.long), k_scale=ks, v_scale=vs,
                                       k_recent=torch.zeros(2, 2, 4, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_recent_keys_decode_and_sparse_bf16_gpu(G):
    case = gpu_case(G)
    q, (k, v), (k8, v8, ks, vs), seq_lens = fp8_inputs(case, torch.bfloat16, "cuda", G)
    ring = recent_ring(k, seq_lens, 64, torch.Generator().manual_seed(G))
    kw = dict(k_scale=ks, v_scale=vs, k_recent=ring)
    out = decode_attention_triton(q, k8, v8, seq_lens, **kw)
    assert_error_within("out", out, reference.decode_attention(q, k8, v8, seq_lens, **kw),
                        reference.decode_attention(q.double(), k8, v8, seq_lens, **{**kw, "k_recent": ring.double()}))
    for per_group in (False, True):
        idx = sparse_lists(case, per_group, G).cuda()
        kw_s = dict(kw, seq_lens=seq_lens)
        out = sparse_decode_attention_triton(q, k8, v8, idx, **kw_s)
        assert_error_within("sparse out", out, reference.sparse_decode_attention(q, k8, v8, idx, **kw_s),
                            reference.sparse_decode_attention(q.double(), k8, v8, idx,
                                                              **{**kw_s, "k_recent": ring.double()}))
