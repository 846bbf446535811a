"""Sparse decode (per-head / per-group lists) tuning sweep + random-gather floor + kernel split, H200."""
import json, os, sys, itertools
import torch
sys.path.insert(0, os.getcwd())
from eval.bench.kernels_decode import _bench_graph, _random_lists, torch_sparse, copy_bandwidth
from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton
from kernels import _decode_common as C
from kernels import reference
dev = torch.device("cuda"); gen = torch.Generator(device=dev); gen.manual_seed(0)
bw = copy_bandwidth(dev); out = {"copy_bw_TBps": bw / 1e12, "rows": []}
orig_plan = C.plan_splits
HQ, HKV, D = 32, 8, 128
for N, B, K in ((32768, 1, 2048), (131072, 1, 2048), (131072, 4, 2048), (131072, 8, 2048)):
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    for Hs, name in ((HQ, "head"), (HKV, "group")):
        idx = _random_lists(B, Hs, N, K, dev, gen)
        floor = (2 * B * Hs * K * D * 2 + idx.numel() * 4) / bw * 1e6
        # random-gather floor: the same rows gathered by torch (index_select on the flat cache) into a buffer
        flat_k, flat_v = k.view(-1, D), v.view(-1, D)
        grp = (torch.arange(Hs, device=dev) // (Hs // HKV)) if Hs == HQ else torch.arange(HKV, device=dev)
        base = (torch.arange(B, device=dev)[:, None] * HKV + grp[None, :]) * N  # [B, Hs]
        rows = (base[..., None] + idx.long()).reshape(-1)
        gather_us = _bench_graph(lambda: (flat_k.index_select(0, rows), flat_v.index_select(0, rows)))
        ref = torch_sparse(q, k, v, idx)
        t_torch = _bench_graph(lambda: torch_sparse(q, k, v, idx))
        base_us = _bench_graph(lambda: sparse_decode_attention_triton(q, k, v, idx))
        res = dict(N=N, B=B, K=K, lists=name, floor_us=floor, gather_copy_us=gather_us, torch_us=t_torch,
                   default_us=base_us, variants=[])
        for bn, nw, ns, waves in itertools.product((16, 32, 64), (2, 4, 8), (2, 3), (4, 16)):
            if name == "group" and bn < 16: continue
            C.plan_splits = lambda L, R, d, blk, waves=waves, **kw: orig_plan(L, R, d, blk, waves=waves)
            try:
                fn = lambda: sparse_decode_attention_triton(q, k, v, idx, _block_n=bn, _num_warps=nw, _num_stages=ns)
                o = fn(); err = (o.float() - ref.float()).abs().max().item()
                t = _bench_graph(fn)
                res["variants"].append(dict(block_n=bn, warps=nw, stages=ns, waves=waves, us=t, err=err))
            except Exception as e:
                res["variants"].append(dict(block_n=bn, warps=nw, stages=ns, waves=waves, error=str(e)[:200]))
            finally:
                C.plan_splits = orig_plan
        ok = [x for x in res["variants"] if "us" in x and x["err"] < 0.05]
        best = min(ok, key=lambda x: x["us"]) if ok else None
        res["best"] = best
        # kernel split of the default launch: split kernel vs merge kernel
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10): sparse_decode_attention_triton(q, k, v, idx)
            torch.cuda.synchronize()
        res["kernels_us"] = {e.key[:60]: e.device_time_total / 10 for e in prof.key_averages() if e.device_time_total > 0}
        out["rows"].append(res)
        print(f"{N}x{B} {name}: floor {floor:.1f} gather {gather_us:.1f} torch {t_torch:.1f} default {base_us:.1f} "
              f"best {best and best['us']:.1f} {best} kernels {res['kernels_us']}", flush=True)
        json.dump(out, open(os.environ.get("OUTF", "/tmp/sweep.json"), "w"), indent=1)
