"""Passkey retrieval samples on a grid of context lengths x needle depths.

The test of Mohtashami & Jaggi (2023, "Landmark Attention"), as run by Quest (arXiv 2406.10774,
Table 1) and TidalDecode (arXiv 2410.05076, Fig. 5): a random 5-digit pass key is stated once inside a
long haystack and the model is asked to repeat it. The prompt is split in three parts so that a
runner can put the *question* in the decode phase (see :mod:`eval.harness.quality`):

    context  = INTRO + haystack[:d] + NEEDLE + haystack[d:]
    question = "\\n\\nWhat is the pass key? The pass key is"
    answer   = " 71432"

``depth`` is the fraction of haystack tokens placed before the needle (0 = right after the intro,
1 = right before the question). Lengths count the model's tokens of ``context + question`` and are
exact up to a few tokens at the two seams (recorded as ``num_tokens``).
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from typing import Any

from eval.tasks.haystack import check_haystack, insert_needle

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeySample:
    """One passkey prompt. ``context + question`` is the model input, ``answer`` the expected continuation."""

    context: str
    question: str
    answer: str
    passkey: str
    target_tokens: int
    num_tokens: int
    depth: float
    haystack: str
    seed: int

    @property
    def prompt(self) -> str:
        return self.context + self.question

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"prompt": self.prompt}


def depth_grid(num_depths: int) -> list[float]:
    """``num_depths`` evenly spaced depths from 0 to 1 inclusive (10 -> 0, 1/9, ..., 1)."""
    if isinstance(num_depths, bool) or not isinstance(num_depths, int) or num_depths < 1:
        raise ValueError(f"num_depths={num_depths!r} is invalid: expected an integer >= 1")
    if num_depths == 1:
        return [0.5]
    return [round(i / (num_depths - 1), 4) for i in range(num_depths)]


def make_passkey_sample(tokenizer: Any, target_tokens: int, depth: float, *, haystack: str = "filler",
                        seed: int = 0) -> PasskeySample:
    """One passkey prompt of about ``target_tokens`` tokens with the needle at ``depth``."""
    if isinstance(target_tokens, bool) or not isinstance(target_tokens, int) or target_tokens < 16:
        raise ValueError(f"target_tokens={target_tokens!r} is invalid: expected an integer >= 16")
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth={depth!r} is invalid: expected a number in [0, 1]")
    check_haystack(haystack)
    seed_key = f"passkey/{seed}/{target_tokens}/{depth}/{haystack}"
    passkey = str(random.Random(seed_key).randint(10000, 99999))
    context, num_tokens = insert_needle(tokenizer, INTRO, NEEDLE.format(key=passkey), QUESTION, haystack,
                                        target_tokens, depth, seed_key)
    return PasskeySample(context=context, question=QUESTION, answer=" " + passkey, passkey=passkey,
                         target_tokens=target_tokens, num_tokens=num_tokens, depth=float(depth),
                         haystack=haystack, seed=seed)


def passkey_grid(tokenizer: Any, lengths: list[int], num_depths: int = 10, *, haystack: str = "filler",
                 samples_per_cell: int = 1, seed: int = 0) -> list[PasskeySample]:
    """Samples for every (length, depth) cell; cell samples differ in pass key and haystack offset."""
    return [make_passkey_sample(tokenizer, length, depth, haystack=haystack, seed=seed + repeat)
            for length in lengths for depth in depth_grid(num_depths) for repeat in range(samples_per_cell)]


_NUMBER = re.compile(r"\d+")


def passkey_correct(generation: str, passkey: str) -> bool:
    """Whether the first number in ``generation`` is the pass key (a leading wrong number is wrong)."""
    match = _NUMBER.search(generation)
    return bool(match) and match.group(0) == passkey
