"""The training objective as the Trainer calls it: one micro-batch in, the mean loss out.

Glue between the model, the teacher (train/teacher.py) and the chunked loss (train/losses.py). The
student runs with ``skip_lm_head=True`` so its logits are only ever formed chunk by chunk.
"""

from __future__ import annotations

from train.losses import LossTerms, ObjectiveWeights, chunked_objective_loss
from train.teacher import final_hidden_states, podkit_model_of


class ObjectiveLoss:
    """``loss = (1 - w) * CE + w * T^2 * KL(teacher || student)`` per predicted token (see train/losses.py).

    ``teacher``: a LoraTeacher / FrozenCopyTeacher, or None for the ``lm`` objective.
    """

    def __init__(self, objective: str, *, teacher=None, distill_weight: float = 0.5, temperature: float = 1.0,
                 chunk_tokens: int | None = 4096):
        self.weights = ObjectiveWeights.for_objective(objective, distill_weight)
        if self.weights.kl and teacher is None:
            raise ValueError(f"train.objective={objective!r} needs a teacher")
        self.objective, self.teacher = objective, teacher
        self.temperature, self.chunk_tokens = temperature, chunk_tokens

    def __call__(self, model, inputs: dict) -> LossTerms:
        input_ids = inputs["input_ids"]
        labels = inputs.get("labels", input_ids)
        attention_mask = inputs.get("attention_mask")
        teacher_hidden = self.teacher.hidden(input_ids, attention_mask) if self.weights.kl else None
        hidden = final_hidden_states(model, input_ids, attention_mask)
        student_head = output_embeddings(model)
        return chunked_objective_loss(hidden, labels, student_head, weights=self.weights,
                                      teacher_hidden=teacher_hidden,
                                      teacher_head=self.teacher.head if self.teacher is not None else None,
                                      temperature=self.temperature, chunk_tokens=self.chunk_tokens)


def output_embeddings(model):
    """The LM head module of ``model`` (through DeepSpeed / peft wrappers)."""
    inner = getattr(model, "module", model)  # DeepSpeed engine: the module (peft or podkit) has the head
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    return head if head is not None else podkit_model_of(model).get_output_embeddings()
