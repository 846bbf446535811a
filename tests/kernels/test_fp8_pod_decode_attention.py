"""FP8 KV caches (kernels/fp8_kv.py) in POD decode and POD + TidalDecode: the ring of proximal keys (one scale per
slot), the anchor layer's keys and the layer's values float8_e4m3fn, dequantised in registers.

As tests/kernels/test_fp8_decode_attention.py: kernel vs reference on the same FP8 caches within the bf16
tolerance (out, gate, scores), and FP8 vs the unquantised caches within FP8_REL_L2 per row. Scales of every slot a
kernel must not read (ring slots outside the window, anchor keys at proximal positions, anything past seq_lens) are
NaN. CPU: interpreter, fp32 / fp16, ragged batches, GQA 1 / 3 / 4 / 8; GPU (``-m gpu``): bf16.
"""

import os

import pytest
import torch
from kernel_checks import case_seed, error_check
from test_fp8_decode_attention import assert_agrees_with_unquantised
from test_pod_decode_attention import CASES, make_case, ring_of
from test_pod_sparse_decode_attention import random_lists

from kernels import fp8_kv, reference
from kernels.triton_pod_decode_attention import pod_decode_attention_triton
from kernels.triton_pod_sparse_decode_attention import pod_sparse_decode_attention_triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")
CPU_DTYPES = [pytest.param(torch.float32, marks=cpu_only), pytest.param(torch.float16, marks=cpu_only)]
assert_error_within = error_check(floor=1e-6)


def fp8_pod_case(case, dtype, device, seed):
    """(q, the float caches, the FP8 caches with their scales, the same scales NaN where the kernel must not read,
    seq_lens, sink, recent)."""
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, dtype, device, seed)
    B, Hq, Hkv, N, D, _, _, lens = case
    (kl8, kls), (ka8, kas), (v8, vs) = (fp8_kv.quantize_kv(t) for t in (k_local, k_anchor, v))
    nan = float("nan")
    ring_unread = torch.isnan(ring_of(torch.zeros(B, Hkv, N, 1), lens, sink, recent, fill=nan)[..., 0])
    j = torch.arange(N)[None, None, :]
    p = (seq_lens.cpu() - 1)[:, None, None]
    past = j > p
    anchor_unread = past | reference.pod_proximal_mask(p, j, sink, recent)
    unread = [s.masked_fill(m.to(device), nan) for s, m in ((kls, ring_unread), (kas, anchor_unread), (vs, past))]
    return q, (k_local, k_anchor, v), (kl8, ka8, v8), (kls, kas, vs), unread, seq_lens, sink, recent


def scale_kw(scales):
    return dict(zip(("k_local_scale", "k_anchor_scale", "v_scale"), scales))


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tau", [None, 0.6])
def test_fp8_pod_decode_matches_reference(case, dtype, tau, poisoned_outputs):
    q, floats, caches, scales, unread, seq_lens, sink, recent = fp8_pod_case(case, dtype, "cpu", case_seed(case, dtype))
    kw = dict(sink=sink, recent=recent, gate_tau=tau, return_gate=True, return_scores=tau is None)
    got = pod_decode_attention_triton(q, *caches, seq_lens, **kw, **scale_kw(unread))
    exact = reference.pod_decode_attention(q.double(), *caches, seq_lens, **kw, **scale_kw(scales))
    ref = reference.pod_decode_attention(q, *caches, seq_lens, **kw, **scale_kw(scales))
    assert not any(torch.isnan(t).any() for t in got)
    for name, a, r, e in zip(("out", "gate", "scores"), got, ref, exact):
        fin = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), fin), f"{name}: -inf where the reference has it"
        assert_error_within(name, a[fin], r[fin], e[fin], floor=1e-5)
    if tau is None:
        unquantised = reference.pod_decode_attention(q.double(), *(t.double() for t in floats), seq_lens, sink=sink,
                                                     recent=recent)
        assert_agrees_with_unquantised(got[0], unquantised)


@cpu_only
def test_fp8_pod_decode_own_anchor_and_gate_estimate():
    """k_local None (the layer is its own anchor: exact attention over its FP8 cache) and a pre-evaluated gate."""
    case = CASES[2]
    q, _, (kl8, ka8, v8), (kls, kas, vs), _, seq_lens, sink, recent = fp8_pod_case(case, torch.float32, "cpu", 3)
    own8, own_s = fp8_kv.quantize_kv(torch.randn(ka8.shape, generator=torch.Generator().manual_seed(1)))
    kw = dict(sink=sink, recent=recent, return_gate=True)
    out, gate = pod_decode_attention_triton(q, None, own8, v8, seq_lens, k_anchor_scale=own_s, v_scale=vs, **kw)
    exact = reference.decode_attention(q.double(), own8, v8, seq_lens, k_scale=own_s, v_scale=vs)
    ref = reference.decode_attention(q, own8, v8, seq_lens, k_scale=own_s, v_scale=vs)
    assert_error_within("own-anchor out", out, ref, exact)
    _, exact_gate = reference.pod_decode_attention(q.double(), None, own8, v8, seq_lens, k_anchor_scale=own_s,
                                                   v_scale=vs, **kw)
    assert (gate.double() - exact_gate).abs().max() < 1e-5
    est = torch.rand(q.shape[:2], generator=torch.Generator().manual_seed(0))
    kw = dict(sink=sink, recent=recent, gate_tau=0.5, gate_estimate=est, return_skip=True, **scale_kw((kls, kas, vs)))
    out, skip = pod_decode_attention_triton(q, kl8, ka8, v8, seq_lens, **kw)
    ref_out, ref_skip = reference.pod_decode_attention(q.double(), kl8, ka8, v8, seq_lens, **kw)
    assert torch.equal(skip, ref_skip) and skip.any() and not skip.all()
    assert (out.double() - ref_out).abs().max() < 1e-5
    with pytest.raises(ValueError, match="k_local_scale is given but k_local is None"):
        pod_decode_attention_triton(q, None, ka8, v8, seq_lens, sink=sink, recent=recent, k_local_scale=kls,
                                    k_anchor_scale=kas, v_scale=vs)


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fp8_pod_sparse_decode_matches_reference(case, per_group, dtype, poisoned_outputs):
    q, floats, caches, scales, unread, seq_lens, sink, recent = fp8_pod_case(case, dtype, "cpu",
                                                                             case_seed(case, per_group, dtype))
    Hs = caches[2].shape[1] if per_group else q.shape[1]
    idx = random_lists(seq_lens, Hs, 24, torch.Generator().manual_seed(case_seed(case, per_group)))
    kw = dict(sink=sink, recent=recent, return_gate=True)
    out, gate = pod_sparse_decode_attention_triton(q, *caches, idx.to(torch.int32), seq_lens, **kw,
                                                   **scale_kw(unread))
    exact = reference.pod_sparse_decode_attention(q.double(), *caches, idx, seq_lens, **kw, **scale_kw(scales))
    ref = reference.pod_sparse_decode_attention(q, *caches, idx, seq_lens, **kw, **scale_kw(scales))
    assert not torch.isnan(out).any() and not torch.isnan(gate).any()
    assert_error_within("out", out, ref[0], exact[0])
    assert_error_within("gate", gate, ref[1], exact[1], floor=1e-5)
    unquantised = reference.pod_sparse_decode_attention(q.double(), *(t.double() for t in floats), idx, seq_lens,
                                                        sink=sink, recent=recent)
    assert_agrees_with_unquantised(out, unquantised)


def gpu_fp8_pod_case(G: int):
    """The GPU cases' bf16 POD inputs: 3 ragged rows up to 3000 positions, D 128, sink 4 + recent 256, group ``G``."""
    Hkv = 8 if G < 8 else 4
    return fp8_pod_case((3, G * Hkv, Hkv, 3000, 128, 4, 256, [3000, 1200, 100]), torch.bfloat16, "cuda", G)


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_fp8_pod_decode_bf16_gpu(G):
    q, floats, caches, scales, unread, seq_lens, sink, recent = gpu_fp8_pod_case(G)
    kw = dict(sink=sink, recent=recent, return_gate=True)
    out, gate = pod_decode_attention_triton(q, *caches, seq_lens, **kw, **scale_kw(unread))
    exact = reference.pod_decode_attention(q.double(), *caches, seq_lens, **kw, **scale_kw(scales))
    ref = reference.pod_decode_attention(q, *caches, seq_lens, **kw, **scale_kw(scales))
    assert_error_within("out", out, ref[0], exact[0])
    idx = random_lists(seq_lens.cpu(), q.shape[1], 512, torch.Generator().manual_seed(G)).cuda()
    out = pod_sparse_decode_attention_triton(q, *caches, idx, seq_lens, sink=sink, recent=recent, **scale_kw(unread))
    assert_error_within("sparse out", out,
                        reference.pod_sparse_decode_attention(q, *caches, idx, seq_lens, sink=sink, recent=recent,
                                                              **scale_kw(scales)),
                        reference.pod_sparse_decode_attention(q.double(), *caches, idx, seq_lens, sink=sink,
                                                              recent=recent, **scale_kw(scales)))


@pytest.mark.parametrize("bad, error, match", [
    (dict(k_local_scale=None), ValueError, "k_local is float8_e4m3fn but k_local_scale is None"),
    (dict(k_anchor_scale=torch.ones(2, 2, 40, dtype=torch.float16)), TypeError, "k_anchor_scale must be a float32"),
    (dict(k_local_scale=torch.ones(2, 2, 40)), ValueError, r"k_local_scale shape \(2, 2, 40\) must be \(2, 2, 6\)"),
    (dict(v_cache=torch.zeros(2, 2, 40, 16), v_scale=None), TypeError, "must all be float8_e4m3fn"),
])
def test_bad_fp8_pod_inputs_name_the_argument(bad, error, match):
    q = torch.zeros(2, 4, 16)
    (kl8, kls), (ka8, kas), (v8, vs) = (fp8_kv.quantize_kv(torch.randn(2, 2, n, 16)) for n in (6, 40, 40))
    args = dict(k_local=kl8, k_anchor=ka8, v_cache=v8, k_local_scale=kls, k_anchor_scale=kas, v_scale=vs)
    args.update(bad)
    caches = [args.pop(n) for n in ("k_local", "k_anchor", "v_cache")]
    seq_lens, idx = torch.tensor([40, 3]), torch.zeros(2, 4, 5, dtype=torch.int64)
    with pytest.raises(error, match=match):
        pod_decode_attention_triton(q, *caches, seq_lens, sink=2, recent=4, **args)
    with pytest.raises(error, match=match):
        pod_sparse_decode_attention_triton(q, *caches, idx, seq_lens, sink=2, recent=4, **args)


def recent_rings(floats, seq_lens, sink, recent, window, seed):
    """The own and the anchor layer's rings of recent keys [B, Hkv, W, D]: the unquantised keys of positions
    [seq_lens - W, seq_lens) at slot position % W (own keys exist for the layer's proximal positions only), large
    random values in every slot a kernel must not read."""
    k_local, k_anchor, _ = floats
    gen = torch.Generator().manual_seed(seed)
    B, Hkv, _, D = k_anchor.shape
    own, anchor = (torch.randn(B, Hkv, window, D, generator=gen).to(k_anchor.device, k_anchor.dtype) * 100
                   for _ in range(2))
    for b, n in enumerate(seq_lens.tolist()):
        for p in range(max(n - window, 0), n):
            anchor[b, :, p % window] = k_anchor[b, :, p]
            if p < sink or n - 1 - p < recent:
                own[b, :, p % window] = k_local[b, :, p if p < sink else sink + p % recent]
    return own, anchor


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("window", [3, 40, "proximal", "proximal+1"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_recent_keys_pod_decode_matches_reference(case, window, dtype, poisoned_outputs):
    """Recent keys (kernels/fp8_kv.py): proximal programs read the newest positions' keys from the layer's own
    ring, distant programs from the anchor's; a window past the proximal one reaches distant positions too (the
    kernel's distant loop reads the ring only then: "proximal" and "proximal+1" are the windows on either side)."""
    offset = {"proximal": 0, "proximal+1": 1}.get(window)
    seed = case_seed(case, dtype) + (window if offset is None else 100 + offset)
    q, floats, caches, scales, unread, seq_lens, sink, recent = fp8_pod_case(case, dtype, "cpu", seed)
    if offset is not None:
        window = recent + offset
    own, anchor = recent_rings(floats, seq_lens, sink, recent, window, seed=window)
    kw = dict(sink=sink, recent=recent, return_gate=True, return_scores=True, k_local_recent=own,
              k_anchor_recent=anchor)
    got = pod_decode_attention_triton(q, *caches, seq_lens, **kw, **scale_kw(unread))
    exact = reference.pod_decode_attention(q.double(), *caches, seq_lens, **{**kw, "k_local_recent": own.double(),
                                                                             "k_anchor_recent": anchor.double()},
                                           **scale_kw(scales))
    ref = reference.pod_decode_attention(q, *caches, seq_lens, **kw, **scale_kw(scales))
    for name, a, r, e in zip(("out", "gate", "scores"), got, ref, exact):
        fin = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), fin), f"{name}: -inf where the reference has it"
        assert_error_within(name, a[fin], r[fin], e[fin], floor=1e-5)
    # the newest positions' logits are the unquantised keys'
    plain = reference.pod_decode_attention(q, *floats, seq_lens, sink=sink, recent=recent, return_scores=True)[1]
    for b, n in enumerate(seq_lens.tolist()):
        newest = slice(max(n - window, 0), n)
        torch.testing.assert_close(ref[2][b, :, newest], plain[b, :, newest])
    with pytest.raises(ValueError, match="k_local_recent and k_anchor_recent go together"):
        pod_decode_attention_triton(q, *caches, seq_lens, sink=sink, recent=recent, k_local_recent=own,
                                    **scale_kw(unread))


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_recent_keys_pod_sparse_decode_matches_reference(case, per_group, dtype, poisoned_outputs):
    """POD + TidalDecode with recent keys: a listed position among the newest W reads the own ring if proximal, the
    anchor's if distant; lists include the newest positions, and W = 12 exceeds some cases' proximal window."""
    window = 12
    q, floats, caches, scales, unread, seq_lens, sink, recent = fp8_pod_case(case, dtype, "cpu",
                                                                             case_seed(case, per_group, dtype) + 1)
    own, anchor = recent_rings(floats, seq_lens, sink, recent, window, seed=2)
    Hs = caches[2].shape[1] if per_group else q.shape[1]
    idx = random_lists(seq_lens, Hs, 24, torch.Generator().manual_seed(case_seed(case, per_group)))
    newest = torch.stack([(seq_lens - 1 - i).clamp(min=0) for i in range(4)], dim=1)  # [B, 4]
    idx = torch.cat([idx, newest[:, None, :].expand(-1, Hs, -1).to(idx.dtype)], dim=2)
    kw = dict(sink=sink, recent=recent, return_gate=True, k_local_recent=own, k_anchor_recent=anchor)
    out, gate = pod_sparse_decode_attention_triton(q, *caches, idx.to(torch.int32), seq_lens, **kw,
                                                   **scale_kw(unread))
    exact = reference.pod_sparse_decode_attention(q.double(), *caches, idx, seq_lens, **scale_kw(scales),
                                                  **{**kw, "k_local_recent": own.double(),
                                                     "k_anchor_recent": anchor.double()})
    ref = reference.pod_sparse_decode_attention(q, *caches, idx, seq_lens, **kw, **scale_kw(scales))
    assert_error_within("out", out, ref[0], exact[0])
    assert_error_within("gate", gate, ref[1], exact[1], floor=1e-5)
    without = reference.pod_sparse_decode_attention(q, *caches, idx, seq_lens, sink=sink, recent=recent,
                                                    **scale_kw(scales))
    assert not torch.allclose(without, ref[0])


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_recent_keys_pod_decode_bf16_gpu(G):
    q, floats, caches, scales, unread, seq_lens, sink, recent = gpu_fp8_pod_case(G)
    own, anchor = recent_rings(floats, seq_lens, sink, recent, 64, seed=G)
    rings = dict(k_local_recent=own, k_anchor_recent=anchor)
    rings64 = dict(k_local_recent=own.double(), k_anchor_recent=anchor.double())
    kw = dict(sink=sink, recent=recent, return_gate=True)
    out, gate = pod_decode_attention_triton(q, *caches, seq_lens, **kw, **rings, **scale_kw(unread))
    exact = reference.pod_decode_attention(q.double(), *caches, seq_lens, **kw, **rings64, **scale_kw(scales))
    ref = reference.pod_decode_attention(q, *caches, seq_lens, **kw, **rings, **scale_kw(scales))
    assert_error_within("out", out, ref[0], exact[0])
    idx = random_lists(seq_lens.cpu(), q.shape[1], 512, torch.Generator().manual_seed(G)).cuda()
    kw = dict(sink=sink, recent=recent)
    out = pod_sparse_decode_attention_triton(q, *caches, idx, seq_lens, **kw, **rings, **scale_kw(unread))
    assert_error_within("sparse out", out,
                        reference.pod_sparse_decode_attention(q, *caches, idx, seq_lens, **kw, **rings,
                                                              **scale_kw(scales)),
                        reference.pod_sparse_decode_attention(q.double(), *caches, idx, seq_lens, **kw, **rings64,
                                                              **scale_kw(scales)))
