"""kernels/fp8_kv.py: the FP8 KV storage format's round trip, its checks and its byte count; the prefill's Triton
quantiser (kernels/triton_fp8_quantize.py) against it under the interpreter, and the public ops."""

import os

import pytest
import torch

from kernels import fp8_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bound(dtype):
    """E4M3 keeps 3 mantissa bits: relative error <= 2^-4 (half an ulp) where x / scale is normal (>= 2^-6),
    absolute error <= 2^-10 * scale (half the subnormal step 2^-9) below; the row's amax comes back exactly."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, 37, 64, generator=gen) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    x[0, 0, 5] = 0.0  # an all-zero token: no NaN, scale = the floor
    data, scale = fp8_kv.quantize_kv(x)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    back = fp8_kv.dequantize_kv(data, scale)
    xf = x.float()
    assert torch.isfinite(back).all() and (back[0, 0, 5] == 0).all() and scale[0, 0, 5] == fp8_kv.SCALE_FLOOR
    err = (back - xf).abs()
    normal = (xf / scale[..., None]).abs() >= 2 ** -6
    assert (err[normal] <= 2 ** -4 * xf.abs()[normal] * (1 + 1e-6)).all()
    assert (err[~normal] <= 2 ** -10 * scale[..., None].expand_as(xf)[~normal] * (1 + 1e-6)).all()
    amax_at = xf.abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.gather(-1, amax_at), xf.gather(-1, amax_at), rtol=1e-6, atol=0)
    assert data.float().abs().amax() <= fp8_kv.FP8_MAX


def test_dequantize_dtype_and_shape_checks():
    data, scale = fp8_kv.quantize_kv(torch.randn(2, 2, 5, 8))
    assert fp8_kv.dequantize_kv(data, scale, torch.bfloat16).dtype == torch.bfloat16
    assert fp8_kv.dequantize_kv(data, scale, torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match=r"scale shape \(2, 2, 4\) must be \(2, 2, 5\)"):
        fp8_kv.dequantize_kv(data, scale[..., :4])
    with pytest.raises(TypeError, match="scale must be a float32 tensor"):
        fp8_kv.dequantize_kv(data, scale.bfloat16())
    with pytest.raises(ValueError, match="scale is None"):
        fp8_kv.check_scale("k_scale", None, "k_cache", data)
    with pytest.raises(ValueError, match="k_scale is given but k_cache has dtype"):
        fp8_kv.check_scale("k_scale", scale, "k_cache", data.float())
    with pytest.raises(TypeError, match="quantize_kv"):
        fp8_kv.quantize_kv(data)


def test_bytes_per_token_and_names():
    assert fp8_kv.bytes_per_token(128, "fp8_e4m3") == 264  # 2 x (128 fp8 bytes + a 4-byte fp32 scale)
    assert fp8_kv.bytes_per_token(128, "bfloat16") == 512
    assert fp8_kv.kv_storage_dtype("fp8_e4m3") == torch.float8_e4m3fn
    assert fp8_kv.kv_storage_dtype("bfloat16", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        fp8_kv.kv_storage_dtype("fp8")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases run the Triton interpreter")
@pytest.mark.parametrize("shape", [(2, 3, 37, 64), (1, 2, 5, 80), (19, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_quantize_matches_reference(shape, dtype):
    """The prefill's one-pass quantiser writes the reference's bytes and scales (zero rows included)."""
    from kernels.triton_fp8_quantize import quantize_kv_triton

    x = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 30).to(dtype)
    x[..., 1, :] = 0.0
    data, scale = quantize_kv_triton(x)
    ref_data, ref_scale = fp8_kv.quantize_kv(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape and scale.shape == x.shape[:-1]
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(scale, ref_scale)
    strided = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # last stride not 1: copied first
    assert torch.equal(quantize_kv_triton(strided)[0].view(torch.uint8), ref_data.view(torch.uint8))


def test_public_ops_dispatch_to_the_reference_on_cpu():
    import kernels

    x = torch.randn(2, 2, 7, 16)
    data, scale = kernels.quantize_kv(x)
    assert torch.equal(kernels.dequantize_kv(data, scale), fp8_kv.dequantize_kv(*fp8_kv.quantize_kv(x)))
