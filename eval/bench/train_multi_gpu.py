"""Multi-GPU POD training throughput and the longest trainable context.

``python -m eval.bench train-multi-gpu --num-gpus 1,2,8 [--seq 32768] [--sp 1] [--out FILE]``
launches ``deepspeed --num_gpus N`` once per N (this file in worker mode) and prints one table:
tokens/s of the whole job, tokens/s per GPU, scaling efficiency against the smallest N
(``eff = tps_N / (tps_min * N / N_min)``; target >= 85% at 2 GPUs), peak memory.

``python -m eval.bench train-multi-gpu --num-gpus 8 --sp 8 --find-max-context --seq 32768``
doubles the context from ``--seq`` (up to ``--max-seq``), one fresh launch per length (an OOM leaves
nothing behind), and reports the longest length whose steps completed.

What one step is: Llama-3-8B shape by default (32 layers, hidden 4096, 32/8 heads, FFN 14336, vocab
128256), random init, bf16, gradient checkpointing, DeepSpeed ZeRO-3 (``--zero-config``), POD attention
(sink 16 + recent 4080, blocks
of ``--block-size`` layers) or ``--scheme dense`` (podkit's dense kernels), one sequence of ``--seq``
tokens per data-parallel replica. Memory: full fine-tuning of 8B keeps ~16 bytes of weights, gradients
and Adam state per parameter (~128 GB), which ZeRO-3 splits over the GPUs; on ONE H200 that leaves too little
for 32K activations and logits, so the 1-GPU row needs ``--zero-config recipes/deepspeed/zero3_offload.json``
(CPU Adam: not a like-for-like baseline; its fp32 master weights, Adam moments and gradients need ~128 GB of
host memory for 8B), ``--method lora`` (peft adapters on every projection: the bf16 weights stay whole on the GPU and
only the adapters train), or the same per-layer shape with fewer ``--layers`` for the scaling efficiency. A failed launch is recorded in the JSON (``failures``) and the next N still runs. With ``--sp P`` (Ulysses, train/sequence_parallel.py) P GPUs share
each sequence, so a step processes ``N / P`` sequences. Tokens/s = N/P * seq / seconds per step.
The same code path as ``train/pod.py`` with ``train.sequence_parallel_size`` (model hook, SP groups,
SP loss), minus the Trainer and data loading.

Long context (train/long_context.py, DeepSpeed's ALST components): ``--tiled-mlp [--tiled-mlp-shards K]``
and ``--activation-offload``, as ``train.tiled_mlp`` / ``train.activation_offload`` in a recipe. The loss runs
the LM head and cross-entropy ``--loss-chunk-tokens`` tokens at a time from the final hidden states
(train/losses.py, as the training pipeline does), so the ``[tokens x vocab]`` logits never exist whole;
``--loss-chunk-tokens 0`` forms them whole (the "before" of the memory-against-context plot).

The launcher: the ``deepspeed`` script beside the interpreter, else the one on PATH, else
``python -m deepspeed.launcher.runner`` (:func:`deepspeed_launcher`); none of them: exit 2, nothing written.

Multi-host: pass ``--hostfile FILE`` (DeepSpeed's format, ``host slots=8`` per line); ``--num-gpus`` is
then the GPUs per host and the job spans every host in the file.

Runs on CPU too (``DS_ACCELERATOR=cpu``, gloo; tiny shapes via ``--layers/--hidden/...``), which is how
tests/train/test_bench_train_multi_gpu.py checks the launcher and the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # launched by deepspeed as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from eval.bench.memory_plot import _label, plot_memory_vs_context  # noqa: E402
from eval.bench.process_group import run_process_group  # noqa: E402
from sparse_models import PodkitLlamaConfig, PodkitLlamaForCausalLM  # noqa: E402
from train.long_context import CheckpointOffload, attach_checkpoint_offload, enable_tiled_mlp  # noqa: E402
from train.objective import ObjectiveLoss  # noqa: E402
from train.recipe_schema import LORA_DEFAULT_TARGETS  # noqa: E402
from train.sequence_parallel import attach_sequence_parallel, sequence_parallel_loss, setup_sequence_parallel  # noqa: E402
from train.trainer import add_lora_adapters  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEARDOWN_GRACE_S = 60  # seconds a job may take to exit after writing its result


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m eval.bench train-multi-gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-gpus", default="1,2", help="comma-separated GPU counts, one launch each (per host with --hostfile)")
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile for a multi-host job")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port of each launch (default: a free port chosen per launch)")
    p.add_argument("--out", default="outputs/bench/train_multi_gpu.json")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel size (GPUs per sequence)")
    p.add_argument("--find-max-context", action="store_true", help="double --seq until a step fails")
    p.add_argument("--max-seq", type=int, default=1 << 20)
    p.add_argument("--scheme", choices=("pod", "dense"), default="pod")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--recent", type=int, default=4080)
    p.add_argument("--block-size", type=int, default=2)
    p.add_argument("--zero-config", default="recipes/deepspeed/zero3.json")
    p.add_argument("--tiled-mlp", action="store_true", help="train.tiled_mlp: DeepSpeed's TiledMLP (train/long_context.py)")
    p.add_argument("--tiled-mlp-shards", type=int, default=None, help="slices (default ceil(seq / SP / hidden))")
    p.add_argument("--activation-offload", action="store_true",
                   help="train.activation_offload: checkpointed layer inputs to CPU")
    p.add_argument("--loss-chunk-tokens", type=int, default=4096,
                   help="LM head + cross-entropy this many tokens at a time (train/losses.py); 0 = whole logits at once")
    p.add_argument("--method", choices=("full", "lora"), default="full",
                   help="full fine-tuning, or peft LoRA on every projection (train.method: lora)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout-s", type=int, default=3600, help="per launch")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON path: run one measurement
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    args.gpu_counts = [int(n) for n in str(args.num_gpus).split(",") if n.strip()]
    problems = [f"--num-gpus {n}: not a multiple of --sp {args.sp}" for n in args.gpu_counts if n % args.sp]
    if args.seq % args.sp:
        problems.append(f"--seq {args.seq}: not divisible by --sp {args.sp}")
    if args.kv_heads % args.sp or args.heads % args.sp:
        problems.append(f"--sp {args.sp}: Ulysses needs --heads {args.heads} and --kv-heads {args.kv_heads} divisible by it")
    if args.tiled_mlp_shards is not None and (args.tiled_mlp_shards < 1 or not args.tiled_mlp):
        problems.append(f"--tiled-mlp-shards {args.tiled_mlp_shards}: expected an integer >= 1, with --tiled-mlp")
    if args.loss_chunk_tokens < 0:
        problems.append(f"--loss-chunk-tokens {args.loss_chunk_tokens}: expected 0 (whole logits) or a positive integer")
    if args.lora_r < 1:
        problems.append(f"--lora-r {args.lora_r}: expected an integer >= 1")
    if problems:
        p.error("; ".join(problems))
    return args


# ---------------------------------------------------------------------------------------------- worker


def deepspeed_config(args, world: int) -> dict:
    """recipes/deepspeed/<zero>.json with its "auto" values filled the way the HF integration fills them."""
    config = json.loads((REPO / args.zero_config).read_text() if not Path(args.zero_config).is_absolute()
                        else Path(args.zero_config).read_text())
    zero = config.setdefault("zero_optimization", {})
    fills = {"reduce_bucket_size": args.hidden * args.hidden, "stage3_prefetch_bucket_size": int(0.9 * args.hidden ** 2),
             "stage3_param_persistence_threshold": 10 * args.hidden}
    for key, value in fills.items():
        if zero.get(key) == "auto":
            zero[key] = value
    config["bf16"] = {"enabled": True}
    config["fp16"] = {"enabled": False}
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world,
                  gradient_clipping=1.0, steps_per_print=10 ** 9)
    params = config.get("optimizer", {}).get("params", {})
    for key, value in {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}.items():
        if params.get(key) == "auto":
            params[key] = value
    config.pop("scheduler", None)
    return config


def build_model(args, ds_config):
    # lazy: may import DeepSpeed, after run_worker sets DS_ACCELERATOR
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(ds_config)  # ZeRO-3: transformers builds the model inside deepspeed.zero.Init
    config = PodkitLlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                               num_hidden_layers=args.layers, num_attention_heads=args.heads,
                               num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 8192),
                               rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                               tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = PodkitLlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    if args.scheme == "pod":
        anchors = [[(layer // args.block_size) * args.block_size] * args.kv_heads for layer in range(args.layers)]
        model.set_sparse_attention(prefill_scheme="pod", decode_scheme="pod", pod_anchor_layers=anchors,
                                   pod_sink_tokens=args.sink, pod_recent_window=args.recent)
    else:
        model.set_sparse_attention(prefill_scheme="dense", decode_scheme="dense")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.method == "lora":  # train.method: lora with the recipe's default targets (every projection)
        model = add_lora_adapters(model, r=args.lora_r, alpha=2 * args.lora_r, dropout=0.0,
                                  target_modules=LORA_DEFAULT_TARGETS)
    return model.train(), keep_alive


def run_worker(args) -> int:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # lazy: DeepSpeed is heavy (training benchmarks only)

    if not torch.cuda.is_available():
        import deepspeed.ops  # lazy: DeepSpeed is optional and heavy (training benchmarks only)

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip the shm op's JIT build on CPU
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sp = setup_sequence_parallel(args.sp)
    replicas = world // args.sp
    ds_config = deepspeed_config(args, world)
    model, keep_alive = build_model(args, ds_config)
    if sp is not None:
        attach_sequence_parallel(model, sp)
    offload = None
    if args.tiled_mlp or args.activation_offload:
        if args.tiled_mlp:
            enable_tiled_mlp(model, args.seq // args.sp, args.tiled_mlp_shards)
        if args.activation_offload:
            offload = CheckpointOffload()
            attach_checkpoint_offload(model, offload)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config)
    replica = rank // args.sp
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1000 + replica))
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    width = args.seq // args.sp
    cut = slice((sp.rank if sp else 0) * width, ((sp.rank if sp else 0) + 1) * width)
    ids, labels = ids[:, cut].to(device), labels[:, cut].to(device)

    def step():
        if offload is not None:  # forward and backward inside: the offloaded inputs come back in backward
            with offload:
                return offloaded_step()
        return offloaded_step()

    def offloaded_step():
        chunk = args.loss_chunk_tokens or None  # None: the whole [tokens x vocab] logits at once (the "before")
        if sp is not None:
            loss, row_loss, _ = sequence_parallel_loss(engine, {"input_ids": ids, "shift_labels": labels}, sp,
                                                       chunk_tokens=chunk)
        else:  # what the Trainer runs for train.objective: lm (labels = the ids, shifted inside)
            loss = ObjectiveLoss("lm", chunk_tokens=chunk)(engine, {"input_ids": ids}).loss
            row_loss = loss.detach()
        engine.backward(loss)
        engine.step()
        return row_loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        row_loss = step()
    sync()
    dist.barrier()
    seconds = (time.perf_counter() - start) / args.steps
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        tokens = replicas * args.seq
        Path(args.worker).write_text(json.dumps({
            "gpus": world, "sp": args.sp, "replicas": replicas, "seq": args.seq, "scheme": args.scheme,
            "seconds_per_step": seconds, "tokens_per_step": tokens, "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_gpu": tokens / seconds / world, "loss": float(row_loss),
            "peak_memory_gib_max_rank": float(peak.item()) if device.type == "cuda" else None,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "zero_config": args.zero_config, "tiled_mlp": args.tiled_mlp, "tiled_mlp_shards": args.tiled_mlp_shards,
            "activation_offload": args.activation_offload, "loss_chunk_tokens": args.loss_chunk_tokens,
            "method": args.method, "lora_r": args.lora_r if args.method == "lora" else None,
            # ZeRO-3 leaves each parameter's local shard in .data; ds_numel is the whole parameter
            "trainable_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)}))
    del keep_alive
    # tear the process groups down before exit: a rank leaving with gloo's threads alive can abort in C++
    # ("terminate called without an active exception"), which failed a CPU CI run after the result was written
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------- launcher


def deepspeed_launcher(python: str | None = None, search_path: str | None = None) -> list[str]:
    """The command that starts DeepSpeed's launcher, in this order: the ``deepspeed`` script beside the
    interpreter (a virtualenv's bin/), the one on ``PATH`` (``search_path``, default the environment's;
    DeepSpeed installed elsewhere, e.g. a system or user site), or ``python -m deepspeed.launcher.runner``
    (what that script runs) when the package imports here. Raises FileNotFoundError naming all three."""
    python = python or sys.executable
    beside = Path(python).parent / "deepspeed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    on_path = shutil.which("deepspeed", path=search_path if search_path is not None else os.environ.get("PATH"))
    if on_path:
        return [on_path]
    if python == sys.executable and importlib.util.find_spec("deepspeed") is not None:
        return [python, "-m", "deepspeed.launcher.runner"]
    raise FileNotFoundError(f"no DeepSpeed launcher: no executable {beside}, no 'deepspeed' on PATH, and the deepspeed "
                            f"package does not import in {python}; install it (pip install deepspeed) or put its "
                            f"'deepspeed' script on PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, gpus: int, seq: int, result_path: Path) -> tuple[dict | None, str]:
    """One ``deepspeed`` job; (its result, or None with the tail of its output when it failed).

    A job that wrote its result and then did not exit within ``TEARDOWN_GRACE_S`` (process-group teardown) keeps its
    row, marked ``"teardown_timed_out": true``: the steps completed and were timed (eval/bench/process_group.py)."""
    command = deepspeed_launcher()
    if args.hostfile:
        command += ["--hostfile", args.hostfile]
    port = args.master_port if args.master_port is not None else _free_port()
    command += ["--num_gpus", str(gpus), "--master_port", str(port), str(Path(__file__).resolve())]
    for name in ("sp", "scheme", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "sink", "recent",
                 "block_size", "zero_config", "warmup", "steps", "loss_chunk_tokens", "method", "lora_r"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--tiled-mlp"] * args.tiled_mlp + ["--activation-offload"] * args.activation_offload
    if args.tiled_mlp_shards is not None:
        command += ["--tiled-mlp-shards", str(args.tiled_mlp_shards)]
    command += ["--seq", str(seq), "--num-gpus", str(gpus), "--worker", str(result_path)]
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    job = run_process_group(command, cwd=REPO, env=env, timeout_s=args.timeout_s, result_file=result_path,
                            grace_s=TEARDOWN_GRACE_S)
    output = job.output
    if job.timed_out:
        output = f"{output}\ntimed out after {args.timeout_s} s (the launcher and its ranks were killed)"
    if result_path.is_file() and (job.returncode == 0 or job.teardown_killed):
        row = json.loads(result_path.read_text())
        if job.teardown_killed:
            row["teardown_timed_out"] = True
        return row, ""
    tail = "\n".join(str(output).splitlines()[-15:])
    return None, tail


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return run_worker(args)
    try:
        launcher = deepspeed_launcher()
    except FileNotFoundError as error:  # before anything is launched or written
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"launcher: {' '.join(launcher)}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_suffix(".run.json")
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "local_rank")},
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": [], "failures": []}
    if args.find_max_context:
        gpus, seq, longest = args.gpu_counts[-1], args.seq, None
        while seq <= args.max_seq:
            row, tail = launch(args, gpus, seq, scratch)
            print(f"{gpus} GPU(s), SP {args.sp}, seq {seq}: " + (f"{row['tokens_per_s']:.0f} tokens/s" if row else "failed"),
                  flush=True)
            if row is None:
                report["failures"].append({"gpus": gpus, "seq": seq, "output_tail": tail})
                break
            report["rows"].append(row)
            longest, seq = seq, seq * 2
        report["longest_trainable_context"] = longest
        report["stopped_by"] = "failure" if report["failures"] else f"--max-seq {args.max_seq}"
        print(f"longest trainable context with SP {args.sp} on {gpus} GPU(s): {longest} "
              f"(stopped by {report['stopped_by']})")
    else:
        for gpus in args.gpu_counts:
            row, tail = launch(args, gpus, args.seq, scratch)
            if row is None:
                report["failures"].append({"gpus": gpus, "seq": args.seq, "output_tail": tail})
                print(f"{gpus} GPU(s): failed\n{tail}", flush=True)
            else:
                report["rows"].append(row)
        if report["rows"]:
            base = report["rows"][0]
            for row in report["rows"]:
                row["scaling_efficiency"] = row["tokens_per_s"] / (base["tokens_per_s"] * row["gpus"] / base["gpus"])
            extras = "".join([", LoRA" * (args.method == "lora"), ", tiled MLP" * args.tiled_mlp,
                              ", checkpoint offload" * args.activation_offload,
                              ", whole logits" * (args.loss_chunk_tokens == 0)])
            print(f"POD training ({args.scheme}), {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} "
                  f"heads, seq {args.seq}, SP {args.sp}, bf16, grad ckpt{extras}, {args.zero_config}, on {base['device']}")
            print(f"scaling efficiency against the {base['gpus']}-GPU row (the first that ran)")
            print(f"{'GPUs':>5}{'s/step':>10}{'tokens/s':>12}{'per GPU':>10}{'efficiency':>12}{'peak GiB':>10}")
            for r in report["rows"]:
                peak = f"{r['peak_memory_gib_max_rank']:>10.1f}" if r["peak_memory_gib_max_rank"] is not None else f"{'-':>10}"
                print(f"{r['gpus']:>5}{r['seconds_per_step']:>10.3f}{r['tokens_per_s']:>12.1f}"
                      f"{r['tokens_per_s_per_gpu']:>10.1f}{100 * r['scaling_efficiency']:>11.1f}%{peak}")
    scratch.unlink(missing_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"-> {out}")
    if args.find_max_context and any(r["peak_memory_gib_max_rank"] is not None for r in report["rows"]):
        print(f"-> {plot_memory_vs_context({_label(report): report}, out.with_suffix('.png'))}")
    return 0 if not report["failures"] or args.find_max_context and report.get("longest_trainable_context") else 1


if __name__ == "__main__":
    from train.process_exit import exit_process

    exit_process(main())  # the workers are ranks of a deepspeed launch: train/process_exit.py says why
