"""One rank of the 2-process sequence-parallel test (launched by test_sequence_parallel_dist.py with torchrun;
``sp_dist_worker.py REPORT cuda`` runs it on 2 GPUs over NCCL; ``sp_dist_worker.py REPORT triton`` on CPU over gloo
with the CUDA dispatch, i.e. podkit's Triton kernels under TRITON_INTERPRET=1, as on the GPUs).

Each rank builds the same tiny model; the one-process reference (whole rows, no SP) is computed locally on
every rank. The SP run uses the real path: deepspeed.comm on gloo, DeepSpeed's SP groups and _SeqAllToAll,
train.sequence_parallel.sequence_parallel_loss, and a DeepSpeed engine (ZeRO stage 0, no mpu) whose
backward averages gradients over the world. Rank 0 writes a JSON report to argv[1].
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

DEVICE = torch.device("cpu")  # cuda:LOCAL_RANK when launched with argv[2] == "cuda" (NCCL)


def probe_all_to_all(dist) -> str | None:
    """None if the backend runs all_to_all_single, else the error text."""
    world = dist.get_world_size()
    x = torch.arange(world, dtype=torch.float32, device=DEVICE) + 100 * dist.get_rank()
    out = torch.empty_like(x)
    try:
        dist.all_to_all_single(out, x)
    except (RuntimeError, NotImplementedError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    expected = torch.arange(world, dtype=torch.float32, device=DEVICE) * 100 + dist.get_rank()
    return None if torch.equal(out, expected) else f"all_to_all_single returned {out.tolist()}, expected {expected.tolist()}"


def engine_for(model):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def compare_case(sp, heads, kv_heads, scheme, checkpointing, seed):
    from sp_helpers import VOCAB, tiny_pod_model

    from train.sequence_parallel import attach_sequence_parallel, sequence_parallel_loss

    batch, s_loc = 2, 9
    s = sp.size * s_loc
    model = tiny_pod_model(heads, kv_heads, scheme=scheme, seed=seed).to(DEVICE).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (batch, s), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    ref_out = reference(input_ids=ids, labels=ids)
    ref_out.loss.backward()

    attach_sequence_parallel(model, sp)
    if checkpointing:  # recomputation re-runs the all-to-alls in backward, on every rank in the same order
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = engine_for(model)
    cut = slice(sp.rank * s_loc, (sp.rank + 1) * s_loc)
    shift_labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    inputs = {"input_ids": ids[:, cut], "shift_labels": shift_labels[:, cut],
              "position_ids": torch.arange(s_loc, device=DEVICE).expand(batch, -1)}
    loss, row_loss, outputs = sequence_parallel_loss(engine, inputs, sp)
    engine.backward(loss)  # DeepSpeed's all-reduce of gradients, averaged over the world
    with torch.no_grad():  # the SP loss never forms the logits (chunked LM head): form this slice's to compare
        logits = model.get_output_embeddings()(outputs.hidden_states[-1])
    logits_error = (logits - ref_out.logits[:, cut]).abs().max().item()
    grad_error, grad_scale = 0.0, 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        grad_error = max(grad_error, (p.grad - q.grad).abs().max().item())
        grad_scale = max(grad_scale, q.grad.abs().max().item())
    attach_sequence_parallel(model, None)
    return {"case": f"heads={heads} kv={kv_heads} {scheme} checkpointing={checkpointing}",
            "loss_sp": row_loss.item(), "loss_reference": ref_out.loss.item(), "logits_max_error": logits_error,
            "grad_max_error": grad_error, "grad_max_abs": grad_scale}


def check_adapter(sp) -> dict:
    """DeepSpeed's UlyssesSPDataLoaderAdapter over a per-rank loader: every rank gets its slice of rank 0's row,
    then of rank 1's row; shift_labels are shifted over the whole row."""
    from torch.utils.data import DataLoader

    from train.sequence_parallel import collate_with_position_ids, sequence_parallel_dataloader

    length = 8 * sp.size
    rows = {r: list(range(1000 * r, 1000 * r + length)) for r in range(sp.size)}
    mine = [{"input_ids": rows[sp.rank], "labels": rows[sp.rank]}]
    adapter = sequence_parallel_dataloader(DataLoader(mine, batch_size=1, collate_fn=collate_with_position_ids), sp,
                                           DEVICE)
    problems = []
    if len(adapter) != sp.size:
        problems.append(f"len(adapter)={len(adapter)}, expected {sp.size}")
    chunk = length // sp.size
    cut = slice(sp.rank * chunk, (sp.rank + 1) * chunk)
    for source in range(sp.size):
        got = next(adapter)
        row = torch.tensor([rows[source]])
        shifted = torch.nn.functional.pad(row[:, 1:], (0, 1), value=-100)
        if not torch.equal(got["input_ids"], row[:, cut]):
            problems.append(f"input_ids of row {source}: {got['input_ids'].tolist()}")
        if not torch.equal(got["shift_labels"], shifted[:, cut]):
            problems.append(f"shift_labels of row {source}: {got['shift_labels'].tolist()}")
        if not torch.equal(got["position_ids"], torch.arange(length)[None, cut]):
            problems.append(f"position_ids of row {source}: {got['position_ids'].tolist()}")
    problems += check_adapter_skip_and_epochs(sp)
    return {"adapter_problems": problems}


def check_adapter_skip_and_epochs(sp) -> list[str]:
    """3 rows per rank. A resume that skips 3 micro-batches continues with the 4th; an exhausted pass keeps
    raising StopIteration until iter() starts the next epoch, which sees every row again."""
    from torch.utils.data import DataLoader

    from train.sequence_parallel import collate_with_position_ids, sequence_parallel_dataloader

    length, count = 4 * sp.size, 3
    mine = [{"input_ids": [10000 * sp.rank + 100 * i + t for t in range(length)]} for i in range(count)]
    for row in mine:
        row["labels"] = row["input_ids"]

    def first_tokens(adapter, n):
        out = []
        for _ in range(n):
            out.append(int(next(adapter)["input_ids"][0, 0]))
        return out

    loader = DataLoader(mine, batch_size=1, collate_fn=collate_with_position_ids)
    full = first_tokens(sequence_parallel_dataloader(loader, sp, DEVICE), count * sp.size)
    problems = []
    resumed = sequence_parallel_dataloader(loader, sp, DEVICE, skip_micro_batches=3)
    rest = first_tokens(resumed, count * sp.size - 3)
    if rest != full[3:]:
        problems.append(f"after skipping 3: {rest}, expected {full[3:]}")
    for attempt in range(2):
        try:
            next(resumed)
            problems.append(f"exhausted adapter yielded a batch (attempt {attempt})")
        except StopIteration:
            pass
    resumed.set_epoch(1)
    if first_tokens(iter(resumed), count * sp.size) != full:
        problems.append("the next epoch did not see every row again")
    return problems


def main(out_path: str, device: str = "cpu") -> int:
    global DEVICE
    if device == "cuda":
        DEVICE = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(DEVICE)
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if device == "triton":  # the kernels' CUDA path on CPU tensors (set before any kernel module is imported)
        os.environ["TRITON_INTERPRET"] = "1"
        import kernels

        kernels.use_triton = lambda tensor: True
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo; no 60 s JIT build
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    import torch.distributed as dist

    torch.set_num_threads(1)
    report = {"world": dist.get_world_size(), "backend": dist.get_backend()}
    unsupported = probe_all_to_all(dist)
    if unsupported is None:
        from train.sequence_parallel import setup_sequence_parallel

        sp = setup_sequence_parallel(dist.get_world_size())
        report["cases"] = [compare_case(sp, 6, 2, "pod", True, 1), compare_case(sp, 8, 4, "pod", False, 2),
                           compare_case(sp, 4, 2, "dense", True, 3)]
        report.update(check_adapter(sp))
    else:
        report["unsupported"] = unsupported
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
