"""Triton pod_decode_attention (sink + ring own keys, anchor keys for distant positions, gate and
gate_tau skip) against kernels.reference. CPU interpreter fp32 / fp16; GPU (``-m gpu``) bf16."""

import os
import zlib

import pytest
import torch
from kernel_checks import error_check

from kernels import reference
from kernels.triton_pod_decode_attention import pod_decode_attention_triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")

CASES = [  # B, Hq, Hkv, N, D, sink, recent, seq_lens
    (3, 4, 4, 150, 32, 4, 16, [150, 40, 3]),       # G = 1; a sequence shorter than sink + recent
    (2, 6, 2, 200, 16, 0, 8, [200, 9]),            # G = 3, no sink
    (2, 8, 2, 130, 64, 3, 70, [130, 72]),          # G = 4, ring wraps, recent crosses a tile
    (2, 8, 1, 97, 16, 4, 1, [97, 5]),              # G = 8, ring of one (only the current token)
    (1, 5, 1, 90, 48, 2, 20, [90]),                # G = 5, D not a power of two
]


assert_error_within = error_check(floor=1e-6)


def ring_of(keys, lens, sink, recent, fill=0.0):
    """[B, Hkv, sink + recent, D]: the sink + ring buffer a POD layer holds for keys [B, Hkv, N, D] once each
    sequence has lens[b] tokens (slot j for sinks, sink + j % recent for the last `recent`); other slots `fill`."""
    B, Hkv, _, D = keys.shape
    ring = torch.full((B, Hkv, sink + recent, D), fill, dtype=keys.dtype)
    for b, L in enumerate(lens):
        for j in range(L):
            if j < sink:
                ring[b, :, j] = keys[b, :, j]
            elif L - 1 - j < recent:
                ring[b, :, sink + j % recent] = keys[b, :, j]
    return ring


def make_case(case, dtype, device, seed):
    """k_local holds the layer's own keys for proximal positions; every other slot is garbage
    (huge), so that reading a wrong slot cannot pass unnoticed."""
    B, Hq, Hkv, N, D, sink, recent, lens = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=gen)
    k_own = torch.randn(B, Hkv, N, D, generator=gen)
    k_anchor = torch.randn(B, Hkv, N, D, generator=gen)
    v = torch.randn(B, Hkv, N, D, generator=gen)
    k_local = ring_of(k_own, lens, sink, recent, fill=1e3)
    # anchor keys at proximal positions are never read: poison them too
    for b, L in enumerate(lens):
        for j in range(L):
            if j < sink or L - 1 - j < recent:
                k_anchor[b, :, j] = 1e3
    t = lambda x: x.to(device, dtype)
    return t(q), t(k_local), t(k_anchor), t(v), torch.tensor(lens, device=device), sink, recent


def run_both(q, k_local, k_anchor, v, seq_lens, sink, recent, tau):
    kw = dict(sink=sink, recent=recent, gate_tau=tau, return_gate=True)
    out, gate = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, **kw)
    exact, exact_gate = reference.pod_decode_attention(q.double(), k_local.double(), k_anchor.double(),
                                                       v.double(), seq_lens, **kw)
    ref, _ = reference.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, **kw)
    return out, gate, exact, exact_gate, ref


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=cpu_only),
                                   pytest.param(torch.float16, marks=cpu_only)])
def test_matches_reference(case, dtype, monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (lambda t: t.fill_(float("nan")) if t.is_floating_point()
                                                          else t)(real_empty(*a, **kw)))
    args = make_case(case, dtype, "cpu", zlib.crc32(repr((case, dtype)).encode()))
    out, gate, exact, exact_gate, ref = run_both(*args, tau=None)
    assert out.dtype == dtype and gate.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(gate).any()
    assert_error_within("out", out, ref, exact)
    assert (gate.double() - exact_gate).abs().max() < 1e-5
    # tau at the median gate: some heads skip distant attention, some don't
    # (halfway between two gate values, so rounding cannot flip a head's decision)
    gates = exact_gate.flatten().sort().values
    mid = gates.numel() // 2
    tau = 0.5 * (gates[mid - 1] + gates[mid]).item() if gates.numel() > 1 else 0.5
    out, gate, exact, exact_gate, ref = run_both(*args, tau=tau)
    assert_error_within("out (tau)", out, ref, exact)
    assert (gate.double() - exact_gate).abs().max() < 1e-5, "the gate is reported before skipping"


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 4, 5])
def test_bf16_gpu(G):
    Hkv = 8 if G < 5 else 2
    case = (2, G * Hkv, Hkv, 3000, 128, 4, 1000, [3000, 1100])
    args = make_case(case, torch.bfloat16, "cuda", G)
    for tau in (None, 0.5):
        out, gate, exact, exact_gate, ref = run_both(*args, tau=tau)
        assert_error_within("out", out, ref, exact)
        assert (gate.double() - exact_gate).abs().max() < 1e-3


@pytest.mark.gpu
def test_gate_estimate_skip_bf16_gpu():
    case = (2, 32, 8, 5000, 128, 4, 1000, [5000, 2100])
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.bfloat16, "cuda", 9)
    est = torch.rand(2, 32, device="cuda")
    est[0, :8] = 0.95  # two whole groups skip
    kw = dict(sink=sink, recent=recent, gate_tau=0.7, gate_estimate=est)
    out, skip = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, return_skip=True, **kw)
    exact = reference.pod_decode_attention(q.double(), k_local.double(), k_anchor.double(), v.double(), seq_lens, **kw)
    ref = reference.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, **kw)
    assert_error_within("out (gate_estimate)", out, ref, exact)
    assert torch.equal(skip, est >= 0.7)


def test_bad_inputs_raise_clear_errors():
    q, kl, ka, v = torch.zeros(2, 4, 16), torch.zeros(2, 2, 12, 16), torch.zeros(2, 2, 40, 16), torch.zeros(2, 2, 40, 16)
    lens = torch.tensor([40, 3])
    with pytest.raises(ValueError, match="k_local shape"):
        pod_decode_attention_triton(q, kl, ka, v, lens, sink=4, recent=9)
    with pytest.raises(ValueError, match="recent must be an int >= 1"):
        pod_decode_attention_triton(q, torch.zeros(2, 2, 4, 16), ka, v, lens, sink=4, recent=0)
    with pytest.raises(ValueError, match="k_anchor shape"):
        pod_decode_attention_triton(q, kl, ka[:, :, :30], v, lens, sink=4, recent=8)
    with pytest.raises(ValueError, match="gate_tau"):
        pod_decode_attention_triton(q, kl, ka, v, lens, sink=4, recent=8, gate_tau=float("nan"))
    with pytest.raises(ValueError, match="seq_lens values"):
        pod_decode_attention_triton(q, kl, ka, v, torch.tensor([41, 3]), sink=4, recent=8)


def _proximal_only(q, k_local, k_anchor, v, seq_lens, sink, recent):
    """Proximal attention alone (sparse_models/schemes/pod.py proximal_only_decode): every gate is
    >= 0, so tau = 0 skips the distant part of every head."""
    return reference.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, sink=sink, recent=recent, gate_tau=0.0)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])
def test_gate_estimate_skip_matches_reference(case):
    """A pre-evaluated gate decides the skip: skipped heads output proximal attention only, the others
    the full POD output (pod.py's gate_estimate="anchor" semantics); the skip mask is returned."""
    if not INTERPRETING:
        pytest.skip("CPU cases run the Triton interpreter")
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.float32, "cpu", zlib.crc32(repr(case).encode()))
    B, Hq = q.shape[:2]
    G = Hq // k_anchor.shape[1]
    gen = torch.Generator().manual_seed(1)
    est = torch.rand(B, Hq, generator=gen)
    est[0, :G] = 0.9   # a whole GQA group skips: its distant chunks load nothing
    est[-1, -1] = 0.1  # and the last group keeps at least one reading head
    tau = 0.5
    kw = dict(sink=sink, recent=recent, gate_tau=tau, gate_estimate=est, return_gate=True, return_skip=True)
    out, gate, skip = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, **kw)
    assert torch.equal(skip, est >= tau)
    full, full_gate = reference.pod_decode_attention(q.double(), k_local.double(), k_anchor.double(), v.double(),
                                                     seq_lens, sink=sink, recent=recent, return_gate=True)
    prox = _proximal_only(q.double(), k_local.double(), k_anchor.double(), v.double(), seq_lens, sink, recent)
    want = torch.where(skip[..., None], prox, full)
    assert (out.double() - want).abs().max() < 1e-5
    ref, ref_gate, ref_skip = reference.pod_decode_attention(q.double(), k_local.double(), k_anchor.double(),
                                                             v.double(), seq_lens, **kw)
    assert torch.equal(ref_skip, skip) and (ref - want).abs().max() < 1e-12
    want_gate = torch.where(skip, torch.ones_like(full_gate), full_gate)
    assert (gate.double() - want_gate).abs().max() < 1e-5 and (ref_gate.double() - want_gate).abs().max() < 1e-6


def test_skipped_groups_read_no_distant_key():
    """Distant anchor keys and values of a fully skipped sequence are NaN: a kernel that loaded and
    multiplied them would return NaN. The other sequence still reads its distant keys."""
    if not INTERPRETING:
        pytest.skip("CPU cases run the Triton interpreter")
    case = (2, 8, 2, 130, 16, 3, 20, [130, 120])
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.float32, "cpu", 3)
    clean_anchor, clean_v = k_anchor.clone(), v.clone()
    distant = slice(sink, 130 - recent)
    k_anchor[0, :, distant] = float("nan")
    v[0, :, distant] = float("nan")
    est = torch.tensor([[0.95] * 8, [0.0] * 8])
    out, skip = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, sink=sink, recent=recent,
                                            gate_tau=0.7, gate_estimate=est, return_skip=True)
    assert skip.float().mean().item() == 0.5, "the skipped fraction of (query, head) pairs"
    prox = _proximal_only(q, k_local, clean_anchor, clean_v, seq_lens, sink, recent)
    full = reference.pod_decode_attention(q, k_local, clean_anchor, clean_v, seq_lens, sink=sink, recent=recent)
    assert not torch.isnan(out).any()
    assert (out[0] - prox[0]).abs().max() < 1e-5 and (out[1] - full[1]).abs().max() < 1e-5


def test_exact_gate_skip_mask_and_estimate_errors():
    if not INTERPRETING:
        pytest.skip("CPU cases run the Triton interpreter")
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(CASES[1], torch.float32, "cpu", 4)
    kw = dict(sink=sink, recent=recent)
    out, gate, skip = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, gate_tau=0.3, return_gate=True,
                                                  return_skip=True, **kw)
    assert torch.equal(skip, gate >= 0.3)
    _, skip_none = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, return_skip=True, **kw)
    assert not skip_none.any()
    est = torch.zeros(q.shape[:2])
    with pytest.raises(ValueError, match="gate_estimate is given but gate_tau is None"):
        pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, gate_estimate=est, **kw)
    with pytest.raises(ValueError, match="gate_estimate shape"):
        pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, gate_tau=0.7, gate_estimate=est[:1], **kw)
    with pytest.raises(TypeError, match="gate_estimate must be a float tensor"):
        pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, gate_tau=0.7, gate_estimate=est.long(), **kw)


def _own_anchor_case(case, dtype, device, seed):
    """An anchor layer: its own keys at every position (k_anchor), and the ring a shared layer would hold."""
    B, Hq, Hkv, N, D, sink, recent, lens = case
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, *rest, generator=gen) for h, rest in ((Hq, (D,)), (Hkv, (N, D)), (Hkv, (N, D))))
    ring = ring_of(k, lens, sink, recent)
    t = lambda x: x.to(device, dtype)  # noqa: E731
    return t(q), t(ring), t(k), t(v), torch.tensor(lens, device=device), sink, recent


def _check_own_anchor(args, gate_tol):
    q, ring, k, v, lens, sink, recent = args
    out, gate = pod_decode_attention_triton(q, None, k, v, lens, sink=sink, recent=recent, return_gate=True)
    # exact attention over the layer's own keys ...
    exact = reference.decode_attention(q.double(), k.double(), v.double(), lens)
    ref = reference.decode_attention(q, k, v, lens)
    assert_error_within("out (own anchor)", out, ref, exact)
    # ... and the gate of the same keys split into proximal (from the ring) and distant
    _, ring_gate = reference.pod_decode_attention(q.double(), ring.double(), k.double(), v.double(), lens, sink=sink,
                                                  recent=recent, return_gate=True)
    assert (gate.double() - ring_gate).abs().max() < gate_tol
    _, ref_gate = reference.pod_decode_attention(q, None, k, v, lens, sink=sink, recent=recent, return_gate=True)
    assert (ref_gate.double() - ring_gate).abs().max() < gate_tol


@cpu_only
@pytest.mark.parametrize("case", CASES)
def test_own_anchor_layer_is_exact_attention_with_its_gate(case):
    """k_local=None (a layer that is its own anchor, as the engine's anchor-gate estimate needs): the output is
    exact attention and the gate is what the ring layout gives for the same keys."""
    _check_own_anchor(_own_anchor_case(case, torch.float32, "cpu", zlib.crc32(repr(case).encode())), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 4, 8])
def test_own_anchor_layer_bf16_gpu(G):
    Hkv = 8 if G < 8 else 2
    _check_own_anchor(_own_anchor_case((2, G * Hkv, Hkv, 3000, 128, 4, 1000, [3000, 1100]), torch.bfloat16,
                                       "cuda", G), 1e-2)


def _scores_by_hand(q, k_local, k_anchor, lens, sink, recent):
    """[B, Hq, N] float64: position j's logit with its own (ring) key if proximal to p = len-1, else the anchor's;
    -inf past the sequence (what TidalDecode's selection in a POD layer ranks)."""
    B, Hq, D = q.shape
    Hkv, N = k_anchor.shape[1], k_anchor.shape[2]
    out = torch.full((B, Hq, N), float("-inf"), dtype=torch.float64)
    for b, L in enumerate(lens.tolist()):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            for j in range(L):
                proximal = j < sink or L - 1 - j < recent
                key = k_local[b, kv, j if j < sink else sink + j % recent] if proximal else k_anchor[b, kv, j]
                out[b, h, j] = (q[b, h].double() @ key.double()) * D ** -0.5
    return out


@cpu_only
@pytest.mark.parametrize("case", CASES[:3])
def test_scores_are_each_positions_logit_by_the_key_it_is_attended_with(case):
    q, k_local, k_anchor, v, lens, sink, recent = make_case(case, torch.float32, "cpu", 11)
    want = _scores_by_hand(q, k_local, k_anchor, lens, sink, recent)
    out, scores = pod_decode_attention_triton(q, k_local, k_anchor, v, lens, sink=sink, recent=recent,
                                              return_scores=True)
    ref_out, ref_scores = reference.pod_decode_attention(q, k_local, k_anchor, v, lens, sink=sink, recent=recent,
                                                         return_scores=True)
    for got in (scores, ref_scores):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        assert (got.double()[finite] - want[finite]).abs().max() < 1e-4
    assert torch.allclose(out, ref_out, atol=1e-5)
    # with the gate too, the order is out, gate, scores
    _, gate, scores2 = pod_decode_attention_triton(q, k_local, k_anchor, v, lens, sink=sink, recent=recent,
                                                   return_gate=True, return_scores=True)
    assert gate.shape == q.shape[:2] and torch.equal(scores2, scores)
    with pytest.raises(ValueError, match="return_scores with gate_estimate"):
        pod_decode_attention_triton(q, k_local, k_anchor, v, lens, sink=sink, recent=recent, gate_tau=0.5,
                                    gate_estimate=torch.zeros(q.shape[:2]), return_scores=True)


@pytest.mark.gpu
def test_scores_bf16_gpu():
    case = (2, 32, 8, 3000, 128, 4, 1000, [3000, 1100])
    q, k_local, k_anchor, v, lens, sink, recent = make_case(case, torch.bfloat16, "cuda", 12)
    _, scores = pod_decode_attention_triton(q, k_local, k_anchor, v, lens, sink=sink, recent=recent,
                                            return_scores=True)
    _, ref = reference.pod_decode_attention(q.float(), k_local.float(), k_anchor.float(), v.float(), lens, sink=sink,
                                            recent=recent, return_scores=True)
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert (scores[finite] - ref[finite]).abs().max() < 0.05


def _score_sharing_by_hand(q, q_anchor, k_local, k_anchor, v, lens, sink, recent, tau):
    """v1 score sharing at decode, written out (fp64): proximal logits ``q . ring key``, distant ``q_anchor . k_a``,
    one softmax over the layer's values; with ``tau``, a head whose exact gate is >= tau drops its distant part."""
    group = q.shape[1] // v.shape[1]
    n, scale = v.shape[2], q.shape[-1] ** -0.5
    p = lens.long()[:, None] - 1
    j = torch.arange(n)[None, :]
    causal = j <= p
    proximal = ((j < sink) | (p - j < recent)) & causal
    slot = torch.where(j < sink, j, sink + j % recent)[0]
    k_prox = k_local[:, :, slot].repeat_interleave(group, 1)
    lp = torch.einsum("bhd,bhnd->bhn", q, k_prox) * scale
    ld = torch.einsum("bhd,bhnd->bhn", q_anchor, k_anchor.repeat_interleave(group, 1)) * scale
    lp = lp.masked_fill(~proximal[:, None], float("-inf"))
    ld = ld.masked_fill(~(causal & ~proximal)[:, None], float("-inf"))
    gate = torch.sigmoid(torch.logsumexp(lp, -1) - torch.logsumexp(ld, -1))
    if tau is not None:
        ld = ld.masked_fill((gate >= tau)[..., None], float("-inf"))
    probs = torch.softmax(torch.where(proximal[:, None], lp, ld), -1)
    return torch.einsum("bhn,bhnd->bhd", probs, v.repeat_interleave(group, 1)), gate


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tau", [None, 0.5])
@cpu_only
def test_score_sharing_matches_the_reference_and_the_formula(case, tau):
    """``q_distant`` (the anchor layer's query: v1 score sharing): the Triton kernel against the reference in fp64,
    and the reference against the formula written out, with and without the exact-gate skip."""
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.float32, "cpu", zlib.crc32(repr(case).encode()))
    q_anchor = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    kw = dict(sink=sink, recent=recent, gate_tau=tau, return_gate=True)
    out, gate = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, q_distant=q_anchor, **kw)
    d = [t.double() for t in (q, k_local, k_anchor, v, q_anchor)]
    exact, exact_gate = reference.pod_decode_attention(*d[:4], seq_lens, q_distant=d[4], **kw)
    by_hand, hand_gate = _score_sharing_by_hand(d[0], d[4], d[1], d[2], d[3], seq_lens, sink, recent, tau)
    assert (exact - by_hand).abs().max() < 1e-9 and (exact_gate - hand_gate).abs().max() < 1e-6  # gate: fp32
    assert (out.double() - exact).abs().max() < 2e-4
    assert (gate.double() - exact_gate).abs().max() < 2e-5
    plain = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, sink=sink, recent=recent)
    assert not torch.allclose(plain, out), "the distant logits did not use q_distant"


def test_score_sharing_refuses_a_mismatched_query():
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(CASES[1], torch.float32, "cpu", 1)
    with pytest.raises(ValueError, match=r"q_distant must have 3 dims \[B,Hq,D\], got shape \(2, 6\)"):
        pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, sink=sink, recent=recent,
                                    q_distant=q[:, :, 0])
    with pytest.raises(ValueError, match=r"q_distant \(\(2, 3, 16\), torch.float32, cpu\) must match q"):
        pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, sink=sink, recent=recent,
                                    q_distant=q[:, :3])


@pytest.mark.gpu
def test_score_sharing_bf16_gpu():
    case = (2, 32, 8, 3000, 128, 4, 1000, [3000, 1100])
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.bfloat16, "cuda", 11)
    q_anchor = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    kw = dict(sink=sink, recent=recent, gate_tau=0.5, return_gate=True)
    out, gate = pod_decode_attention_triton(q, k_local, k_anchor, v, seq_lens, q_distant=q_anchor, **kw)
    exact, exact_gate = reference.pod_decode_attention(q.double(), k_local.double(), k_anchor.double(), v.double(),
                                                       seq_lens, q_distant=q_anchor.double(), **kw)
    ref, _ = reference.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, q_distant=q_anchor, **kw)
    assert_error_within("out (score sharing)", out, ref, exact)
    assert (gate.double() - exact_gate).abs().max() < 1e-3
