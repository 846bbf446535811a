"""The distillation teacher: the starting checkpoint with dense attention and frozen weights.

Two ways to have it, chosen by the training method:
  * LoRA -- no second copy: the student itself with its adapters disabled (peft's ``disable_adapter()``)
    and its attention switched to dense for the teacher's forward. The base weights never train under
    LoRA, so this *is* the frozen starting model.
  * full fine-tuning -- a frozen copy loaded from the same checkpoint with dense attention. Under
    DeepSpeed ZeRO-3 it is wrapped in an optimizer-less DeepSpeed engine with the student's ZeRO
    config, so its parameters are sharded like the student's (the approach TRL takes for its reference
    models); otherwise it sits on the training device, in bf16 when training in bf16.

Every teacher forward runs under ``torch.no_grad()``: gradients reach only the student.
"""

from __future__ import annotations

import contextlib
import copy

import torch

DENSE = dict(prefill_scheme="dense", decode_scheme="dense")


def podkit_model_of(model):
    """The podkit ``*ForCausalLM`` inside DeepSpeed / peft wrappers."""
    inner = getattr(model, "module", model)          # DeepSpeed engine / DDP
    if hasattr(inner, "get_base_model"):            # peft
        inner = inner.get_base_model()
    return inner


@contextlib.contextmanager
def dense_attention(model):
    """Run ``model`` (a podkit causal LM, possibly wrapped) with dense attention inside the block."""
    podkit = podkit_model_of(model)
    saved = podkit.sparse_config
    if saved.prefill_scheme == "dense" and saved.decode_scheme == "dense":
        yield
        return
    podkit.set_sparse_attention(**DENSE)
    try:
        yield
    finally:
        podkit.set_sparse_attention(saved)


def final_hidden_states(model, input_ids, attention_mask=None):
    """``[B, S, H]`` after the final norm, without the LM head: podkit models skip it
    (``skip_lm_head``); other transformers causal LMs return their hidden states with logits for no
    position (``logits_to_keep`` = an empty index)."""
    if hasattr(podkit_model_of(model), "sparse_config"):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, skip_lm_head=True)
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True,
                    logits_to_keep=input_ids.new_zeros(0))
    return out.hidden_states[-1]


class LoraTeacher:
    """The student's base weights, adapters disabled, dense attention."""

    def __init__(self, student):
        self.student = student

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[B, S, H]`` (after the final norm) of the dense base model."""
        peft_model = getattr(self.student, "module", self.student)
        with peft_model.disable_adapter(), dense_attention(peft_model):
            out = self.student(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, skip_lm_head=True)
        return out.hidden_states[-1]

    @torch.no_grad()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        peft_model = getattr(self.student, "module", self.student)
        with peft_model.disable_adapter():
            return peft_model.get_output_embeddings()(hidden)


class FrozenCopyTeacher:
    """A separate dense model (or DeepSpeed inference engine around one) with frozen weights."""

    def __init__(self, model):
        self.model = model
        self.podkit = podkit_model_of(model)

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return final_hidden_states(self.model, input_ids, attention_mask)

    @torch.no_grad()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.podkit.get_output_embeddings()(hidden)


def freeze(model):
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def build_frozen_copy_teacher(dense_model, *, device: torch.device, dtype: torch.dtype | None,
                              deepspeed_config: dict | None) -> FrozenCopyTeacher:
    """Wrap a freshly loaded dense model as the teacher.

    ``deepspeed_config``: the student's resolved DeepSpeed config (the Trainer's), or None. With ZeRO
    stage 3 the teacher becomes a DeepSpeed engine without optimizer, sharded like the student (it
    must then have been loaded under the same ``zero.Init``); with stage 0-2 or no DeepSpeed it is a
    plain module on ``device`` in ``dtype``.
    """
    freeze(dense_model)
    zero = (deepspeed_config or {}).get("zero_optimization") or {}
    if deepspeed_config and zero.get("stage", 0) == 3:
        import deepspeed

        config = copy.deepcopy(deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        hidden = getattr(dense_model.config, "hidden_size", None)
        for key, value in (("reduce_bucket_size", hidden * hidden if hidden else None),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden) if hidden else None),
                           ("stage3_param_persistence_threshold", 10 * hidden if hidden else None)):
            if config["zero_optimization"].get(key) == "auto" and value is not None:
                config["zero_optimization"][key] = value
        engine, *_ = deepspeed.initialize(model=dense_model, config=config)
        engine.eval()
        return FrozenCopyTeacher(engine)
    return FrozenCopyTeacher(dense_model.to(device=device, dtype=dtype))
