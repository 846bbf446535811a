"""POD attention split in two (kernels/pod_split_attention.py): torch's fused causal attention over the distant
core + the Triton proximal band, merged by log-sum-exp. Output and the four gradients against autograd of
kernels.reference in fp64, on the same window edge cases as the single-pass kernels (sink column, pure-distant
range, band, diagonal; no distant pair; every pair distant), GQA groups 1-8, ragged batches."""

import pytest
import torch
from kernel_checks import DEVICE, case_seed, error_check
from test_pod_prefill_attention import CASES, pod_case_inputs

from kernels import pod_split_attention as split
from kernels import reference
from kernels.triton_pod_prefill_attention import pod_prefill_attention_triton

assert_error_within = error_check(floor=2e-5)


def _check_against_reference(case, dtype, gen, factor=1.0, monkeypatch=None):
    batch, hq, hkv, s, d, sink, recent = case
    inputs, seq_lens, dout = pod_case_inputs(case, dtype, gen)
    calls = []
    real = split.PodSplitAttentionFunction.apply
    monkeypatch.setattr(split.PodSplitAttentionFunction, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("PODKIT_POD_ATTENTION", "split")
    out = pod_prefill_attention_triton(*inputs, seq_lens, sink=sink, recent=recent)
    assert calls == [1], "the split path did not run"
    grads = torch.autograd.grad(out, inputs, dout)
    exact_in = [t.detach().double().requires_grad_() for t in inputs]
    exact_out = reference.pod_prefill_attention(*exact_in, seq_lens, sink=sink, recent=recent)
    exact_grads = torch.autograd.grad(exact_out, exact_in, dout.double())
    ref_in = [t.detach().requires_grad_() for t in inputs]
    ref_out = reference.pod_prefill_attention(*ref_in, seq_lens, sink=sink, recent=recent)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout)
    assert out.dtype == dtype and not any(torch.isnan(t).any() for t in (out, *grads))
    assert_error_within("out", out, ref_out, exact_out, factor=factor)
    for name, g, r, e in zip(("dq", "dk_own", "dk_anchor", "dv"), grads, ref_grads, exact_grads):
        assert_error_within(name, g, r, e, factor=factor)
    padding = torch.arange(s, device=DEVICE)[None, :] >= seq_lens[:, None]
    assert (out.transpose(1, 2)[padding] == 0).all()


@pytest.mark.parametrize("case", CASES)
def test_split_equals_the_reference(case, monkeypatch):
    gen = torch.Generator().manual_seed(case_seed(case))
    _check_against_reference(case, torch.float32, gen, monkeypatch=monkeypatch)


class _RecordingCore(split._CausalCore):
    """Records the core's inputs; ``refuse_gqa``: raises on fewer K/V heads, as an op without GQA does."""

    def __init__(self, name, refuse_gqa):
        self.name, self.refuse_gqa, self.calls = name, refuse_gqa, []

    def forward(self, q, k, v, scale):
        self.calls.append((q, k, v))
        if self.refuse_gqa and k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must equal the query's")
        return q.clone(), torch.zeros(q.shape[:3]), ()


@pytest.mark.parametrize("refuse_gqa", [False, True])
def test_the_distant_core_is_a_shifted_causal_attention(refuse_gqa, monkeypatch):
    """The core: rows [sink + recent, S) against anchor keys [sink, S - recent); KV heads as they are, or repeated to
    the query heads when the backend refuses GQA (and then for every later call)."""
    monkeypatch.setattr(split, "_NATIVE_GQA", {})
    q = torch.arange(2 * 4 * 10 * 1, dtype=torch.float32).reshape(2, 4, 10, 1)
    k = torch.arange(2 * 2 * 10 * 1, dtype=torch.float32).reshape(2, 2, 10, 1)
    core = _RecordingCore("fake", refuse_gqa)
    *_, native = split._core_forward(core, q, k, k, sink=2, recent=3, scale=1.0)
    q_core, k_core, v_core = core.calls[-1]
    assert native is not refuse_gqa and split._NATIVE_GQA == {"fake": not refuse_gqa}
    assert torch.equal(q_core, q[:, :, 5:]) and torch.equal(v_core, k_core)
    if refuse_gqa:
        assert len(core.calls) == 2 and k_core.shape == (2, 4, 5, 1)
        assert torch.equal(k_core[:, 1], k[:, 0, 2:7]) and torch.equal(k_core[:, 3], k[:, 1, 2:7])
        split._core_forward(core, q, k, k, sink=2, recent=3, scale=1.0)
        assert len(core.calls) == 3, "a refusing backend is asked with repeated heads straight away"
    else:
        assert len(core.calls) == 1 and torch.equal(k_core, k[:, :, 2:7])


def test_split_with_repeated_kv_heads_equals_the_reference(monkeypatch):
    """The fallback for a backend without GQA (repeated K/V, gradients summed per group) on a GQA-4 ragged batch."""
    monkeypatch.setattr(split, "_NATIVE_GQA", {"cpu_flash": False, "flash": False, "efficient": False, "cudnn": False})
    _check_against_reference((2, 8, 2, 150, 32, 3, 40), torch.float32, torch.Generator().manual_seed(7),
                             monkeypatch=monkeypatch)


def test_an_unknown_path_is_refused_before_any_work(monkeypatch):
    monkeypatch.setenv("PODKIT_POD_ATTENTION", "fast")
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    k = torch.randn(1, 1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"PODKIT_POD_ATTENTION='fast': allowed values are auto, fused, split"):
        pod_prefill_attention_triton(q, k, k, k, torch.tensor([8], device=DEVICE), sink=1, recent=2)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_split_bf16_gpu(group, monkeypatch):
    gen = torch.Generator().manual_seed(100 + group)
    _check_against_reference((2, 2 * group, 2, 1100, 128, 16, 300), torch.bfloat16, gen, factor=3.0,
                             monkeypatch=monkeypatch)


@pytest.mark.gpu
def test_split_bf16_gpu_with_repeated_kv_heads(monkeypatch):
    monkeypatch.setattr(split, "_NATIVE_GQA", {"flash": False, "efficient": False, "cudnn": False})
    _check_against_reference((2, 8, 2, 1100, 128, 16, 300), torch.bfloat16, torch.Generator().manual_seed(9),
                             factor=3.0, monkeypatch=monkeypatch)


@pytest.mark.gpu
def test_split_equals_sdpa_at_long_context_gpu(monkeypatch):
    """With anchor = own keys POD is causal attention: the split path against torch SDPA at 16K, where the first
    merge kernel (in place) lost rows to a race between warps that 1100-token cases never showed."""
    monkeypatch.setenv("PODKIT_POD_ATTENTION", "split")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 32, 16384, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 8, 16384, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out = pod_prefill_attention_triton(q, k, k, v, torch.tensor([16384], device="cuda"), sink=16, recent=4080)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (out.float() - expected.float()).abs().max().item() < 0.01


def test_a_torch_that_cannot_name_its_backend_falls_back_to_the_fused_route(monkeypatch):
    """``torch._fused_sdp_choice`` is private: if it is gone (or fails), the probe warns and answers None, which
    sends POD attention to the single-pass kernels instead of failing the training step."""
    def gone(*args, **kwargs):
        raise AttributeError("module 'torch' has no attribute '_fused_sdp_choice'")

    monkeypatch.setattr(torch, "_fused_sdp_choice", gone, raising=False)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.warns(RuntimeWarning, match="single-pass Triton route"):
        assert split._sdpa_backend_choice(q, k, k, 0.25) is None


def _scores_sharing_by_hand(q, q_anchor, k_own, k_anchor, v, seq_lens, sink, recent):
    """v1 score sharing written out with [S, S] logits: proximal ``q . k_own``, distant ``q_anchor . k_anchor``, one
    softmax, the layer's own values; padding rows 0 (fp64)."""
    group = q.shape[1] // k_own.shape[1]
    k_own, k_anchor, v = (t.repeat_interleave(group, 1) for t in (k_own, k_anchor, v))
    s, scale = q.shape[2], q.shape[3] ** -0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    proximal = (j < sink) | (i - j < recent)
    logits = torch.where(proximal, q @ k_own.transpose(-1, -2), q_anchor @ k_anchor.transpose(-1, -2)) * scale
    keep = (j <= i)[None] & (j[None] < seq_lens[:, None, None].cpu())
    probs = torch.softmax(logits.masked_fill(~keep[:, None], float("-inf")), -1)
    rows = (torch.arange(s)[None, :] < seq_lens[:, None].cpu())[:, None, :, None]
    return torch.where(rows, probs @ v, torch.zeros(()))


@pytest.mark.parametrize("case", CASES + [(2, 8, 2, 150, 32, 3, 40)])
def test_score_sharing_split_equals_the_reference(case, monkeypatch):
    """``q_distant`` (v1 score sharing: the distant pairs take the anchor's queries): the split route's output and
    its five gradients against the reference in fp64, and the reference against the formula written out."""
    batch, hq, hkv, s, d, sink, recent = case
    gen = torch.Generator().manual_seed(case_seed(case, "scores"))
    inputs, seq_lens, dout = pod_case_inputs(case, torch.float32, gen)
    q_anchor = torch.randn(batch, hq, s, d, generator=gen).to(DEVICE).requires_grad_()
    calls = []
    real = split.PodSplitAttentionFunction.apply
    monkeypatch.setattr(split.PodSplitAttentionFunction, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("PODKIT_POD_ATTENTION", "split")
    out = pod_prefill_attention_triton(*inputs, seq_lens, sink=sink, recent=recent, q_distant=q_anchor)
    assert calls == [1] or s <= sink + recent, "the split path did not run"
    grads = torch.autograd.grad(out, [*inputs, q_anchor], dout)
    exact_in = [t.detach().double().requires_grad_() for t in (*inputs, q_anchor)]
    q, k_own, k_anchor, v, qa = exact_in
    exact_out = reference.pod_prefill_attention(q, k_own, k_anchor, v, seq_lens, sink=sink, recent=recent,
                                                q_distant=qa)
    exact_grads = torch.autograd.grad(exact_out, exact_in, dout.double())
    by_hand = _scores_sharing_by_hand(*(t.detach().cpu() for t in exact_in[:1] + exact_in[4:] + exact_in[1:4]),
                                      seq_lens, sink, recent)
    assert torch.allclose(exact_out.detach().cpu(), by_hand, atol=1e-10)
    for name, got, want in zip(("out", "dq", "dk_own", "dk_anchor", "dv", "dq_anchor"), (out, *grads),
                               (exact_out, *exact_grads)):
        assert (got.double() - want).abs().max().item() < 2e-4, name
    if sink + recent < s:  # the distant pairs read the anchor's queries, not the layer's
        assert grads[4].abs().sum() > 0
    plain = pod_prefill_attention_triton(*inputs, seq_lens, sink=sink, recent=recent)
    assert sink + recent >= s or not torch.allclose(plain, out)


def test_score_sharing_refuses_a_gate_and_a_wrong_shape():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    k = torch.randn(1, 1, 8, 16, device=DEVICE)
    lens = torch.tensor([8], device=DEVICE)
    with pytest.raises(ValueError, match=r"q_distant shape \(1, 2, 4, 16\) must equal q's \(1, 2, 8, 16\)"):
        pod_prefill_attention_triton(q, k, k, k, lens, sink=1, recent=2, q_distant=q[:, :, :4])
    with pytest.raises(ValueError, match="return_gate=True with q_distant"):
        pod_prefill_attention_triton(q, k, k, k, lens, sink=1, recent=2, q_distant=q, return_gate=True)
