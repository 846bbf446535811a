"""Held-out text must not be trained on: hashed token n-grams of training shards vs held-out text.

``ngram_hashes(tokens, n)`` is a polynomial hash (mod 2^64) of every window of ``n`` consecutive
tokens, vectorised as ``n`` passes over the array. A held-out set is tokenised with the same
tokenizer; a training shard stream "overlaps" it where one of its n-gram hashes is in the held-out
set. With ``n = 32`` tokens a shared window means copied text, not a common phrase.

``drop_shared_spans`` is the same test used as a filter: the training split of a corpus source loses
every span covered by an n-gram of the held-out set (``FILTER_N`` < the check's default 32, so the check
passes by construction), and the document is cut there into separate documents.
"""

from __future__ import annotations

import numpy as np

_BASE = np.uint64(1_000_003)
FILTER_N = 24


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """uint64 ``[len(tokens) - n + 1]`` hashes of the n-token windows (empty if too short)."""
    tokens = np.asarray(tokens).astype(np.uint64)
    count = len(tokens) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    out = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            out = out * _BASE + tokens[j:j + count] + np.uint64(1)
    return out


def in_sorted(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``values`` in ``table`` (sorted, unique), as a bool mask: a binary search per value, O(n log m)
    (``np.isin`` would sort the whole table again on every call)."""
    if len(table) == 0:
        return np.zeros(len(values), dtype=bool)
    index = np.minimum(np.searchsorted(table, values), len(table) - 1)
    return table[index] == values


def overlap_count(train, heldout_tokens: np.ndarray, n: int = 32, chunk: int = 8 * 1024 * 1024) -> int:
    """How many n-token windows of the training stream ``train`` (a ShardedTokens) also occur in
    ``heldout_tokens``. The stream is scanned in chunks that overlap by ``n - 1`` tokens."""
    held = np.unique(ngram_hashes(heldout_tokens, n))
    hits = 0
    for start in range(0, train.total_tokens, chunk):
        length = min(chunk + n - 1, train.total_tokens - start)
        hits += int(in_sorted(ngram_hashes(train.read(start, length), n), held).sum())
    return hits


def drop_shared_spans(ids: np.ndarray, heldout_hashes: np.ndarray, n: int = FILTER_N) -> list[np.ndarray]:
    """``ids`` without every token covered by an n-token window whose hash is in ``heldout_hashes``
    (sorted, unique), as the list of remaining segments (in order; empty ones dropped)."""
    hashes = ngram_hashes(ids, n)
    if len(hashes) == 0 or len(heldout_hashes) == 0:
        return [ids]
    hit = in_sorted(hashes, heldout_hashes)
    if not hit.any():
        return [ids]
    covered = np.zeros(len(ids) + 1, dtype=np.int32)  # difference array: +1 at a window start, -1 past its end
    starts = np.flatnonzero(hit)
    np.add.at(covered, starts, 1)
    np.add.at(covered, starts + n, -1)
    keep = np.cumsum(covered[:-1]) == 0
    edges = np.flatnonzero(np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8)))
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]
