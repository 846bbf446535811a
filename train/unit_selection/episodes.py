"""Synthetic retrieval samples for the gate optimisation: ``podkit:recall`` episodes at one length.

Source: ``train/corpus/recall.py``'s ``make_episode`` (facts about invented people at random paragraph breaks
of real prose, then a quiz asking for some of them), over prose taken from the *training* mixture (rows of
``data.train`` decoded back to text). So nothing here is an evaluated text or template: not RULER's (its
"special magic number" needles, train/long_context_eval/), not ``eval/tasks/passkey.py``'s pass key nor
``eval/tasks/needle.py``'s secret word; recall.py keeps its wording disjoint from theirs
(``EVALUATION_PHRASES``, checked by tests/train/test_recall.py and tests/train/test_unit_selection.py).

The loss positions are those that predict an answer's value tokens (``A: <who>'s <what> is <value>.``): the
value can only come from the fact, usually further back than POD's proximal window (recall.py ``FACT_SPAN``).
"""

from __future__ import annotations

import random
import re

import torch

from train.corpus.recall import QUIZ_HEADER, make_episode

_ANSWER = re.compile(r"^A: .*? is (.+)\.$", re.MULTILINE)


def answer_spans(episode: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the answer values in an episode's quiz."""
    quiz = episode.rfind(QUIZ_HEADER)
    if quiz < 0:
        return []
    return [(m.start(1), m.end(1)) for m in _ANSWER.finditer(episode, quiz)]


def _encode(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` and, per token, whether it overlaps an answer span."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    marks = [any(start < e and s < end for s, e in spans) for start, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), marks


def recall_samples(tokenizer, prose: list[str], *, length: int, count: int, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` episodes of exactly ``length`` tokens: ``(ids[N,S] int64, loss_mask[N,S] bool)``.

    ``loss_mask[n, t]`` marks positions whose *next* token is an answer value token (the positions whose hidden
    state predicts it). Episode ``n`` is built over ``prose[n % len(prose)]``, shortened until the whole
    episode (facts and quiz) fits, then right-filled with the start of the next prose text so every row has
    ``length`` tokens (filler after the quiz carries no loss). Deterministic for a seed.
    """
    if not prose:
        raise ValueError("no prose to build recall episodes from")
    rng = random.Random(f"podkit-unit-selection/{seed}")
    rows, masks = [], []
    for n in range(count):
        text = prose[n % len(prose)]
        chars = len(text)
        for _ in range(40):  # shorten the prose until the episode fits; each try draws new facts
            episode = make_episode(text[:chars], random.Random(rng.random()))
            ids, marks = _encode(tokenizer, episode, answer_spans(episode))
            if len(ids) <= length:
                break
            chars = int(chars * length / len(ids) * 0.95)
        else:
            raise ValueError(f"could not fit a recall episode (facts and quiz) into {length} tokens: raise the "
                             f"episode length (pod.unit_selection.length)")
        if not any(marks):
            raise ValueError(f"a recall episode of {len(ids)} tokens has no answer token (length {length} too short)")
        filler, _ = _encode(tokenizer, "\n\n" + prose[(n + 1) % len(prose)], [])
        ids = (ids + filler * (1 + length // max(len(filler), 1)))[:length]
        if len(ids) < length:
            raise ValueError(f"prose text {(n + 1) % len(prose)} is empty: cannot fill an episode to {length} tokens")
        marks = (marks + [False] * length)[:length]
        rows.append(ids)
        masks.append(marks[1:] + [False])  # position t predicts token t + 1
    return torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.bool)
