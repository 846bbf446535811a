"""POD training attention backward: current (dkdv + dq kernels) vs fused dkdv+atomic dQ variants.
PODKIT_HOPPER_CONFIGS=0 python3 benchmarks/h200_2026-12-01/issue13_s10/pod_backward_atomic_dq/bench_bwd.py OUT.json
(from the repository root; TRITON_INTERPRET=1 for a tiny CPU check). Measured 2026-12-01 on one H200: bwd.json."""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton
from kernels import _prefill_pod_launch as tp
from kernels._prefill_common import LOG2_E, dot_precision, head_dim_block, interpreter_active
from kernels._prefill_pod_bwd import pod_delta_kernel, pod_dkdv_kernel, pod_dq_kernel
import fused

interp = interpreter_active()
dev = "cpu" if interp else "cuda"
res = {"device": torch.cuda.get_device_name() if not interp else "cpu", "triton": triton.__version__,
       "torch": torch.__version__, "rows": []}
if not interp:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
cfgs = fused.fused_configs() if not interp else [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
kernel = fused.make_kernel(cfgs)


def launch_parts(q, k, a, v, sl, out, lse2, dout, sink, recent, scale, parts):
    B, Hq, S, D = q.shape; Hkv = k.shape[1]; G = Hq // Hkv; bd = head_dim_block(D); prec = dot_precision(q.dtype)
    delta = torch.empty_like(lse2)
    if "delta" in parts:
        pod_delta_kernel[(triton.cdiv(S, 64), B * Hq)](out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2), delta.stride(0), delta.stride(1), Hq, S,
            HEAD_DIM=D, BLOCK_D=bd, BLOCK_M=64)
    dko = torch.empty(k.shape, device=q.device, dtype=q.dtype); dka = torch.empty_like(dko); dv = torch.empty_like(dko)
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), a.stride(0), a.stride(1),
              a.stride(2), v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
              lse2.stride(0), lse2.stride(1))
    if "dkdv" in parts:
        pod_dkdv_kernel[lambda m: (triton.cdiv(S, m["BLOCK_N"]), B * Hkv)](q, k, a, v, dout, lse2, delta, sl, dko, dka, dv,
            *common, dko.stride(0), dko.stride(1), dko.stride(2), Hkv, S, sink, recent, scale * LOG2_E, scale,
            GROUP=G, HEAD_DIM=D, BLOCK_D=bd, DOT_PRECISION=prec)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if "dq" in parts:
        pod_dq_kernel[lambda m: (triton.cdiv(S, m["BLOCK_M"]), B * Hq)](q, k, a, v, dout, lse2, delta, sl, dq,
            *common, dq.stride(0), dq.stride(1), dq.stride(2), Hq, S, sink, recent, scale * LOG2_E, scale,
            GROUP=G, HEAD_DIM=D, BLOCK_D=bd, DOT_PRECISION=prec)
    if "fused0" in parts or "fused1" in parts:
        mode = 1 if "fused1" in parts else 0
        dq32 = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        kernel[lambda m: (triton.cdiv(S, m["BLOCK_N"]), B * Hkv)](q, k, a, v, dout, lse2, delta, sl, dko, dka, dv, dq32,
            *common, dko.stride(0), dko.stride(1), dko.stride(2), Hkv, S, sink, recent, scale * LOG2_E, scale,
            GROUP=G, HEAD_DIM=D, BLOCK_D=bd, DOT_PRECISION=prec, DQ_MODE=mode)
        dq = dq32.to(q.dtype)
    return dq, dko, dka, dv


def bench(fn):
    if interp:
        t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=50, rep=400)


def case(B, Hq, Hkv, S, D, sink, recent, lens, dtype, timing):
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda h: torch.randn(B, h, S, D, device=dev, dtype=dtype, generator=g)
    q, k, a, v, dout = mk(Hq), mk(Hkv), mk(Hkv), mk(Hkv), mk(Hq)
    sl = torch.tensor(lens, device=dev, dtype=torch.int32)
    scale = D ** -0.5
    out, lse2, _ = tp._pod_forward(q, k, a, v, sl, sink, recent, scale, False)
    ref = launch_parts(q, k, a, v, sl, out, lse2, dout, sink, recent, scale, ("delta", "dkdv", "dq"))
    row = {"shape": [B, Hq, Hkv, S, D], "sink": sink, "recent": recent, "lens": lens, "dtype": str(dtype)}
    modes = ["fused0"] + (["fused1"] if (not interp and D == head_dim_block(D)) else [])
    for m in modes:
        try:
            got = launch_parts(q, k, a, v, sl, out, lse2, dout, sink, recent, scale, ("delta", m))
            row[m + "_maxabs"] = [float((x.float() - y.float()).abs().max()) for x, y in zip(got, ref)]
            row[m + "_refmax"] = [float(y.float().abs().max()) for y in ref]
            if timing:
                row[m + "_ms"] = bench(lambda: launch_parts(q, k, a, v, sl, out, lse2, dout, sink, recent, scale, ("delta", m)))
                row[m + "_config"] = str(kernel.best_config)
        except Exception as e:  # noqa: BLE001
            row[m + "_error"] = repr(e)[:2000]
    if timing:
        row["current_bwd_ms"] = bench(lambda: launch_parts(q, k, a, v, sl, out, lse2, dout, sink, recent, scale, ("delta", "dkdv", "dq")))
        row["delta_ms"] = bench(lambda: launch_parts(q, k, a, v, sl, out, lse2, dout, sink, recent, scale, ("delta",)))
        row["dkdv_ms"] = bench(lambda: launch_parts(q, k, a, v, sl, out, lse2, dout, sink, recent, scale, ("delta", "dkdv")))
        row["dq_ms"] = bench(lambda: launch_parts(q, k, a, v, sl, out, lse2, dout, sink, recent, scale, ("delta", "dq")))
        row["dkdv_config"] = str(pod_dkdv_kernel.best_config); row["dq_config"] = str(pod_dq_kernel.best_config)
        row["pod_fwd_ms"] = bench(lambda: tp._pod_forward(q, k, a, v, sl, sink, recent, scale, False))
        qs, ks, vs = [x.detach().requires_grad_() for x in (q, k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1))]
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        row["sdpa_fwd_ms"] = bench(sd)
        row["sdpa_fwdbwd_ms"] = bench(lambda: sd().backward(dout))
    res["rows"].append(row); print(json.dumps(row), flush=True)


if interp:
    case(2, 4, 1, 80, 32, 4, 24, [80, 57], torch.float32, False)
    case(1, 6, 2, 70, 16, 0, 20, [70], torch.float32, False)
else:
    case(1, 32, 8, 32768, 128, 16, 4080, [32768], torch.bfloat16, True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
    case(2, 32, 8, 3000, 128, 16, 1000, [3000, 2048], torch.bfloat16, False)
json.dump(res, open(sys.argv[1], "w"), indent=1)
