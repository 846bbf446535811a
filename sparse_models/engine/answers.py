"""Batched retrieval answers through podkit's generation engine (sparse_models.engine): the protocol of
:func:`eval.runner.retrieval_generate` (context prefilled with the prefill scheme, question fed token
by token through the decode path, or prefilled with the context when its ids are empty, greedy answer
through the decode path) for many prompts at once,
with CUDA-graph decode steps on a GPU. The RULER leaderboard uses it on CUDA (``--engine``), where
the one-prompt loop would take hours per length.

Ragged batches: each row's question has its own length, so at decode step t a row still in its
question feeds its question's token t (teacher forcing) while a row past it feeds its own last
greedy token; a finished row (end-of-sequence or its ``max_new_tokens``) feeds a dummy token whose
cache slot nothing reads before the batch ends.
"""

from __future__ import annotations

from typing import Sequence

import torch


def slots_needed(context_ids: Sequence[Sequence[int]], question_ids: Sequence[Sequence[int]],
                 max_new_tokens: Sequence[int]) -> int:
    """Cache slots per row for :func:`engine_answers`: the longest context plus the most decode steps."""
    return max(len(c) for c in context_ids) + max(len(q) + n for q, n in zip(question_ids, max_new_tokens))


@torch.no_grad()
def engine_answers(engine, context_ids: Sequence[Sequence[int]], question_ids: Sequence[Sequence[int]],
                   max_new_tokens: Sequence[int], eos_token_id: int | None,
                   stats: dict | None = None) -> list[list[int]]:
    """Greedy answer token ids (end-of-sequence excluded) per row, at most ``max_new_tokens[b]`` each.

    ``context_ids[b]`` is prefilled; ``question_ids[b]`` is fed through decode steps (the question-agnostic
    protocol), or is empty when the question was prefilled with the context: that row's first answer token then
    comes from the prefill's last logits.
    ``engine``: a :class:`sparse_models.engine.GenerationEngine` with ``max_batch_size >= len(context_ids)``
    and a capacity of at least :func:`slots_needed` (every row advances until the last row finishes).
    ``stats``: if given, receives the prefill scheme's report (``GenerationEngine.prefill``; Token Sparse: a
    TokenSparseStats whose rows are the batch's rows, in order).
    """
    batch = len(context_ids)
    if not batch or not len(question_ids) == len(max_new_tokens) == batch:
        raise ValueError(f"engine_answers: {batch} contexts, {len(question_ids)} questions and "
                         f"{len(max_new_tokens)} answer lengths: expected the same non-zero number")
    if any(len(c) < 1 for c in context_ids) or any(n < 1 for n in max_new_tokens):
        raise ValueError("engine_answers: every context needs >= 1 token and every row max_new_tokens >= 1")
    need = slots_needed(context_ids, question_ids, max_new_tokens)
    if need > engine.capacity or batch > engine.max_batch_size:
        raise ValueError(f"engine_answers: {batch} rows needing {need} slots, but the engine holds "
                         f"{engine.max_batch_size} rows of {engine.capacity}")
    first = engine.prefill([list(c) for c in context_ids], stats=stats).argmax(-1).tolist()
    answers: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    fed = [0] * batch

    def take(b: int, token: int) -> None:
        """Row ``b``'s greedy token: the end of its answer, or the next answer token (fed back next step)."""
        if eos_token_id is not None and token == eos_token_id:
            done[b] = True
            return
        answers[b].append(token)
        fed[b] = token
        done[b] = len(answers[b]) >= max_new_tokens[b]

    for b in range(batch):
        if question_ids[b]:
            fed[b] = question_ids[b][0]
        else:
            take(b, first[b])
    step = 0
    device = engine.device
    while not all(done):
        logits = engine.step(batch, torch.tensor(fed, dtype=torch.long, device=device))
        greedy = logits.argmax(-1).tolist()
        step += 1
        for b in range(batch):
            if done[b]:
                continue
            if step < len(question_ids[b]):
                fed[b] = question_ids[b][step]
                continue
            take(b, greedy[b])
    return answers
