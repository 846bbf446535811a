"""Needle-in-a-haystack question answering on a grid of context lengths x needle depths.

Like RULER's ``niah_single`` (Hsieh et al. 2024) and the original needle test (Kamradt 2023), with
real prose as the haystack: a single fact "The secret {object} of {name} is {value}." is inserted at
``depth``; the question asks for it and the answer is a word (not a number, unlike the passkey).
Names, objects and values come from fixed word lists, drawn by a seeded RNG, so samples are
reproducible. The split context / question / answer is the one of :mod:`eval.tasks.passkey`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from eval.tasks.haystack import check_haystack, insert_needle
from eval.tasks.passkey import PasskeySample, depth_grid

NAMES = ("Alice", "Bertrand", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ingrid", "Jonas")
OBJECTS = ("colour", "fruit", "animal", "city", "instrument")
VALUES = {
    "colour": ("crimson", "turquoise", "amber", "violet", "olive", "scarlet"),
    "fruit": ("apricot", "mango", "papaya", "cherry", "lychee", "quince"),
    "animal": ("otter", "falcon", "badger", "walrus", "lynx", "heron"),
    "city": ("Lisbon", "Oslo", "Nairobi", "Kyoto", "Lima", "Prague"),
    "instrument": ("cello", "oboe", "banjo", "harp", "tuba", "sitar"),
}
INTRO = "Read the text below. A secret is hidden in it; you will be asked about it.\n\n"


def make_needle_sample(tokenizer: Any, target_tokens: int, depth: float, *, haystack: str = "pride_and_prejudice",
                       seed: int = 0) -> PasskeySample:
    """One needle-QA prompt of about ``target_tokens`` tokens; ``answer`` is " <value>"."""
    if isinstance(target_tokens, bool) or not isinstance(target_tokens, int) or target_tokens < 32:
        raise ValueError(f"target_tokens={target_tokens!r} is invalid: expected an integer >= 32")
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth={depth!r} is invalid: expected a number in [0, 1]")
    check_haystack(haystack)
    rng = random.Random(f"needle/{seed}/{target_tokens}/{depth}/{haystack}")
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    value = rng.choice(VALUES[obj])
    needle = f" The secret {obj} of {name} is {value}. "
    question = f"\n\nQuestion: what is the secret {obj} of {name}?\nAnswer: The secret {obj} of {name} is"
    context, num_tokens = insert_needle(tokenizer, INTRO, needle, question, haystack, target_tokens, depth,
                                        f"needle/{seed}/{target_tokens}/{depth}/{haystack}")
    return PasskeySample(context=context, question=question, answer=" " + value, passkey=value,
                         target_tokens=target_tokens, num_tokens=num_tokens,
                         depth=float(depth), haystack=haystack, seed=seed)


def needle_grid(tokenizer: Any, lengths: list[int], num_depths: int = 10, *, haystack: str = "pride_and_prejudice",
                samples_per_cell: int = 1, seed: int = 0) -> list[PasskeySample]:
    return [make_needle_sample(tokenizer, length, depth, haystack=haystack, seed=seed + repeat)
            for length in lengths for depth in depth_grid(num_depths) for repeat in range(samples_per_cell)]


_WORD = re.compile(r"[A-Za-z]+")


def needle_correct(generation: str, value: str) -> bool:
    """Whether the first word of ``generation`` is the needle's value (case-insensitive)."""
    match = _WORD.search(generation)
    return bool(match) and match.group(0).lower() == value.lower()
