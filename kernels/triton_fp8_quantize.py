"""Quantise keys or values to the FP8 KV cache format in one pass (Triton): what the prefill writes.

``quantize_kv_triton(x) -> (data, scale)``: x [..., N, D] fp16 / bf16 / fp32 with a unit last stride ->
data [..., N, D] float8_e4m3fn and scale [..., N] fp32, the bytes and scales of ``kernels.fp8_kv.quantize_kv`` (the
spec it is tested against; format and layout: kernels/fp8_kv.py). One program per BLOCK_R rows (a row is one token
of one KV head) reads each row once and writes its bytes and scale, where the torch reference runs an amax, a
division, a clamp and a cast as separate passes over the prompt's K/V. The rounding is kernels/_fp8_device.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _fp8_device as F8
from .fp8_kv import FP8_DTYPE, SCALE_DTYPE

_BLOCK_R = 16


@triton.jit
def _quantize_kv_kernel(X, Data, Scale, rows, stride_xr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    """Program r0: rows [r0 * BLOCK_R, r0 * BLOCK_R + BLOCK_R) of X [rows, D] -> Data (uint8 view) and Scale."""
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r < rows)[:, None] & (offs_d < D)[None, :]
    x = tl.load(X + offs_r[:, None] * stride_xr + offs_d[None, :], mask=mask, other=0.0)
    bits, scale = F8.quantize_rows(x, mask)
    tl.store(Data + offs_r[:, None] * D + offs_d[None, :], bits, mask=mask)
    tl.store(Scale + offs_r, scale, mask=offs_r < rows)


def quantize_kv_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N, D] (fp16 / bf16 / fp32) -> (data [..., N, D] float8_e4m3fn, scale [..., N] fp32); see the module
    docstring. Both outputs are new contiguous tensors."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32) \
            or x.dim() < 2:
        raise TypeError(f"quantize_kv: x must be a float16 / bfloat16 / float32 tensor [..., N, D], got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    D = x.shape[-1]
    flat = x.reshape(-1, D)  # a view for the usual [B, Hkv, N, D] slices; a copy only for odd strides
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    data = torch.empty(x.shape, device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty(x.shape[:-1], device=x.device, dtype=SCALE_DTYPE)
    if rows:
        _quantize_kv_kernel[(triton.cdiv(rows, _BLOCK_R),)](
            flat, data.view(torch.uint8), scale, rows, flat.stride(0),
            D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_R=_BLOCK_R, num_warps=4)
    return data, scale
