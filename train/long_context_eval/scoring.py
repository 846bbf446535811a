"""RULER scores of a podkit model under its current schemes, through the generation engine.

The protocol is the leaderboard's (eval/harness/leaderboard.py, after kvpress's RULER protocol): the context is prefilled
with the model's prefill scheme, the question is fed token by token through the decode path, and the answer is
decoded greedily (sparse_models/engine/answers.py), ``batch_size`` prompts per engine. Scores are RULER's
(``ruler.score``): percent of the references found, per sample.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from sparse_models.engine import GenerationEngine
from sparse_models.engine.answers import engine_answers, slots_needed
from train.long_context_eval import ruler


@torch.no_grad()
def answer_samples(model, tokenizer, samples: list[ruler.RulerSample], *, chat: bool, batch_size: int,
                   max_new_tokens: int | None = None) -> list[str]:
    """Greedy answers of ``model`` (a podkit causal LM, its current schemes) to ``samples``, in order."""
    was_training = model.training
    model.eval()
    # prompts of similar length share an engine: the cache is sized by the longest row of the batch
    order = sorted(range(len(samples)), key=lambda i: (samples[i].max_length, samples[i].task, samples[i].index))
    by_index: dict[int, str] = {}
    for start in range(0, len(order), batch_size):
        chunk = [samples[i] for i in order[start:start + batch_size]]
        rendered = [ruler.render(s, tokenizer, chat) for s in chunk]
        contexts = [tokenizer(c).input_ids for c, _ in rendered]
        questions = [tokenizer(q, add_special_tokens=False).input_ids for _, q in rendered]
        tokens = [min(s.tokens_to_generate, max_new_tokens or s.tokens_to_generate) for s in chunk]
        engine = GenerationEngine(model, sparse_config=model.sparse_config, max_batch_size=len(chunk),
                                  max_seq_len=slots_needed(contexts, questions, tokens))
        for i, answer in zip(order[start:start + batch_size],
                             engine_answers(engine, contexts, questions, tokens, tokenizer.eos_token_id)):
            by_index[i] = tokenizer.decode(answer)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    answers = [by_index[i] for i in range(len(samples))]
    if was_training:
        model.train()
    return answers


def score_samples(model, tokenizer, samples: list[ruler.RulerSample], *, chat: bool, batch_size: int,
                  label: str, log=print) -> list[dict]:
    """One record per sample: task, category, length, index, seed, score (0-100) and the generation."""
    started = time.perf_counter()
    answers = answer_samples(model, tokenizer, samples, chat=chat, batch_size=batch_size)
    records = [{"row": label, "task": s.task, "category": s.category, "length": s.max_length, "index": s.index,
                "seed": s.seed, "score": 100.0 * ruler.score(s.task, text, s.outputs), "generation": text}
               for s, text in zip(samples, answers)]
    log(f"[ruler] {label}: {len(samples)} samples in {time.perf_counter() - started:.0f}s; "
        + ", ".join(f"{length}: {row['average']:.1f}" for length, row in summarise(records).items()))
    return records


def summarise(records: list[dict]) -> dict[str, dict]:
    """``{length: {"average", "tasks": {task: mean}, "categories": {category: mean}, "samples"}}`` (strings as
    keys, JSON-ready). The average is RULER's: the mean over tasks of each task's mean score."""
    by_length: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    categories: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_length[r["length"]][r["task"]].append(r["score"])
    out = {}
    for length in sorted(by_length):
        tasks = {task: statistics.fmean(scores) for task, scores in by_length[length].items()}
        for task, mean in tasks.items():
            categories[length][ruler.CATEGORY[ruler.TASKS[task][0]]].append(mean)
        out[str(length)] = {"average": statistics.fmean(tasks.values()), "tasks": tasks,
                            "categories": {c: statistics.fmean(v) for c, v in categories[length].items()},
                            "samples": sum(len(v) for v in by_length[length].values())}
    return out


def relative(rows: dict[str, dict], reference: str) -> dict[str, dict[str, float]]:
    """Each row's average as a fraction of ``reference``'s, per length (None where the reference scores 0)."""
    base = rows.get(reference, {})
    return {name: {length: (row[length]["average"] / base[length]["average"]
                            if length in base and base[length]["average"] else None)
                   for length in row} for name, row in rows.items()}
