"""Append one decode token's keys and values to a static KV cache in one launch (Triton).

Why a kernel: the engine's decode step wrote keys and values with two advanced-indexing assignments per layer
(``buffer[b, :, positions[b]] = x``). On an H200 each is a generic ``index_put`` launch of about 3.8 µs for a few
KB (64 of them per Llama-3-8B step, 0.25 ms of a 6.6 ms step: BENCHMARKS.md, "Where the dense decode step's
time goes"). One program per (sequence, KV head) stores the head's D key and D value elements at its slot.

``append_kv_triton(key_buffer, value_buffer, k, v, positions)``:
    key_buffer, value_buffer: [Bmax, Hkv, N, D] (any strides with a unit last stride, e.g. a view of POD's
        key pool); k, v: [B, Hkv, D] with B <= Bmax; positions: [B] slot of each sequence's token.
Same contract as ``kernels.reference.append_kv`` (the spec it is tested against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._value_checks import check_append_inputs


@triton.jit
def _append_kv_kernel(K, V, POS, KBUF, VBUF,
                      stride_kb, stride_kh, stride_vb, stride_vh,
                      stride_kbb, stride_kbh, stride_kbn, stride_vbb, stride_vbh, stride_vbn,
                      num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // num_heads).to(tl.int64)
    h = (pid % num_heads).to(tl.int64)
    slot = tl.load(POS + b).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < HEAD_DIM
    key = tl.load(K + b * stride_kb + h * stride_kh + offs, mask=ok)
    value = tl.load(V + b * stride_vb + h * stride_vh + offs, mask=ok)
    tl.store(KBUF + b * stride_kbb + h * stride_kbh + slot * stride_kbn + offs, key.to(KBUF.dtype.element_ty), mask=ok)
    tl.store(VBUF + b * stride_vbb + h * stride_vbh + slot * stride_vbn + offs, value.to(VBUF.dtype.element_ty),
             mask=ok)


def append_kv_triton(key_buffer: torch.Tensor, value_buffer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor) -> None:
    check_append_inputs(key_buffer, value_buffer, k, v, positions)
    batch, heads, dim = k.shape
    if batch == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    for name, t in (("key_buffer", key_buffer), ("value_buffer", value_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride (got strides {t.stride()})")
    _append_kv_kernel[(batch * heads,)](
        k, v, positions, key_buffer, value_buffer,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_buffer.stride(0), key_buffer.stride(1), key_buffer.stride(2),
        value_buffer.stride(0), value_buffer.stride(1), value_buffer.stride(2),
        heads, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim))
