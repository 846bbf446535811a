"""POD training attention split in two: torch's fused causal attention over the distant core, the Triton
kernels over the proximal band, merged by log-sum-exp (forward and backward).

POD (METHODS.md §A.3, arXiv 2412.02252 v2 §4): a query at ``i`` sees key ``j <= i`` through the own key when
``j < sink`` or ``i - j < recent`` (proximal) and through the anchor key otherwise (distant,
``sink <= j <= i - recent``). The distant pairs form an ordinary causal attention after a shift: with
``c = sink + recent`` and ``L = S - c``, the queries ``q[c:]`` against ``k_anchor[sink : S - recent]`` and
``v[sink : S - recent]`` (both of length ``L``) under a top-left causal mask are exactly the distant pairs
(query ``t = i - c`` sees key ``u = j - sink`` iff ``u <= t``). That core is most of the work at long context
(76% of the pairs at 32K with recent 4080), so it runs on the fastest causal kernel torch has on the device (the
backend ``scaled_dot_product_attention`` itself would pick); the proximal band (sink columns + a diagonal band of
width ``recent``) runs on podkit's POD kernels with ``PROX_ONLY``.

Merge: ``lse = logaddexp(lse_P, lse_D)``, ``out = exp(lse_P - lse) out_P + exp(lse_D - lse) out_D``, one Triton
pass over the two parts (kernels/_pod_merge.py). Backward (the identity ring attention uses): each part's gradients
are its own kernel's backward run with the *merged* ``out`` and ``lse``, since then ``P`` is each pair's probability
in the whole softmax and ``delta = rowsum(dO * out)`` is the whole row's. torch's fused attention ops take ``out`` and ``logsumexp`` as inputs of their backward, which is
what makes this possible without a kernel of our own for the core.

GQA: the core reads the KV heads as they are where the backend's op takes fewer K/V heads than query heads (the
flash kernels do) and repeats them to the query heads otherwise, summing their gradients back per group. Padding
rows (``i >= seq_lens[b]``) output 0 and get ``lse = +inf``, so they add nothing to any gradient; keys past ``seq_lens[b]`` are only ever seen by padding rows (causality).
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
import triton

from ._pod_merge import pod_merge_kernel
from ._prefill_common import LOG2_E, head_dim_block
from ._prefill_pod_launch import _pod_backward, _pod_forward, pod_delta

_aten = torch.ops.aten


class _CausalCore(Protocol):
    """One backend of torch's fused causal attention: ``forward(q, k, v, scale) -> out, lse, saved`` with ``lse``
    natural-log ``[B, H, L]``-shaped (any strides, possibly padded at the end), and
    ``backward(dout, q, k, v, out, lse, saved, scale) -> dq, dk, dv`` taking an ``out`` / ``lse`` of our choice."""

    name: str

    def forward(self, q, k, v, scale): ...

    def backward(self, dout, q, k, v, out, lse, saved, scale): ...


class _CpuFlash(_CausalCore):
    name = "cpu_flash"

    def forward(self, q, k, v, scale):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()

    def backward(self, dout, q, k, v, out, lse, saved, scale):
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, True,
                                                                         scale=scale)


class _CudaFlash(_CausalCore):
    name = "flash"

    def forward(self, q, k, v, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, saved, scale):
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return _aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                                  0.0, True, seed, offset, scale=scale)


class _CudaEfficient(_CausalCore):
    name = "efficient"

    def forward(self, q, k, v, scale):
        out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                                               scale=scale)
        return out, lse, (seed, offset)

    def backward(self, dout, q, k, v, out, lse, saved, scale):
        seed, offset = saved
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True, scale=scale)
        return dq, dk, dv


class _CudaCudnn(_CausalCore):
    name = "cudnn"

    def forward(self, q, k, v, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, saved, scale):
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return _aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, seed, offset, None, cum_q,
                                                                  cum_k, max_q, max_k, 0.0, True, scale=scale)


def causal_core_for(q, k, v, scale) -> _CausalCore | None:
    """The backend ``scaled_dot_product_attention`` would use for a causal call on ``q [B, Hq, L, D]`` and
    ``k`` / ``v [B, Hkv, L, D]`` (None: only the math path, which has no fused backward to reuse, or torch could
    not be asked)."""
    if q.device.type == "cpu":
        return _CpuFlash()
    from torch.nn.attention import SDPBackend

    choice = _sdpa_backend_choice(q, k, v, scale)
    return {int(SDPBackend.FLASH_ATTENTION): _CudaFlash(), int(SDPBackend.EFFICIENT_ATTENTION): _CudaEfficient(),
            int(SDPBackend.CUDNN_ATTENTION): _CudaCudnn()}.get(choice)


def _sdpa_backend_choice(q, k, v, scale) -> int | None:
    """``torch._fused_sdp_choice`` for a causal call (an int of ``SDPBackend``), or None where this torch cannot
    answer (the helper is private: a torch that renamed it sends POD attention to the fused route, with a warning)."""
    try:
        try:
            return int(torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale,
                                               enable_gqa=q.shape[1] != k.shape[1]))
        except TypeError:  # a torch without enable_gqa: ask with the heads repeated, as the core will run
            group = q.shape[1] // k.shape[1]
            return int(torch._fused_sdp_choice(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), None,
                                               0.0, True, scale=scale))
    except (AttributeError, TypeError, RuntimeError) as err:
        warnings.warn(f"POD split attention: torch._fused_sdp_choice failed ({err!r}); using the single-pass "
                      f"Triton route (PODKIT_POD_ATTENTION=fused)", RuntimeWarning, stacklevel=3)
        return None


def _rows(lse, length):
    """The ``[B, H, length]`` view of a backend's LSE (some pad the last dimension, cuDNN adds a trailing 1)."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :length]


# Whether a backend's private op takes fewer K/V heads than query heads (GQA without copies), learnt on first use:
# the CPU and CUDA flash kernels do; an op that refuses raises before computing anything and gets repeated K/V.
_NATIVE_GQA: dict[str, bool] = {}


def _core_views(q, k_anchor, v, sink, recent, repeat_kv):
    """The distant core's q [B, Hq, L, D] and k / v [B, Hkv, L, D] (views; [B, Hq, L, D] copies with ``repeat_kv``):
    queries ``[sink + recent, S)`` against anchor keys / values ``[sink, S - recent)``."""
    seq_total = q.shape[2]
    k_core, v_core = k_anchor[:, :, sink:seq_total - recent], v[:, :, sink:seq_total - recent]
    if repeat_kv:
        group = q.shape[1] // k_anchor.shape[1]
        k_core, v_core = k_core.repeat_interleave(group, 1), v_core.repeat_interleave(group, 1)
    return q[:, :, sink + recent:], k_core, v_core


def _core_forward(core, q, k_anchor, v, sink, recent, scale):
    """-> out_d [B, Hq, L, D], lse_d (backend layout), saved, native_gqa: the distant core, on the KV heads as they
    are where the backend takes GQA (``native_gqa``; also with one query head per KV head), else on K/V repeated to
    the query heads."""
    if q.shape[1] != k_anchor.shape[1] and _NATIVE_GQA.get(core.name, True):
        try:
            out_d, lse_d, saved = core.forward(*_core_views(q, k_anchor, v, sink, recent, False), scale)
            _NATIVE_GQA[core.name] = True
            return out_d, lse_d, saved, True
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            _NATIVE_GQA[core.name] = False
    repeat_kv = q.shape[1] != k_anchor.shape[1]
    out_d, lse_d, saved = core.forward(*_core_views(q, k_anchor, v, sink, recent, repeat_kv), scale)
    return out_d, lse_d, saved, not repeat_kv


def _merge_core_with_band(out_p, lse2_p, out_d, lse_d, seq_lens, start):
    """-> out [B, H, S, D], lse2 [B, H, S]: the band's ``out_p`` / ``lse2_p`` merged with the core's ``out_d``
    [B, H, L, D] / ``lse_d`` [B, H, L] on rows ``start + t`` (kernels/_pod_merge.py)."""
    batch, num_heads, seq_total, head_dim = out_p.shape
    out, lse2 = torch.empty_like(out_p), torch.empty_like(lse2_p)
    out_d = out_d if out_d.stride(-1) == 1 else out_d.contiguous()
    block_m = 64
    pod_merge_kernel[(triton.cdiv(seq_total, block_m), batch * num_heads)](
        out, lse2, out_p, lse2_p, out_d, lse_d, seq_lens,
        out.stride(0), out.stride(1), out.stride(2), lse2.stride(0), lse2.stride(1),
        out_d.stride(0), out_d.stride(1), out_d.stride(2), lse_d.stride(0), lse_d.stride(1), lse_d.stride(2),
        num_heads, seq_total, start,
        HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim), BLOCK_M=block_m,
    )
    return out, lse2


class PodSplitAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, q_distant, k_own, k_anchor, v, seq_lens, sink, recent, scale, core):
        seq_total = q.shape[2]
        # the band; padding rows already 0 with lse +inf, rows without a proximal key lse -inf
        out, lse2, _ = _pod_forward(q, k_own, k_anchor, v, seq_lens, sink, recent, scale, False, prox_only=True)
        start = sink + recent
        length = seq_total - start
        lse_d_raw, saved, kv_repeated = None, (), False
        if length > 0:
            out_d, lse_d_raw, saved, native_gqa = _core_forward(core, q_distant, k_anchor, v, sink, recent, scale)
            kv_repeated = not native_gqa
            out, lse2 = _merge_core_with_band(out, lse2, out_d, _rows(lse_d_raw, length), seq_lens, start)
        ctx.shared_queries = q_distant is q  # key sharing: the core's query gradient goes to dq itself
        ctx.save_for_backward(q, q_distant, k_own, k_anchor, v, seq_lens, out, lse2)
        ctx.core_state = (core, lse_d_raw, saved, kv_repeated, length)
        ctx.pod_args = (sink, recent, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, q_distant, k_own, k_anchor, v, seq_lens, out, lse2 = ctx.saved_tensors
        core, lse_d_raw, saved, kv_repeated, length = ctx.core_state
        sink, recent, scale = ctx.pod_args
        dout = dout.contiguous()
        delta = pod_delta(out, dout, lse2)
        dq, dk_own, _, dv = _pod_backward(dout, q, k_own, k_anchor, v, seq_lens, out, lse2, sink, recent, scale,
                                          prox_only=True, delta=delta)
        dk_anchor = torch.zeros_like(k_anchor)
        # score sharing: the distant pairs' query gradient belongs to the anchor layer's queries
        dq_distant = None if ctx.shared_queries else torch.zeros_like(q_distant)
        if length > 0:
            start = sink + recent
            seq_total = q.shape[2]
            batch, num_kv_heads = k_anchor.shape[:2]
            group = q.shape[1] // num_kv_heads
            q_core, k_core, v_core = _core_views(q_distant, k_anchor, v, sink, recent, kv_repeated)
            lse_core = lse_d_raw.clone()  # the backend's layout (strides, padding), the merged values
            _rows(lse_core, length).copy_(lse2[:, :, start:] * (1.0 / LOG2_E))
            dq_d, dk_d, dv_d = core.backward(dout[:, :, start:], q_core, k_core, v_core, out[:, :, start:], lse_core,
                                             saved, scale)
            if dq_distant is None:
                dq[:, :, start:] += dq_d
            else:
                dq_distant[:, :, start:] = dq_d
            if kv_repeated:
                fold = (batch, num_kv_heads, group, length, -1)
                dk_d = dk_d.reshape(fold).sum(2, dtype=torch.float32)
                dv_d = dv_d.reshape(fold).sum(2, dtype=torch.float32)
            dk_anchor[:, :, sink:seq_total - recent] = dk_d
            dv[:, :, sink:seq_total - recent] += dv_d
        return dq, dq_distant, dk_own, dk_anchor, dv, None, None, None, None, None


def pod_split_attention(q, k_own, k_anchor, v, seq_lens, *, sink: int, recent: int, scale: float,
                        q_distant=None):
    """POD attention = torch's fused causal core + the Triton proximal band (module docstring), differentiable.

    Inputs as ``pod_prefill_attention_triton`` (already checked there). ``q_distant`` [B, Hq, S, D]: the queries of
    the distant pairs, ``q`` itself by default (key sharing, paper v2); the anchor layer's queries give v1's score
    sharing (METHODS.md A.3: distant logits ``q_a . k_a``), since the core is then the anchor's own distant
    attention applied to this layer's values. Returns None, having computed nothing, when no fused backend takes
    the core on this device (the caller then runs the single-pass kernels or the reference)."""
    seq_total = q.shape[2]
    q_distant = q if q_distant is None else q_distant
    core = None
    if seq_total - sink - recent > 0:
        core = causal_core_for(q_distant[:, :, sink + recent:], k_anchor[:, :, sink:seq_total - recent],
                               v[:, :, sink:seq_total - recent], scale)
        if core is None:
            return None
    return PodSplitAttentionFunction.apply(q, q_distant, k_own, k_anchor, v, seq_lens, sink, recent, scale, core)
