"""Triton kernel: merge the distant core's attention with the proximal band's (kernels/pod_split_attention.py).

For a query row ``i = start + t`` of a valid sequence position, with the band's ``(out_p, lse2_p)`` and the core's
``(out_d, lse_d)`` (the core's LSE in natural log, as torch's fused attention ops return it):

    m = max(lse2_p, lse2_d),  w_p = 2^(lse2_p - m),  w_d = 2^(lse2_d - m)
    out = (w_p out_p + w_d out_d) / (w_p + w_d),   lse2 = m + log2(w_p + w_d)

(log-sum-exp merge of two softmax partitions, as in ring / split-KV attention). Rows before ``start`` have no
distant pair and keep the band's values; padding rows (``i >= seq_lens[b]``) keep the band's 0 / ``+inf``. One
read of each operand and one write: the torch composition of the same formula took several full fp32 passes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._prefill_common import LOG2_E

_LOG2_E = tl.constexpr(LOG2_E)  # a jit'ed function reads module globals only as constexpr


@triton.jit
def pod_merge_kernel(
    OUT, LSE2, OUT_P, LSE2_P, OUT_D, LSE_D, SEQ_LENS,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_db, stride_dh, stride_ds,
    stride_eb, stride_eh, stride_es,
    num_heads, seq_total, start,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """OUT_P [B, H, S, D] / LSE2_P [B, H, S] (log2): the band's; OUT / LSE2 (same shapes and strides): the merge.
    OUT_D [B, H, L, D] / LSE_D [B, H, L] (natural log): the core's, any strides (unit last stride for OUT_D).

    Not in place: the warps of a program load a row's LSE in one layout and store it in another, so an in-place
    update let one warp overwrite a row another had yet to read (wrong rows, 4 in 8, seen at 32K on an H200)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    seq_len = tl.load(SEQ_LENS + b)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_in = rows < seq_total
    offs_t = rows - start
    is_core = (offs_t >= 0) & (rows < seq_len)  # rows with distant pairs; the rest keep the band's values
    d_ok = offs_d[None, :] < HEAD_DIM

    lse2_p = tl.load(LSE2_P + b * stride_lb + h * stride_lh + rows, mask=row_in, other=0.0)
    lse2_d = tl.load(LSE_D + b * stride_eb + h * stride_eh + offs_t * stride_es, mask=is_core, other=0.0) * _LOG2_E
    m = tl.where(is_core, tl.maximum(lse2_p, lse2_d), 0.0)  # finite on core rows: each sees its first anchor key
    w_p = tl.where(is_core, tl.exp2(lse2_p - m), 1.0)
    w_d = tl.where(is_core, tl.exp2(lse2_d - m), 0.0)
    total = w_p + w_d

    row_off = b * stride_ob + h * stride_oh + rows[:, None] * stride_os + offs_d[None, :]
    out_p = tl.load(OUT_P + row_off, mask=row_in[:, None] & d_ok, other=0.0).to(tl.float32)
    out_d = tl.load(OUT_D + b * stride_db + h * stride_dh + offs_t[:, None] * stride_ds + offs_d[None, :],
                    mask=is_core[:, None] & d_ok, other=0.0).to(tl.float32)
    out = (w_p[:, None] * out_p + w_d[:, None] * out_d) / total[:, None]
    tl.store(OUT + row_off, out.to(OUT.dtype.element_ty), mask=row_in[:, None] & d_ok)
    tl.store(LSE2 + b * stride_lb + h * stride_lh + rows, tl.where(is_core, m + tl.log2(total), lse2_p), mask=row_in)
