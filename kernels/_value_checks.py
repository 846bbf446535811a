"""When the kernels' host-side value checks run (no Triton import: the reference ops use it too)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

SKIP_VALUE_CHECKS_ENV = "PODKIT_SKIP_VALUE_CHECKS"
DECODE_LINEAR_MAX_ROWS = 64  # decode_linear pads the batch to a power-of-two row tile held in registers


def value_checks_enabled(t: torch.Tensor) -> bool:
    """False under ``PODKIT_SKIP_VALUE_CHECKS=1`` (timed benchmarks) and during CUDA-graph capture: a value
    check reads the tensor on the host, which would sync inside a timed step or break a capture."""
    if os.environ.get(SKIP_VALUE_CHECKS_ENV, "0") == "1":
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


@contextlib.contextmanager
def value_checks_skipped(force: bool = False):
    """Set ``PODKIT_SKIP_VALUE_CHECKS=1`` for the block (a timed benchmark: no host syncs inside timed steps) and
    restore the caller's value afterwards, so that a benchmark run in-process (tests, notebooks) does not switch the
    checks off for everything that runs after it. force=False keeps a value the caller set (``=0`` times the checks
    too); force=True sets 1 regardless."""
    before = os.environ.get(SKIP_VALUE_CHECKS_ENV)
    if force or before is None:
        os.environ[SKIP_VALUE_CHECKS_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SKIP_VALUE_CHECKS_ENV, None)
        else:
            os.environ[SKIP_VALUE_CHECKS_ENV] = before


def skipping_value_checks(fn=None, *, force: bool = False):
    """Decorator form of ``value_checks_skipped`` for a benchmark's ``main``."""
    def wrap(f):
        @functools.wraps(f)
        def run(*args, **kwargs):
            with value_checks_skipped(force=force):
                return f(*args, **kwargs)
        return run
    return wrap(fn) if fn is not None else wrap


def check_append_inputs(key_buffer, value_buffer, k, v, positions, *, key_heads=None, ring=None, sink=0,
                        recent=1) -> None:
    """``append_kv``'s arguments: shapes, dtypes and (outside capture) slot values, each error naming the
    argument. value buffer [Bmax, Hkv, N, D]; key buffer the same, or [Bmax, U, N, D] with key_heads int [Hkv] in
    [-1, U); k, v [B <= Bmax, Hkv, D]; positions int [B] in [0, N); ring None or [Bmax, Hkv, sink + recent, D]."""
    for name, t in (("key_buffer", key_buffer), ("value_buffer", value_buffer)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [Bmax, Hkv, N, D]; got shape {tuple(t.shape)}")
    bmax, heads, capacity, dim = value_buffer.shape
    if key_heads is None and key_buffer.shape != value_buffer.shape:
        raise ValueError(f"value_buffer shape {tuple(value_buffer.shape)} must equal key_buffer shape "
                         f"{tuple(key_buffer.shape)}")
    if key_heads is not None:
        if (key_buffer.shape[0], key_buffer.shape[2], key_buffer.shape[3]) != (bmax, capacity, dim):
            raise ValueError(f"key_buffer shape {tuple(key_buffer.shape)} must be [Bmax={bmax}, U, N={capacity}, "
                             f"D={dim}] like value_buffer")
        if key_heads.dim() != 1 or key_heads.shape[0] != heads or key_heads.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"key_heads must be an int32 / int64 [Hkv={heads}] tensor (a key_buffer row per head, "
                             f"-1 for none); got {key_heads.dtype} {tuple(key_heads.shape)}")
        if value_checks_enabled(key_heads):
            lo, hi = int(key_heads.min()), int(key_heads.max())
            if lo < -1 or hi >= key_buffer.shape[1]:
                raise ValueError(f"key_heads must be rows in [-1, U={key_buffer.shape[1]}); got min {lo}, max {hi}")
    if ring is not None:
        if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0 or isinstance(recent, bool) \
                or not isinstance(recent, int) or recent < 1:
            raise ValueError(f"sink={sink!r} and recent={recent!r}: expected integers >= 0 and >= 1 with a ring")
        if tuple(ring.shape) != (bmax, heads, sink + recent, dim):
            raise ValueError(f"ring must be [Bmax={bmax}, Hkv={heads}, sink + recent={sink + recent}, D={dim}]; got "
                             f"shape {tuple(ring.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (heads, dim) or t.shape[0] > bmax:
            raise ValueError(f"{name} must be [B <= {bmax}, {heads}, {dim}] to match the buffers; got shape "
                             f"{tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if positions.dim() != 1 or positions.shape[0] != k.shape[0] or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be an int32 / int64 [B={k.shape[0]}] tensor; got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if value_checks_enabled(positions) and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= capacity:
            raise ValueError(f"positions must be slots in [0, N={capacity}); got min {lo}, max {hi}")


def check_append_scales(key_buffer, value_buffer, ring, key_scale, value_scale, ring_scale) -> bool:
    """The FP8 half of ``append_kv``'s checks (format: kernels/fp8_kv.py). Returns whether the buffers are FP8:
    all of them (keys, values, ring) or none, each FP8 buffer with its fp32 scales [*buffer.shape[:-1]]."""
    from .fp8_kv import check_scale, is_fp8

    buffers = [("key_buffer", key_buffer), ("value_buffer", value_buffer)] + ([("ring", ring)] if ring is not None
                                                                              else [])
    kinds = {name: is_fp8(t) for name, t in buffers}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"key_buffer, value_buffer and ring must all be float8_e4m3fn or none; got "
                         f"{ {name: str(t.dtype) for name, t in buffers} }")
    check_scale("key_scale", key_scale, "key_buffer", key_buffer)
    check_scale("value_scale", value_scale, "value_buffer", value_buffer)
    if ring is not None:
        check_scale("ring_scale", ring_scale, "ring", ring)
    elif ring_scale is not None:
        raise ValueError("ring_scale is given without a ring")
    return kinds["key_buffer"]


def check_decode_linear_inputs(x, weights, biases, gated: bool):
    """``decode_linear``'s arguments, each error naming the argument; returns (weights, biases) as tuples of the
    same length (biases padded with None). x [M <= 64, K]; 1-3 weights [N_i, K] with a unit last stride, x's
    dtype and device; biases None or one [N_i] / None per weight; gated: exactly two weights of one shape."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K] (the decode batch's rows); got shape {tuple(x.shape)}")
    if x.shape[0] > DECODE_LINEAR_MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows: decode_linear is for decode batches of at most "
                         f"{DECODE_LINEAR_MAX_ROWS} rows; use "
                         f"torch.nn.functional.linear for larger ones")
    weights = tuple(weights) if isinstance(weights, (list, tuple)) else (weights,)
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"weights: expected 1 to 3 tensors sharing the input; got {len(weights)}")
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise ValueError(f"weights[{i}] must be [N, K={x.shape[1]}]; got shape {tuple(w.shape)}")
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"weights[{i}] is {w.dtype} on {w.device}; expected x's {x.dtype} on {x.device}")
        if w.stride(-1) != 1:
            raise ValueError(f"weights[{i}] must have a unit last stride (row-major); got strides {w.stride()}")
    if biases is None:
        biases = (None,) * len(weights)
    biases = tuple(biases)
    if len(biases) != len(weights):
        raise ValueError(f"biases: expected None or one entry per weight ({len(weights)}); got {len(biases)}")
    for i, (b, w) in enumerate(zip(biases, weights)):
        if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0]):
            raise ValueError(f"biases[{i}] must be None or [N={w.shape[0]}]; got shape {tuple(b.shape)}")
    if gated and (len(weights) != 2 or weights[0].shape != weights[1].shape):
        raise ValueError(f"gated=True takes two weights of one shape (gate, up); got shapes "
                         f"{[tuple(w.shape) for w in weights]}")
    return weights, biases
