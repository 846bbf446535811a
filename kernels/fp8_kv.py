"""FP8 KV cache storage: the format, its quantise / dequantise reference and the argument checks.

``kv_cache_dtype`` (vLLM's and transformers' naming): ``"bfloat16"`` (default: keys and values in the model's
dtype) or ``"fp8_e4m3"``. The FP8 format is OCP E4M3 ("FP8 Formats for Deep Learning", Micikevicius et al.,
arXiv 2209.05433, section 3: 4 exponent bits, 3 mantissa bits, no infinities, max 448, smallest normal 2^-6,
subnormals down to 2^-9), as torch.float8_e4m3fn / Triton's tl.float8e4nv. vLLM's FP8 KV cache
(docs.vllm.ai, "Quantized KV Cache") stores the same element type with one scale per tensor or per head; podkit
keeps one scale per (token, KV head), which the decode append can compute from the token alone.

Layout (what the caches allocate for every tensor of keys or values that the scheme keeps):

    data   [B, Hkv, N, D]  torch.float8_e4m3fn   x / scale, rounded to nearest even, saturated to +-448
    scale  [B, Hkv, N]     torch.float32         max(amax_d |x[..., n, d]| / 448, SCALE_FLOOR)

so that ``x ~= data.float() * scale[..., None]``. One scale per token and KV head: the decode append computes it
from the token alone (no earlier token is re-quantised), and tokens differ in magnitude (attention sinks carry larger
keys and values), so one token's outliers cost no other token precision. Keys also have outlier channels (KIVI,
arXiv 2402.02750, quantises keys per channel for 2-bit integers); E4M3 keeps its 3 mantissa bits on channels down
to 2^-6 / 448 (about 2^-14.8) of the token's amax, subnormals below, so a per-token scale suffices. Per-block
scales (one per 16 tokens) would save 15 of every 16 scales, under 3% of an FP8 cache at D = 128, but on the
post-RoPE keys and values of SmolLM2-135M (the embedded model, sparse_models/smollm2.py; every layer, 2K tokens of
prose; 2026-12-03, figures in the commit that added this sentence) both a per-block and a per-head scale gave
larger attention-output errors than the per-token scale, in the mean over layers and in the worst layer; decode
perplexity against a bf16 cache ranks them the same way (BENCHMARKS.md "FP8 scale layouts against a bf16 cache"),
and finds the keys, not the values, behind FP8's cost.

Why the scale is fp32, not bf16: bytes per token and KV head, keys + values, are ``2 * (D + 4)`` with fp32 scales,
``2 * (D + 2)`` with bf16 ones, against ``4 * D`` in bf16: at D = 128, 264 vs 260 vs 512 bytes (1.94x vs 1.97x).
The 1.5% is not worth a scale that rounds: a bf16 scale rounded below amax / 448 would push the block's largest
element past 448 (saturated) and one rounded above wastes up to 2^-8 of the range; an fp32 scale divides exactly as
the reference does, keeps the scale loads 4-byte aligned and is what vLLM's fp8 KV scales are (fp32).

What else follows the rule, and what stays in the model's dtype (bf16):
- POD (arXiv 2412.02252): an anchor layer's keys are that layer's K cache, so they are FP8 with per-token scales
  like any K cache; the ring of proximal keys (``k_local [B, Hkv, sink + recent, D]``) is FP8 with its own scale
  ``[B, Hkv, sink + recent]`` per slot, written by the same append (a ring slot is one token's key). Values are the
  layer's own V cache: FP8.
- Quest (arXiv 2406.10774): page max / min stay in bf16 (the model's dtype, as with a bf16 cache), computed in
  fp32 from the *dequantised* keys (``kernels.reference.quest_page_minmax(k, seq_lens, page_size, k_scale=scale)``)
  and cast with ``round_outward`` (max up, min down: a dequantised key is an fp32 product that bf16 may not hold).
  The page score is an upper bound of q.k over the page only if max >= every key and min <= every key, channel by
  channel; FP8 min / max would need the same outward rounding on a far coarser grid plus a scale per page, for
  metadata that is 2 / page_size of a bf16 K cache. So the bound holds for the keys attention actually reads, and
  ``quest_page_scores`` is unchanged.
- Everything per query (q, gate estimates, TidalDecode's indices, scores, partial outputs) is unchanged.

Recent keys (``kv_cache_recent_keys`` = W, default 0): the cache also keeps every layer's own keys of the newest W
positions in the model's dtype, a ring ``[B, Hkv, W, D]`` at slot ``position % W`` (``sparse_models/ring.py``
without a sink), and attention reads those positions' keys from it instead of their FP8 copy; values stay FP8 (KIVI,
arXiv 2402.02750, keeps a full-precision residual of the newest tokens for the same reason). Why keys and why the
newest: on the embedded model FP8 values cost nothing measurable and FP8 keys all of FP8's decode perplexity, and a
bf16 window of the newest positions removed most of it where a bf16 sink did not (BENCHMARKS.md "FP8 scale layouts
against a bf16 cache"): the newest keys take the largest attention weights, so their rounding moves the output
most. A position's FP8 copy is written at once, so when it leaves the window nothing is re-quantised. The memory is
fixed per sequence: W * D * itemsize bytes per layer and KV head (64 positions at D = 128 in bf16: 16 KiB), 0.19%
of the FP8 cache at 32K. Quest's page bounds cover both versions of a recent key (``schemes/quest.py``). Both caches
keep the ring (``sparse_models/cache.py``, whose readers overlay it; ``engine/static_cache.py``), and every decode
kernel takes it (``k_recent``; POD's ``k_local_recent`` for the layer's own keys and ``k_anchor_recent`` for the
anchor's): a tile row whose position is among the newest W loads its key from the ring and takes scale 1
(``kernels/_fp8_device.recent_key_rows``), the FP8 row is not used. Full decode runs that select only in the
tiles that reach the newest W positions; POD decode's distant loop runs it only when W exceeds the proximal window
(otherwise no distant position is among the newest W; a per-tile test there spilled registers past
tests/kernels/test_sm90_compile.py's limit), its proximal loop and the sparse kernels on every tile (a sparse
tile's rows are arbitrary positions). Default 0 (off): on a GPU the per-tile select cost more decode time than the
window's bytes suggest (BENCHMARKS.md "Recent keys' decode cost on an H100").

The decode kernels read FP8 K/V and their scales and dequantise in registers: an E4M3 value converts exactly
to fp16 / bf16 / fp32 (3 mantissa bits, exponents 2^-9 .. 2^8), so the kernels feed ``k8.to(q.dtype)`` to the same
dot as bf16 keys and apply the scales in fp32 on the products: logits ``(q . k8) * k_scale[n]`` and values
``(p * v_scale[n]) @ v8``; with bf16 keys nothing changes.

Rounding (what was verified where): torch's CPU cast float32 -> float8_e4m3fn is round-to-nearest-even with
subnormals (c10/util/Float8_e4m3fn.h). Triton 3.6's interpreter loads float8_e4m3fn tensors and converts them to
fp32 exactly, but its fp32 -> tl.float8e4nv cast is not round-to-nearest-even (ties round away, subnormals
flush: checked on CPU, 2026-12-03). The Triton writers, the decode append (kernels/triton_cache_append.py) and
the prefill's quantiser (kernels/triton_fp8_quantize.py, the CUDA side of the public op ``kernels.quantize_kv``),
therefore round in software (``kernels/_fp8_device.py``: c10's integer algorithm, the same bits in the interpreter
and compiled) and store uint8 bytes through a ``uint8`` view of the cache; the divisions are ``tl.math.div_rn``
(IEEE, as torch). The tests check byte equality with this module under the interpreter, and the FP8 variant of
each kernel path compiles for sm_90 without a GPU (tests/kernels/sm90_compile.py); their GPU runs: BENCHMARKS.md,
"GPU tests" and "FP8 KV cache".
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("bfloat16", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest scale: an all-zero token gets this instead of 0 (no 0 / 0). A token whose amax is below 448 * 2^-64
# (~2.4e-17) is quantised against the floor instead (error <= 2^-4 |x| + 2^-74); no K/V entry that small matters.
SCALE_FLOOR = 2.0 ** -64
SCALE_DTYPE = torch.float32

__all__ = ["KV_CACHE_DTYPES", "FP8_DTYPE", "FP8_MAX", "SCALE_FLOOR", "SCALE_DTYPE", "kv_storage_dtype",
           "bytes_per_token", "quantize_kv", "dequantize_kv", "is_fp8", "check_scale", "round_outward",
           "overlay_recent_keys", "check_recent_keys"]


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The element dtype of the K/V buffers for a ``kv_cache_dtype`` name: the model's dtype for "bfloat16"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FP8_DTYPE if kv_cache_dtype == "fp8_e4m3" else model_dtype


def bytes_per_token(head_dim: int, kv_cache_dtype: str, model_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one token takes per KV head, keys and values together: 2 * (D + 4) in FP8, 2 * D * itemsize else."""
    dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
    if dtype == FP8_DTYPE:
        return 2 * (head_dim + SCALE_DTYPE.itemsize)
    return 2 * head_dim * dtype.itemsize


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N, D] (fp16 / bf16 / fp32 keys or values) -> (data [..., N, D] float8_e4m3fn, scale [..., N] fp32).

    scale = max(amax_d |x| / 448, SCALE_FLOOR) per row, data = RTNE(clamp(x / scale, -448, 448)). The clamp is
    needed: torch's cast turns values past 448 into NaN, and x / scale can round a hair past 448."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == FP8_DTYPE or x.dim() < 2:
        raise TypeError(f"quantize_kv: x must be a float tensor [..., N, D], got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    xf = x.float()
    # Divide by a tensor on x's device, not by the Python number: CUDA torch turns "tensor / CPU scalar" into a
    # multiplication by the scalar's reciprocal (BinaryDivTrueKernel.cu), which rounds differently from the IEEE
    # division the Triton kernels do (kernels/_fp8_device.quantize_rows) and broke their byte equality on the H200.
    scale = (xf.abs().amax(-1) / torch.full((), FP8_MAX, device=xf.device)).clamp(min=SCALE_FLOOR)
    data = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return data, scale


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(data [..., N, D] float8_e4m3fn, scale [..., N]) -> data * scale in ``dtype`` (product in fp32, or fp64)."""
    check_scale("scale", scale, "data", data)
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    return (data.to(ct) * scale.to(ct)[..., None]).to(dtype)


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == FP8_DTYPE


def check_scale(name: str, scale, cache_name: str, cache: torch.Tensor) -> None:
    """A cache of FP8 needs ``scale`` fp32 [*cache.shape[:-1]] on its device; a cache of floats takes none."""
    if not is_fp8(cache):
        if scale is not None:
            raise ValueError(f"{name} is given but {cache_name} has dtype {cache.dtype}; scales go with "
                             f"float8_e4m3fn caches only")
        return
    want = tuple(cache.shape[:-1])
    if scale is None:
        raise ValueError(f"{cache_name} is float8_e4m3fn but {name} is None; pass its fp32 scales {list(want)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != SCALE_DTYPE:
        raise TypeError(f"{name} must be a float32 tensor {list(want)} (one scale per token and KV head), got "
                        f"{getattr(scale, 'dtype', type(scale).__name__)}")
    if tuple(scale.shape) != want:
        raise ValueError(f"{name} shape {tuple(scale.shape)} must be {want} ({cache_name}'s shape without D)")
    if scale.device != cache.device:
        raise ValueError(f"{name} is on {scale.device} but {cache_name} is on {cache.device}; they must match")


def check_recent_keys(k_recent, cache: torch.Tensor, cache_name: str = "k_cache") -> None:
    """``k_recent`` (recent keys, module docstring): None, or with an FP8 ``cache`` [B, Hkv, N, D] a float tensor
    [B, Hkv, W, D], W >= 1, on its device (the model's dtype: the keys attention reads for the newest W positions)."""
    if k_recent is None:
        return
    if not is_fp8(cache):
        raise ValueError(f"k_recent is given but {cache_name} has dtype {cache.dtype}; recent keys go with "
                         f"float8_e4m3fn caches only")
    if not isinstance(k_recent, torch.Tensor) or not k_recent.is_floating_point() or is_fp8(k_recent):
        raise TypeError(f"k_recent must be a float tensor [B, Hkv, W, D] in the model's dtype, got "
                        f"{getattr(k_recent, 'dtype', type(k_recent).__name__)}")
    b, h, _, d = cache.shape
    if k_recent.dim() != 4 or (k_recent.shape[0], k_recent.shape[1], k_recent.shape[3]) != (b, h, d) \
            or k_recent.shape[2] < 1:
        raise ValueError(f"k_recent shape {tuple(k_recent.shape)} must be [B={b}, Hkv={h}, W >= 1, D={d}]")
    if k_recent.device != cache.device:
        raise ValueError(f"k_recent is on {k_recent.device} but {cache_name} is on {cache.device}; they must match")


def round_outward(page_max: torch.Tensor, page_min: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """fp32 Quest page max / min [B, Hkv, P, D] -> ``dtype``, max rounded up and min rounded down, so that the cast
    bound still bounds every key of the page (+-inf of empty pages stay)."""
    mx, mn = page_max.to(dtype), page_min.to(dtype)
    mx = torch.where(mx.float() < page_max, torch.nextafter(mx, torch.full_like(mx, float("inf"))), mx)
    mn = torch.where(mn.float() > page_min, torch.nextafter(mn, torch.full_like(mn, float("-inf"))), mn)
    return mx, mn


def overlay_recent_keys(keys: torch.Tensor, k_recent: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Keys as attention reads them with recent keys (module docstring, "Recent keys"): ``keys`` [B, Hkv, N, D]
    (slot = position, dequantised) with every position p in [seq_lens[b] - W, seq_lens[b]) taken from the ring
    ``k_recent`` [B, Hkv, W, D] at slot p % W. Returns a new tensor in ``keys``' dtype."""
    n, window = keys.shape[2], k_recent.shape[2]
    pos = torch.arange(n, device=keys.device)
    lens = seq_lens.to(keys.device).long()[:, None]
    recent = (pos[None, :] >= lens - window) & (pos[None, :] < lens)  # [B, N]
    return torch.where(recent[:, None, :, None], k_recent[:, :, pos % window].to(keys.dtype), keys)
