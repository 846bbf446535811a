"""Training through the CUDA dispatch: every parameter gets the gradient the PyTorch reference gives it.

On CUDA the kernels package runs the Triton kernels (kernels/__init__.py). The test patches
``kernels.use_triton`` to choose: yes for the kernels (on CPU they run under TRITON_INTERPRET=1, see
tests/conftest.py), no for the PyTorch reference. On CPU this reproduces the 2-GPU sequence-parallel failure
of issue 13: the forward-only dense prefill kernel cut the graph, and the q/k/v projections of dense layers
and of POD's anchor layers got no gradient at all. Under ``-m gpu`` nothing is skipped: it runs on CUDA.
"""

import pytest
import torch
from sm_tiny import left_padded, random_prompts, tiny_model

import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

POD = {"prefill_scheme": "pod", "decode_scheme": "pod",
       "pod": {"sink_tokens": 2, "recent_window": 4, "anchor_layers": [[0, 0], [0, 1], [0, 1], [3, 1]]}}


def _loss_logits_grads(model, ids, mask):
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: None if p.grad is None else p.grad.clone()
                                                    for n, p in model.named_parameters()}


@pytest.mark.parametrize("scheme", ["dense", "pod"])
def test_triton_dispatch_trains_every_parameter_like_the_reference(scheme, monkeypatch):
    _check_training_through_the_kernels(scheme, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["dense", "pod"])
def test_triton_kernels_train_every_parameter_on_gpu(scheme, monkeypatch):
    """The same for ``pytest -m gpu`` (which deselects the unmarked test): compiled kernels on CUDA."""
    _check_training_through_the_kernels(scheme, monkeypatch)


def _check_training_through_the_kernels(scheme, monkeypatch):
    model = tiny_model(3, 4, POD if scheme == "pod" else None, seed=4).to(DEVICE).train()
    ids, mask = (t.to(DEVICE) for t in left_padded(random_prompts([19, 13], seed=4)))  # a padded row
    monkeypatch.setattr(kernels, "use_triton", lambda tensor: False)
    loss_ref, logits_ref, grads_ref = _loss_logits_grads(model, ids, mask)
    monkeypatch.setattr(kernels, "use_triton", lambda tensor: True)
    loss, logits, grads = _loss_logits_grads(model, ids, mask)
    missing = sorted(n for n, g in grads.items() if g is None)
    assert not missing, f"no gradient through the Triton kernels for {missing}"
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    valid = mask.bool()
    torch.testing.assert_close(logits[valid], logits_ref[valid], rtol=1e-4, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_forward_only_triton_op_refuses_inputs_that_need_grad(monkeypatch):
    monkeypatch.setattr(kernels, "use_triton", lambda tensor: True)
    q = torch.randn(1, 2, 4, 8, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, device=DEVICE)
    lens = torch.tensor([6], device=DEVICE)
    with pytest.raises(RuntimeError, match="decode_attention: the Triton kernel is forward only"):
        kernels.decode_attention(q[:, :, 0], k, k, lens)
    with torch.no_grad():
        out = kernels.decode_attention(q[:, :, 0], k, k, lens)
    torch.testing.assert_close(out, kernels.reference.decode_attention(q[:, :, 0].detach(), k, k, lens),
                               rtol=1e-4, atol=1e-5)
