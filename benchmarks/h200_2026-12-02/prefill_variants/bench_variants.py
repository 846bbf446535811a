"""Time the dense prefill variants of dense_variants.py against torch SDPA and podkit's kernel in one run.

    python benchmarks/h200_2026-12-02/prefill_variants/bench_variants.py OUT.json [--lengths 8192 32768]

One sequence, 32 query / 8 KV heads, D 128, bf16, causal (the Llama-3-8B attention shape). Every row is checked
against SDPA (max abs error) before it is timed; ``do_bench`` medians. The FLOP floor uses a bf16 matmul rate
measured in the same run. A config that fails to compile or run is recorded with its error, not dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dense_variants import dense_prefill_variant  # noqa: E402

from kernels.triton_prefill_attention import _prefill_attention_kernel, prefill_attention_triton  # noqa: E402

CONFIGS = {
    "fma": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 4),
            (256, 64, 16, 2), (256, 64, 16, 3), (256, 128, 16, 2)],
    "pipe": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
    "pair": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
    "tma": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 4),
            (256, 64, 16, 2), (256, 128, 16, 2)],
    "ws": [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
           (256, 64, 8, 2), (256, 64, 16, 2), (256, 128, 16, 2)],
    "wsm": [(128, 64, 4, 2), (128, 128, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (256, 64, 16, 2)],
}


def matmul_rate_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * 8192 ** 3 / ms / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--variants", nargs="+", default=list(CONFIGS))
    args = ap.parse_args()
    rate = matmul_rate_tflops()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "matmul_tflops": rate, "lengths": {}}
    print(f"bf16 matmul {rate:.0f} TFLOP/s", flush=True)
    for seq in args.lengths:
        torch.manual_seed(0)
        q = torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, seq, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        offsets = torch.zeros(1, dtype=torch.int32, device="cuda")
        lens = torch.full((1,), seq, dtype=torch.int32, device="cuda")
        flops = 4 * 32 * seq * seq * 128 / 2
        rows = {}
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def timed(fn):
                err = (fn().float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                return {"ms": ms, "max_abs_err": err, "tflops": flops / ms / 1e9}

            rows["sdpa"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            rows["podkit"] = timed(lambda: prefill_attention_triton(q, k, v, offsets, lens))
            rows["podkit"]["config"] = str(getattr(_prefill_attention_kernel, "best_config", ""))
            for name in args.variants:
                for bm, bn, warps, stages in CONFIGS[name]:
                    key = f"{name}_m{bm}_n{bn}_w{warps}_s{stages}"
                    try:
                        rows[key] = timed(lambda: dense_prefill_variant(name, q, k, v, block_m=bm, block_n=bn,
                                                                        num_warps=warps, num_stages=stages))
                    except Exception as exc:  # noqa: BLE001  (a config that does not compile is a result too)
                        rows[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    row = rows[key]
                    if "ms" in row:
                        row["x_sdpa"] = row["ms"] / rows["sdpa"]["ms"]
                    print(seq, key, json.dumps(row), flush=True)
        rows["podkit"]["x_sdpa"] = rows["podkit"]["ms"] / rows["sdpa"]["ms"]
        result["lengths"][str(seq)] = {"flop_floor_ms": flops / rate / 1e9, "rows": rows}
        print(seq, "sdpa", rows["sdpa"], "podkit", rows["podkit"], flush=True)
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
