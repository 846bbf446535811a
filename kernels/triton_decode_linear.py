"""Decode-time projections as one bandwidth-bound launch per group of weights (Triton).

Why: at decode the layer's matrix products are matrix-vector products (M = batch <= 16 rows) that only have to
read each weight once. On an H200 cuBLAS runs Llama-3-8B's per-layer products well above their bytes / copy
bandwidth (only the large lm_head reaches it), with split-K reduce kernels on top, and the engine launched q, k,
v, gate and up separately (BENCHMARKS.md, "Where the dense decode step's time goes"). This kernel reads several
weights that share the input in one launch (q/k/v; gate/up, with the SiLU gating fused into the epilogue), with
tiles of ``BLOCK_N`` output rows x ``BLOCK_K`` inputs, so a fused group has enough programs to fill the GPU
without split-K.

``decode_linear_triton(x, weights, biases=None, gated=False)``:
    x: [M, K] (M <= 64; the decode batch); weights: 1-3 tensors [N_i, K] (row-major, unit last stride);
    biases: None or a matching tuple of [N_i] / None.
    Returns [M, N_0 + N_1 + ...] (the products side by side), or, with ``gated=True`` and two weights of the
    same shape (gate, up), ``silu(x W_0^T + b_0) * (x W_1^T + b_1)``: [M, N_0].
Same contract as ``kernels.reference.decode_linear`` (the spec it is tested against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._prefill_common import FLOAT32_FIRST_CANDIDATE, dot_precision, pick_configs
from ._value_checks import check_decode_linear_inputs


def _configs():
    return pick_configs([
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 128}, num_warps=4, num_stages=5),
        triton.Config({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 64, "BLOCK_K": 256}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=4, num_stages=3),
    ], triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1))


@triton.jit
def _rows_times_x(X, stride_xm, W, stride_wn, rows, M, N, K, M_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 [M_BLOCK, BLOCK_N] = x[:M] @ W[rows]^T over the whole K (rows past N and x rows past M read 0)."""
    offs_m = tl.arange(0, M_BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([M_BLOCK, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(W + rows[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :],
                    mask=(rows[:, None] < N) & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _store(OUT, stride_om, col0, acc, B, rows, M, N, HAS_BIAS: tl.constexpr, M_BLOCK: tl.constexpr):
    offs_m = tl.arange(0, M_BLOCK)
    if HAS_BIAS:
        acc += tl.load(B + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + offs_m[:, None] * stride_om + (col0 + rows)[None, :], acc.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (rows[None, :] < N))


@triton.autotune(configs=_configs(), key=["N0", "N1", "N2", "K", "M_BLOCK", "GATED"],
                 prune_configs_by=FLOAT32_FIRST_CANDIDATE)
@triton.jit
def _decode_linear_kernel(X, W0, W1, W2, B0, B1, B2, OUT, M, K, N0, N1, N2,
                          stride_xm, stride_w0, stride_w1, stride_w2, stride_om,
                          HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, HAS_BIAS2: tl.constexpr,
                          GATED: tl.constexpr, M_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Tiles are laid out weight after weight (tiles0 of W0, then W1's, then W2's), so no tile straddles two
    # weights; GATED programs own the same rows of W0 (gate) and W1 (up).
    pid = tl.program_id(0)
    tiles0 = tl.cdiv(N0, BLOCK_N)
    tiles1 = tl.cdiv(N1, BLOCK_N)
    if GATED:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        gate = _rows_times_x(X, stride_xm, W0, stride_w0, rows, M, N0, K, M_BLOCK, BLOCK_N, BLOCK_K, DOT_PRECISION)
        up = _rows_times_x(X, stride_xm, W1, stride_w1, rows, M, N0, K, M_BLOCK, BLOCK_N, BLOCK_K, DOT_PRECISION)
        if HAS_BIAS0:
            gate += tl.load(B0 + rows, mask=rows < N0, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS1:
            up += tl.load(B1 + rows, mask=rows < N0, other=0.0).to(tl.float32)[None, :]
        act = gate / (1.0 + tl.exp(-gate)) * up
        _store(OUT, stride_om, 0, act, B0, rows, M, N0, False, M_BLOCK)
    elif pid < tiles0:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _rows_times_x(X, stride_xm, W0, stride_w0, rows, M, N0, K, M_BLOCK, BLOCK_N, BLOCK_K, DOT_PRECISION)
        _store(OUT, stride_om, 0, acc, B0, rows, M, N0, HAS_BIAS0, M_BLOCK)
    elif pid < tiles0 + tiles1:
        rows = (pid - tiles0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _rows_times_x(X, stride_xm, W1, stride_w1, rows, M, N1, K, M_BLOCK, BLOCK_N, BLOCK_K, DOT_PRECISION)
        _store(OUT, stride_om, N0, acc, B1, rows, M, N1, HAS_BIAS1, M_BLOCK)
    else:
        rows = (pid - tiles0 - tiles1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _rows_times_x(X, stride_xm, W2, stride_w2, rows, M, N2, K, M_BLOCK, BLOCK_N, BLOCK_K, DOT_PRECISION)
        _store(OUT, stride_om, N0 + N1, acc, B2, rows, M, N2, HAS_BIAS2, M_BLOCK)


def decode_linear_triton(x: torch.Tensor, weights, biases=None, *, gated: bool = False) -> torch.Tensor:
    weights, biases = check_decode_linear_inputs(x, weights, biases, gated)
    x = x.contiguous()
    m, k = x.shape
    sizes = [w.shape[0] for w in weights]
    out = torch.empty(m, sizes[0] if gated else sum(sizes), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    padded = weights + (weights[0],) * (3 - len(weights))     # unused slots point at a real tensor
    bias_args = tuple(b if b is not None else padded[0] for b in (biases + (None,) * (3 - len(biases))))
    counts = sizes + [0] * (3 - len(sizes))
    # tl.dot needs at least 16 rows; the decode batch is padded (masked loads) to the next power of two
    m_block = max(16, triton.next_power_of_2(m))

    def grid(meta):
        tiles = [triton.cdiv(n, meta["BLOCK_N"]) for n in counts]
        return (tiles[0] if gated else sum(tiles),)

    _decode_linear_kernel[grid](
        x, *padded, *bias_args, out, m, k, *counts,
        x.stride(0), *(w.stride(0) for w in padded), out.stride(0),
        HAS_BIAS0=len(biases) > 0 and biases[0] is not None, HAS_BIAS1=len(biases) > 1 and biases[1] is not None,
        HAS_BIAS2=len(biases) > 2 and biases[2] is not None, GATED=gated, M_BLOCK=m_block,
        DOT_PRECISION=dot_precision(x.dtype))
    return out
