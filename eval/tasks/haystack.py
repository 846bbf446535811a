"""Haystacks for retrieval tasks: token streams a needle is hidden in, cut to an exact token count.

Two kinds (both tokenised with the model's own tokenizer, so lengths are in the model's tokens):

* ``"filler"``: the classic repeated filler of the passkey test (Mohtashami & Jaggi 2023, used by
  Quest and TidalDecode): "The grass is green. The sky is blue. ..." -- trivially compressible, so
  the needle is the only surprising content;
* a book name from :data:`eval.data.texts.TEXT_NAMES` (e.g. ``"moby_dick"``): real prose, where the
  needle competes with natural content; much harder for a small model.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

from eval.data.texts import TEXT_NAMES, load_text

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def haystack_names() -> tuple[str, ...]:
    """Every accepted haystack name: ``"filler"`` plus the book names of eval.data.texts."""

    return ("filler",) + TEXT_NAMES


def check_haystack(haystack: str) -> None:
    if haystack not in haystack_names():
        raise ValueError(f"haystack={haystack!r} is not known: expected one of {', '.join(haystack_names())}")


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (BOS is the model's business, not the haystack's)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def haystack_tokens(tokenizer: Any, haystack: str, num_tokens: int, rng: random.Random) -> list[int]:
    """``num_tokens`` haystack token ids; a book haystack starts at a random paragraph chosen by ``rng``."""
    check_haystack(haystack)
    if num_tokens <= 0:
        return []
    if haystack == "filler":
        unit = encode(tokenizer, FILLER)
        # Repeating the token ids of one unit keeps the filler periodic in tokens, not just in text.
        return (unit * (num_tokens // len(unit) + 1))[:num_tokens]
    ids = _book_tokens(id(tokenizer), tokenizer, haystack)
    if len(ids) < num_tokens:
        raise ValueError(f"haystack={haystack!r} has {len(ids)} tokens, fewer than the {num_tokens} requested")
    start = rng.randrange(0, len(ids) - num_tokens + 1)
    return ids[start:start + num_tokens]


@lru_cache(maxsize=8)
def _book_tokens(_key: int, tokenizer: Any, name: str) -> list[int]:
    return encode(tokenizer, load_text(name))


def sentence_split_point(tokenizer: Any, hay: list[int], depth: float, search: int = 64) -> int:
    """The token index nearest ``depth * len(hay)`` that follows a sentence end (a token ending in '.').

    Inserting the needle between sentences keeps words intact; if no sentence end lies within
    ``search`` tokens (or at the two ends of the haystack) the exact index is used.
    """
    exact = round(float(depth) * len(hay))
    if exact <= 0 or exact >= len(hay):
        return exact
    for offset in range(search + 1):
        for index in (exact - offset, exact + offset):
            if 0 < index < len(hay) and tokenizer.decode(hay[index - 1:index]).rstrip().endswith((".", "!", "?")):
                return index
    return exact


def insert_needle(tokenizer: Any, intro: str, needle: str, question: str, haystack: str, target_tokens: int,
                  depth: float, rng_seed: str) -> tuple[str, int]:
    """``(context, num_tokens)`` with ``context = intro + hay[:d] + needle + hay[d:]`` sized so that
    ``context + question`` is ``target_tokens`` long (re-measured, then corrected, since tokens can
    merge across the seams)."""
    fixed = len(encode(tokenizer, intro)) + len(encode(tokenizer, needle)) + len(encode(tokenizer, question))
    num_hay = target_tokens - fixed
    if num_hay < 0:
        raise ValueError(f"target_tokens={target_tokens} is too short: the intro, needle and question alone "
                         f"take {fixed} tokens")
    context, num_tokens = "", 0
    for _ in range(3):
        rng = random.Random(rng_seed)  # same haystack window on every correction round
        hay = haystack_tokens(tokenizer, haystack, max(num_hay, 0), rng)
        split = sentence_split_point(tokenizer, hay, depth)
        before = tokenizer.decode(hay[:split]) if split else ""
        after = tokenizer.decode(hay[split:]) if split < len(hay) else ""
        context = intro + before + needle + after
        num_tokens = len(encode(tokenizer, context + question))
        if num_tokens == target_tokens:
            break
        num_hay += target_tokens - num_tokens
    return context, num_tokens
