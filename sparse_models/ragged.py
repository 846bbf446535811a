"""Ragged batches: the caller's padded layout <-> podkit's "slot = position" layout.

A caller (``generate()``, lm-eval, a training loop) hands the model ``input_ids [B, S]`` with an
``attention_mask`` that marks padding, usually on the left. podkit's caches and kernels want every
sequence ``b`` to hold its tokens at slots ``[0, seq_lens[b])`` with position id = slot
(ARCHITECTURE.md). :func:`pack_new_tokens` moves each row's new tokens to the front of a packed
``[B, S']`` tensor (``S'`` = the longest row), :func:`unpack` puts per-token results back where the
caller had them (zeros at padding).

Only the *new* columns of the mask (the last ``S``) need to be one contiguous run per row; the past
columns only have to count the tokens the cache already holds. A row like ``[1, 0, 1]`` among the new
columns is rejected: there is no position that token could take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """Where each row's new tokens sit, in the caller's layout and in the packed layout.

    Attributes:
        start: [B] int64, caller column of each row's first new token.
        num_new: [B] int64, number of new tokens per row (``n_b``).
        width: S', the packed width (``max(num_new)``, at least 1).
        caller_width: S, the caller's number of new columns.
        identity: True when packing is a no-op (every new column of every row is a token).
    """

    start: torch.Tensor
    num_new: torch.Tensor
    width: int
    caller_width: int
    identity: bool

    def valid(self) -> torch.Tensor:
        """[B, S'] bool: packed slot j of row b holds a real token."""
        cols = torch.arange(self.width, device=self.num_new.device)
        return cols[None, :] < self.num_new[:, None]

    def pack(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """[B, S, ...] (caller layout) -> [B, S', ...] (packed); padding slots get ``fill``."""
        if self.identity:
            return x
        cols = torch.arange(self.width, device=x.device)
        idx = (self.start[:, None] + cols[None, :]).clamp(max=self.caller_width - 1)  # [B, S']
        gathered = torch.gather(x, 1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))
        valid = self.valid().view(*idx.shape, *([1] * (x.dim() - 2)))
        return torch.where(valid, gathered, torch.full_like(gathered, fill))

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S', ...] (packed) -> [B, S, ...] (caller layout), zeros at the caller's padding."""
        if self.identity:
            return x
        batch = x.shape[0]
        out = x.new_zeros(batch, self.caller_width, *x.shape[2:])
        valid = self.valid()
        rows = torch.arange(batch, device=x.device)[:, None].expand(-1, self.width)
        cols = self.start[:, None] + torch.arange(self.width, device=x.device)[None, :]
        out[rows[valid], cols[valid]] = x[valid]
        return out


def pack_new_tokens(attention_mask: torch.Tensor | None, batch: int, num_new_columns: int,
                    past_lens: torch.Tensor | None, past_columns: int, device) -> PackedBatch:
    """Check ``attention_mask`` and locate each row's new tokens.

    Args:
        attention_mask: [B, past_columns + S] 0/1 (or None: every new column is a token).
        batch, num_new_columns: B and S of the new input.
        past_lens: [B] tokens the cache already holds per row (None without a cache).
        past_columns: columns of the mask the cache has already seen (``cache.get_seq_length()``).
    Raises:
        ValueError naming ``attention_mask`` for wrong shapes, holes among the new columns, rows
        without tokens (on a fresh prefill) or a past part that disagrees with the cache.
    """
    s = num_new_columns
    if attention_mask is None:
        num_new = torch.full((batch,), s, dtype=torch.long, device=device)
        start = torch.zeros(batch, dtype=torch.long, device=device)
        return PackedBatch(start, num_new, max(s, 1), s, True)
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: podkit models take a 2-D "
                         f"[batch, columns] 0/1 mask (4-D masks are not supported)")
    if attention_mask.shape[0] != batch:
        raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows but the input has batch size {batch}")
    total = attention_mask.shape[1]
    if total == s and past_columns > 0:
        # Only the new columns were passed (allowed when the caller tracks the past itself).
        new = attention_mask
        past = None
    elif total == past_columns + s:
        new = attention_mask[:, past_columns:]
        past = attention_mask[:, :past_columns]
    else:
        raise ValueError(f"attention_mask has {total} columns; expected {past_columns + s} (the {past_columns} columns "
                         f"the cache has seen + {s} new ones)")
    new = new.to(device=device) != 0
    num_new = new.sum(-1)
    cols = torch.arange(s, device=device)
    start = torch.where(new, cols[None, :], torch.full_like(cols[None, :], s)).amin(-1).clamp(max=max(s - 1, 0))
    run = (cols[None, :] >= start[:, None]) & (cols[None, :] < (start + num_new)[:, None])
    if not torch.equal(run, new):
        bad = int((run != new).any(-1).nonzero()[0, 0])
        raise ValueError(f"attention_mask row {bad} has holes among its new columns ({new[bad].int().tolist()}): "
                         f"each row's new tokens must be one contiguous run (left or right padding only)")
    if past_lens is None or past_columns == 0:
        if bool((num_new == 0).any()):
            bad = int((num_new == 0).nonzero()[0, 0])
            raise ValueError(f"attention_mask row {bad} has no tokens: every sequence needs at least one")
    elif past is not None:
        seen = (past.to(device) != 0).sum(-1)
        if not torch.equal(seen, past_lens.to(device)):
            raise ValueError(f"attention_mask past columns count {seen.tolist()} tokens per row but the cache holds "
                             f"{past_lens.tolist()}: pass the mask of the whole sequence so far")
    identity = bool(num_new.eq(s).all())
    return PackedBatch(start.long(), num_new.long(), max(int(num_new.max()), 1), s, identity)


def left_align(attention_mask: torch.Tensor, *tensors: torch.Tensor | None):
    """A right-padded batch moved to left padding: each row rolled right by its trailing padding columns.

    ``attention_mask`` [B, S] 0/1; ``tensors`` [B, S, ...] (input ids, input embeddings; None passes through).
    Returns ``(mask, *tensors)`` in the same shapes, unchanged objects when no row ends in padding. ``generate()``
    takes the next token from the last column, which a right-padded row holds padding in (PodkitCausalLMMixin
    .generate). Rows with holes keep them (the forward rejects them).
    """
    if attention_mask.dim() != 2 or attention_mask.shape[1] == 0:
        return (attention_mask, *tensors)
    real = attention_mask != 0
    width = attention_mask.shape[1]
    cols = torch.arange(width, device=attention_mask.device)
    last = torch.where(real, cols[None, :], torch.full_like(cols[None, :], -1)).amax(-1)  # [B]; -1: empty row
    shift = torch.where(last >= 0, width - 1 - last, torch.zeros_like(last))
    if not bool(shift.any()):
        return (attention_mask, *tensors)
    source = (cols[None, :] - shift[:, None]) % width  # new column c holds old column c - shift

    def roll(x):
        if x is None:
            return None
        idx = source.to(x.device).view(*source.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        return torch.gather(x, 1, idx)

    return (roll(attention_mask), *(roll(t) for t in tensors))
