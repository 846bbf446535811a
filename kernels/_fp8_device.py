"""Triton device helpers of the FP8 KV cache (format: kernels/fp8_kv.py): quantise token rows, load a tile.

``e4m3_bits`` rounds fp32 to E4M3 in integer arithmetic, after c10's ``fp8e4m3fn_from_fp32_value``
(pytorch c10/util/Float8_e4m3fn.h), so the bytes equal torch's cast under the interpreter (whose own
fp32 -> tl.float8e4nv cast rounds ties away and flushes subnormals) and compiled alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
SCALE_FLOOR = tl.constexpr(2.0 ** -64)  # = kernels.fp8_kv.SCALE_FLOOR


@triton.jit
def e4m3_bits(x):
    """x: fp32, finite, |x| <= 448 -> int32 E4M3 bit patterns in [0, 255], round to nearest even."""
    xi = x.to(tl.int32, bitcast=True)
    a = xi & 0x7FFFFFFF
    # |x| < 2^-6 (exponent field < 121): subnormal. Adding 2^14 (bits 141 << 23), whose fp32 ulp is 2^-9 = the
    # E4M3 subnormal step, rounds to nearest even in the fp32 adder; the low bits are then the mantissa (8 = the
    # smallest normal, which is also its right encoding).
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    # normal: rebias the exponent (127 -> 7) and round the 20 dropped mantissa bits to nearest even
    norm = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    bits = tl.where(a < (121 << 23), sub, norm)
    return tl.where(xi < 0, bits | 0x80, bits)


@triton.jit
def quantize_rows(x, mask):
    """x: [R, BLOCK_D] tokens' keys or values of one KV head each (any float dtype), mask: valid elements.
    Returns (uint8 E4M3 bytes [R, BLOCK_D], fp32 scales [R]): scale = max(amax / 448, floor), bytes = RTNE(x / scale),
    as kernels/fp8_kv.quantize_kv (IEEE divisions, then the clamp its cast needs)."""
    xf = tl.where(mask, x.to(tl.float32), 0.0)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(xf), axis=1), FP8_MAX), SCALE_FLOOR)
    y = tl.minimum(tl.maximum(tl.math.div_rn(xf, scale[:, None]), -FP8_MAX), FP8_MAX)
    return e4m3_bits(y).to(tl.uint8), scale


@triton.jit
def quantize_row(x, mask):
    """``quantize_rows`` of one token: x, mask [BLOCK_D] -> (uint8 bytes [BLOCK_D], fp32 scale)."""
    bits, scale = quantize_rows(x[None, :], mask[None, :])
    return tl.reshape(bits, [x.shape[0]]), tl.sum(scale, axis=0)


@triton.jit
def load_kv_tile(ptrs, mask, scale_ptrs, row_mask, dtype: tl.constexpr, FP8: tl.constexpr, HOP: tl.constexpr = True,
                 REMASK: tl.constexpr = False):
    """A [BLOCK_N, BLOCK_D] tile of keys or values in ``dtype`` and its per-row fp32 scales [BLOCK_N] (FP8), or
    the tile as stored and ``row_mask`` in place of scales, unused (bf16 / fp16 / fp32 caches: no extra load or op).
    E4M3 -> fp16 / bf16 / fp32 is exact, so the caller applies the scales in fp32 (to the logits, and through
    ``online_softmax_update``'s ``v_scale``). One return: the compiler types every return of a function alike.
    HOP (the default, what every kernel used first) converts through fp32; HOP=False converts straight to
    ``dtype``: on sm_90 Triton 3.6 lowers e4m3 -> fp16 to one ``cvt.rn.f16x2.e4m3x2`` per element pair and
    e4m3 -> bf16 to that plus ``cvt.bf16.f16`` per element, where the fp32 hop adds ``cvt.f32.f16`` and
    ``cvt.rn.bf16.f32`` per element (PTX read from tests/kernels/sm90_compile.py-style compiles). Same values.
    REMASK re-applies ``mask`` after the conversion (a no-op on the values: masked elements are 0 already). It
    changes the compiled code: without it Triton 3.6 moves the layout change to the MMA operand above the
    conversion, onto the 8-bit tile, and a tile that the dot reads transposed (the values of p @ v) then goes
    through shared memory one byte per ``ld.shared.b8`` (sm_90's ldmatrix transposes 16-bit elements only); the
    ``tl.where`` keeps the conversion in the load's layout, so the 16-bit tile takes ``ldmatrix.trans``."""
    t = tl.load(ptrs, mask=mask, other=0.0)
    if FP8:
        if HOP:
            t = t.to(tl.float32).to(dtype)
        else:
            t = t.to(dtype)
        if REMASK:
            t = tl.where(mask, t, 0.0)
        scale = tl.load(scale_ptrs, mask=row_mask, other=0.0)
    else:
        scale = row_mask
    return t, scale


@triton.jit
def recent_key_rows(k, k_sc, kr_base, pos, stride_krn, offs_d, d_mask, row_mask, seq_len, RECENT: tl.constexpr):
    """Recent keys (kernels/fp8_kv.py): rows of a key tile ``k`` [BLOCK_N, BLOCK_D] (converted, with fp32 scales
    ``k_sc`` [BLOCK_N]) whose position ``pos`` [BLOCK_N] lies in [seq_len - RECENT, seq_len) take the key kept in
    the model's dtype at ring slot pos % RECENT (``kr_base`` + slot * stride_krn) and scale 1. Other rows are
    unchanged; the ring load is masked to the recent rows."""
    recent = row_mask & (pos >= seq_len - RECENT) & (pos < seq_len)
    slot = tl.where(recent, pos % RECENT, 0)
    kr = tl.load(kr_base + slot[:, None] * stride_krn + offs_d[None, :], mask=recent[:, None] & d_mask[None, :],
                 other=0.0)
    k = tl.where(recent[:, None], kr.to(k.dtype), k)
    k_sc = tl.where(recent, 1.0, k_sc)
    return k, k_sc
