"""Shared pieces of podkit's Triton decode kernels (flash-decoding style split-K).

Every decode op here works the same way (Dao et al., "Flash-Decoding for long-context inference",
2023): the keys of one (sequence, KV head) are cut into `num_splits` chunks, one Triton program per
(chunk, sequence, KV head) computes a partial softmax attention for the `G` query heads of the group
and writes a normalised partial output `o_part[B,Hq,S,D]` (fp32) and its log-sum-exp
`lse_part[B,Hq,S]` (fp32, -inf for a chunk without any valid key). `merge_splits` then merges the
chunks with one log-sum-exp reduction per (sequence, query head). POD decode additionally keeps
proximal and distant chunks apart in the merge to compute its gate.

This module holds: input validation (errors name the argument, the value and what is allowed,
raised before any kernel runs), the split planner, the online-softmax tile update shared by the
kernels, and the merge kernel.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
# Upper bound on chunks per (sequence, head): the merge kernel holds all of a row's chunks in
# registers at once (BLOCK_S x BLOCK_D fp32), so keep it modest.
MAX_SPLITS = 128

from ._interpreter import interpreting  # noqa: E402,F401  (also installs the interpreter patch)
from ._value_checks import value_checks_enabled  # noqa: E402,F401  (re-exported: the kernels import it from here)
from .fp8_kv import check_recent_keys, check_scale, is_fp8  # noqa: E402


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small stand-in (2) on CPU so that the
    interpreter tests still get several chunks per row and exercise the merge."""
    if device.type != "cuda":
        return 2
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def plan_splits(length: int, rows: int, device: torch.device, block: int,
                waves: int = 4, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """Choose (num_splits, chunk) for `rows` independent rows of `length` keys each.

    Aims at about `waves` programs per SM in total so that one (sequence, KV head) at batch 1 still
    fills the GPU, with chunks a multiple of `block` (the kernel's tile) and at most `max_splits`.
    `length` is the cache capacity (not max(seq_lens)) so that planning needs no host sync and the
    launch is CUDA-graph safe; chunks past a sequence's length exit at once.
    """
    length = max(int(length), 1)
    max_tiles = triton.cdiv(length, block)
    want = max(1, triton.cdiv(waves * num_sms(device), max(rows, 1)))
    num_splits = max(1, min(want, max_tiles, max_splits))
    chunk = triton.cdiv(triton.cdiv(length, num_splits), block) * block
    num_splits = triton.cdiv(length, chunk)
    return num_splits, chunk


def check_float(name: str, t, ndim: int, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {shape_doc}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: float16, bfloat16, float32")


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must match")


def check_index_tensor(name: str, t, ndim: int, shape_doc: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {shape_doc}, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: int32, int64")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; they must match")


def check_cache(name: str, t, shape_doc: str, q: torch.Tensor, scale_name: str, scale) -> None:
    """A K/V cache argument: 4 dims, q's float dtype, or float8_e4m3fn with fp32 scales [*t.shape[:-1]]
    (kernels/fp8_kv.py); on q's device. Errors name the argument."""
    if is_fp8(t):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {shape_doc}, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
    else:
        check_float(name, t, 4, shape_doc)
        check_same(name, t, "q", q)
    check_scale(scale_name, scale, name, t)


def check_fp8_pair(pairs) -> bool:
    """Whether the (name, cache) pairs, all of one kernel launch, are FP8: all of them or none."""
    kinds = {name: str(t.dtype) for name, t in pairs}
    if len({is_fp8(t) for _, t in pairs}) > 1:
        raise TypeError(f"{', '.join(kinds)} must all be float8_e4m3fn or all q's dtype; got {kinds}")
    return is_fp8(pairs[0][1])


def scale_args(scale: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """A scale tensor [B, H, N] and its three strides for a kernel launch; ``dummy`` and zeros without one."""
    return (scale, *scale.stride()) if scale is not None else (dummy, 0, 0, 0)


def check_recent(k_recent, k_cache: torch.Tensor, q: torch.Tensor) -> None:
    """Recent keys (kernels/fp8_kv.py): None, or with an FP8 ``k_cache`` [B, Hkv, W, D] in q's dtype."""
    check_recent_keys(k_recent, k_cache)
    if k_recent is not None:
        check_same("k_recent", k_recent, "q", q)


def recent_args(k_recent: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """The recent-key ring [B, Hkv, W, D] (last dim contiguous) and its three strides for a kernel launch;
    ``dummy`` and zeros without one."""
    if k_recent is None:
        return dummy, 0, 0, 0
    k_recent = last_dim_contiguous(k_recent)
    return (k_recent, *k_recent.stride()[:3])


def check_query_and_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> tuple[int, ...]:
    """Checks shared by the decode launchers: q ``[B,Hq,D]``, k/v caches ``[B,Hkv,N,D]`` of q's float
    dtype (or both float8_e4m3fn with fp32 scales ``[B,Hkv,N]``) and device, a supported head dim and GQA
    ratio. Returns ``(B, Hq, Hkv, N, D, G)``."""
    check_float("q", q, 3, "[B,Hq,D]")
    check_cache("k_cache", k_cache, "[B,Hkv,N,D]", q, "k_scale", k_scale)
    check_cache("v_cache", v_cache, "[B,Hkv,N,D]", q, "v_scale", v_scale)
    check_fp8_pair([("k_cache", k_cache), ("v_cache", v_cache)])
    B, Hq, D = q.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache shape {tuple(k_cache.shape)} does not match q [B={B},Hq={Hq},D={D}]; "
                         f"expected [B,Hkv,N,D]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    check_head_dim(D)
    Hkv, N = k_cache.shape[1], k_cache.shape[2]
    return B, Hq, Hkv, N, D, check_gqa(Hq, Hkv)


def check_head_dim(D: int) -> None:
    if D < 1 or D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} is not supported; allowed: 1..{MAX_HEAD_DIM}")


def check_gqa(Hq: int, Hkv: int) -> int:
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} must be a positive multiple of KV heads Hkv={Hkv}")
    return Hq // Hkv


def check_seq_lens_values(seq_lens: torch.Tensor, N: int) -> None:
    """seq_lens[b] must lie in [1, N] (the query's own key is already in the cache)."""
    if not value_checks_enabled(seq_lens) or seq_lens.numel() == 0:
        return
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 1 or hi > N:
        raise ValueError(f"seq_lens values must lie in [1, N={N}] (N = cache capacity); "
                         f"got min {lo}, max {hi}")


def check_index_values(name: str, indices: torch.Tensor, N: int) -> None:
    """Index entries must be -1 (ignored) or a slot in [0, N)."""
    if not value_checks_enabled(indices) or indices.numel() == 0:
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < -1 or hi >= N:
        raise ValueError(f"{name} entries must be -1 (padding) or a slot in [0, N={N}); "
                         f"got min {lo}, max {hi}")


def resolve_scale(scale, D: int) -> float:
    if scale is None:
        return D ** -0.5
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale}")
    return scale


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels assume stride 1 along the head dim (vectorised row loads); other strides are free."""
    return t if t.stride(-1) == 1 else t.contiguous()


def block_g(G: int) -> int:
    """Rows of the query tile: tl.dot needs M >= 16, so a GQA group is padded up to 16."""
    return max(16, triton.next_power_of_2(G))


# ---------------------------------------------------------------------------------------------
# Device helpers shared by the split kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def tile_logits(q, k, sm_scale, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """Logits q.k * scale of a [BLOCK_G, BLOCK_D] query tile against a [BLOCK_N, BLOCK_D] key
    tile -> [BLOCK_G, BLOCK_N] fp32. USE_DOT=False (one query head per program) uses a broadcast
    multiply-sum instead of tl.dot, which needs 16 rows; IEEE keeps fp32 inputs out of TF32."""
    if USE_DOT:
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
    else:
        s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
    return s * sm_scale


@triton.jit
def online_softmax_update(s, v, m_i, l_i, acc, USE_DOT: tl.constexpr, IEEE: tl.constexpr, v_scale=None,
                          SCALED_V: tl.constexpr = False):
    """One online-softmax step (Milakov & Gimelshein 2018; FlashAttention).

    s: [BLOCK_G, BLOCK_N] fp32 logits with -inf at invalid keys; v: [BLOCK_N, BLOCK_D];
    m_i, l_i: [BLOCK_G] running max / sum; acc: [BLOCK_G, BLOCK_D] fp32 unnormalised output.
    SCALED_V: v holds FP8 values (converted exactly) whose per-row fp32 scales v_scale [BLOCK_N] weigh the
    probabilities of the output, not of the sum: acc += (p * v_scale) @ v (kernels/fp8_kv.py).
    Safe when a whole tile is invalid (m stays -inf, nothing accumulates, no NaN).
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALED_V:
        p = p * v_scale[None, :]
    if USE_DOT:
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def store_partial(OPart, LSEPart, m_i, l_i, acc, row_off_o, row_off_l, row_mask, offs_d, D: tl.constexpr):
    """Write a chunk's normalised partial output and its LSE (-inf when the chunk saw no key)."""
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
    out = acc / l_safe[:, None]
    tl.store(OPart + row_off_o[:, None] + offs_d[None, :], out,
             mask=row_mask[:, None] & (offs_d[None, :] < D))
    tl.store(LSEPart + row_off_l, lse, mask=row_mask)


# ---------------------------------------------------------------------------------------------
# Merge of the chunks
# ---------------------------------------------------------------------------------------------

@triton.jit
def _logsumexp_masked(x, mask):
    x = tl.where(mask, x, float("-inf"))
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(x - m_safe), axis=0)
    return tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))


@triton.jit
def _merge_splits_kernel(
    OPart, LSEPart, Out, LSEOut, GateOut,
    num_splits, split_p_start, tau, Hq,
    stride_op_row, stride_op_s, stride_lp_row,
    stride_out_b, stride_out_h,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_PROXIMAL: tl.constexpr, USE_TAU: tl.constexpr,
    WRITE_LSE: tl.constexpr, WRITE_GATE: tl.constexpr,
):
    """One program per (sequence, query head): out = sum_s w_s o_s, w_s = exp(lse_s - lse).

    With HAS_PROXIMAL (POD decode), chunks [split_p_start, num_splits) are proximal and the rest
    distant: gate = sigmoid(lse_P - lse_D); with USE_TAU, rows whose gate >= tau keep only the
    proximal chunks (out = o^P).
    """
    row = tl.program_id(0)
    b = row // Hq
    h = row % Hq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(LSEPart + row * stride_lp_row + offs_s, mask=s_mask, other=float("-inf"))
    if HAS_PROXIMAL:
        is_p = offs_s >= split_p_start
        lse_p = _logsumexp_masked(lse, s_mask & is_p)
        lse_d = _logsumexp_masked(lse, s_mask & (offs_s < split_p_start))
        # sigmoid(lse_p - lse_d) written to stay finite when either side is empty (-inf)
        both = (lse_p != float("-inf")) & (lse_d != float("-inf"))
        diff = tl.where(both, lse_p - lse_d, 0.0)
        gate = tl.where(both, 1.0 / (1.0 + tl.exp(-diff)), tl.where(lse_d == float("-inf"), 1.0, 0.0))
        if WRITE_GATE:
            tl.store(GateOut + b * Hq + h, gate)
        if USE_TAU:
            lse = tl.where(is_p, lse, tl.where(gate < tau, lse, float("-inf")))
    total_lse = _logsumexp_masked(lse, s_mask)
    w = tl.where(total_lse == float("-inf"), 0.0, tl.exp(lse - tl.where(total_lse == float("-inf"), 0.0, total_lse)))
    w = tl.where(s_mask, w, 0.0)
    o = tl.load(OPart + row * stride_op_row + offs_s[:, None] * stride_op_s + offs_d[None, :],
                mask=s_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * o, axis=0)
    tl.store(Out + b * stride_out_b + h * stride_out_h + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < D)
    if WRITE_LSE:
        tl.store(LSEOut + b * Hq + h, total_lse)


def alloc_partials(B: int, Hq: int, num_splits: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """o_part[B,Hq,S,D] and lse_part[B,Hq,S], both fp32 (allocated uninitialised: every chunk's
    program writes its slot, including chunks that see no key)."""
    o_part = torch.empty(B, Hq, num_splits, D, device=device, dtype=torch.float32)
    lse_part = torch.empty(B, Hq, num_splits, device=device, dtype=torch.float32)
    return o_part, lse_part


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, *,
                 lse_out: torch.Tensor | None = None, gate_out: torch.Tensor | None = None,
                 split_p_start: int | None = None, tau: float | None = None) -> None:
    """Merge o_part[B,Hq,S,D] / lse_part[B,Hq,S] into out[B,Hq,D] (any float dtype, last dim
    contiguous). Optionally writes lse_out[B,Hq] fp32 and, for POD, gate_out[B,Hq] fp32."""
    B, Hq, S, D = o_part.shape
    has_p = split_p_start is not None
    _merge_splits_kernel[(B * Hq,)](
        o_part, lse_part, out,
        lse_out if lse_out is not None else lse_part,
        gate_out if gate_out is not None else lse_part,
        S, split_p_start if has_p else S, float(tau) if tau is not None else 0.0, Hq,
        o_part.stride(1), o_part.stride(2), lse_part.stride(1),
        out.stride(0), out.stride(1),
        D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_S=max(2, triton.next_power_of_2(S)),
        HAS_PROXIMAL=has_p, USE_TAU=has_p and tau is not None,
        WRITE_LSE=lse_out is not None, WRITE_GATE=gate_out is not None,
        num_warps=4,
    )


def merge_gated_splits(o_part: torch.Tensor, lse_part: torch.Tensor, q: torch.Tensor, *, split_p_start: int,
                       gate_tau: float | None, estimate: torch.Tensor | None, return_gate: bool, return_skip: bool):
    """Merge POD's distant + proximal partials into ``out [B, Hq, D]`` and build the optional outputs.

    Shared by the POD decode launchers (``triton_pod_decode_attention``, ``triton_pod_sparse_decode_attention``).
    ``estimate [B, Hq]``: a pre-evaluated gate (the skipped heads' distant partials are already empty, so no tau in
    the merge) or None (this layer's exact gate, with ``gate_tau`` applied in the merge). Returns ``out``, or a tuple
    ``(out[, gate [B, Hq] fp32][, skip [B, Hq] bool])`` following ``return_gate`` / ``return_skip``."""
    B, Hq, D = q.shape
    use_estimate = estimate is not None
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    exact_skip = return_skip and gate_tau is not None and not use_estimate
    gate = torch.empty(B, Hq, device=q.device, dtype=torch.float32) if (return_gate or exact_skip) else None
    merge_splits(o_part, lse_part, out, gate_out=gate, split_p_start=split_p_start,
                 tau=None if use_estimate else gate_tau)
    results = [out]
    if return_gate:
        results.append(gate)
    if return_skip:
        if use_estimate:
            skip = estimate >= gate_tau
        elif gate_tau is not None:
            skip = gate >= gate_tau
        else:
            skip = torch.zeros(B, Hq, device=q.device, dtype=torch.bool)
        results.append(skip)
    return tuple(results) if len(results) > 1 else out
