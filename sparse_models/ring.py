"""The sink + ring slot layout of a proximal key buffer (POD, arXiv 2412.02252 §2.3; ARCHITECTURE.md
``pod_decode_attention``): ``sink + recent`` slots, slot ``t < sink`` holding position t and ring slot
``sink + j % recent`` the latest position j. Both caches (``sparse_models/cache.py``,
``sparse_models/engine/static_cache.py``) and POD's attention (``sparse_models/schemes/pod.py``) index it here."""

from __future__ import annotations

import torch


def ring_slots(pos: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Slot of key position ``pos`` (any shape, int): sinks first, then the ring."""
    return torch.where(pos < sink, pos, sink + pos % recent)


def local_slot_positions(seq_lens: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Position held by each slot once ``seq_lens`` [B] tokens were written.

    Returns [B, sink + recent] int64: slot t < sink holds position t; ring slot ``sink + r`` holds the
    latest position j <= seq_len - 1 with j % recent == r. -1 where no such position exists.
    """
    lens = seq_lens.long()
    last = (lens - 1)[:, None]
    sinks = torch.arange(sink, device=lens.device)[None, :].expand(lens.shape[0], -1)
    sinks = torch.where(sinks < lens[:, None], sinks, torch.full_like(sinks, -1))
    r = torch.arange(recent, device=lens.device)[None, :]
    ring = last - torch.remainder(last - r, recent)
    ring = torch.where(ring >= 0, ring, torch.full_like(ring, -1))
    return torch.cat([sinks, ring], dim=1)


def written_ring(ring: torch.Tensor, k: torch.Tensor, start: torch.Tensor, new_lens: torch.Tensor, sink: int,
                 recent: int) -> torch.Tensor:
    """``ring`` [B, H, sink + recent, D] after a chunk of keys ``k`` [B, H, S, D] at positions ``start[b] + j`` is
    stored (columns at positions >= ``new_lens[b]`` are padding): every slot whose position, once ``new_lens``
    tokens are stored (:func:`local_slot_positions`), lies in the chunk takes that key; the others keep theirs.
    Returns a new tensor."""
    s = k.shape[2]
    pos = local_slot_positions(new_lens, sink, recent)  # [B, sink + recent]
    take = (pos >= start[:, None]) & (pos < new_lens[:, None])
    src_idx = (pos - start[:, None]).clamp(0, s - 1)
    src = torch.gather(k, 2, src_idx[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3]))
    return torch.where(take[:, None, :, None], src.to(ring.dtype), ring)
