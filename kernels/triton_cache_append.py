"""Append one decode token's keys and values to a static KV cache in one launch (Triton).

Why a kernel: the engine's decode step wrote keys and values with two advanced-indexing assignments per layer
(``buffer[b, :, positions[b]] = x``), and in POD's layout one more per layer into the ring of proximal keys plus the
slot arithmetic (``sink + pos % recent``) as separate torch launches. On an H200 each is a generic ``index_put``
launch for a few KB, 64 of them per Llama-3-8B step (BENCHMARKS.md, "Where the dense decode step's time
goes"). One program per (sequence, KV head) stores the head's D key and D
value elements at its slot, and the key at its ring slot too when the layer keeps a ring.

``append_kv_triton(key_buffer, value_buffer, k, v, positions, *, key_heads=None, ring=None, sink=0, recent=1)``:
    key_buffer: [Bmax, U, N, D]; value_buffer: [Bmax, Hkv, N, D] (any strides with a unit last stride, e.g. POD's
        key pool); k, v: [B, Hkv, D] with B <= Bmax; positions: [B] slot of each sequence's token.
    key_heads: None (U == Hkv, head h's keys in row h) or int [Hkv]: head h's row in key_buffer, -1 for a head
        that keeps no full keys (a POD non-anchor head: its distant keys are its anchor layer's).
    ring: None or [Bmax, Hkv, sink + recent, D]: POD's proximal keys; position p goes to slot p if p < sink, else
        sink + p % recent (``StaticCache.ring_slots``).
    key_scale, value_scale, ring_scale: FP8 caches only (every buffer float8_e4m3fn, kernels/fp8_kv.py): fp32
        [Bmax, U, N], [Bmax, Hkv, N], [Bmax, Hkv, sink + recent]. The program quantises the token's key and value
        in registers (one scale per token and KV head, ``kernels/_fp8_device.quantize_row``) and writes the same
        bytes and scale as ``kernels.fp8_kv.quantize_kv``; the key is quantised once for its row and its ring slot.
Same contract as ``kernels.reference.append_kv`` (the spec it is tested against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _fp8_device as F8
from ._value_checks import check_append_inputs, check_append_scales


@triton.jit
def _append_kv_kernel(K, V, POS, KBUF, VBUF, KEY_HEADS, RING, KSC, VSC, RSC,
                      stride_kb, stride_kh, stride_vb, stride_vh,
                      stride_kbb, stride_kbh, stride_kbn, stride_vbb, stride_vbh, stride_vbn,
                      stride_rb, stride_rh, stride_rn,
                      stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsn,
                      stride_rsb, stride_rsh, stride_rsn,
                      num_heads, sink, recent,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAPPED: tl.constexpr, HAS_RING: tl.constexpr,
                      FP8: tl.constexpr = False):
    """Program (b * Hkv + h). FP8: the buffers are uint8 views of float8_e4m3fn caches and K/V/RSC their scales."""
    pid = tl.program_id(0)
    b = (pid // num_heads).to(tl.int64)
    h = (pid % num_heads).to(tl.int64)
    slot = tl.load(POS + b).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < HEAD_DIM
    key = tl.load(K + b * stride_kb + h * stride_kh + offs, mask=ok)
    value = tl.load(V + b * stride_vb + h * stride_vh + offs, mask=ok)
    if FP8:
        key, key_scale = F8.quantize_row(key, ok)
        value, value_scale = F8.quantize_row(value, ok)
        tl.store(VSC + b * stride_vsb + h * stride_vsh + slot * stride_vsn, value_scale)
    tl.store(VBUF + b * stride_vbb + h * stride_vbh + slot * stride_vbn + offs, value.to(VBUF.dtype.element_ty),
             mask=ok)
    row = h
    has_row = True
    if MAPPED:
        row = tl.load(KEY_HEADS + h).to(tl.int64)  # -1: this head keeps no full keys
        has_row = row >= 0
        row = tl.maximum(row, 0)
    tl.store(KBUF + b * stride_kbb + row * stride_kbh + slot * stride_kbn + offs, key.to(KBUF.dtype.element_ty),
             mask=ok & has_row)
    if FP8:
        tl.store(KSC + b * stride_ksb + row * stride_ksh + slot * stride_ksn, key_scale, mask=has_row)
    if HAS_RING:
        ring_slot = tl.where(slot < sink, slot, sink + slot % recent)
        tl.store(RING + b * stride_rb + h * stride_rh + ring_slot * stride_rn + offs, key.to(RING.dtype.element_ty),
                 mask=ok)
        if FP8:
            tl.store(RSC + b * stride_rsb + h * stride_rsh + ring_slot * stride_rsn, key_scale)


def append_kv_triton(key_buffer: torch.Tensor, value_buffer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor, *, key_heads: torch.Tensor | None = None,
                     ring: torch.Tensor | None = None, sink: int = 0, recent: int = 1,
                     key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None,
                     ring_scale: torch.Tensor | None = None) -> None:
    check_append_inputs(key_buffer, value_buffer, k, v, positions, key_heads=key_heads, ring=ring, sink=sink,
                        recent=recent)
    fp8 = check_append_scales(key_buffer, value_buffer, ring, key_scale, value_scale, ring_scale)
    batch, heads, dim = k.shape
    if batch == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    for name, t in (("key_buffer", key_buffer), ("value_buffer", value_buffer), ("ring", ring)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride (got strides {t.stride()})")
    if fp8:  # the kernel writes rounded bytes (kernels/_fp8_device.py) through uint8 views
        key_buffer, value_buffer = key_buffer.view(torch.uint8), value_buffer.view(torch.uint8)
        ring = ring.view(torch.uint8) if ring is not None else None
    ring_strides = (ring.stride(0), ring.stride(1), ring.stride(2)) if ring is not None else (0, 0, 0)
    scales = (key_scale, value_scale, ring_scale) if fp8 else (None, None, None)
    scale_strides = [x for t in scales for x in (t.stride()[:3] if t is not None else (0, 0, 0))]
    _append_kv_kernel[(batch * heads,)](
        k, v, positions, key_buffer, value_buffer,
        key_heads if key_heads is not None else positions, ring if ring is not None else value_buffer,
        *(t if t is not None else positions for t in scales),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_buffer.stride(0), key_buffer.stride(1), key_buffer.stride(2),
        value_buffer.stride(0), value_buffer.stride(1), value_buffer.stride(2),
        *ring_strides, *scale_strides,
        heads, sink, recent,
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), MAPPED=key_heads is not None, HAS_RING=ring is not None,
        FP8=fp8)
