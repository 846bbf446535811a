"""POD sparse decode tuning sweep (per-head / per-group), H200."""
import json, os, sys, itertools
import torch
sys.path.insert(0, os.getcwd())
from eval.bench.kernels_decode import _bench_graph, _random_lists, copy_bandwidth
from kernels.triton_pod_sparse_decode_attention import pod_sparse_decode_attention_triton as F
from kernels import _decode_common as C
dev = torch.device("cuda"); gen = torch.Generator(device=dev); gen.manual_seed(0)
bw = copy_bandwidth(dev); out = {"copy_bw_TBps": bw / 1e12, "rows": []}
orig_plan = C.plan_splits
HQ, HKV, D, SINK, REC = 32, 8, 128, 4, 2048
for N, B, K in ((32768, 1, 2048), (131072, 1, 2048), (131072, 4, 2048)):
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    kl = torch.randn(B, HKV, SINK + REC, D, device=dev, dtype=torch.bfloat16)
    lens = torch.full((B,), N, device=dev, dtype=torch.int32)
    for Hs, name in ((HQ, "head"), (HKV, "group")):
        idx = _random_lists(B, Hs, N, K, dev, gen)
        floor = (2 * B * Hs * K * D * 2 + idx.numel() * 4) / bw * 1e6
        ref = F(q, kl, k, v, idx, lens, sink=SINK, recent=REC)
        base_us = _bench_graph(lambda: F(q, kl, k, v, idx, lens, sink=SINK, recent=REC))
        res = dict(N=N, B=B, K=K, lists=name, floor_us=floor, default_us=base_us, variants=[])
        for bn, nw, ns, waves in itertools.product((16, 32, 64), (2, 4, 8), (2, 3), (4, 16)):
            if name == "group" and nw == 2: continue
            C.plan_splits = lambda L, R, d, blk, waves=waves, max_splits=C.MAX_SPLITS: orig_plan(L, R, d, blk, waves=waves, max_splits=max_splits)
            try:
                fn = lambda: F(q, kl, k, v, idx, lens, sink=SINK, recent=REC, _block_n=bn, _num_warps=nw, _num_stages=ns)
                o = fn(); err = (o.float() - ref.float()).abs().max().item()
                res["variants"].append(dict(block_n=bn, warps=nw, stages=ns, waves=waves, us=_bench_graph(fn), err=err))
            except Exception as e:
                res["variants"].append(dict(block_n=bn, warps=nw, stages=ns, waves=waves, error=str(e)[:200]))
            finally:
                C.plan_splits = orig_plan
        ok = [x for x in res["variants"] if "us" in x and x["err"] < 0.05]
        res["best"] = min(ok, key=lambda x: x["us"]) if ok else None
        out["rows"].append(res)
        print(f"pod_sparse {N}x{B} {name}: floor {floor:.1f} default {base_us:.1f} best {res['best']}", flush=True)
        json.dump(out, open(os.environ.get("OUTF", "/tmp/sweep_pod.json"), "w"), indent=1)
