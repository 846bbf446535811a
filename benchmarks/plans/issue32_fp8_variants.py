"""Issue 32: A/B timing of the FP8 full-decode variants (kernels/triton_decode_attention.FP8_DECODE_VARIANTS).

    python3 benchmarks/plans/issue32_fp8_variants.py --out $OUT/fp8_variants.json
        [--contexts 32768 131072] [--batches 1 4] [--variants base f16_vreg ...] [--iters 50]

Llama-3-8B attention shape (32 query heads, 8 KV heads, D = 128, bf16 q), every sequence full. Per context x
batch: random bf16 K/V quantised (kernels/fp8_kv.quantize_kv), the bf16 kernel timed on the dequantised K/V and
every FP8 variant on the FP8 cache, each as CUDA-graph replays with L2 flushed before each, median (the method of
eval/bench/kernels_decode.py, `_bench_graph`, imported from there). Copy bandwidth is measured in the same run
(eval/bench/kernels_decode.copy_bandwidth). Checks per variant: max abs difference to the bf16 kernel on the
dequantised data, and the error against an fp64 reference on the FP8 cache, which must stay within 4x the fp32
reference's own error + 1e-6 (tests/kernels/kernel_checks.py's rule), else the row is marked wrong.
Writes the JSON, a PNG next to it when matplotlib imports, and prints a table. Needs torch + triton + this repo.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

HQ, HKV, D = 32, 8, 128
ERROR_FACTOR, ERROR_FLOOR = 4.0, 1e-6


def parse_args(argv, variant_names):
    """Arguments, validated before any GPU work (argparse exits 2 with one line on a bad value)."""
    ap = argparse.ArgumentParser(prog="issue32_fp8_variants.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path (the PNG goes next to it)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--variants", nargs="+", default=list(variant_names), choices=list(variant_names), metavar="V",
                    help=f"FP8 variants to time (default all: {', '.join(variant_names)})")
    ap.add_argument("--iters", type=int, default=50, help="CUDA-graph replays per timing (median)")
    args = ap.parse_args(argv)
    for name, vals, lo in (("--contexts", args.contexts, 1), ("--batches", args.batches, 1), ("--iters", [args.iters], 1)):
        bad = [x for x in vals if x < lo]
        if bad:
            ap.error(f"{name} {bad[0]} must be >= {lo}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        ap.error(f"--out {args.out}: folder {out_dir} does not exist")
    return args


def grouped_reference(q, k8, ks, v8, vs, dtype):
    """Decode attention on an FP8 cache in ``dtype`` (fp32 or fp64) without expanding K/V to the query heads.
    q [B,Hq,D], k8/v8 [B,Hkv,N,D] e4m3, ks/vs [B,Hkv,N] -> out [B,Hq,D] in ``dtype`` (all slots valid)."""
    B, Hq, Dh = q.shape
    Hkv = k8.shape[1]
    k = k8.to(dtype) * ks.to(dtype)[..., None]
    v = v8.to(dtype) * vs.to(dtype)[..., None]
    qg = q.to(dtype).view(B, Hkv, Hq // Hkv, Dh)
    logits = torch.einsum("bhgd,bhnd->bhgn", qg, k) * Dh ** -0.5
    out = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(logits, -1), v)
    return out.reshape(B, Hq, Dh)


def measure_shape(N, B, variants, bw, iters, gen):
    """Rows for one context x batch: the bf16 kernel, then each FP8 variant (time, ratio, bytes, bw share, errors)."""
    from eval.bench.kernels_decode import _bench_graph
    from kernels.fp8_kv import bytes_per_token, dequantize_kv, quantize_kv
    from kernels.triton_decode_attention import decode_attention_triton
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    seq_lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
    (k8, ks), (v8, vs) = (quantize_kv(torch.randn(B, HKV, N, D, device="cuda", dtype=torch.bfloat16, generator=gen))
                          for _ in range(2))
    kd, vd = dequantize_kv(k8, ks, torch.bfloat16), dequantize_kv(v8, vs, torch.bfloat16)
    exact = grouped_reference(q, k8, ks, v8, vs, torch.float64)
    ref_err = (grouped_reference(q, k8, ks, v8, vs, torch.float32).to(torch.bfloat16).double() - exact).abs().max().item()
    tol = ERROR_FACTOR * ref_err + ERROR_FLOOR
    out16 = decode_attention_triton(q, kd, vd, seq_lens)
    t16 = _bench_graph(lambda: decode_attention_triton(q, kd, vd, seq_lens), iters=iters)
    bytes16, bytes8 = (B * HKV * N * bytes_per_token(D, c) for c in ("bfloat16", "fp8_e4m3"))
    rows = [dict(context=N, batch=B, variant="bf16", us=t16, over_bf16=1.0, bytes=bytes16,
                 bw_share=bytes16 / bw * 1e6 / t16, err_vs_ref=(out16.double() - exact).abs().max().item(),
                 diff_vs_bf16=0.0, ok=True)]
    for name in variants:
        row = dict(context=N, batch=B, variant=name, bytes=bytes8, tolerance=tol)
        try:
            fn = lambda: decode_attention_triton(q, k8, v8, seq_lens, k_scale=ks, v_scale=vs, fp8_variant=name)  # noqa: E731
            out = fn()
            err = (out.double() - exact).abs().max().item()
            t8 = _bench_graph(fn, iters=iters)
            row.update(us=t8, over_bf16=t8 / t16, bw_share=bytes8 / bw * 1e6 / t8, err_vs_ref=err,
                       diff_vs_bf16=(out.double() - out16.double()).abs().max().item(),
                       ok=bool(err <= tol and torch.isfinite(out).all().item()),
                       # the CPU tests' bound for fp16-dot variants on bf16 q: one bf16 ulp of the largest output
                       within_bf16_ulp=bool(err <= 2.0 ** -7 * exact.abs().max().item() + ERROR_FLOOR))
        except Exception as exc:  # noqa: BLE001 - one failing variant must not cost the others their rows
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(r):
    if "us" not in r:
        return f"{r['context']:>7} {r['batch']:>2} {r['variant']:<26} ERROR {r.get('error', '')}"
    return (f"{r['context']:>7} {r['batch']:>2} {r['variant']:<26} {r['us']:9.1f} us {r['over_bf16']:6.3f}x "
            f"{r['bw_share'] * 100:5.1f}% bw  err {r['err_vs_ref']:.2e}  d_bf16 {r['diff_vs_bf16']:.2e}"
            f"{'' if r['ok'] else '  WRONG' + ('' if r.get('within_bf16_ulp') else ' (> 1 bf16 ulp)')}")


def plot(rows, path):
    """Bars of fp8 / bf16 time per variant, one group per context x batch; skipped without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes = sorted({(r["context"], r["batch"]) for r in rows})
    names = [n for n in dict.fromkeys(r["variant"] for r in rows) if n != "bf16"]
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 4.5))
    width = 0.8 / max(len(shapes), 1)
    for i, (N, B) in enumerate(shapes):
        vals = [next((r.get("over_bf16", float("nan")) for r in rows
                      if (r["context"], r["batch"], r["variant"]) == (N, B, n)), float("nan")) for n in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"{N // 1024}K x {B}")
    ax.axhline(0.6, color="k", ls="--", lw=1, label="target 0.6")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("FP8 time / bf16 kernel time")
    ax.set_title("Issue 32: FP8 full-decode variants (CUDA-graph replays)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    from kernels.triton_decode_attention import FP8_DECODE_VARIANTS  # the names, for argument checks
    args = parse_args(argv, tuple(FP8_DECODE_VARIANTS))
    if not torch.cuda.is_available():
        print("issue32_fp8_variants: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from eval.bench.kernels_decode import copy_bandwidth
    os.environ["PODKIT_SKIP_VALUE_CHECKS"] = "1"  # no host syncs inside graph capture, as the engine runs
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    for N in args.contexts:
        for B in args.batches:
            rows += measure_shape(N, B, args.variants, bw, args.iters, gen)
            torch.cuda.empty_cache()
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  shape=dict(Hq=HQ, Hkv=HKV, D=D), copy_bandwidth_TBps=bw / 1e12,
                  variants={n: FP8_DECODE_VARIANTS[n] for n in args.variants}, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = plot(rows, os.path.splitext(args.out)[0] + ".png")
    print("\n".join(format_row(r) for r in rows))
    print(f"wrote {args.out}" + (f" and {png}" if png else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
