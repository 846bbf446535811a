"""Training losses computed in token chunks, so the ``[tokens x vocab]`` logits never exist whole.

Objectives (``train.objective``):
  * ``lm``          -- next-token cross-entropy on the labels;
  * ``distill``     -- token-level KL(teacher || student) over the vocabulary, where the teacher is the
                       same checkpoint run with dense attention and its frozen starting weights
                       (knowledge distillation, Hinton et al. 2015, Eq. 2: both distributions softened
                       by a temperature T, the KL multiplied by T^2 so its gradient scale does not
                       depend on T);
  * ``lm+distill``  -- ``(1 - w) * lm + w * distill`` with ``w = train.distill_weight``.

The loss is the mean over the predicted tokens of the micro-batch (labels != -100).

Chunking. With a 128K vocabulary, fp32 logits of 32K tokens are 16 GiB for the student alone, and
as much again for the teacher and for the softmax of each. :func:`chunked_objective_loss` walks the
tokens ``chunk_tokens`` at a time: per chunk it computes the student's and the teacher's logits from
their final hidden states, the chunk's loss terms, and discards the logits; each chunk runs under
activation checkpointing, so backward recomputes the chunk's logits instead of keeping them. Peak
extra memory is O(chunk_tokens x vocab), whatever the sequence length. ``chunk_tokens=None`` computes
everything in one piece (the reference the tests compare against).

A frozen LM head (LoRA trains adapters on the projections, not the head) takes another route: each chunk's
gradient with respect to its hidden states is formed right away in the forward pass and kept (``[n, H]``, the
size of the hidden states), the way Liger Kernel's fused linear cross-entropy does, so backward recomputes
nothing. Recomputing instead breaks under DeepSpeed ZeRO-3: it releases a frozen module's gathered weight as
soon as the module's forward returns, so the recomputed product has saved an empty weight (torch's checkpoint
refuses it: "Recomputed values ... have different metadata"). It also saves the head's second forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

OBJECTIVES = ("lm", "distill", "lm+distill")


@dataclass(frozen=True)
class ObjectiveWeights:
    """How an objective mixes its terms: ``loss = lm * lm_term + kl * kl_term``."""

    lm: float
    kl: float

    @classmethod
    def for_objective(cls, objective: str, distill_weight: float = 0.5) -> ObjectiveWeights:
        if objective == "lm":
            return cls(1.0, 0.0)
        if objective == "distill":
            return cls(0.0, 1.0)
        if objective == "lm+distill":
            return cls(1.0 - distill_weight, distill_weight)
        raise ValueError(f"train.objective={objective!r}: expected one of {', '.join(OBJECTIVES)}")


@dataclass
class LossTerms:
    """The mean loss to backpropagate and its detached parts (for the loss log)."""

    loss: torch.Tensor
    lm: float
    kl: float
    tokens: int


def _chunk_sums(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor | None, labels: torch.Tensor,
                student_head: Callable, teacher_head: Callable | None, weights: ObjectiveWeights,
                temperature: float) -> torch.Tensor:
    """Summed loss terms of one chunk: ``[3]`` fp32 = (weighted loss sum, lm sum, kl sum).

    ``student_hidden [n, H]``, ``teacher_hidden [n, H]`` (or None when ``weights.kl == 0``),
    ``labels [n]`` int64 (-100 = not predicted)."""
    valid = labels != -100
    logits = student_head(student_hidden).float()                       # [n, V]
    zero = logits.new_zeros(())
    if weights.lm:
        lm_sum = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    else:  # still logged: the cross-entropy of a distilled student is what its perplexity shows
        with torch.no_grad():
            lm_sum = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    kl_sum = zero
    if weights.kl:
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher_head(teacher_hidden).float() / temperature, dim=-1)
        student_logp = F.log_softmax(logits / temperature, dim=-1)
        # KL(p_t || p_s) per token = sum_v p_t (log p_t - log p_s); teacher terms carry no gradient.
        per_token = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
        kl_sum = (per_token * valid).sum() * temperature ** 2
    total = weights.lm * lm_sum + weights.kl * kl_sum
    return torch.stack([total, lm_sum.detach(), kl_sum.detach()])


class _FrozenHeadChunk(torch.autograd.Function):
    """One chunk's summed terms ``[3]`` whose gradient to ``hidden [n, H]`` is computed in forward.

    ``scale`` is the factor the caller will backpropagate into the weighted sum (``1 / tokens`` for the mean
    loss): the kept gradient is formed already scaled, so backward multiplies by exactly 1.0 in the usual case
    and the bf16 gradient rounds as it does on the recomputing route."""

    @staticmethod
    def forward(ctx, hidden, teacher_hidden, labels, student_head, teacher_head, weights, temperature, scale):
        with torch.enable_grad():
            leaf = hidden.detach().requires_grad_(True)
            sums = _chunk_sums(leaf, teacher_hidden, labels, student_head, teacher_head, weights, temperature)
            (grad,) = torch.autograd.grad(sums[0] * scale, leaf)
        ctx.save_for_backward(grad)
        ctx.scale = scale
        return sums.detach()

    @staticmethod
    def backward(ctx, grad_sums):
        (grad,) = ctx.saved_tensors
        factor = (grad_sums[0] / ctx.scale).to(grad.dtype)  # exactly 1.0 for the mean loss: no rounding added
        return grad * factor, None, None, None, None, None, None, None


def _trains(head) -> bool:
    """Whether any parameter of ``head`` (a module, or a plain function: none) takes a gradient."""
    parameters = getattr(head, "parameters", None)
    return parameters is None or any(p.requires_grad for p in parameters())


def chunked_objective_loss(student_hidden: torch.Tensor, labels: torch.Tensor, student_head: Callable, *,
                           weights: ObjectiveWeights, teacher_hidden: torch.Tensor | None = None,
                           teacher_head: Callable | None = None, temperature: float = 1.0,
                           chunk_tokens: int | None = 4096, labels_shifted: bool = False) -> LossTerms:
    """Mean next-token loss of a micro-batch from final hidden states.

    ``student_hidden [B, S, H]`` (after the final norm), ``labels [B, S]`` (unshifted: position t
    predicts ``labels[:, t + 1]``; -100 ignored), ``teacher_hidden [B, S, H]`` (no grad) for the KL
    term. ``student_head`` / ``teacher_head`` map ``[n, H] -> [n, V]`` (the LM heads; passing modules
    rather than weights keeps DeepSpeed ZeRO-3's gather hooks working). ``labels_shifted=True``: ``labels``
    are already aligned with the positions (sequence parallelism's ``shift_labels``: a rank's slice has no
    next token of its own at its last position).
    """
    if weights.kl and (teacher_hidden is None or teacher_head is None):
        raise ValueError("the distill objective needs teacher_hidden and teacher_head")
    if temperature <= 0:
        raise ValueError(f"train.distill_temperature={temperature}: expected a positive number")
    keep = slice(None) if labels_shifted else slice(None, -1)  # shifted: labels[:, t] is position t's target
    hidden = student_hidden[:, keep].reshape(-1, student_hidden.shape[-1])
    targets = (labels if labels_shifted else labels[:, 1:]).reshape(-1).to(hidden.device)
    teacher = teacher_hidden[:, keep].reshape(-1, teacher_hidden.shape[-1]) if weights.kl else None
    tokens = int((targets != -100).sum())
    n = hidden.shape[0]
    step = n if not chunk_tokens or chunk_tokens >= n else chunk_tokens
    sums = hidden.new_zeros(3, dtype=torch.float32)
    denominator = max(tokens, 1)
    frozen_head = not _trains(student_head)
    for start in range(0, n, step):
        piece = slice(start, start + step)
        args = (hidden[piece], teacher[piece] if teacher is not None else None, targets[piece],
                student_head, teacher_head, weights, temperature)
        if step < n and torch.is_grad_enabled() and hidden.requires_grad:
            if frozen_head:  # the chunk's gradient to its hidden states now; nothing recomputed (module docstring)
                sums = sums + _FrozenHeadChunk.apply(*args, 1.0 / denominator)
            else:  # the chunk's logits are recomputed in backward instead of being kept for it
                sums = sums + checkpoint(_chunk_sums, *args, use_reentrant=False)
        else:
            sums = sums + _chunk_sums(*args)
    parts = sums[1:].detach().tolist()
    return LossTerms(loss=sums[0] / denominator, lm=parts[0] / denominator, kl=parts[1] / denominator,
                     tokens=tokens)
