"""The training objectives (train/losses.py, train/objective.py, train/teacher.py) on tiny models.

Checks: chunked loss == unchunked (value and gradients), KL against a hand-written reference, KL is 0
at step 0 when the student equals the teacher (POD disabled), gradients reach only the student, the
LoRA teacher equals the base model, the POD student's KL is positive.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import SHARP_QK_STD
from tests.tiny_models import tiny_model as factory_model
from train.losses import ObjectiveWeights, chunked_objective_loss
from train.objective import ObjectiveLoss
from train.teacher import FrozenCopyTeacher, LoraTeacher, dense_attention, freeze

POD = dict(prefill_scheme="pod", decode_scheme="pod", pod_sink_tokens=2, pod_recent_window=5)
# layer -> anchor layer per KV head: blocks {0, 1}, {2, 3} for head 0 and {0}, {1, 2}, {3} for head 1
ANCHORS = [[0, 0], [0, 1], [2, 1], [2, 3]]


def tiny_model(group: int = 3, layers: int = 4, seed: int = 0):
    """A random podkit Llama: 6 query / 2 KV heads (GQA 3), hidden 48, vocab 61, dense attention; q/k sharper
    than the default init, so POD changes the outputs visibly."""
    return factory_model(3, layers, seed=seed, qk_std=SHARP_QK_STD)


def _pod_student(seed=0):
    model = tiny_model(group=3, layers=4, seed=seed)
    model.set_sparse_attention(pod_anchor_layers=ANCHORS, **POD)
    return model


def _batch(batch=2, length=23, vocab=61, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    labels = ids.clone()
    labels[0, 5] = -100  # an ignored target
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("objective", ["lm", "distill", "lm+distill"])
@pytest.mark.parametrize("chunk", [1, 7, 16])
@pytest.mark.parametrize("frozen_head", [False, True], ids=["head-trains", "head-frozen"])
def test_chunked_loss_equals_unchunked_with_gradients(objective, chunk, frozen_head):
    """A frozen head (LoRA) takes the gradient-in-forward route (train/losses.py), a trained one recomputes."""
    torch.manual_seed(0)
    hidden_size, vocab = 12, 37
    head = torch.nn.Linear(hidden_size, vocab, bias=False).requires_grad_(not frozen_head)
    teacher_head = torch.nn.Linear(hidden_size, vocab, bias=False)
    student_hidden = torch.randn(3, 9, hidden_size, requires_grad=True)
    teacher_hidden = torch.randn(3, 9, hidden_size)
    labels = torch.randint(0, vocab, (3, 9))
    labels[1, 3:6] = -100
    weights = ObjectiveWeights.for_objective(objective, 0.3)
    results = []
    for chunk_tokens in (None, chunk):
        head.zero_grad()
        student_hidden.grad = None
        terms = chunked_objective_loss(student_hidden, labels, head, weights=weights, teacher_hidden=teacher_hidden,
                                       teacher_head=teacher_head, temperature=2.0, chunk_tokens=chunk_tokens)
        (3.0 * terms.loss).backward()  # a factor other than 1 reaches the kept gradient too
        results.append((terms.loss.detach(), terms.lm, terms.kl, student_hidden.grad.clone(),
                        head.weight.grad.clone() if not frozen_head else torch.zeros(())))
    (a, lm_a, kl_a, gh_a, gw_a), (b, lm_b, kl_b, gh_b, gw_b) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert lm_a == pytest.approx(lm_b, rel=1e-5) and kl_a == pytest.approx(kl_b, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(gh_a, gh_b, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw_a, gw_b, rtol=1e-4, atol=1e-6)


def test_loss_terms_match_a_plain_reference():
    torch.manual_seed(3)
    head, teacher_head = torch.nn.Linear(8, 11, bias=False), torch.nn.Linear(8, 11, bias=False)
    hs, ht = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, 2] = -100
    temperature = 1.5
    terms = chunked_objective_loss(hs, labels, head, weights=ObjectiveWeights(0.25, 0.75), teacher_hidden=ht,
                                   teacher_head=teacher_head, temperature=temperature, chunk_tokens=4)
    logits_s, logits_t = head(hs)[:, :-1], teacher_head(ht)[:, :-1]
    targets = labels[:, 1:]
    valid = targets != -100
    ce = F.cross_entropy(logits_s.reshape(-1, 11), targets.reshape(-1), ignore_index=-100)
    p_t = F.softmax(logits_t / temperature, -1)
    kl_tok = (p_t * (p_t.log() - F.log_softmax(logits_s / temperature, -1))).sum(-1)
    kl = (kl_tok * valid).sum() / valid.sum() * temperature ** 2
    assert terms.lm == pytest.approx(float(ce.detach()), rel=1e-5)
    assert terms.kl == pytest.approx(float(kl.detach()), rel=1e-5)
    assert float(terms.loss.detach()) == pytest.approx(0.25 * float(ce.detach()) + 0.75 * float(kl.detach()), rel=1e-5)
    assert terms.tokens == int(valid.sum())


def test_kl_is_zero_at_step_zero_when_pod_is_disabled():
    student = tiny_model(group=3, layers=4, seed=0).train()
    teacher = FrozenCopyTeacher(freeze(copy.deepcopy(student)))
    terms = ObjectiveLoss("distill", teacher=teacher, chunk_tokens=8)(student, _batch())
    assert abs(terms.kl) < 1e-6 and abs(float(terms.loss.detach())) < 1e-6


def test_pod_student_has_positive_kl_and_gradients_reach_only_the_student():
    dense = tiny_model(group=3, layers=4, seed=0)
    teacher = FrozenCopyTeacher(freeze(copy.deepcopy(dense)))
    student = _pod_student(seed=0).train()
    terms = ObjectiveLoss("lm+distill", teacher=teacher, distill_weight=0.5, chunk_tokens=8)(student, _batch())
    assert terms.kl > 1e-4
    terms.loss.backward()
    assert all(p.grad is None for p in teacher.model.parameters())
    grads = [p.grad for p in student.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)


def test_lora_teacher_equals_the_dense_base_and_restores_the_student():
    from peft import LoraConfig, get_peft_model

    base = _pod_student(seed=0)
    reference = tiny_model(group=3, layers=4, seed=0).eval()  # the same weights, dense attention
    student = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                                              init_lora_weights=False))  # non-zero adapters: student != base
    batch = _batch()
    teacher = LoraTeacher(student)
    with torch.no_grad():
        expected = reference(input_ids=batch["input_ids"], skip_lm_head=True).hidden_states[-1]
        expected_logits = reference(input_ids=batch["input_ids"]).logits
    got = teacher.hidden(batch["input_ids"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(teacher.head(got), expected_logits, rtol=1e-5, atol=1e-5)
    # afterwards the student is the POD model with its adapters again
    assert student.get_base_model().sparse_config.prefill_scheme == "pod"
    with torch.no_grad():
        student_hidden = student(input_ids=batch["input_ids"], skip_lm_head=True).hidden_states[-1]
    assert not torch.allclose(student_hidden, expected, atol=1e-3)
    terms = ObjectiveLoss("distill", teacher=teacher, chunk_tokens=5)(student.train(), batch)
    terms.loss.backward()
    trainable = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    assert all(p.grad is not None for _, p in trainable)


def test_dense_attention_context_restores_the_scheme_on_error():
    student = _pod_student()
    with pytest.raises(RuntimeError):
        with dense_attention(student):
            assert student.sparse_config.prefill_scheme == "dense"
            raise RuntimeError("boom")
    assert student.sparse_config.prefill_scheme == "pod"


def test_objective_errors_name_the_field():
    with pytest.raises(ValueError, match="train.objective='kl'"):
        ObjectiveWeights.for_objective("kl")
    with pytest.raises(ValueError, match="needs a teacher"):
        ObjectiveLoss("distill", teacher=None)
    with pytest.raises(ValueError, match="distill_temperature"):
        chunked_objective_loss(torch.zeros(1, 3, 2), torch.zeros(1, 3, dtype=torch.long), torch.nn.Linear(2, 3),
                               weights=ObjectiveWeights(1.0, 0.0), temperature=0.0)
