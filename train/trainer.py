"""The training stage: transformers Trainer (+ DeepSpeed ZeRO-2/3) on the POD model.

What the recipe's ``train`` section becomes (:func:`training_arguments`), LoRA wrapping (peft),
per-step loss records (``<output_dir>/losses.jsonl``: the raw micro-batch losses of this rank,
averaged per optimizer step -- the resume test compares these), and the run itself
(:func:`train_model`): ``resume_from_checkpoint`` = null / "auto" (latest ``checkpoint-N`` in
output_dir) / a path. The trained weights (or the LoRA adapter) go to ``<output_dir>/trained`` via
``trainer.save_model`` (under ZeRO-3 that gathers the 16-bit weights: the DeepSpeed configs set
``stage3_gather_16bit_weights_on_model_save``).

Gradient checkpointing is non-reentrant: POD layers receive their anchor's keys as an explicit
argument of the decoder loop, so a recomputed layer sees the same inputs (DESIGN.md pitfall).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from train.recipe import Recipe


def training_arguments(recipe: Recipe):
    """``transformers.TrainingArguments`` for the recipe (works on transformers 5.17 and 5.24)."""
    import inspect

    from transformers import TrainingArguments

    t = recipe.train
    kwargs = dict(
        output_dir=t.output_dir,
        per_device_train_batch_size=t.per_device_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        max_steps=t.max_steps,
        num_train_epochs=t.num_train_epochs,
        bf16=t.bf16,
        gradient_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        seed=t.seed,
        data_seed=t.seed,
        report_to=[r for r in t.report_to if r != "none"] or "none",
        deepspeed=str(recipe.deepspeed_config_path) if recipe.deepspeed_config_path else None,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=False,
        use_cpu=not torch.cuda.is_available(),
    )
    parameters = inspect.signature(TrainingArguments.__init__).parameters
    if "activation_checkpointing" in parameters:  # transformers >= 5.2x renamed gradient_checkpointing
        kwargs["activation_checkpointing"] = kwargs.pop("gradient_checkpointing")
        kwargs["activation_checkpointing_kwargs"] = kwargs.pop("gradient_checkpointing_kwargs")
    if t.warmup_steps:
        kwargs["warmup_steps"] = t.warmup_steps
    elif t.warmup_ratio:
        # transformers 5.x: a float warmup_steps < 1 is a ratio; older versions have warmup_ratio
        kwargs["warmup_ratio" if "warmup_ratio" in parameters else "warmup_steps"] = t.warmup_ratio
    return TrainingArguments(**{k: v for k, v in kwargs.items() if k in parameters})


def wrap_lora(model, recipe: Recipe):
    """peft LoRA on ``train.lora_target_modules``; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    t = recipe.train
    config = LoraConfig(r=t.lora_r, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                        target_modules=list(t.lora_target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _loss_trainer_class():
    from transformers import Trainer, TrainerCallback

    class LossRecorder(TrainerCallback):
        """Writes {"step", "loss", "lr"} per optimizer step to losses.jsonl (rank-local micro-batch mean)."""

        def __init__(self, path: Path, buffer: list):
            self.path, self.buffer = path, buffer

        def on_step_end(self, args, state, control, **kwargs):
            if self.buffer:
                loss = sum(self.buffer) / len(self.buffer)
                self.buffer.clear()
                if args.process_index == 0:
                    with self.path.open("a") as f:
                        f.write(json.dumps({"step": state.global_step, "loss": loss}) + "\n")

    class PodTrainer(Trainer):
        """Trainer that records each micro-batch's unscaled loss for the per-step record."""

        def __init__(self, *args, loss_log: Path, sequence_parallel=None, activation_offload=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.activation_offload = activation_offload  # CheckpointOffload or None (train/long_context.py)
            self._micro_losses: list[float] = []
            self.add_callback(LossRecorder(loss_log, self._micro_losses))
            self.sequence_parallel = sequence_parallel  # UlyssesAttention or None (train/sequence_parallel.py)
            if sequence_parallel is not None:
                self.model_accepts_loss_kwargs = False  # the SP loss normalises by the whole rows' token count

        def train(self, resume_from_checkpoint=None, **kwargs):
            self._resume_checkpoint = resume_from_checkpoint
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

        def training_step(self, *args, **kwargs):
            if self.activation_offload is None:
                return super().training_step(*args, **kwargs)
            with self.activation_offload:  # forward and backward: the offloaded layer inputs come back in backward
                return super().training_step(*args, **kwargs)

        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            if self.sequence_parallel is None:
                return loader
            from train.sequence_parallel import resumed_micro_batches, sequence_parallel_dataloader

            resume = getattr(self, "_resume_checkpoint", None)
            skip = resumed_micro_batches(resume if isinstance(resume, str) else None,
                                         len(loader) * self.sequence_parallel.size, self.args.gradient_accumulation_steps)
            if skip:  # the SP adapter fast-forwards itself; the Trainer's skip_first_batches cannot rebuild it
                self.args.ignore_data_skip = True
            return sequence_parallel_dataloader(loader, self.sequence_parallel, self.args.device,
                                                skip_micro_batches=skip)

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            if self.sequence_parallel is not None and model.training:
                from train.sequence_parallel import sequence_parallel_loss

                loss, row_loss, outputs = sequence_parallel_loss(model, inputs, self.sequence_parallel)
                self._micro_losses.append(float(row_loss))  # the whole rows' loss, not this rank's slice
                return (loss, outputs) if return_outputs else loss
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            loss = result[0] if return_outputs else result
            if model.training:
                self._micro_losses.append(float(loss.detach().float()))
            return result

    return PodTrainer


def resolve_resume(recipe: Recipe) -> str | None:
    resume = recipe.train.resume_from_checkpoint
    if resume == "auto":
        from transformers.trainer_utils import get_last_checkpoint

        folder = Path(recipe.train.output_dir)
        return get_last_checkpoint(str(folder)) if folder.is_dir() else None
    return resume


def train_model(model, train_dataset, recipe: Recipe, args, *, tokenizer=None, log=print,
                sequence_parallel=None) -> Path:
    """Train; returns ``<output_dir>/trained`` (weights, or the adapter for LoRA).

    ``sequence_parallel``: the UlyssesAttention of ``train.sequence_parallel_size > 1``
    (train/sequence_parallel.py), attached to the model for training and detached afterwards."""
    from transformers import default_data_collator

    collator = default_data_collator
    if sequence_parallel is not None:
        from train.sequence_parallel import attach_sequence_parallel, collate_with_position_ids

        attach_sequence_parallel(model, sequence_parallel)
        collator = collate_with_position_ids  # DeepSpeed's SP data-loader adapter requires position_ids
    offload = _enable_long_context(model, recipe, args, log)
    if recipe.train.method == "lora":
        model = wrap_lora(model, recipe)
        if args.process_index == 0:
            model.print_trainable_parameters()
    if recipe.train.gradient_checkpointing:
        model.config.use_cache = False
    out = Path(recipe.train.output_dir)
    trainer = _loss_trainer_class()(model=model, args=args, train_dataset=train_dataset,
                                    data_collator=collator, processing_class=tokenizer,
                                    loss_log=out / "losses.jsonl", sequence_parallel=sequence_parallel,
                                    activation_offload=offload)
    resume = resolve_resume(recipe)
    if resume and args.process_index == 0:
        log(f"[train] resuming from {resume}")
    result = trainer.train(resume_from_checkpoint=resume)
    if sequence_parallel is not None:
        from train.sequence_parallel import attach_sequence_parallel

        attach_sequence_parallel(model, None)
    if recipe.train.tiled_mlp or offload is not None:
        from train.long_context import attach_checkpoint_offload, disable_tiled_mlp

        disable_tiled_mlp(model)
        attach_checkpoint_offload(model, None)
    trained = out / "trained"
    trainer.save_model(str(trained))  # collective under ZeRO-3; rank 0 writes
    if args.process_index == 0:
        (trained / "train_metrics.json").write_text(json.dumps(result.metrics, indent=1))
        log(f"[train] {result.global_step} steps, final train loss {result.training_loss:.4f} -> {trained}")
    return trained


def _enable_long_context(model, recipe: Recipe, args, log):
    """``train.tiled_mlp`` / ``train.activation_offload`` (train/long_context.py) on ``model``; returns the
    CheckpointOffload the trainer wraps each step in, or None."""
    t = recipe.train
    if not (t.tiled_mlp or t.activation_offload):
        return None
    from train.long_context import CheckpointOffload, attach_checkpoint_offload, enable_tiled_mlp

    if t.tiled_mlp:
        tokens_per_rank = recipe.data.context_length // t.sequence_parallel_size
        shards = enable_tiled_mlp(model, tokens_per_rank, t.tiled_mlp_shards)
        if args.process_index == 0:
            log(f"[train] tiled MLP: {shards} slices of the {tokens_per_rank} tokens per rank")
    if not t.activation_offload:
        return None
    offload = CheckpointOffload()
    attach_checkpoint_offload(model, offload)
    if args.process_index == 0:
        log("[train] checkpointed layer inputs offloaded to CPU")
    return offload


def world_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's environment (1 process when absent)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
