"""Ulysses sequence parallelism around podkit's attention (DeepSpeed-Ulysses, Jacobs et al., arXiv 2309.14509).

With sequence parallel size ``P`` every rank of an SP group holds the same sequences but only a 1/P
slice of their tokens: rank ``r`` holds positions ``[r * S_loc, (r + 1) * S_loc)``. Everything except
attention (embeddings, projections, MLP, norms, LM head) is per token, so it runs on the slice as is.
Attention needs every position, so around each layer's attention call the slices are exchanged:

    q [B, Hq, S_loc, D], k/v/k_anchor [B, Hkv, S_loc, D]
        -- all-to-all (scatter heads, gather sequence) -->  [B, H/P, S, D]   (heads [r*H/P, (r+1)*H/P))
    attention over the full sequence for this rank's heads (dense, POD, ... exactly as without SP)
    out [B, Hq/P, S, D]
        -- all-to-all (scatter sequence, gather heads) -->  [B, Hq, S_loc, D]

The exchange is DeepSpeed's own ``deepspeed.sequence.layer._SeqAllToAll`` (differentiable; its
backward is the inverse all-to-all), on the SP process group built by
``deepspeed.runtime.sequence_parallel.parallel_state_sp`` (see ``train/sequence_parallel.py``).

Why the KV head count must be divisible by P: query head ``h`` reads KV head ``h // G``. Rank ``r``
receives query heads ``[r*Hq/P, (r+1)*Hq/P)`` and KV heads ``[r*Hkv/P, (r+1)*Hkv/P)``; those are the
KV heads its query heads read exactly when ``Hkv % P == 0`` (then ``Hq % P == 0`` too). POD's anchor
keys are per KV head (the anchor layer's keys of the same head), so they shard like k.

Positions: RoPE must see global positions, so the model adds ``rank * S_loc`` to its slot positions
(:meth:`UlyssesAttention.global_positions_and_lengths`), and the attention state sees the global
sequence length ``P * S_loc``. Only full (unpadded) rows of a training-style forward are supported:
no cache, no attention-mask padding (packed training data has neither).

deepspeed is imported lazily, so this module imports on machines without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class UlyssesAttention:
    """The SP group a model's attention exchanges over. Set as ``model.model.sequence_parallel``.

    Attributes:
        group: the sequence-parallel process group (a ``deepspeed.comm`` / torch ProcessGroup).
        size: P, the number of ranks in the group.
        rank: this rank's index inside the group (which sequence slice it holds).
        exchange: ``(x [B, S, H, D], scatter_dim, gather_dim) -> tensor``; default: DeepSpeed's
            ``_SeqAllToAll`` on ``group`` (batch dim 0). Tests may inject another one.
    """

    group: Any
    size: int
    rank: int
    exchange: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None

    def __post_init__(self):
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size={self.size!r}: expected the sequence-parallel group size, an integer >= 1")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank={self.rank!r}: expected an integer in [0, {self.size})")

    # ------------------------------------------------------------------ exchanges
    def _all_to_all(self, x_bshd: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        if self.exchange is not None:
            return self.exchange(x_bshd, scatter_dim, gather_dim)
        from deepspeed.sequence.layer import _SeqAllToAll

        return _SeqAllToAll.apply(self.group, x_bshd.contiguous(), scatter_dim, gather_dim, 0)

    def heads_from_sequence(self, x: torch.Tensor, name: str = "x") -> torch.Tensor:
        """[B, H, S_loc, D] (this rank's tokens, all heads) -> [B, H/P, P*S_loc, D] (all tokens, this rank's heads)."""
        if x.dim() != 4 or x.shape[1] % self.size:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: expected [B, H, S_loc, D] with H divisible by "
                             f"the sequence-parallel size {self.size}")
        if self.size == 1:
            return x
        return self._all_to_all(x.transpose(1, 2), 2, 1).transpose(1, 2)

    def sequence_from_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H/P, S, D] (all tokens, this rank's heads) -> [B, H, S/P, D] (this rank's tokens, all heads)."""
        if self.size == 1:
            return x
        return self._all_to_all(x.transpose(1, 2), 1, 2).transpose(1, 2)

    # ------------------------------------------------------------------ model hooks
    def global_positions_and_lengths(self, phase: str, cache, positions: torch.Tensor, num_new: torch.Tensor):
        """positions [B, S_loc] (slots of the local slice), num_new [B] -> (global positions [B, S_loc],
        global lengths [B], global lengths [B]) for the decoder loop. Rejects what SP does not cover."""
        if phase != "prefill" or cache is not None:
            raise ValueError(f"sequence parallelism runs training-style forwards only (no cache, no past); got "
                             f"phase={phase!r} with cache={'set' if cache is not None else None}: call the model "
                             f"with use_cache=False, or detach the SP group (model.model.sequence_parallel = None)")
        width = positions.shape[1]
        if bool((num_new != width).any()):
            raise ValueError(f"attention_mask: sequence parallelism needs unpadded rows (every row holds all {width} "
                             f"tokens of its slice); got row lengths {num_new.tolist()}")
        lengths = torch.full_like(num_new, width * self.size)
        return positions + self.rank * width, lengths, lengths

    def attention(self, attention_fn: Callable, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  state, k_anchor: torch.Tensor | None = None, q_anchor: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_fn(layer, q, k, v, state, k_anchor, q_anchor)`` over the whole sequence for this rank's heads.

        q [B, Hq, S_loc, D]; k, v, k_anchor [B, Hkv, S_loc, D]; q_anchor [B, Hq, S_loc, D] -> [B, Hq, S_loc, D].
        ``state`` must carry the global lengths (see :meth:`global_positions_and_lengths`).
        """
        if k.shape[1] % self.size:
            raise ValueError(f"k has {k.shape[1]} KV heads: Ulysses sequence parallelism needs the KV head count "
                             f"divisible by the sequence-parallel size {self.size}")
        q_g = self.heads_from_sequence(q, "q")
        k_g = self.heads_from_sequence(k, "k")
        v_g = self.heads_from_sequence(v, "v")
        ka_g = None if k_anchor is None else self.heads_from_sequence(k_anchor, "k_anchor")
        qa_g = None if q_anchor is None else self.heads_from_sequence(q_anchor, "q_anchor")
        out = attention_fn(layer, q_g, k_g, v_g, state, ka_g, qa_g)
        return self.sequence_from_heads(out)
