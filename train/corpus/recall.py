"""``podkit:recall``: synthetic recall documents built from the prose of the training mixture.

Why. Plain next-token text rarely needs a token more than a few hundred positions back, so a POD
adaptation on prose alone never asks the shared distant keys to *find* anything: the adapted model
keeps its perplexity and loses the pass key (BENCHMARKS.md, "Why passkey collapses under POD").
Long-context adaptations mix in synthetic retrieval for this reason (e.g. the passkey-style data of
Mohtashami & Jaggi 2023, §4; RULER's needle variants, Hsieh et al. 2024, §3). Each document here is a
run of *episodes*: a stretch of real prose with a few facts placed at random paragraph breaks, then
questions about some of them with their answers. The answers can only be predicted by attending back
to the fact, usually further back than POD's proximal window.

Nothing here is the evaluation's text: the filler is the training split of the prose sources (held-out
documents, *Emma* and the out-of-domain books are already removed from it, ``train.corpus.documents``),
and the fact and question wording is disjoint from the evaluated tasks' (``eval/tasks/passkey.py``'s
"pass key", ``eval/tasks/needle.py``'s "secret ... of ...", RULER's "special magic number"); a test
checks that.

Episode (one of several per document; lengths in characters, about 4 per token)::

    <prose ...> [facts at random paragraph breaks, e.g. "Margaret Holt's locker number is 48213."] <prose ...>
    Quiz.
    Q: What is Margaret Holt's locker number?
    A: Margaret Holt's locker number is 48213.

Two shapes (``SHAPES``):

* ``podkit:recall`` -- four episodes of ~600-1800 tokens per document, facts in the first 70%: an episode fits
  a 2K training row;
* ``podkit:recall-long`` -- one episode of ~3.5K-6.5K tokens per document, facts in the first half, so a fact
  is at least half an episode (typically 1.7K tokens or more) before its question: mostly beyond the 8K recipe's
  1008-token proximal window, where POD's shared distant keys have to find it. Its documents start training
  rows (``row_aligned``: ``train.corpus.mixture``), so no row boundary cuts an episode (a few of the longest,
  under 1% on the embedded prose, run past 8K tokens and lose the end of their quiz); it needs
  ``data.context_length`` of at least ``min_context`` tokens, since a shorter row would keep the prose and lose
  the quiz.

Deterministic: the same seed, version, shape and prose give the same documents.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

RECALL_VERSION = 1          # bump when the generator's output changes: token shards are rebuilt
PROSE_SOURCES = ("austen", "shakespeare", "bible-web", "anarchist-faq")
EPISODE_CHARS = (2_400, 7_200)   # ~600-1800 tokens: an episode fits one 2K training row (when a row
                                 # boundary cuts one, the questions after the cut lose their facts)
FACT_SPAN = 0.7                  # facts go in the first 70% of an episode: mostly beyond a 256-token window
FACTS_PER_EPISODE = (2, 5)
EPISODES_PER_DOCUMENT = 4
DOCUMENTS = 4_000           # at most ~4 x 4 x 4.8K chars = 77M characters; the mixture draws what its weight asks


@dataclass(frozen=True)
class RecallShape:
    """The episodes one recall source generates (see the module docstring)."""

    episode_chars: tuple[int, int]   # prose characters per episode (about 4 per token)
    fact_span: float                 # facts go in this leading fraction of an episode
    episodes_per_document: int
    documents: int
    row_aligned: bool                # each document starts a training row (train.corpus.mixture)
    min_context: int                 # the shortest data.context_length whose rows hold a whole episode


SHAPES = {
    "recall": RecallShape(EPISODE_CHARS, FACT_SPAN, EPISODES_PER_DOCUMENT, DOCUMENTS, row_aligned=False,
                          min_context=2),
    # ~3.5K-6.5K tokens with the prose sources' ~4 characters per token: under an 8K row with room for the quiz;
    # the prose runs out well before 4000 documents (every stretch is used once)
    "recall-long": RecallShape((14_000, 26_000), 0.5, 1, DOCUMENTS, row_aligned=True, min_context=8192),
}

FIRST_NAMES = ("Margaret", "Thomas", "Eleanor", "Arthur", "Beatrice", "Walter", "Clara", "Henry", "Agnes", "Oliver",
               "Louisa", "Edmund", "Harriet", "Frederick", "Ada", "Julian", "Cecily", "Rupert", "Mabel", "Victor",
               "Rosa", "Felix", "Ida", "Leopold", "Nora", "Gilbert", "Sylvia", "Ambrose", "Irene", "Casper")
SURNAMES = ("Holt", "Ashdown", "Pryce", "Kendal", "Marlow", "Fenwick", "Barrow", "Tilney", "Quill", "Ormond",
            "Redfern", "Sutton", "Vance", "Whitlock", "Garland", "Hale", "Lindqvist", "Moreau", "Okafor", "Brandt",
            "Castell", "Dunmore", "Everly", "Fairbank", "Grey", "Hurst", "Ingram", "Joyce", "Keating", "Lowry")
NUMBER_ATTRIBUTES = ("locker number", "room number", "ticket number", "account number", "badge number",
                     "seat number", "parcel number", "invoice number", "house number", "membership number")
WORD_ATTRIBUTES = ("favourite colour", "home town", "usual drink", "chosen flower", "lucky charm", "pet's name",
                   "middle name", "travel destination", "preferred instrument", "garden tree")
CODE_ATTRIBUTES = ("door code", "booking reference", "licence plate", "locker combination", "wifi password")
WORD_VALUES = ("amber", "Bristol", "cocoa", "marigold", "horseshoe", "Pepper", "Augustine", "Lisbon", "cello",
               "juniper", "crimson", "Dundee", "lemonade", "violet", "acorn", "Biscuit", "Bartholomew", "Oslo",
               "harp", "willow", "teal", "Galway", "cider", "tulip", "compass", "Maple", "Percival", "Naples",
               "oboe", "cedar", "indigo", "Whitby", "ginger", "orchid", "lantern", "Muffin", "Rowena", "Tangier",
               "flute", "hazel")
_CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
FACT_TEMPLATES = ("{who}'s {what} is {value}.", "For the record, {who}'s {what} is {value}.",
                  "Note that the {what} of {who} is {value}.")
QUIZ_HEADER = "\n\nQuiz.\n"
QUESTION = "Q: What is {who}'s {what}?\nA: {who}'s {what} is {value}.\n"

# wording the evaluation tasks use; none of it may appear in a fact or question (tests/train/test_recall.py)
EVALUATION_PHRASES = ("pass key", "passkey", "secret", "special magic", "magic number", "hidden inside",
                      "memorize", "What is the pass key")


def _value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        digits = rng.randint(3, 6)
        return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    if kind == "code":
        return "".join(rng.choice(_CODE_ALPHABET) for _ in range(3)) + "-" + "".join(
            rng.choice(_CODE_ALPHABET) for _ in range(rng.randint(2, 4)))
    return rng.choice(WORD_VALUES)


def _facts(rng: random.Random, count: int) -> list[dict]:
    """``count`` facts with distinct (person, attribute) keys."""
    facts, keys = [], set()
    while len(facts) < count:
        who = f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"
        kind = rng.choice(("number", "number", "word", "code"))
        what = rng.choice({"number": NUMBER_ATTRIBUTES, "word": WORD_ATTRIBUTES, "code": CODE_ATTRIBUTES}[kind])
        if (who, what) in keys:
            continue
        keys.add((who, what))
        facts.append({"who": who, "what": what, "value": _value(rng, kind)})
    return facts


def _paragraph_breaks(text: str) -> list[int]:
    """Offsets just after each blank-line paragraph break (or line break when a text has none)."""
    breaks = [m.end() for m in re.finditer(r"\n\s*\n", text)]
    return breaks or [m.end() for m in re.finditer(r"\n", text)]


def make_episode(prose: str, rng: random.Random, fact_span: float = FACT_SPAN) -> str:
    """One episode over ``prose`` (a stretch of real text): facts inserted at random paragraph breaks
    in its first ``fact_span``, then a quiz on at least half of them, in random order."""
    facts = _facts(rng, rng.randint(*FACTS_PER_EPISODE))
    breaks = [b for b in _paragraph_breaks(prose) if b < fact_span * len(prose)] or [0]
    places = sorted(rng.choice(breaks) for _ in facts)
    pieces, start = [], 0
    for place, fact in zip(places, facts):
        pieces += [prose[start:place], rng.choice(FACT_TEMPLATES).format(**fact) + "\n\n"]
        start = place
    pieces.append(prose[start:].rstrip() + QUIZ_HEADER)
    asked = rng.sample(facts, rng.randint((len(facts) + 1) // 2, len(facts)))
    pieces += [QUESTION.format(**fact) for fact in asked]
    return "".join(pieces)


def _prose_stretches(texts: Iterable[str], rng: random.Random, chars: tuple[int, int] = EPISODE_CHARS
                     ) -> Iterator[str]:
    """Consecutive stretches of ``chars`` characters (cut at a line break) out of ``texts``."""
    for text in texts:
        start = 0
        while len(text) - start >= chars[0]:
            end = min(len(text), start + rng.randint(*chars))
            cut = text.rfind("\n", start + chars[0] // 2, end) if end < len(text) else -1
            end = cut + 1 if cut > 0 else end
            yield text[start:end]
            start = end


def recall_documents(prose_by_source: dict[str, Iterable[str]], *, documents: int | None = None,
                     seed: int = 0, shape: RecallShape = SHAPES["recall"]) -> Iterator[str]:
    """``documents`` (default ``shape.documents``) recall documents of ``shape.episodes_per_document``
    episodes each, taking prose stretches round-robin over the sources (so every prose genre is filler) until
    ``documents`` or the prose ends."""
    documents = shape.documents if documents is None else documents
    rng = random.Random(f"podkit-recall/{RECALL_VERSION}/{seed}")
    streams = [_prose_stretches(texts, random.Random(f"{name}/{seed}"), shape.episode_chars)
               for name, texts in prose_by_source.items()]
    made = 0
    while streams and made < documents:
        episodes = []
        # a document of fewer episodes than there are sources starts at the next source, so that every
        # genre is filler (podkit:recall's four episodes already visit the four sources in turn)
        first = made % len(streams) if shape.episodes_per_document < len(streams) else 0
        for stream in streams[first:] + streams[:first]:
            stretch = next(stream, None)
            if stretch is None:
                streams.remove(stream)
                continue
            episodes.append(make_episode(stretch, rng, shape.fact_span))
            if len(episodes) == shape.episodes_per_document:
                break
        if not episodes:
            break
        made += 1
        yield "\n\n".join(episodes)
