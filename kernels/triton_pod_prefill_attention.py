"""POD prefill / training attention with a Triton forward and backward.

POD (Ma et al., "Compressing KV Cache for Long-Context LLM Inference with Inter-Layer Attention
Similarity", arXiv 2412.02252 v2; METHODS.md §A.3): for a query at position ``i`` and a key at
``j <= i``, the pair is *proximal* when ``j < sink`` or ``i - j < recent`` and uses the layer's own
key ``k_own[j]``; otherwise it is *distant* and uses the anchor layer's key ``k_anchor[j]``. Queries
and values are the layer's own. The paper's two masked passes merged by log-sum-exp,
``o = g o_P + (1 - g) o_D`` with ``g = sigmoid(lse_P - lse_D)``, equal one softmax over both kinds
of pair, which is what the kernels compute in a single pass (``_prefill_pod_fwd.py``), with a
FlashAttention-2 style backward (``_prefill_pod_bwd.py``) giving gradients for ``q``, ``k_own``,
``k_anchor`` and ``v``.

    q[B,Hq,S,D], k_own/k_anchor/v[B,Hkv,S,D], seq_lens[B] (right padding) -> out[B,Hq,S,D]
    (, gate[B,Hq,S] fp32: the proximal share of the softmax mass; 1 where no distant key exists,
    0 on padding rows). The gate is returned for inspection and is not differentiable.

For a head that is its own anchor pass ``k_anchor = k_own`` (the same tensor): the result is plain
causal attention and autograd sums the two key gradients.
"""

from __future__ import annotations

import os

import torch

from ._prefill_common import check_float_tensor, check_gqa, check_int_vector, resolve_scale
from ._prefill_pod_launch import _pod_backward, _pod_forward
from .pod_split_attention import pod_split_attention


class PodPrefillAttentionFunction(torch.autograd.Function):
    """autograd wrapper: forward saves the log2-domain LSE, backward recomputes probabilities."""

    @staticmethod
    def forward(ctx, q, k_own, k_anchor, v, seq_lens, sink, recent, scale, return_gate):
        out, lse2, gate = _pod_forward(q, k_own, k_anchor, v, seq_lens, sink, recent, scale, return_gate)
        ctx.save_for_backward(q, k_own, k_anchor, v, seq_lens, out, lse2)
        ctx.pod_args = (sink, recent, scale)
        if gate is None:
            return out
        ctx.mark_non_differentiable(gate)
        return out, gate

    @staticmethod
    def backward(ctx, dout, *unused_gate_grad):
        q, k_own, k_anchor, v, seq_lens, out, lse2 = ctx.saved_tensors
        sink, recent, scale = ctx.pod_args
        dq, dk_own, dk_anchor, dv = _pod_backward(dout, q, k_own, k_anchor, v, seq_lens, out, lse2, sink, recent,
                                                  scale)
        return dq, dk_own, dk_anchor, dv, None, None, None, None, None


POD_ATTENTION_PATHS = ("auto", "fused", "split")


def pod_attention_path(device: torch.device | str = "cuda") -> str:
    """The route of the differentiable POD attention, ``fused`` or ``split``, from ``PODKIT_POD_ATTENTION``:

    * ``fused``: one Triton pass over both kinds of pair (kernels/_prefill_pod_fwd.py, _prefill_pod_bwd.py);
    * ``split``: torch's fused causal attention over the distant core + the Triton proximal band, merged by
      log-sum-exp (kernels/pod_split_attention.py); the faster route on an H200 (BENCHMARKS.md, status table,
      "POD training attention", and the entry "POD training attention split in two");
    * ``auto`` (default): ``split`` on CUDA, ``fused`` elsewhere (the CPU route is the Triton interpreter, for tests).
    """
    path = os.environ.get("PODKIT_POD_ATTENTION", "auto")
    if path not in POD_ATTENTION_PATHS:
        raise ValueError(f"PODKIT_POD_ATTENTION={path!r}: allowed values are {', '.join(POD_ATTENTION_PATHS)}")
    if path == "auto":
        return "split" if torch.device(device).type == "cuda" else "fused"
    return path


def _check_window(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative int")
    return value


def pod_prefill_attention_triton(q, k_own, k_anchor, v, seq_lens, *, sink, recent, scale=None, return_gate=False,
                                 q_distant=None):
    """POD prefill / training attention (Triton forward and backward, differentiable).

    Args:
        q: ``[B, Hq, S, D]`` fp16/bf16/fp32 queries (post-RoPE).
        k_own: ``[B, Hkv, S, D]`` this layer's keys (proximal pairs).
        k_anchor: ``[B, Hkv, S, D]`` the anchor layer's keys (distant pairs).
        v: ``[B, Hkv, S, D]`` this layer's values.
        seq_lens: ``[B]`` int in ``[0, S]``; rows at positions ``>= seq_lens[b]`` output 0.
        sink, recent: proximal window: ``j < sink`` or ``i - j < recent`` (ints ``>= 0``).
        scale: softmax scale, default ``D ** -0.5``.
        return_gate: also return ``gate[B, Hq, S]`` fp32 (not differentiable).
        q_distant: ``[B, Hq, S, D]`` queries of the distant pairs, default ``q`` (key sharing). The anchor layer's
            queries give v1's score sharing; only the split route takes them (its distant core is an ordinary
            causal attention), and where it cannot run, the reference does (kernels/reference.py).

    Returns:
        ``out[B, Hq, S, D]`` in q's dtype (``, gate``).
    """
    check_float_tensor("q", q, 4)
    for name, tensor in (("k_own", k_own), ("k_anchor", k_anchor), ("v", v)):
        check_float_tensor(name, tensor, 4, dtype=q.dtype, device=q.device)
    batch, num_q_heads, seq_total, head_dim = q.shape
    expected = (batch, k_own.shape[1], seq_total, head_dim)
    for name, tensor in (("k_own", k_own), ("k_anchor", k_anchor), ("v", v)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} must be [B, Hkv, S, D] = {expected}")
    check_gqa(num_q_heads, k_own.shape[1], "k_own")
    if q_distant is not None:
        check_float_tensor("q_distant", q_distant, 4, dtype=q.dtype, device=q.device)
        if q_distant.shape != q.shape:
            raise ValueError(f"q_distant shape {tuple(q_distant.shape)} must equal q's {tuple(q.shape)}")
        if return_gate:
            raise ValueError("return_gate=True with q_distant: the gate is not computed under score sharing")
    seq_lens = check_int_vector("seq_lens", seq_lens, batch, q.device, low=0, high=seq_total)
    sink = _check_window("sink", sink)
    recent = _check_window("recent", recent)
    scale = resolve_scale(scale, head_dim)
    if q.numel() == 0:
        out = torch.zeros_like(q)
        gate = torch.zeros((batch, num_q_heads, seq_total), device=q.device, dtype=torch.float32)
        return (out, gate) if return_gate else out
    if not return_gate and pod_attention_path(q.device) == "split":
        out = pod_split_attention(q, k_own, k_anchor, v, seq_lens, sink=sink, recent=recent, scale=scale,
                                  q_distant=q_distant)
        if out is not None:
            return out
    if q_distant is not None:  # the single-pass kernels read one query per row
        from .reference import pod_prefill_attention
        return pod_prefill_attention(q, k_own, k_anchor, v, seq_lens, sink=sink, recent=recent, scale=scale,
                                     q_distant=q_distant)
    return PodPrefillAttentionFunction.apply(q, k_own, k_anchor, v, seq_lens, sink, recent, scale, return_gate)
