"""The training stage: transformers Trainer (+ DeepSpeed ZeRO-2/3) on the POD model.

What the recipe's ``train`` section becomes (:func:`training_arguments`), LoRA wrapping (peft),
per-step loss records (``<output_dir>/losses.jsonl``: this rank's loss per optimizer step, the number
the Trainer logs, also under gradient accumulation -- the resume test compares these), and the run itself
(:func:`train_model`): ``resume_from_checkpoint`` = null / "auto" (latest ``checkpoint-N`` in
output_dir) / a path. The trained weights (or the LoRA adapter) go to ``<output_dir>/trained`` via
``trainer.save_model`` (under ZeRO-3 that gathers the 16-bit weights: the DeepSpeed configs set
``stage3_gather_16bit_weights_on_model_save``).

Gradient checkpointing is non-reentrant: POD layers receive their anchor's keys as an explicit
argument of the decoder loop, so a recomputed layer sees the same inputs (module attributes set during
the first forward would differ on recomputation).
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
    t = recipe.train
    return add_lora_adapters(model, r=t.lora_r, alpha=t.lora_alpha, dropout=t.lora_dropout,
                             target_modules=t.lora_target_modules)


def add_lora_adapters(model, *, r: int, alpha: int, dropout: float, target_modules):
    """``model`` wrapped by peft with rank-``r`` adapters on ``target_modules`` (the only parameters that train)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _loss_trainer_class():
    from transformers import Trainer, TrainerCallback

    class LossRecorder(TrainerCallback):
        """Writes {"step", "loss"} per optimizer step to losses.jsonl: the sum of the step's micro-batch
        contributions (PodTrainer.training_step), i.e. the loss the Trainer logs for this rank; plus the
        objective's parts ("lm", "kl": mean cross-entropy and KL per token) when train/objective.py runs."""

        def __init__(self, path: Path, buffer: list, terms: list):
            self.path, self.buffer, self.terms = path, buffer, terms

        def on_step_end(self, args, state, control, **kwargs):
            if self.buffer:
                record = {"step": state.global_step, "loss": sum(self.buffer)}
                if self.terms:
                    record["lm"] = sum(t.lm for t in self.terms) / len(self.terms)
                    record["kl"] = sum(t.kl for t in self.terms) / len(self.terms)
                self.buffer.clear()
                self.terms.clear()
                if args.process_index == 0:
                    with self.path.open("a") as f:
                        f.write(json.dumps(record) + "\n")

    class PodTrainer(Trainer):
        """Trainer that records each optimizer step's loss (losses.jsonl) and saves checkpoints crash-safely."""

        def __init__(self, *args, loss_log: Path, sequence_parallel=None, activation_offload=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.activation_offload = activation_offload  # CheckpointOffload or None (train/long_context.py)
            self._micro_losses: list[float] = []
            self._micro_terms: list = []
            self.objective_loss = None  # train/objective.py ObjectiveLoss, set by train_model
            self.loss_log = loss_log
            self.add_callback(LossRecorder(loss_log, self._micro_losses, self._micro_terms))
            self.sequence_parallel = sequence_parallel  # UlyssesAttention or None (train/sequence_parallel.py)
            if sequence_parallel is not None:
                self.model_accepts_loss_kwargs = False  # the SP loss normalises by the whole rows' token count

        def train(self, resume_from_checkpoint=None, **kwargs):
            """The Trainer's run; ``losses.jsonl`` holds this run only (a fresh run starts it anew, a resume cuts it
            back to the checkpoint's step) and the returned training loss is over all of its steps
            (train/checkpoints.py ``prepare_loss_log``, ``with_whole_run_loss``)."""
            from train.checkpoints import prepare_loss_log, with_whole_run_loss

            self._resume_checkpoint = resume_from_checkpoint
            main = self.args.process_index == 0
            if main:
                resume = resume_from_checkpoint
                if resume is True:
                    from transformers.trainer_utils import get_last_checkpoint

                    resume = get_last_checkpoint(self.args.output_dir)
                prepare_loss_log(self.loss_log, resume or None)
            result = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            return with_whole_run_loss(result, self.loss_log) if main else result

        def training_step(self, model, inputs, *args, **kwargs):
            """Record what this micro-batch adds to the Trainer's logged loss (scaled for gradient accumulation:
            the per-step sum is the number the Trainer logs). Under SP, compute_loss recorded the whole rows'
            loss; it is scaled the same way."""
            mark = len(self._micro_losses)
            if self.activation_offload is None:
                loss = super().training_step(model, inputs, *args, **kwargs)
            else:
                with self.activation_offload:  # forward and backward: offloaded layer inputs come back in backward
                    loss = super().training_step(model, inputs, *args, **kwargs)
            recorded = self._micro_losses[mark:]
            del self._micro_losses[mark:]
            accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            self._micro_losses.append(recorded[-1] / accumulation if self.sequence_parallel is not None and recorded
                                      else float(loss.detach().float()))
            return loss

        # checkpoints (train/checkpoints.py): crash-safe saving, tied-weight warning, schedule on resume
        def _get_output_dir(self, trial):
            return getattr(self, "_checkpoint_staging", None) or super()._get_output_dir(trial)

        def _save_checkpoint(self, model, trial):
            from train.checkpoints import save_checkpoint_atomically

            save_checkpoint_atomically(self, lambda: super(PodTrainer, self)._save_checkpoint(model, trial), trial)

        def _issue_warnings_after_load(self, load_result):
            from train.checkpoints import drop_tied_missing_keys

            return super()._issue_warnings_after_load(drop_tied_missing_keys(self.model, load_result))

        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None and self.lr_scheduler is not None:
                from train.checkpoints import follow_current_schedule

                follow_current_schedule(self.lr_scheduler, log=print if self.args.process_index == 0 else lambda *a: None)

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
            if self.objective_loss is not None and model.training:
                terms = self.objective_loss(model, inputs)  # the micro-batch's mean; the Trainer divides by GA
                self._micro_losses.append(float(terms.loss.detach()))
                self._micro_terms.append(terms)
                return (terms.loss, None) if return_outputs else terms.loss
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


def build_objective(trainer, recipe: Recipe, *, teacher_factory=None, log=print):
    """The ObjectiveLoss for ``train.objective`` (None: the model's own loss, unchunked ``lm``).

    ``teacher_factory()``: loads the dense starting model for full fine-tuning (under ZeRO-3 it must
    run while the Trainer's DeepSpeed config is active, so the copy is built inside ``zero.Init``).
    """
    from train.objective import ObjectiveLoss

    t = recipe.train
    if t.objective == "lm" and t.loss_chunk_tokens is None:
        return None
    teacher = None
    if t.objective != "lm":
        from train.teacher import LoraTeacher, build_frozen_copy_teacher

        if t.method == "lora":
            teacher = LoraTeacher(trainer.model)
            log("[train] distillation teacher: the base model with its LoRA adapters disabled, dense attention")
        else:
            if teacher_factory is None:
                raise ValueError(f"train.objective={t.objective!r} with train.method='full' needs a teacher_factory")
            ds = getattr(trainer.args, "hf_deepspeed_config", None)
            dtype = torch.bfloat16 if t.bf16 else None
            teacher = build_frozen_copy_teacher(teacher_factory(), device=trainer.args.device, dtype=dtype,
                                                deepspeed_config=ds.config if ds is not None else None)
            log(f"[train] distillation teacher: a frozen dense copy of the starting weights "
                f"({'ZeRO-3 sharded' if ds is not None and ds.is_zero3() else 'on ' + str(trainer.args.device)})")
    return ObjectiveLoss(t.objective, teacher=teacher, distill_weight=t.distill_weight,
                         temperature=t.distill_temperature, chunk_tokens=t.loss_chunk_tokens)


def train_model(model, train_dataset, recipe: Recipe, args, *, tokenizer=None, log=print,
                sequence_parallel=None, teacher_factory=None, callbacks=()) -> Path:
    """Train; returns ``<output_dir>/trained`` (weights, or the adapter for LoRA).

    ``sequence_parallel``: the UlyssesAttention of ``train.sequence_parallel_size > 1``
    (train/sequence_parallel.py), attached to the model for training and detached afterwards.
    ``teacher_factory``: see :func:`build_objective`. ``callbacks``: extra Trainer callbacks (the
    learning curve)."""
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
                                    callbacks=list(callbacks) or None, activation_offload=offload)
    if sequence_parallel is None:
        trainer.objective_loss = build_objective(trainer, recipe, teacher_factory=teacher_factory, log=log)
        if trainer.objective_loss is not None:
            trainer.model_accepts_loss_kwargs = False  # a per-micro-batch mean: the Trainer divides by GA
    resume = resolve_resume(recipe)
    _check_free_space(model, recipe, args, log)  # before any step: a checkpoint that cannot fit stops the run here
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
    try:
        trainer.save_model(str(trained))  # collective under ZeRO-3; rank 0 writes
    except Exception as error:
        from train.checkpoints import StorageError, out_of_space

        if not out_of_space(error, out):
            raise
        raise StorageError(f"writing {trained} failed: no space left on the device ({type(error).__name__}); the "
                           f"checkpoints in {out} are kept: free space and run again with "
                           f"train.resume_from_checkpoint=auto") from None
    if args.process_index == 0:
        (trained / "train_metrics.json").write_text(json.dumps(result.metrics, indent=1))
        log(f"[train] {result.global_step} steps, final train loss {result.training_loss:.4f} -> {trained}")
    return trained


def _check_free_space(model, recipe: Recipe, args, log) -> None:
    """Stop before training when ``train.output_dir`` cannot hold one checkpoint (train/checkpoints.py
    ``free_space_check``), warn when the run's checkpoints may not all fit. Rank 0 decides for every rank."""
    import math

    from train.checkpoints import StorageError, checkpoint_size_estimate, free_space_check

    t = recipe.train
    estimate = checkpoint_size_estimate(model, deepspeed=bool(args.deepspeed), lora=t.method == "lora")
    saves = math.ceil(t.max_steps / t.save_steps) if t.max_steps > 0 and t.save_steps else 1
    verdict = list(free_space_check(t.output_dir, estimate, saves=saves, keep=t.save_total_limit))
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(verdict, src=0)  # ranks measuring a few bytes apart must agree
    problem, warning = verdict
    if problem:
        raise StorageError(problem)
    if warning and args.process_index == 0:
        log(warning)


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
