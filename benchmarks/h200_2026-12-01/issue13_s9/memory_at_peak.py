"""Where POD's extra training memory is: 1B shape, 32K, one step each of dense (transformers SDPA) and POD,
plain AdamW (no DeepSpeed, same for both). Phase peaks + the live allocations at the step's peak (CUDA
allocator trace replay), grouped by the first repository / library frame."""
import json, sys, time, collections
sys.path.insert(0, ".")
import torch
from eval.bench.train import build_model, parse_args
args = parse_args(["--seq", sys.argv[2] if len(sys.argv) > 2 else "32768"])
dev = torch.device("cuda")
out = {}
def site(frames):
    keep = []
    for f in frames:
        fn = f["filename"]
        if any(k in fn for k in ("/kernels/", "/sparse_models/", "/train/", "/eval/", "transformers/models", "torch/nn/functional", "torch/utils/checkpoint", "autograd")):
            keep.append(f"{fn.split('/')[-2]}/{fn.split('/')[-1]}:{f['line']}:{f['name']}")
        if len(keep) == 3: break
    return " < ".join(keep) or (frames[0]["filename"].split("/")[-1] + ":" + frames[0]["name"] if frames else "?")
for scheme in ("dense", "pod"):
    model = build_model(scheme, args, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, args.vocab, (1, args.seq), device=dev)
    def step(phases=None):
        torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize(); fwd = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward(); torch.cuda.synchronize(); bwd = torch.cuda.max_memory_allocated()
        opt.step(); opt.zero_grad(set_to_none=True)
        if phases is not None:
            phases.update(base_gib=base / 2**30, fwd_peak_gib=fwd / 2**30, bwd_peak_gib=bwd / 2**30)
    step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=400000)
    phases = {}
    t0 = time.perf_counter(); step(phases); torch.cuda.synchronize(); phases["step_s"] = time.perf_counter() - t0
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, None
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", [])); total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif a in ("free_completed",) and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    groups = collections.Counter(); counts = collections.Counter()
    for size, frames in (at_peak or {}).values():
        k = site(frames); groups[k] += size; counts[k] += 1
    phases["trace_peak_gib_above_start"] = peak / 2**30
    phases["top_at_peak"] = [(k, round(v / 2**30, 3), counts[k]) for k, v in groups.most_common(25)]
    out[scheme] = phases
    print(scheme, json.dumps({k: v for k, v in phases.items() if k != "top_at_peak"}))
    for row in phases["top_at_peak"][:15]: print("   ", row)
    model = opt = None; torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
