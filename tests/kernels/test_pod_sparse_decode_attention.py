"""Triton pod_sparse_decode_attention (POD + TidalDecode: sparse decode over selected positions, proximal
keys from the layer's own sink + ring, distant keys from the anchor, gate and compute skip) against
kernels.reference, against the engine's torch gather (sparse_models/engine/decode_layers.py
_pod_sparse_run, re-stated here), and against dense POD decode when every position is selected."""

import os
import zlib

import pytest
import torch
from test_pod_decode_attention import make_case

from kernels import reference
from kernels.triton_pod_sparse_decode_attention import pod_sparse_decode_attention_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")
cpu_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases run the Triton interpreter")

CASES = [  # B, Hq, Hkv, N, D, sink, recent, seq_lens
    (3, 4, 4, 150, 32, 4, 16, [150, 40, 3]),       # G = 1; a sequence shorter than sink + recent
    (2, 6, 2, 200, 16, 0, 8, [200, 9]),            # G = 3, no sink
    (2, 8, 2, 130, 16, 3, 70, [130, 72]),          # G = 4, ring wraps
    (2, 8, 1, 97, 16, 4, 1, [97, 5]),              # G = 8, ring of one (only the current token)
]


def random_lists(seq_lens, Hs, K, gen):
    """[B,Hs,K] distinct positions < seq_len in random order (the current one always in), -1 padded."""
    rows = []
    for L in seq_lens.tolist():
        heads = []
        for _ in range(Hs):
            perm = torch.randperm(L - 1, generator=gen)[: K - 1] if L > 1 else torch.zeros(0, dtype=torch.long)
            lst = torch.cat([perm, torch.tensor([L - 1])])
            lst = lst[torch.randperm(lst.numel(), generator=gen)]
            heads.append(torch.cat([lst, torch.full((K - lst.numel(),), -1)]))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def engine_gather(q, k_local, k_anchor, v, idx, seq_lens, sink, recent):
    """The torch gather the engine used before this kernel (decode_layers._pod_sparse_run)."""
    B, Hq, D = q.shape
    G = Hq // v.shape[1]
    if idx.shape[1] != Hq:
        idx = idx.repeat_interleave(G, dim=1)
    valid = idx >= 0
    j = idx.clamp(min=0)
    p = (seq_lens - 1)[:, None, None]
    proximal = (j < sink) | (p - j < recent)
    b = torch.arange(B)[:, None, None]
    kvh = (torch.arange(Hq) // G)[None, :, None]
    ring = torch.where(j < sink, j, sink + j % recent)
    k = torch.where(proximal[..., None], k_local[b, kvh, ring], k_anchor[b, kvh, j])
    logits = torch.einsum("bhd,bhkd->bhk", q.double(), k.double()) * D ** -0.5
    probs = torch.softmax(logits.masked_fill(~valid, float("-inf")), -1)
    return torch.einsum("bhk,bhkd->bhd", probs, v[b, kvh, j].double())


@cpu_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_group", [False, True])
def test_matches_reference_and_engine_gather(case, per_group):
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.float32, "cpu",
                                                                zlib.crc32(repr((case, per_group)).encode()))
    Hq, Hkv = q.shape[1], v.shape[1]
    gen = torch.Generator().manual_seed(len(case[-1]))
    idx = random_lists(seq_lens, Hkv if per_group else Hq, 40, gen)
    out, gate = pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, idx, seq_lens, sink=sink, recent=recent,
                                                   return_gate=True)
    want = engine_gather(q, k_local, k_anchor, v, idx, seq_lens, sink, recent)
    assert (out.double() - want).abs().max() < 1e-5
    ref, ref_gate = reference.pod_sparse_decode_attention(q.double(), k_local.double(), k_anchor.double(), v.double(),
                                                          idx, seq_lens, sink=sink, recent=recent, return_gate=True)
    assert (ref - want).abs().max() < 1e-10
    assert (gate.double() - ref_gate).abs().max() < 1e-5
    # exact-gate skip at the median gate: some heads drop their distant entries
    gates = ref_gate.flatten().sort().values
    tau = 0.5 * (gates[gates.numel() // 2 - 1] + gates[gates.numel() // 2]).item()
    kw = dict(sink=sink, recent=recent, gate_tau=tau, return_gate=True, return_skip=True)
    out, gate, skip = pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, idx, seq_lens, **kw)
    ref, ref_gate, ref_skip = reference.pod_sparse_decode_attention(q.double(), k_local.double(), k_anchor.double(),
                                                                    v.double(), idx, seq_lens, **kw)
    assert torch.equal(skip, ref_skip) and (out.double() - ref).abs().max() < 1e-5
    assert (gate.double() - ref_gate).abs().max() < 1e-5


@cpu_only
@pytest.mark.parametrize("per_group", [False, True])
def test_gate_estimate_skip_reads_no_distant_row(per_group):
    """Skipped heads' distant rows are NaN: loading and using them would give NaN."""
    case = (2, 8, 2, 130, 16, 3, 20, [130, 120])
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.float32, "cpu", 8)
    gen = torch.Generator().manual_seed(2)
    idx = random_lists(seq_lens, 2 if per_group else 8, 60, gen)
    clean_anchor, clean_v = k_anchor.clone(), v.clone()
    k_anchor[0, :, sink:130 - recent] = float("nan")
    v[0, :, sink:130 - recent] = float("nan")
    est = torch.tensor([[0.9] * 8, [0.9, 0.1] * 4])  # sequence 0 skips everywhere, sequence 1 half its heads
    kw = dict(sink=sink, recent=recent, gate_tau=0.7, gate_estimate=est, return_gate=True, return_skip=True)
    out, gate, skip = pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, idx, seq_lens, **kw)
    ref, ref_gate, ref_skip = reference.pod_sparse_decode_attention(q, k_local, clean_anchor, clean_v, idx, seq_lens,
                                                                    **kw)
    assert torch.equal(skip, est >= 0.7) and torch.equal(ref_skip, skip)
    assert skip.float().mean().item() == 0.75
    assert not torch.isnan(out).any() and (out - ref).abs().max() < 1e-5
    assert (gate - ref_gate).abs().max() < 1e-5 and (gate[skip] == 1).all()


@cpu_only
def test_everything_selected_equals_dense_pod_decode():
    case = CASES[2]
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.float32, "cpu", 4)
    N = v.shape[2]
    idx = torch.arange(N).expand(2, 2, N).clone()
    idx[1, :, int(seq_lens[1]):] = -1
    for tau in (None, 0.6):
        kw = dict(sink=sink, recent=recent, gate_tau=tau, return_gate=True)
        out, gate = pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, idx, seq_lens, **kw)
        dense, dense_gate = reference.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, **kw)
        assert (out - dense).abs().max() < 1e-5 and (gate - dense_gate).abs().max() < 1e-5


@cpu_only
def test_bad_inputs():
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(CASES[1], torch.float32, "cpu", 1)
    kw = dict(sink=sink, recent=recent)
    with pytest.raises(ValueError, match="indices shape"):
        pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, torch.zeros(2, 5, 4, dtype=torch.long),
                                           seq_lens, **kw)
    with pytest.raises(ValueError, match="indices entries"):
        pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, torch.full((2, 2, 4), 200), seq_lens, **kw)
    with pytest.raises(ValueError, match="gate_estimate is given"):
        pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, torch.zeros(2, 2, 4, dtype=torch.long), seq_lens,
                                           gate_estimate=torch.zeros(2, 6), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("per_group", [False, True])
def test_bf16_gpu(per_group):
    case = (2, 32, 8, 6000, 128, 4, 1000, [6000, 2500])
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.bfloat16, "cuda", 3)
    idx = random_lists(seq_lens.cpu(), 8 if per_group else 32, 2048, torch.Generator().manual_seed(0)).cuda()
    est = torch.rand(2, 32, device="cuda")
    for kw in (dict(), dict(gate_tau=0.5), dict(gate_tau=0.5, gate_estimate=est)):
        out = pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, idx, seq_lens, sink=sink, recent=recent, **kw)
        exact = reference.pod_sparse_decode_attention(q.double(), k_local.double(), k_anchor.double(), v.double(),
                                                      idx, seq_lens, sink=sink, recent=recent, **kw)
        ref = reference.pod_sparse_decode_attention(q, k_local, k_anchor, v, idx, seq_lens, sink=sink, recent=recent,
                                                    **kw)
        assert (out.double() - exact).abs().max() <= 4 * (ref.double() - exact).abs().max() + 1e-3


@cpu_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_group", [False, True])
def test_score_sharing_matches_the_reference_and_dense_pod_decode(case, per_group):
    """``q_distant`` (v1 score sharing: distant entries take the anchor layer's query): the kernel against the
    reference in fp64, with and without the exact-gate skip, and every position selected equals POD decode."""
    q, k_local, k_anchor, v, seq_lens, sink, recent = make_case(case, torch.float32, "cpu",
                                                                zlib.crc32(repr((case, per_group, "qd")).encode()))
    q_anchor = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    Hq, Hkv = q.shape[1], v.shape[1]
    idx = random_lists(seq_lens, Hkv if per_group else Hq, 40, torch.Generator().manual_seed(len(case[-1])))
    d = [t.double() for t in (q, k_local, k_anchor, v, q_anchor)]
    for tau in (None, 0.5):
        kw = dict(sink=sink, recent=recent, gate_tau=tau, return_gate=True)
        out, gate = pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, idx, seq_lens, q_distant=q_anchor, **kw)
        ref, ref_gate = reference.pod_sparse_decode_attention(*d[:4], idx, seq_lens, q_distant=d[4], **kw)
        assert (out.double() - ref).abs().max() < 1e-5 and (gate.double() - ref_gate).abs().max() < 1e-5
    plain = pod_sparse_decode_attention_triton(q, k_local, k_anchor, v, idx, seq_lens, sink=sink, recent=recent)
    assert not torch.allclose(plain, out)
    everything = torch.arange(v.shape[2]).expand(q.shape[0], Hkv, -1).clone()
    for b, n in enumerate(seq_lens.tolist()):
        everything[b, :, n:] = -1
    full = reference.pod_sparse_decode_attention(*d[:4], everything, seq_lens, sink=sink, recent=recent, q_distant=d[4])
    dense = reference.pod_decode_attention(*d[:4], seq_lens, sink=sink, recent=recent, q_distant=d[4])
    assert (full - dense).abs().max() < 1e-10
