"""A/B of the dense prefill kernel before and after the 2026-12-01 change, against SDPA (run from the repository root
of a git checkout on a GPU: python benchmarks/h200_2026-12-01/prefill_issue13_s8/prefill_ab.py; writes $OUTF). The
previous kernel is taken from commit fb9e405 (`git show`) into the kernels package for the run (it imports kernels'
helpers); the measured run had that same file beside it."""
import json, os, subprocess, sys
sys.path.insert(0, os.getcwd())
with open("kernels/_old_prefill.py", "w") as f:
    f.write(subprocess.run(["git", "show", "fb9e405:kernels/triton_prefill_attention.py"], check=True,
                           capture_output=True, text=True).stdout)
import torch, triton, triton.testing
import torch.nn.functional as F
from kernels import _old_prefill as OLD
from kernels import triton_prefill_attention as NEW
res = {}
for S in (8192, 32768):
    torch.manual_seed(0)
    q = torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    offs = torch.zeros(1, dtype=torch.int32, device="cuda"); lens = torch.full((1,), S, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = {}
        for name, fn in (("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
                         ("old", lambda: OLD.prefill_attention_triton(q, k, v, offs, lens)),
                         ("new", lambda: NEW.prefill_attention_triton(q, k, v, offs, lens))):
            o = fn(); err = (o.float() - ref.float()).abs().max().item()
            ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
            out[name] = dict(ms=ms, err=err, tflops=4 * 32 * S * S * 128 / 2 / ms / 1e9)
        out["old_over_sdpa"] = out["old"]["ms"] / out["sdpa"]["ms"]; out["new_over_sdpa"] = out["new"]["ms"] / out["sdpa"]["ms"]
        best = {n: str(getattr(m._prefill_attention_kernel, "best_config", "")) for n, m in (("old", OLD), ("new", NEW))}
        out["best_config"] = best
    res[S] = out
    print(S, json.dumps(out), flush=True)
json.dump(res, open(os.environ.get("OUTF", "/tmp/prefill_ab.json"), "w"), indent=1)
