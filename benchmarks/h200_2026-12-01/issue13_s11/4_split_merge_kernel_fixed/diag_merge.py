import json, os, sys, torch
import torch.nn.functional as F
from kernels import pod_split_attention as split
from kernels._prefill_pod_launch import _pod_forward
res = {}
torch.manual_seed(0)
S, sink, recent = int(sys.argv[1]), 16, 4080
c = sink + recent; L = S - c; scale = 128 ** -0.5
q = torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16)
lens = torch.full((1,), S, dtype=torch.int32, device="cuda")
qc, kc, vc = q[:, :, c:], k[:, :, sink:S - recent], v[:, :, sink:S - recent]
for name, core in (("cudnn", split._CudaCudnn()), ("flash", split._CudaFlash()), ("efficient", split._CudaEfficient())):
    for rep in (False, True):
        kk, vv = (kc.repeat_interleave(4, 1), vc.repeat_interleave(4, 1)) if rep else (kc, vc)
        try:
            out_d, lse_d, _ = core.forward(qc, kk, vv, scale)
        except Exception as e:
            res[f"{name}_rep{rep}"] = repr(e)[:200]; continue
        ref = F.scaled_dot_product_attention(qc.float(), kc.repeat_interleave(4, 1).float(), vc.repeat_interleave(4, 1).float(), is_causal=True, scale=scale) if name == "cudnn" and not rep else ref
        err = (out_d.float() - ref).abs()
        res[f"{name}_rep{rep}"] = dict(out_err=err.max().item(), rows_bad=int((err.amax(dim=(0, 1, 3)) > 0.01).sum()), lse_shape=list(lse_d.shape), lse_stride=list(lse_d.stride()), out_stride=list(out_d.stride()))
# merge: torch vs kernel
core = split._CudaFlash()
out_d, lse_d, _ = core.forward(qc, kc, vc, scale)
out_p, lse2_p, _ = _pod_forward(q, k, k, v, lens, sink, recent, scale, False, prox_only=True)
lse_p = lse2_p[:, :, c:] / 1.4426950408889634
mg = torch.logaddexp(lse_p, lse_d.float())
ref_m = torch.exp(lse_p - mg)[..., None] * out_p[:, :, c:].float() + torch.exp(lse_d - mg)[..., None] * out_d.float()
o2, l2 = split._merge_core_with_band(out_p, lse2_p, out_d, split._rows(lse_d, L), lens, c)
res["merge_err"] = (o2[:, :, c:].float() - ref_m).abs().max().item()
res["merge_lse_err"] = (l2[:, :, c:] / 1.4426950408889634 - mg).abs().max().item()
full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float()
res["flash_merged_vs_sdpa"] = (o2.float() - full).abs().max().item()
print(json.dumps(res, indent=1))
bad = ((o2[:, :, c:].float() - ref_m).abs() > 0.01).nonzero().tolist()
info = {"n_bad": len(bad), "first": []}
w = torch.exp(lse_d - mg)
for bb, h, t, d in bad[:6]:
    info["first"].append(dict(h=h, t=t, d=d, got=o2[bb, h, c + t, d].item(), ref=ref_m[bb, h, t, d].item(),
                              out_p=out_p[bb, h, c + t, d].item(), out_d=out_d[bb, h, t, d].item(), w_d=w[bb, h, t].item()))
rows_bad = sorted({(h, t) for _, h, t, _ in bad})
info["n_rows_bad"] = len(rows_bad); info["rows"] = rows_bad[:20]
print(json.dumps(info))
