"""Causal prefill attention for Hopper (sm_90) in Gluon: TMA producer warp, async wgmma, softmax overlapped with P V.

The same contract as :func:`kernels.triton_prefill_attention.prefill_attention_triton` (ragged ``q_offsets`` /
``kv_lens``, GQA without ``repeat_kv``, LSE in natural log), written in Triton's Gluon dialect
(``triton.experimental.gluon``), where warps, shared memory, barriers and the asynchrony of the tensor-core
instructions are explicit. The Triton (``tl.dot``) kernel stays behind torch SDPA on an H200 because one
warp group runs Q K^T, the softmax and P V strictly in turn; Triton 3.6's automatic warp specialisation does not
partition that loop on sm_90 (BENCHMARKS.md, "Dense prefill in Gluon"). This kernel follows FlashAttention-3
(Shah et al. 2024, arXiv 2407.08608):

- §3.1 producer-consumer warp specialisation: one producer warp streams K and V tiles with TMA into a ring of
  ``STAGES`` shared-memory slots (``k_ready`` / ``v_ready`` / ``kv_empty`` mbarriers); the consumer warps (two warp
  groups, 64 query rows each) never issue a load.
- §3.2 intra-warpgroup overlap (Algorithm 2): iteration ``j`` issues ``S_j = Q K_j^T`` and
  ``O += P_{j-1} V_{j-1}`` as asynchronous wgmma, waits only for ``S_j``, and computes the softmax of ``S_j`` while
  ``P_{j-1} V_{j-1}`` is still on the tensor cores.

Layout: ``q[B, Hq, S, D]``, ``k/v[B, Hkv, S, D]`` contiguous, bf16 or fp16, ``D`` in {64, 128}. Query ``i`` of
sequence ``b`` sits at position ``q_offsets[b] + i`` and sees keys ``j <= q_offsets[b] + i`` with ``j < kv_lens[b]``;
rows at positions ``>= kv_lens[b]`` output 0 with ``lse = -inf``. The descriptors read 2-D views
(``[B * H * S, D]``): a tile that runs past a head's last row reads the next head's rows, which the causal / length
masks exclude (keys) or which are never stored (queries). Keys and values at positions ``>= kv_lens[b]`` must be
finite, as they are in a fresh prefill (the padding tokens' own projections), because a masked logit contributes
``0 * v`` to the P V product. :func:`unsupported_reason` says which calls may take this kernel; the Triton kernel
serves every other case (``PODKIT_PREFILL_KERNEL`` picks, :func:`use_gluon_kernel`).

Gluon has no interpreter mode: the CPU tests compile this kernel for sm_90 (``compile_for_sm90``), and its
numerical tests run on a Hopper GPU (``tests/kernels/test_gluon_prefill_attention.py``).
"""

from __future__ import annotations

import os

import torch
import triton

from ._interpreter import interpreting
from ._prefill_common import LOG2_E

try:  # Gluon ships with Triton >= 3.5; its Hopper module is what this kernel needs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAS_GLUON = False

SUPPORTED_HEAD_DIMS = (64, 128)
# (BLOCK_M, BLOCK_N, STAGES, warps per consumer partition, consumer partitions). 128 query rows = two consumer warp
# groups sharing each K/V tile. As two 4-warp partitions (each releases a K/V slot on its own) the kernel is
# faster on an H200 than as one 8-warp partition, which puts a partition-wide barrier before each release
# (BENCHMARKS.md, "Dense prefill in Gluon", "How the arrangement was chosen"). 3 stages of 128-key K and V tiles + the Q tiles = 224 KB of the H100/H200's
# 227 KB shared memory at D = 128.
DEFAULT_TILE = {128: (128, 128, 3, 4, 2), 64: (128, 128, 4, 4, 2)}
# registers per thread of a consumer partition when there are two (setmaxnreg; the producer warp keeps 24): two
# 128-thread warp groups at 240 + one producer warp group at 24 fill the 64K-register file
CONSUMER_REGS = 240
KERNEL_ENV = "PODKIT_PREFILL_KERNEL"
KERNEL_CHOICES = ("auto", "gluon", "triton")


if HAS_GLUON:

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, q_pos, start_n, kv_len, qk_scale,
                      BLOCK_N: gl.constexpr, s_layout: gl.constexpr, MASKED: gl.constexpr):
        """Online-softmax update for one key tile (exp2 domain). s [BLOCK_M, BLOCK_N] fp32 raw logits ->
        p [BLOCK_M, BLOCK_N] fp32, alpha / m / l [BLOCK_M] (rows of ``s_layout``)."""
        if MASKED:
            key_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos < kv_len)[None, :]
            s = gl.where(visible, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            # a row with no visible key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            s = s - m_safe[:, None]
        else:
            # every key of the tile is visible to every row: the scale rides on the max and on the subtraction
            # (one FMA per logit)
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            m_safe = m_new
            s = s * qk_scale - m_safe[:, None]
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _consume_tile(j, p_cur, acc, m_i, l_i, q_pos, kv_len, qk_scale, q_smem, k_smem, v_smem, k_ready, v_ready,
                      kv_empty, zero_s, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                      o_layout: gl.constexpr, p_layout: gl.constexpr, MASKED: gl.constexpr):
        """Iteration ``j >= 1`` of FlashAttention-3's Algorithm 2: ``p_cur`` holds P_{j-1} (operand layout) and
        ``acc`` the O that P_{j-1} V_{j-1} still has to be added to. Returns P_j and O after P_{j-1} V_{j-1},
        rescaled to tile j's running max. Nothing asynchronous crosses the loop's back edge: each wgmma issued
        here is waited for here."""
        cur = j % STAGES
        prev = (j + STAGES - 1) % STAGES
        mbarrier.wait(k_ready.index(cur), (j // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(cur).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_cur, v_smem.index(prev), acc, is_async=True)
        # wgmma groups retire in order: with one (P_{j-1} V_{j-1}) left outstanding, S_j is ready
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        # the softmax of tile j runs while P_{j-1} V_{j-1} is on the tensor cores
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, q_pos, j * BLOCK_N, kv_len, qk_scale, BLOCK_N, s_layout,
                                           MASKED)
        p_next = gl.convert_layout(p.to(k_smem.dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # tile j-1's K and V are consumed: its slot goes back to the producer
        mbarrier.arrive(kv_empty.index(prev))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        return p_next, acc, m_i, l_i

    @gluon.jit
    def _consumer(desc_q, OUT, LSE, q_row, kv_len, q_offset, m0, seq_q, n_full, n_total, qk_scale,
                  stride_os, stride_od, out_base, lse_base, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                  kv_empty, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr, WRITE_LSE: gl.constexpr, num_warps: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        q_pos = q_offset + m0 + gl.arange(0, BLOCK_M, layout=rows_s)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=rows_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.expect(q_ready, desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [q_row, 0], q_ready, q_smem)
        mbarrier.wait(q_ready, 0)
        # tile 0 (masked: it may hold the diagonal; masking a fully visible tile costs one tile's selects)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, q_pos, 0, kv_len, qk_scale, BLOCK_N, s_layout, True)
        p_cur = gl.convert_layout(p.to(k_smem.dtype), p_layout)

        # tiles 1.. : the fully visible ones, then the diagonal / kv_len-edge ones (masked)
        split = gl.maximum(n_full, 1)
        for j in range(1, split):
            p_cur, acc, m_i, l_i = _consume_tile(j, p_cur, acc, m_i, l_i, q_pos, kv_len, qk_scale, q_smem, k_smem,
                                                 v_smem, k_ready, v_ready, kv_empty, zero_s, BLOCK_N, STAGES,
                                                 s_layout, o_layout, p_layout, False)
        for j in range(split, n_total):
            p_cur, acc, m_i, l_i = _consume_tile(j, p_cur, acc, m_i, l_i, q_pos, kv_len, qk_scale, q_smem, k_smem,
                                                 v_smem, k_ready, v_ready, kv_empty, zero_s, BLOCK_N, STAGES,
                                                 s_layout, o_layout, p_layout, True)
        # the last tile's P V
        last = n_total - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p_cur, v_smem.index(last % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

        # epilogue: rows of padding (position >= kv_len) and rows past the sequence's end are not attention rows
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=rows_o)
        row_ok = (offs_m < seq_q) & (q_offset + offs_m < kv_len)
        l_o = gl.convert_layout(l_i, rows_o)
        l_safe = gl.where(row_ok & (l_o > 0), l_o, 1.0)
        out = acc / l_safe[:, None]
        out = gl.where(row_ok[:, None], out, 0.0)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = OUT + out_base + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
        gl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(offs_m < seq_q)[:, None])
        if WRITE_LSE:
            m_o = gl.convert_layout(m_i, rows_o)
            lse = (m_o + gl.log2(l_safe)) * 0.6931471805599453  # back from the log2 domain
            lse = gl.where(row_ok & (l_o > 0), lse, float("-inf"))
            gl.store(LSE + lse_base + offs_m, lse, mask=offs_m < seq_q)

    @gluon.jit
    def _producer(desc_k, desc_v, kv_row, n_total, k_smem, v_smem, k_ready, v_ready, kv_empty,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """One warp: K and V tiles of this program's key range, ``STAGES`` ahead of the consumers."""
        for j in range(0, n_total):
            slot = j % STAGES
            # the slot's previous tile (j - STAGES) must be consumed; the first STAGES tiles find it empty
            mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
            row = kv_row + j * BLOCK_N
            mbarrier.expect(k_ready.index(slot), desc_k.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_k, [row, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.expect(v_ready.index(slot), desc_v.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_v, [row, 0], v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _prefill_attention_sm90_kernel(
        desc_q, desc_k, desc_v, OUT, LSE, Q_OFFSETS, KV_LENS,
        stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh,
        num_q_heads, seq_q, num_keys, qk_scale,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, WRITE_LSE: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # grid (batch*head, query block), query blocks in reverse: the longest causal rows start first
        pid_bh = gl.program_id(0)
        pid_m = gl.num_programs(1) - 1 - gl.program_id(1)
        b = pid_bh // num_q_heads
        h = pid_bh % num_q_heads
        num_kv_heads = num_q_heads // GROUP
        q_offset = gl.load(Q_OFFSETS + b)
        kv_len = gl.load(KV_LENS + b)
        m0 = pid_m * BLOCK_M
        first_pos = q_offset + m0
        # tiles [0, n_full) are visible to every row; tiles [n_full, n_total) hold the diagonal / kv_len edge
        full_end = gl.maximum(gl.minimum(first_pos + 1, kv_len), 0)
        n_full = full_end // BLOCK_N
        last_pos = gl.minimum(q_offset + gl.minimum(m0 + BLOCK_M, seq_q), kv_len)
        n_total = gl.maximum(gl.cdiv(last_pos, BLOCK_N), n_full)
        # a block with no attention row still runs one (fully masked) tile, so no barrier is left unwaited
        n_total = gl.where(first_pos < kv_len, gl.maximum(n_total, 1), 1)
        n_full = gl.where(first_pos < kv_len, n_full, 0)
        q_row = pid_bh * seq_q + m0
        kv_row = (b * num_kv_heads + h // GROUP) * num_keys
        out_base = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
        lse_base = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh

        dtype: gl.constexpr = desc_q.dtype
        SUB_M: gl.constexpr = BLOCK_M // CONSUMERS  # query rows of one consumer partition (its Q tile)
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, SUB_M, HEAD_DIM], desc_q.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_k.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_v.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_ready.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=CONSUMERS)
        fence_async_shared()

        if CONSUMERS == 1:
            gl.warp_specialize([
                (_consumer, (desc_q, OUT, LSE, q_row, kv_len, q_offset, m0, seq_q, n_full, n_total, qk_scale,
                             stride_os, stride_od, out_base, lse_base, q_smem.index(0), k_smem, v_smem,
                             q_ready.index(0), k_ready, v_ready, kv_empty, SUB_M, BLOCK_N, HEAD_DIM, STAGES,
                             WRITE_LSE, num_warps)),
                (_producer, (desc_k, desc_v, kv_row, n_total, k_smem, v_smem, k_ready, v_ready, kv_empty, BLOCK_N,
                             STAGES)),
            ], [1], [24])
        else:
            # one partition per consumer warp group: each releases a K/V slot on its own (kv_empty counts two
            # arrivals), so neither waits for the other at a partition-wide barrier
            gl.warp_specialize([
                (_consumer, (desc_q, OUT, LSE, q_row, kv_len, q_offset, m0, seq_q, n_full, n_total, qk_scale,
                             stride_os, stride_od, out_base, lse_base, q_smem.index(0), k_smem, v_smem,
                             q_ready.index(0), k_ready, v_ready, kv_empty, SUB_M, BLOCK_N, HEAD_DIM, STAGES,
                             WRITE_LSE, num_warps)),
                (_consumer, (desc_q, OUT, LSE, q_row + SUB_M, kv_len, q_offset, m0 + SUB_M, seq_q, n_full, n_total,
                             qk_scale, stride_os, stride_od, out_base, lse_base, q_smem.index(1), k_smem, v_smem,
                             q_ready.index(1), k_ready, v_ready, kv_empty, SUB_M, BLOCK_N, HEAD_DIM, STAGES,
                             WRITE_LSE, num_warps)),
                (_producer, (desc_k, desc_v, kv_row, n_total, k_smem, v_smem, k_ready, v_ready, kv_empty, BLOCK_N,
                             STAGES)),
            ], [num_warps, 1], [CONSUMER_REGS, 24])


def kernel_choice():
    """``PODKIT_PREFILL_KERNEL``: ``auto`` (default), ``gluon`` or ``triton`` (see :func:`use_gluon_kernel`)."""
    value = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={value!r}; allowed: {', '.join(KERNEL_CHOICES)}")
    return value


def _is_hopper(device):
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def unsupported_reason(q, k, v, require_contiguous=True):
    """Why a checked prefill call (q [B, Hq, S, D], k/v [B, Hkv, N, D]) cannot take the Gluon kernel, or None if
    it can: it needs Gluon (Triton >= 3.5), no Triton interpreter, a Hopper GPU (sm_90; Blackwell's tensor cores
    need another kernel), bf16/fp16, D in {64, 128}, the fresh-prefill layout N == S (keys past ``kv_lens`` are
    then the padding tokens' own, finite) and, with ``require_contiguous``, contiguous q/k/v (the TMA descriptors
    read 2-D views)."""
    if not HAS_GLUON:
        return "triton.experimental.gluon is not available (Triton >= 3.5 has it)"
    if interpreting():
        return "TRITON_INTERPRET=1 (Gluon kernels have no interpreter mode)"
    if not _is_hopper(q.device):
        return f"device {q.device} is not a Hopper (sm_90) GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype}; allowed: torch.bfloat16, torch.float16"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim {q.shape[-1]}; allowed: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
    if k.shape[2] != q.shape[2]:
        return f"{k.shape[2]} keys for {q.shape[2]} queries (needs the fresh-prefill layout, N == S)"
    if require_contiguous and not all(t.is_contiguous() for t in (q, k, v)):
        return "q, k and v must be contiguous"
    return None


def use_gluon_kernel(q, k, v, require_contiguous=True):
    """Whether ``prefill_attention_triton`` runs this kernel: ``PODKIT_PREFILL_KERNEL=auto`` (default) takes it
    wherever :func:`unsupported_reason` finds nothing; ``gluon`` takes it and refuses an unsupported call with the
    reason; ``triton`` never takes it."""
    choice = kernel_choice()
    if choice == "triton":
        return False
    reason = unsupported_reason(q, k, v, require_contiguous)
    if choice == "gluon" and reason is not None:
        raise ValueError(f"{KERNEL_ENV}=gluon, but this call cannot run the Gluon sm_90 kernel: {reason}")
    return reason is None


def gluon_inputs(q, k, v):
    """``(q, k, v)`` for this kernel, with contiguous copies of those that are not, or None when the call runs the
    ``tl.dot`` kernel (:func:`use_gluon_kernel`). The engine's and the model classes' q/k/v are ``[B, S, H, D]``
    projections viewed as ``[B, H, S, D]``. Copying them reads and writes each tensor once (linear in S), a small
    fraction of the attention's quadratic work at long contexts and less than the tl.dot kernel's gap to this one."""
    if not use_gluon_kernel(q, k, v, require_contiguous=False):
        return None
    return tuple(t if t.is_contiguous() else t.contiguous() for t in (q, k, v))


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _descriptors(q, k, v, block_m, block_n):
    """Host TMA descriptors over the 2-D views q [B*Hq*S, D], k/v [B*Hkv*S, D]."""
    dim = q.shape[-1]
    dtype = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, dim], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], dtype)
    return (TensorDescriptor.from_tensor(q.view(-1, dim), [block_m, dim], q_layout),
            TensorDescriptor.from_tensor(k.view(-1, dim), [block_n, dim], kv_layout),
            TensorDescriptor.from_tensor(v.view(-1, dim), [block_n, dim], kv_layout))


def launch_prefill_kernel_sm90(q, k, v, out, lse, q_offsets, kv_lens, group, scale, write_lse, tile=None):
    """Launch on checked inputs (as ``kernels.triton_prefill_attention.launch_prefill_kernel``; the caller has
    checked :func:`unsupported_reason`). ``tile=(BLOCK_M, BLOCK_N, STAGES, warps per consumer, consumers)``,
    default per D (``DEFAULT_TILE``)."""
    batch, num_q_heads, seq_q, head_dim = q.shape
    block_m, block_n, stages, num_warps, consumers = tile or DEFAULT_TILE[head_dim]
    desc_q, desc_k, desc_v = _descriptors(q, k, v, block_m // consumers, block_n)
    grid = (batch * num_q_heads, triton.cdiv(seq_q, block_m))
    _prefill_attention_sm90_kernel[grid](
        desc_q, desc_k, desc_v, out, lse, q_offsets, kv_lens,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), lse.stride(0), lse.stride(1),
        num_q_heads, seq_q, k.shape[2], scale * LOG2_E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, WRITE_LSE=write_lse,
        CONSUMERS=consumers, CONSUMER_REGS=CONSUMER_REGS, num_warps=num_warps,
    )


def compile_for_sm90(head_dim=128, dtype=torch.bfloat16, group=4, tile=None, write_lse=True):
    """Compile the kernel for sm_90 without a GPU (Triton's bundled ptxas); returns the compiled kernel, whose
    ``asm`` holds the TTGIR, PTX and cubin. The CPU tests use it to keep the kernel building where it cannot run."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    if interpreting():
        raise RuntimeError("compile_for_sm90 needs TRITON_INTERPRET unset: under it Triton's JIT wraps the kernel for "
                           "the interpreter, which Gluon does not have")

    block_m, block_n, stages, num_warps, consumers = tile or DEFAULT_TILE[head_dim]
    rows = 4 * max(block_m, block_n)
    fake = torch.empty(1, 1, rows, head_dim, dtype=dtype)
    desc_q, desc_k, desc_v = _descriptors(fake, fake, fake, block_m // consumers, block_n)
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    fn = _prefill_attention_sm90_kernel
    signature = {
        "desc_q": mangle_type(desc_q), "desc_k": mangle_type(desc_k), "desc_v": mangle_type(desc_v),
        "OUT": ptr, "LSE": "*fp32", "Q_OFFSETS": "*i32", "KV_LENS": "*i32",
        **{name: "i32" for name in ("stride_ob", "stride_oh", "stride_os", "stride_od", "stride_lb", "stride_lh",
                                     "num_q_heads", "seq_q", "num_keys")},
        "qk_scale": "fp32",
    }
    constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages,
                  "WRITE_LSE": write_lse, "CONSUMERS": consumers, "CONSUMER_REGS": CONSUMER_REGS,
                  "num_warps": num_warps}
    for name in constexprs:
        signature[name] = "constexpr"
    src = GluonASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
