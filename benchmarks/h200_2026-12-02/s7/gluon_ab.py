"""One tile of the Gluon sm_90 prefill kernel (kernels/gluon_prefill_attention_sm90.py): correctness on ragged GQA
batches against the fp64 reference, then time against torch SDPA and podkit's Triton kernel at 8K / 32K / 128K.

    python benchmarks/h200_2026-12-02/s7/gluon_ab.py OUT.json BLOCK_M BLOCK_N STAGES WARPS CONSUMERS

One process per tile (a barrier mistake hangs the GPU, and the caller's timeout then costs one tile, not the run).
Shape: one sequence, 32 query / 8 KV heads, D 128, bf16, causal (Llama-3-8B attention); ``do_bench`` medians.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.getcwd())
os.environ["PODKIT_SKIP_VALUE_CHECKS"] = "1"

from kernels import reference  # noqa: E402
from kernels.gluon_prefill_attention_sm90 import launch_prefill_kernel_sm90  # noqa: E402
from kernels.triton_prefill_attention import launch_prefill_kernel  # noqa: E402


def run(kernel, q, k, v, q_offsets, kv_lens, tile=None):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device)
    group = q.shape[1] // k.shape[1]
    kernel(q, k, v, out, lse, q_offsets.int(), kv_lens.int(), group, q.shape[-1] ** -0.5, True, tile=tile)
    return out, lse


def check(tile, group, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, hkv, s = 3, 2, 700
    q = torch.randn(batch, hkv * group, s, dim, generator=gen).cuda().to(dtype)
    k = torch.randn(batch, hkv, s, dim, generator=gen).cuda().to(dtype)
    v = torch.randn(batch, hkv, s, dim, generator=gen).cuda().to(dtype)
    q_offsets = torch.tensor([0, 0, 37], device="cuda")
    kv_lens = torch.tensor([s, 513, 300], device="cuda")
    out, lse = run(launch_prefill_kernel_sm90, q, k, v, q_offsets, kv_lens, tile)
    exact_out, exact_lse = reference.prefill_attention(q.double(), k.double(), v.double(), q_offsets, kv_lens,
                                                       return_lse=True)
    ref_out = reference.prefill_attention(q, k, v, q_offsets, kv_lens)
    finite = torch.isfinite(exact_lse)
    return {"group": group, "dim": dim, "dtype": str(dtype),
            "out_err": (out.double() - exact_out).abs().max().item(),
            "ref_err": (ref_out.double() - exact_out).abs().max().item(),
            "lse_err": (lse[finite].double() - exact_lse[finite]).abs().max().item(),
            "padding_ok": bool(torch.isinf(lse[~finite]).all() and (out[~finite] == 0).all()),
            "nan": bool(torch.isnan(out).any()),
            # where NaNs are (batch, head, row): to tell a race in one warp group from a bad tile edge
            "nan_rows": torch.isnan(out).any(-1).nonzero()[:12].tolist()}


def main():
    out_path = sys.argv[1]
    tile = tuple(int(x) for x in sys.argv[2:7])
    result = {"tile": tile, "device": torch.cuda.get_device_name(), "checks": [], "lengths": {}}
    for group, dim, dtype in ((1, 128, torch.bfloat16), (3, 128, torch.bfloat16), (4, 128, torch.float16),
                              (8, 128, torch.bfloat16)):
        result["checks"].append(check(tile, group, dim, dtype, seed=group))
        print(tile, result["checks"][-1], flush=True)
    json.dump(result, open(out_path, "w"), indent=1)
    for seq in (8192, 32768, 131072):
        torch.manual_seed(0)
        q = torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, seq, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        offs = torch.zeros(1, dtype=torch.int32, device="cuda")
        lens = torch.full((1,), seq, dtype=torch.int32, device="cuda")
        flops = 4 * 32 * seq * seq * 128 / 2
        row = {}
        with torch.no_grad():
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
            ref = sdpa()
            for name, fn in (("sdpa", sdpa),
                             ("gluon", lambda: run(launch_prefill_kernel_sm90, q, k, v, offs, lens, tile)[0]),
                             ("triton", lambda: run(launch_prefill_kernel, q, k, v, offs, lens)[0])):
                err = (fn().float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_err_vs_sdpa": err}
        for name in ("gluon", "triton"):
            row[name]["x_sdpa"] = row[name]["ms"] / row["sdpa"]["ms"]
        result["lengths"][str(seq)] = row
        print(tile, seq, json.dumps(row), flush=True)
        json.dump(result, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
