"""Held-out text must not be trained on: hashed token n-grams of training shards vs held-out text.

``ngram_hashes(tokens, n)`` is a polynomial hash (mod 2^64) of every window of ``n`` consecutive
tokens, vectorised as ``n`` passes over the array. A held-out set is tokenised with the same
tokenizer; a training shard stream "overlaps" it where one of its n-gram hashes is in the held-out
set. With ``n = 32`` tokens a shared window means copied text, not a common phrase.
"""

from __future__ import annotations

import numpy as np

_BASE = np.uint64(1_000_003)


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


def overlap_count(train, heldout_tokens: np.ndarray, n: int = 32, chunk: int = 8 * 1024 * 1024) -> int:
    """How many n-token windows of the training stream ``train`` (a ShardedTokens) also occur in
    ``heldout_tokens``. The stream is scanned in chunks that overlap by ``n - 1`` tokens."""
    held = np.unique(ngram_hashes(heldout_tokens, n))
    hits = 0
    for start in range(0, train.total_tokens, chunk):
        length = min(chunk + n - 1, train.total_tokens - start)
        hits += int(np.isin(ngram_hashes(train.read(start, length), n), held, assume_unique=False).sum())
    return hits
