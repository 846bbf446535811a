"""Training throughput of POD vs dense: ``python -m eval.bench train [--out FILE] [shape options]``.

Default shape: Llama-3.2-1B (16 layers, hidden 2048, 32 heads, 8 KV heads, FFN 8192, vocab 128256),
random init, bf16, one sequence of 32K tokens per step, gradient checkpointing, DeepSpeed ZeRO-2
(one GPU). In the same run it trains
  * ``dense``: stock transformers ``LlamaForCausalLM`` with SDPA attention (the peer a user runs);
  * ``pod``: ``PodkitLlamaForCausalLM`` with POD prefill/training attention (kernels'
    ``pod_prefill_attention``, Triton fwd/bwd on CUDA), sink 16 + recent 4080, blocks of
    ``--block-size`` consecutive layers for every KV head (random weights have no exploration).
and reports tokens/s, the POD/dense ratio, and MFU = model FLOPs/s / peak, with model FLOPs per
token = 6 * (non-embedding params + LM head) + 6 * L * Hq * D * S (causal attention, forward +
backward; the recomputation of gradient checkpointing is not counted, as usual for MFU). Peak bf16:
989.5 TFLOP/s (H200 dense spec) and the matmul peak measured on this GPU in the same run.
Targets: POD >= 0.95x dense tokens/s (it replaced an earlier 0.85x; BENCHMARKS.md, "Targets that changed"),
dense MFU >= 35%; their current values are in BENCHMARKS.md's status table.

DeepSpeed is imported only here, lazily; without it (``--no-deepspeed`` or not installed) the step is
a plain ``torch.optim.AdamW`` step on bf16 weights, and the JSON says so.

Each scheme is measured in its own Python process. In one process the first scheme's DeepSpeed engine
stayed allocated after it was dropped (its weights, fp32 master copy, Adam state and gradient partitions:
about 20 GiB at the 1B shape), so the second scheme's peak memory included it (BENCHMARKS.md, "Where the long-context step's time went, POD's
memory under ZeRO-2").
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eval.bench.process_group import run_process_group
from kernels.triton_pod_prefill_attention import pod_attention_path
from sparse_models import PodkitLlamaConfig, PodkitLlamaForCausalLM

H200_BF16_PEAK = 989.5e12


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m eval.bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="outputs/bench/train.json")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (the SmolLM2 GPU recipe: 8 x 2048)")
    p.add_argument("--no-gradient-checkpointing", action="store_true",
                   help="keep activations (recipes/smollm2_135m_gpu.yaml trains without recomputation)")
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--recent", type=int, default=4080)
    p.add_argument("--block-size", type=int, default=2, help="consecutive layers per POD block (all KV heads)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--schemes", default="dense,pod")
    p.add_argument("--timeout-s", type=int, default=3600, help="per scheme (each runs in its own process)")
    p.add_argument("--row-out", default=None, help=argparse.SUPPRESS)  # internal: measure one scheme, write its row
    return p.parse_args(argv)


def model_config(args):
    return PodkitLlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 8192),
                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                             tie_word_embeddings=False)


def build_model(scheme: str, args, device):
    config = model_config(args)
    torch.manual_seed(0)
    if scheme == "dense":
        plain = LlamaConfig(**{k: v for k, v in config.to_dict().items() if k not in ("sparse_attention", "model_type")})
        plain._attn_implementation = "sdpa"
        model = LlamaForCausalLM(plain)
    else:
        anchors = [[(layer // args.block_size) * args.block_size] * args.kv_heads for layer in range(args.layers)]
        model = PodkitLlamaForCausalLM(config)
        model.set_sparse_attention(prefill_scheme="pod", decode_scheme="pod", pod_anchor_layers=anchors,
                                   pod_sink_tokens=args.sink, pod_recent_window=args.recent)
    model.config.use_cache = False
    if not args.no_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device=device, dtype=torch.bfloat16).train()


def model_flops_per_token(args) -> float:
    head_dim = args.hidden // args.heads
    attn_proj = args.hidden * head_dim * (2 * args.heads + 2 * args.kv_heads)
    mlp = 3 * args.hidden * args.intermediate
    params = args.layers * (attn_proj + mlp) + args.hidden * args.vocab  # + LM head; embeddings are lookups
    return 6 * params + 6 * args.layers * args.heads * head_dim * args.seq


def _deepspeed_engine(model, args):
    import deepspeed  # lazy: DeepSpeed is heavy (training benchmarks only)

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        import deepspeed.ops  # lazy: DeepSpeed is optional and heavy (training benchmarks only)

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                               "contiguous_gradients": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0, "torch_adam": True}},
              "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def measure(scheme: str, args, device, use_deepspeed: bool) -> dict:
    model = build_model(scheme, args, device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    engine = None
    if use_deepspeed:
        engine = _deepspeed_engine(model, args)

        def step():
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    result = {"scheme": scheme, "seconds_per_step": seconds, "tokens_per_s": args.batch * args.seq / seconds,
              "loss": float(loss.detach()), "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30
              if device.type == "cuda" else None, "process_id": os.getpid()}
    if scheme == "pod":
        result["pod_attention"] = pod_attention_path(device)  # PODKIT_POD_ATTENTION's route on this device
    return result


def _destroy_process_group() -> None:
    """DeepSpeed initialised a one-process group; leaving with it alive can hang the exit (seen on an H200)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def measure_in_fresh_process(scheme: str, argv: list[str], out: Path, timeout_s: float) -> dict | None:
    """:func:`measure` for one scheme in a new interpreter (see the module docstring: a DeepSpeed engine is not
    freed within a process). Returns its row, or None after printing the child's output tail when it failed."""
    row_path = out.with_name(f"{out.stem}.{scheme}.row.json")
    row_path.parent.mkdir(parents=True, exist_ok=True)
    row_path.unlink(missing_ok=True)
    keep = []
    skip_next = False
    for i, arg in enumerate(argv):  # drop the parent's --schemes / --row-out (both "--x v" and "--x=v" forms)
        if skip_next:
            skip_next = False
            continue
        if arg in ("--schemes", "--row-out"):
            skip_next = True
            continue
        if arg.startswith(("--schemes=", "--row-out=")):
            continue
        keep.append(arg)
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # the child sets up its own group
        env.pop(name, None)
    job = run_process_group([sys.executable, "-m", "eval.bench", "train", *keep, "--schemes", scheme,
                             "--row-out", str(row_path)], cwd=repo, env=env, timeout_s=timeout_s, result_file=row_path)
    if not row_path.is_file() or not (job.returncode == 0 or job.teardown_killed):
        tail = "\n".join(job.output.splitlines()[-20:])
        why = f"timed out after {timeout_s} s" if job.timed_out else f"exit code {job.returncode}"
        print(f"error: measuring {scheme} failed ({why}):\n{tail}", file=sys.stderr)
        return None
    row = json.loads(row_path.read_text())
    row_path.unlink()
    if job.teardown_killed:
        row["teardown_timed_out"] = True
    return row


def measured_matmul_peak(device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (time.perf_counter() - start)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_deepspeed = not args.no_deepspeed
    if use_deepspeed:
        try:
            import deepspeed  # noqa: F401  # lazy: probes for the optional DeepSpeed
        except ImportError:
            print("deepspeed is not installed: plain torch AdamW steps (pass --no-deepspeed to silence this)")
            use_deepspeed = False
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = sorted(set(schemes) - {"dense", "pod"})
    if unknown or not schemes:
        print(f"error: --schemes={args.schemes!r}: allowed schemes are dense and pod (comma-separated)", file=sys.stderr)
        return 2
    if args.row_out:  # child process: one scheme, its row to a file
        row = measure(schemes[0], args, device, use_deepspeed)
        Path(args.row_out).write_text(json.dumps(row))
        _destroy_process_group()
        return 0
    flops = model_flops_per_token(args)
    matmul_peak = measured_matmul_peak(device)
    rows = []
    for scheme in schemes:
        row = measure_in_fresh_process(scheme, argv if argv is not None else sys.argv[1:], Path(args.out), args.timeout_s)
        if row is None:
            return 1
        row["mfu_vs_spec"] = row["tokens_per_s"] * flops / H200_BF16_PEAK if device.type == "cuda" else None
        row["mfu_vs_measured_matmul"] = row["tokens_per_s"] * flops / matmul_peak if matmul_peak else None
        rows.append(row)
    by = {r["scheme"]: r for r in rows}
    ratio = by["pod"]["tokens_per_s"] / by["dense"]["tokens_per_s"] if {"pod", "dense"} <= set(by) else None
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"train benchmark on {device_name}: {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} "
          f"heads, {args.batch} x {args.seq} tokens per step, bf16, "
          f"{'no grad ckpt' if args.no_gradient_checkpointing else 'grad ckpt'}, {'DeepSpeed ZeRO-2' if use_deepspeed else 'torch AdamW'}")
    print(f"{'scheme':<8}{'s/step':>10}{'tokens/s':>12}{'MFU(spec)':>11}{'MFU(meas)':>11}{'mem GiB':>9}")
    for r in rows:
        fmt = lambda x, spec: (spec.format(x) if x is not None else f"{'-':>{10 if '%' in spec else 9}}")  # noqa: E731
        print(f"{r['scheme']:<8}{r['seconds_per_step']:>10.3f}{r['tokens_per_s']:>12.1f}"
              f"{fmt(r['mfu_vs_spec'] and 100 * r['mfu_vs_spec'], '{:>10.1f}%')}"
              f"{fmt(r['mfu_vs_measured_matmul'] and 100 * r['mfu_vs_measured_matmul'], '{:>10.1f}%')}"
              f"{fmt(r['peak_memory_gib'], '{:>9.1f}')}")
    if ratio is not None:
        print(f"POD / dense tokens/s: {ratio:.3f} (target >= 0.95)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device_name, "args": vars(args), "deepspeed": use_deepspeed,
                               "model_flops_per_token": flops, "matmul_peak_flops": matmul_peak,
                               "rows": rows, "pod_over_dense": ratio,
                               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, indent=1))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
