"""Ulysses sequence parallelism for POD training: ``train.sequence_parallel_size: P`` in the recipe.

DeepSpeed-Ulysses (arXiv 2309.14509), with DeepSpeed's own pieces (deepspeed >= 0.18):

* process groups: ``deepspeed.runtime.sequence_parallel.parallel_state_sp.initialize_sequence_parallel``
  -- consecutive ranks ``[i*P, (i+1)*P)`` form one SP group (keep P <= GPUs per host so the
  all-to-alls stay on NVLink);
* attention: the model's per-layer attention is wrapped by ``sparse_models.sequence_parallel.
  UlyssesAttention`` (``deepspeed.sequence.layer._SeqAllToAll`` to head shards of the whole
  sequence and back); RoPE uses global positions;
* data: ``deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter`` -- the usual
  data-parallel loader gives each rank its own packed rows; the adapter gathers the rows of the SP
  group and hands every rank its 1/P slice of one row at a time (plus ``shift_labels``, the labels
  shifted by one over the *whole* row, so the slice boundaries lose no target);
* loss: :func:`sequence_parallel_loss` -- token-level cross-entropy summed on the slice, normalised by
  the token count of the whole row (summed over the SP group).

Gradient scaling. The transformers Trainer builds the DeepSpeed engine without an ``mpu``, so the
engine treats all W ranks as data parallel and averages gradients over W. The gradient of one row's
mean loss is the *sum* of the P slices' gradients (the all-to-all backward routes every attention
gradient to the rank that owns the token). Each rank therefore backpropagates ``P * slice_sum / N_row``:
averaging over W = DP * P ranks gives the mean over the DP replicas of the per-row gradient, as
without SP. (tests/train/test_sequence_parallel_dist.py checks loss and gradients against one process.)
"""

from __future__ import annotations

import torch

from sparse_models.sequence_parallel import UlyssesAttention


def setup_sequence_parallel(size: int) -> UlyssesAttention | None:
    """Create (once per process) DeepSpeed's SP groups of ``size`` ranks; None when ``size == 1``.

    Needs ``deepspeed.comm`` initialised (``deepspeed.init_distributed()``) on every rank; collective.
    """
    if size == 1:
        return None
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp_state

    if not dist.is_initialized():
        raise RuntimeError("sequence parallelism needs deepspeed.comm initialised (launch with deepspeed, and set "
                           "deepspeed.config in the recipe)")
    world = dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"train.sequence_parallel_size={size}: expected a divisor of the world size {world}")
    if sp_state._SEQUENCE_PARALLEL_GROUP is None:
        sp_state.initialize_sequence_parallel(size)
    if sp_state.get_sequence_parallel_world_size() != size:
        raise RuntimeError(f"sequence-parallel groups of {sp_state.get_sequence_parallel_world_size()} ranks already "
                           f"exist in this process; cannot switch to {size}")
    return UlyssesAttention(group=sp_state.get_sequence_parallel_group(), size=size,
                            rank=sp_state.get_sequence_parallel_rank())


def attach_sequence_parallel(model, sp: UlyssesAttention | None) -> None:
    """Point every podkit decoder inside ``model`` (plain, peft-wrapped or DeepSpeed-wrapped) at ``sp``."""
    from sparse_models.modeling_common import PodkitModelMixin

    decoders = [m for m in model.modules() if isinstance(m, PodkitModelMixin)]
    if not decoders:
        raise TypeError(f"{type(model).__name__} holds no podkit decoder: sequence parallelism needs a podkit model "
                        f"class (sparse_models)")
    for decoder in decoders:
        if sp is not None:
            kv_heads, heads = decoder.config.num_key_value_heads, decoder.config.num_attention_heads
            if kv_heads % sp.size or heads % sp.size:
                raise ValueError(f"train.sequence_parallel_size={sp.size}: Ulysses needs the attention heads "
                                 f"({heads}) and KV heads ({kv_heads}) divisible by it")
        decoder.sequence_parallel = sp


def collate_with_position_ids(features: list[dict]) -> dict[str, torch.Tensor]:
    """``default_data_collator`` plus ``position_ids`` [B, S] = 0..S-1 (the adapter requires them; podkit's
    model derives global positions itself, from the SP rank)."""
    from transformers import default_data_collator

    batch = default_data_collator(features)
    ids = batch["input_ids"]
    batch["position_ids"] = torch.arange(ids.shape[1], dtype=torch.long)[None, :].expand_as(ids).contiguous()
    return batch


def sequence_parallel_dataloader(dataloader, sp: UlyssesAttention, device, *, skip_micro_batches: int = 0):
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter`` over the Trainer's (data-parallel) loader: every SP rank gets
    its slice of the same row; ``len`` grows by P (each rank's rows are consumed by the whole group).

    ``skip_micro_batches``: SP micro-batches to drop at the start (a resume in the middle of an epoch; the
    Trainer's own fast-forward cannot rebuild this adapter). Collective: every rank of the group must pass
    the same number."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    class SequenceParallelDataLoader(UlyssesSPDataLoaderAdapter):
        """The adapter, plus what the Trainer's epoch loop needs: ``set_epoch`` reaches the data-parallel
        sampler (a new shuffle per epoch), an exhausted pass keeps raising StopIteration until the next
        ``iter()`` (the Trainer may ask for more batches than a resumed epoch has left), and the skip."""

        def __init__(self, *args, skip: int, **kwargs):
            super().__init__(*args, **kwargs)
            self.to_skip, self.exhausted = skip, False

        def __iter__(self):
            if self.exhausted:  # a new epoch: a fresh pass over the (re-seeded) data-parallel loader
                self.iter, self.exhausted = iter(self.dl), False
                self.micro_batches.clear()
            return self

        def __next__(self):
            if self.exhausted:
                raise StopIteration
            try:
                while self.to_skip:
                    if not self.micro_batches and self.to_skip >= self.sp_world_size:
                        next(self.iter)  # each rank drops its own row: the group's rows, nothing exchanged
                        self.to_skip -= self.sp_world_size
                    else:
                        super().__next__()
                        self.to_skip -= 1
                return super().__next__()
            except StopIteration:
                self.exhausted = True
                raise

        def set_epoch(self, epoch: int) -> None:
            batch_sampler = getattr(self.dl, "batch_sampler", None)
            for holder in (self.dl, batch_sampler, getattr(batch_sampler, "batch_sampler", None)):
                if hasattr(holder, "set_epoch"):
                    holder.set_epoch(epoch)

    return SequenceParallelDataLoader(dataloader, sp_rank=sp.rank, sp_group=sp.group, sp_world_size=sp.size,
                                      device=device, skip=skip_micro_batches)


def resumed_micro_batches(checkpoint: str | None, batches_per_epoch: int, accumulation: int) -> int:
    """Micro-batches of the current epoch a checkpoint has already trained on, as the Trainer counts them
    (``global_step % update_steps_per_epoch * gradient_accumulation_steps``); 0 without a checkpoint."""
    import json
    from pathlib import Path

    state = Path(checkpoint) / "trainer_state.json" if checkpoint else None
    if state is None or not state.is_file():
        return 0
    steps_per_epoch = max(batches_per_epoch // accumulation + int(batches_per_epoch % accumulation > 0), 1)
    return json.loads(state.read_text())["global_step"] % steps_per_epoch * accumulation


def sequence_parallel_loss(model, inputs: dict, sp: UlyssesAttention, chunk_tokens: int | None = 4096):
    """Loss of one SP micro-batch. ``inputs``: ``input_ids`` [B, S/P] (this rank's slice), ``shift_labels``
    [B, S/P] (-100 = ignored), optional ``position_ids``.

    Returns ``(loss_to_backward, row_loss, outputs)``: ``loss_to_backward = P * slice_sum / N`` (see the module
    docstring for the factor P), ``row_loss`` = the mean token loss of the whole rows (detached, equal on
    every rank of the group), ``outputs`` the model's outputs for this slice.
    """
    import torch.distributed as dist

    from train.losses import ObjectiveWeights, chunked_objective_loss
    from train.objective import output_embeddings

    if "shift_labels" not in inputs:
        raise KeyError(f"inputs holds {sorted(inputs)}: sequence-parallel batches carry shift_labels "
                       f"(UlyssesSPDataLoaderAdapter adds them)")
    inputs = dict(inputs)
    labels = inputs.pop("shift_labels")
    inputs.pop("labels", None)
    # The LM head and the cross-entropy run in token chunks from the final hidden states (train/losses.py):
    # at 64K tokens per rank and a 128K vocabulary the slice's fp32 logits alone would be 31 GiB.
    outputs = model(**inputs, use_cache=False, skip_lm_head=True)
    terms = chunked_objective_loss(outputs.hidden_states[-1], labels, output_embeddings(model),
                                   weights=ObjectiveWeights(1.0, 0.0), chunk_tokens=chunk_tokens, labels_shifted=True)
    slice_sum = terms.loss * terms.tokens
    counts = torch.stack([(labels != -100).sum().to(slice_sum.device, torch.float32), slice_sum.detach().float()])
    dist.all_reduce(counts, group=sp.group)  # [tokens of the rows, loss sum of the rows]
    tokens = counts[0].clamp(min=1)
    return slice_sum * (sp.size / tokens), counts[1] / tokens, outputs
