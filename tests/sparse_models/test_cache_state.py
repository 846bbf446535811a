"""The cache state both caches share one implementation of (Quest's ``KeyState`` in ``sparse_models/schemes/quest.py``,
``sparse_models/ring.py``) agrees with its definition: pages folded token by token equal ``kernels.quest_page_minmax``
of the whole keys, and a ring written from a chunk holds, at every position's slot, that position's key."""

from __future__ import annotations

import pytest
import torch

import kernels
from sparse_models.ring import local_slot_positions, ring_slots, written_ring
from sparse_models.schemes.quest import fold_token


def test_pages_folded_token_by_token_equal_the_whole_page_minmax():
    g = torch.Generator().manual_seed(0)
    batch, heads, n, d, page_size = 2, 3, 21, 4, 4
    keys = torch.randn(batch, heads, n, d, generator=g)
    lens = torch.tensor([21, 13])
    pages = -(-n // page_size)
    page_max = torch.full((batch, heads, pages, d), float("-inf"))
    page_min = torch.full((batch, heads, pages, d), float("inf"))
    for p in range(n):
        pos = torch.minimum(torch.full((batch,), p), lens - 1)  # a finished row re-folds its last key: a no-op
        fold_token(page_max, page_min, keys[torch.arange(batch), :, pos], pos, page_size)
    want_max, want_min = kernels.quest_page_minmax(keys, lens, page_size)
    for b, length in enumerate(lens.tolist()):
        used = -(-length // page_size)
        torch.testing.assert_close(page_max[b, :, :used], want_max[b, :, :used].to(page_max.dtype))
        torch.testing.assert_close(page_min[b, :, :used], want_min[b, :, :used].to(page_min.dtype))


@pytest.mark.parametrize("sink, recent", [(2, 4), (0, 3), (3, 1)])
def test_a_ring_written_from_a_chunk_holds_each_kept_position_at_its_slot(sink, recent):
    g = torch.Generator().manual_seed(1)
    batch, heads, s, d = 2, 2, 11, 3
    k = torch.randn(batch, heads, s, d, generator=g)
    lens = torch.tensor([11, 5])
    ring = written_ring(torch.zeros(batch, heads, sink + recent, d), k, torch.zeros(batch, dtype=torch.long), lens,
                        sink, recent)
    for b, length in enumerate(lens.tolist()):
        for p in range(length):
            if p < sink or p >= length - recent:
                torch.testing.assert_close(ring[b, :, int(ring_slots(torch.tensor(p), sink, recent))], k[b, :, p])
    assert (local_slot_positions(lens, sink, recent) < lens[:, None]).all()
