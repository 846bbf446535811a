"""What distillation costs in memory: peak memory of POD training steps per objective and method.

    python -m eval.bench distill-memory --model default --context 2048 --batch 8 --steps 3 --out outputs/bench/distill_memory.json

For each setting (``lm`` / ``distill`` with full fine-tuning, where the teacher is a frozen dense copy, and
``lm`` / ``distill`` with LoRA, where the teacher is the student with its adapters disabled) a fresh process
builds the POD model (the block map of a quick exploration is replaced by a fixed head-wise map: memory
does not depend on which layers share), runs ``--steps`` AdamW steps through ``train.objective.ObjectiveLoss``
and reports the peak: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak resident set on CPU.
The difference between a ``distill`` row and its ``lm`` row is the teacher's cost: its weights (full FT only)
plus its forward activations, which are not kept for backward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

SETTINGS = (("full", "lm"), ("full", "distill"), ("lora", "lm"), ("lora", "distill"))

WORKER = r"""
import json, resource, sys, time, torch
from eval.models import load_model
from train.objective import ObjectiveLoss
from train.teacher import FrozenCopyTeacher, LoraTeacher, freeze
method, objective, context, batch, steps, device, dtype = sys.argv[1:8]
context, batch, steps = int(context), int(batch), int(steps)
dtype = getattr(torch, dtype)
def pod_model():
    model = load_model("default", device=device, dtype=dtype)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    anchors = [[(l // 2) * 2 if h % 2 == 0 else l for h in range(heads)] for l in range(layers)]
    model.set_sparse_attention(prefill_scheme="pod", decode_scheme="pod", pod_anchor_layers=anchors,
                               pod_sink_tokens=16, pod_recent_window=max(context // 8 - 16, 1))
    return model
student = pod_model().train()
teacher = None
if method == "lora":
    from peft import LoraConfig, get_peft_model
    student = get_peft_model(student, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                     "o_proj"]))
    teacher = LoraTeacher(student) if objective == "distill" else None
elif objective == "distill":
    dense = load_model("default", device=device, dtype=dtype)
    teacher = FrozenCopyTeacher(freeze(dense))
loss_fn = ObjectiveLoss(objective, teacher=teacher, chunk_tokens=4096)
optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-5)
vocab = student.config.vocab_size
if device.startswith("cuda"):
    torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
for _ in range(steps):
    ids = torch.randint(0, vocab, (batch, context), device=device)
    terms = loss_fn(student, {"input_ids": ids, "labels": ids})
    terms.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
if device.startswith("cuda"):
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_bytes": peak, "seconds_per_step": (time.perf_counter() - start) / steps}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench distill-memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", choices=["default"], help="the embedded SmolLM2-135M")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="weights (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/distill_memory.json"))
    args = parser.parse_args(argv)
    for name in ("context", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: expected an integer >= 1")
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    rows = []
    for method, objective in SETTINGS:
        done = subprocess.run([sys.executable, "-c", WORKER, method, objective, str(args.context), str(args.batch),
                               str(args.steps), args.device, dtype], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[2])
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        row = {"method": method, "objective": objective, **json.loads(done.stdout.strip().splitlines()[-1])}
        rows.append(row)
        print(f"{method:<5} {objective:<8} peak {row['peak_bytes'] / 2**30:7.2f} GiB  "
              f"{row['seconds_per_step']:.2f} s/step", flush=True)
    by_key = {(r["method"], r["objective"]): r for r in rows}
    for method in ("full", "lora"):
        extra = by_key[(method, "distill")]["peak_bytes"] - by_key[(method, "lm")]["peak_bytes"]
        print(f"{method}: the teacher adds {extra / 2**30:.2f} GiB "
              f"({100 * extra / by_key[(method, 'lm')]['peak_bytes']:+.0f}%)")
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "measure": "torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "peak RSS",
              "context": args.context, "batch": args.batch, "steps": args.steps, "dtype": dtype, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
