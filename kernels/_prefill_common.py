"""Shared helpers for the prefill/training-side Triton kernels.

Input checks (raised before any launch, naming the argument, the value and what is allowed),
interpreter detection (``TRITON_INTERPRET=1`` runs kernels on CPU with small single configs) and
the dtype-dependent ``tl.dot`` precision choice.
"""

from __future__ import annotations

import math
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2_E = 1.4426950408889634


from ._interpreter import interpreting as interpreter_active  # noqa: E402,F401  (also installs the interpreter patch)
from ._value_checks import value_checks_enabled  # noqa: E402


def forward_tile_candidates():
    """``(base, sm_90)`` autotune candidate lists of the FlashAttention-style forward kernels (dense, sparse and
    POD prefill): query tile BLOCK_M x key tile BLOCK_N (tests run every one of them on the GPU)."""
    import triton

    base = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=4),
    ]
    hopper = [
        # sm_90: deeper software pipelines to keep the wgmma units fed (Triton's fused-attention tutorial
        # autotunes BLOCK_M 64/128 x BLOCK_N 32/64/128 with 2-4 stages); 228 KB of shared memory per SM
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=4),
        # four warpgroups over 256 query rows share each K/V tile: the fastest dense tile at 32K on an H200
        # (BENCHMARKS.md, "Dense prefill at the tutorial's arithmetic"; benchmarks/h200_2026-12-02/prefill_variants)
        triton.Config({"BLOCK_M": 256, "BLOCK_N": 64}, num_warps=16, num_stages=3),
    ]
    return base, hopper


def forward_tile_configs(*, hopper_opt_in_env: str | None = None):
    """Autotune candidates of the forward kernels (:func:`forward_tile_candidates`); one small tile under the
    interpreter; ``hopper_opt_in_env`` as in :func:`pick_configs`."""
    import triton

    base, hopper = forward_tile_candidates()
    return pick_configs(base, triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1),
                        hopper_configs=hopper, hopper_opt_in_env=hopper_opt_in_env)


# The POD training kernels' sm_90 candidates are opt-in: with them the autotuner's picks made the 1B-shape POD
# training step slower on an H200, although they won the autotuner's own timing (BENCHMARKS.md, "Dense prefill at
# the tutorial's arithmetic", the POD training step).
POD_HOPPER_CONFIGS_ENV = "PODKIT_POD_HOPPER_CONFIGS"


def is_hopper_or_newer() -> bool:
    """Whether the current CUDA device is sm_90 or newer (False without CUDA, and under the interpreter).
    ``PODKIT_HOPPER_CONFIGS=0`` says False (A/B runs of the extra autotune candidates)."""
    if interpreter_active() or os.environ.get("PODKIT_HOPPER_CONFIGS", "1") == "0" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def pick_configs(gpu_configs, interpreter_config, hopper_configs=(), *, hopper_opt_in_env: str | None = None):
    """Autotune candidates: one small config under the interpreter (it cannot benchmark), only
    the first (default) GPU config when ``PODKIT_TRITON_AUTOTUNE=0`` (fast compiles in tests),
    else all of them, plus ``hopper_configs`` on sm_90+ (:func:`is_hopper_or_newer`), for a family with a
    ``hopper_opt_in_env`` only when that variable is "1". The autotuner
    times every candidate at the first call of each key and keeps the fastest, so extra candidates
    cost compile time only, never correctness; one that does not fit the GPU is skipped."""
    if interpreter_active():
        return [interpreter_config]
    if os.environ.get("PODKIT_TRITON_AUTOTUNE", "1") == "0":
        return gpu_configs[:1]
    opted_in = hopper_opt_in_env is None or os.environ.get(hopper_opt_in_env, "0") == "1"
    return list(gpu_configs) + (list(hopper_configs) if opted_in and is_hopper_or_newer() else [])


def float32_first_candidate(configs, named_args, **kwargs):
    """``early_config_prune`` of every autotuned podkit kernel (``prune_configs_by=FLOAT32_FIRST_CANDIDATE``):
    with float32 inputs only the first candidate is compiled, with bf16 / fp16 every candidate.

    float32 is the compatibility path (the embedded default loads as stored, in float32), where ``tl.dot`` runs in
    exact IEEE math (:func:`dot_precision`); generating that dot's PTX for every tile candidate held the first
    ``generate()`` call for minutes on an H100, while the first candidate alone compiles in seconds (BENCHMARKS.md,
    "generate() against the engine"; ``benchmarks/plans/gve_fp32_probe.py``). The dtype is the first floating
    tensor argument's; Triton's autotuner keys its cache on argument dtypes, so a bf16 call still tunes fully."""
    for value in named_args.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return list(configs[:1]) if value.dtype == torch.float32 else list(configs)
    return list(configs)


FLOAT32_FIRST_CANDIDATE = {"early_config_prune": float32_first_candidate}


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 inputs use exact IEEE math (tf32 would lose ~3 digits);
    fp16/bf16 inputs use the tensor cores' native precision with fp32 accumulation."""
    return "ieee" if dtype == torch.float32 else "tf32"


def head_dim_block(head_dim: int) -> int:
    """Power-of-two register tile for the head dimension (masked when ``D`` is not a power of 2)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def resolve_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale} must be a finite positive number (default D ** -0.5)")
    return scale


def check_float_tensor(name: str, tensor, ndim: int, *, dtype=None, device=None) -> None:
    """Tensor type, rank, dtype (fp16/bf16/fp32, or equal to ``dtype``) and device checks."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}.dtype={tensor.dtype} is not supported; allowed: float16, bfloat16, float32")
    if dtype is not None and tensor.dtype != dtype:
        raise TypeError(f"{name}.dtype={tensor.dtype} must equal q.dtype={dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but q is on {device}; all inputs must share a device")
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head) dimension, got strides {tensor.stride()}")


def check_int_vector(name: str, tensor, batch: int, device, *, low: int, high: int | None) -> torch.Tensor:
    """Per-sequence integer vector ``[B]`` with values in ``[low, high]``; returned as int32.

    The range check reads the values (one device sync); it runs before any kernel launch, and is left out
    under ``PODKIT_SKIP_VALUE_CHECKS=1`` (timed benchmarks) and during CUDA-graph capture, as the decode
    kernels' checks are (kernels/_value_checks.py).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [{batch}], got {type(tensor).__name__}")
    if tensor.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}.dtype={tensor.dtype} must be int32 or int64")
    if tuple(tensor.shape) != (batch,):
        raise ValueError(f"{name} must have shape [{batch}] (one entry per sequence), got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but q is on {device}; all inputs must share a device")
    if batch > 0 and value_checks_enabled(tensor):
        lo, hi = int(tensor.min()), int(tensor.max())
        if lo < low or (high is not None and hi > high):
            allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"{name} has values in [{lo}, {hi}]; allowed range is {allowed}")
    return tensor.to(torch.int32).contiguous()


def check_gqa(num_q_heads: int, num_kv_heads: int, kv_name: str = "k") -> int:
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has {num_q_heads} heads and {kv_name} has {num_kv_heads}: the query head count must be a "
            f"positive multiple of the KV head count (GQA group size G = Hq // Hkv)"
        )
    return num_q_heads // num_kv_heads
