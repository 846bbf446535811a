"""Compile podkit's decode kernels for sm_90 (H200) on a machine without a GPU and print ptxas resource use.

    TRITON_INTERPRET=0 python tests/kernels/sm90_compile.py

Triton lowers each kernel to PTX and assembles it with the ptxas bundled in its wheel, so compile
errors that the CPU interpreter cannot see (layouts, histogram / atomic lowering, type rules) and
register spills show up before a GPU run. Prints one JSON object per kernel variant:
{"kernel", "variant", "regs", "stack"} (stack > 0: spilled bytes per thread).
Used by tests/kernels/test_sm90_compile.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TYPES = dict(Q="*bf16", QD="*bf16", K="*bf16", V="*bf16", KLocal="*bf16", KAnchor="*bf16", Idx="*i32", SeqLens="*i32",
              OPart="*fp32", LSEPart="*fp32", GateEst="*fp32", Scores="*fp32", LSE="*fp32", Out="*fp32",
              Hist="*i32", Counts="*i32", sm_scale="fp32", tau="fp32", KS="*fp32", VS="*fp32", KLS="*fp32",
              KAS="*fp32", KR="*bf16", KRL="*bf16", KRA="*bf16")
# FP8 variants (kernels/fp8_kv.py): the caches are float8_e4m3fn, read with the FP8 constexpr; the append kernel
# writes them through uint8 views
_FP8_TYPES = dict(K="*fp8e4nv", V="*fp8e4nv", KLocal="*fp8e4nv", KAnchor="*fp8e4nv", KBUF="*u8", VBUF="*u8",
                  RING="*u8")
_APPEND_TYPES = dict(POS="*i64", KBUF="*bf16", VBUF="*bf16", RING="*bf16", KEY_HEADS="*i32", KSC="*fp32",
                     VSC="*fp32", RSC="*fp32")


def resource_usage(fn, constexprs, types=None, num_warps=4, num_stages=2):
    """(registers, stack bytes) per thread of `fn` compiled for sm_90; other args default to i32."""
    types = {**_TYPES, **(types or {})}
    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    fields = dict(tok.split(":") for tok in next(line for line in text.splitlines() if "REG:" in line).split()
                  if ":" in tok)
    return int(fields["REG"]), int(fields["STACK"])


def variants():
    """Every variant of the bf16 caches (FP8=False), then the FP8 variants of the kernels that read K/V."""
    for name, variant, fn, constexprs, types, num_warps, num_stages in _bf16_variants():
        if "FP8" in fn.arg_names:
            constexprs = dict(constexprs, FP8=False)
        yield name, variant, fn, _no_recent(fn, constexprs), types, num_warps, num_stages
    # one FP8 variant per code path (each compile costs about a second): selection at G = 4, POD decode's skip and
    # own-anchor modes, both list granularities of the two sparse kernels, the append
    fp8_skipped = {("decode_split", "selection G=1"), ("decode_split", "selection G=8"),
                   ("pod_decode_split", "skip=False"), ("pod_decode_split", "skip=False scores")}
    for name, variant, fn, constexprs, types, num_warps, num_stages in _bf16_variants():
        if "FP8" in fn.arg_names and (name, variant) not in fp8_skipped:
            yield (name, f"{variant} fp8", fn, _no_recent(fn, dict(constexprs, FP8=True)), {**types, **_FP8_TYPES},
                   num_warps, num_stages)
    # recent keys (kernels/fp8_kv.py "Recent keys"): the FP8 kernels that read the model-dtype ring, W = 64
    recent = {("decode_split", "selection G=4"), ("sparse_decode_split", "per_group=False"),
              ("sparse_decode_split", "per_group=True"), ("pod_decode_split", "skip=True"),
              ("pod_decode_split", "skip=False own-anchor"), ("pod_sparse_split", "per_group=False"),
              ("pod_sparse_split", "per_group=True")}
    for name, variant, fn, constexprs, types, num_warps, num_stages in _bf16_variants():
        if (name, variant) in recent:
            constexprs = dict(constexprs, FP8=True, RECENT=64)
            if "RECENT_DISTANT" in fn.arg_names:  # POD decode: a window wider than the proximal one (the worst case)
                constexprs["RECENT_DISTANT"] = 64
            yield name, f"{variant} fp8 recent", fn, constexprs, {**types, **_FP8_TYPES}, num_warps, num_stages


def _no_recent(fn, constexprs: dict) -> dict:
    """A constexpr left out of the dict would compile as a runtime i32: RECENT = 0 (and POD decode's RECENT_DISTANT)
    for the kernels that have it."""
    if "RECENT_DISTANT" in fn.arg_names:
        constexprs = dict(constexprs, RECENT_DISTANT=0)
    return dict(constexprs, RECENT=0) if "RECENT" in fn.arg_names else constexprs


def _bf16_variants():
    from kernels import _decode_topk_split as TS
    from kernels import triton_cache_append as AP
    from kernels import triton_decode_attention as DA
    from kernels import triton_fp8_quantize as FQ
    from kernels import triton_pod_decode_attention as PD
    from kernels import triton_pod_sparse_decode_attention as PS
    from kernels import triton_sparse_decode_attention as SP
    yield ("cache_append", "pod ring", AP._append_kv_kernel,
           dict(HEAD_DIM=128, BLOCK_D=128, MAPPED=True, HAS_RING=True), _APPEND_TYPES, 4, 2)
    yield ("fp8_quantize", "", FQ._quantize_kv_kernel, dict(D=128, BLOCK_D=128, BLOCK_R=FQ._BLOCK_R),
           dict(X="*bf16", Data="*u8", Scale="*fp32"), 4, 2)
    tile = dict(BLOCK_N=64, D=128, BLOCK_D=128, IEEE=False)
    for G in (1, 4, 8):
        yield ("decode_split", f"selection G={G}", DA._decode_split_kernel,
               dict(G=G, BLOCK_G=16, RETURN_SCORES=True, EXCLUDE_LAST=True, HIST0=True, GH=G, BITS=8, LEVELS=4,
                    CVT=0, REMASK=0, **tile), {}, DA._NUM_WARPS, DA._NUM_STAGES)  # CVT, REMASK: FP8 "base"
    yield ("group_probability", "hist0", DA._group_probability_kernel,
           dict(G=4, BLOCK_G=4, BLOCK_N=256, HIST0=True, BITS=8, LEVELS=4), {}, 4, 2)
    passes = dict(BITS_=TS.BITS, LEVELS_=TS.LEVELS, BLOCK=TS._BLOCK)
    for level in range(TS.LEVELS):
        yield ("topk_hist_pass", f"level {level}", TS._hist_pass_kernel, dict(LEVEL=level, **passes), {"K": "i32"},
               TS._NUM_WARPS, 2)
    yield "topk_count", "", TS._count_kernel, passes, {"K": "i32"}, TS._NUM_WARPS, 2
    yield ("topk_write", "", TS._write_kernel, dict(BLOCK_S=128, **passes), {"K": "i32", "Out": "*i64"},
           TS._NUM_WARPS, 2)
    for skip, by_position, scores in ((False, False, False), (True, False, False), (False, True, False),
                                      (False, False, True)):
        variant = f"skip={skip}" + (" own-anchor" if by_position else "") + (" scores" if scores else "")
        yield ("pod_decode_split", variant, PD._pod_decode_split_kernel,
               dict(G=4, BLOCK_G=16, SKIP=skip, LOCAL_BY_POSITION=by_position, RETURN_SCORES=scores, **tile), {},
               PD._NUM_WARPS, PD._NUM_STAGES)
    for per_group in (False, True):
        plan = SP._PLAN_GROUP if per_group else SP._PLAN_HEAD
        yield ("sparse_decode_split", f"per_group={per_group}", SP._sparse_decode_split_kernel,
               dict(G=4, HEADS_PER_LIST=4 if per_group else 1, BLOCK_G=16 if per_group else 1, D=128, BLOCK_D=128,
                    BLOCK_N=plan["block_n"], USE_DOT=per_group, IEEE=False), {},
               plan["num_warps"], plan["num_stages"])
    for per_group in (False, True):
        plan = PS._PLAN_GROUP if per_group else PS._PLAN_HEAD
        yield ("pod_sparse_split", f"per_group={per_group}", PS._pod_sparse_split_kernel,
               dict(G=4, HEADS_PER_LIST=4 if per_group else 1, BLOCK_G=16 if per_group else 1, D=128, BLOCK_D=128,
                    BLOCK_N=plan["block_n"], USE_DOT=per_group, IEEE=False, SKIP=True), {},
               plan["num_warps"], plan["num_stages"])


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("sm90_compile: run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    for name, variant, fn, constexprs, types, num_warps, num_stages in variants():
        regs, stack = resource_usage(fn, constexprs, types, num_warps, num_stages)
        print(json.dumps(dict(kernel=name, variant=variant, num_warps=num_warps, regs=regs, stack=stack)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
