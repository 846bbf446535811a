"""Next-token sampling: greedy, temperature, top-p (nucleus), per batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import EngineError


@dataclass
class SamplingConfig:
    """``temperature=0`` is greedy (argmax). ``top_p`` in (0, 1]: keep the smallest set of tokens whose
    probability mass reaches top_p. ``seed`` makes stochastic sampling reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise EngineError(f"temperature={self.temperature!r} is invalid: expected a number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise EngineError(f"top_p={self.top_p!r} is invalid: expected a number in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None):
    """logits [B, V] -> next tokens [B] int64 (no host sync)."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass of the tokens ranked above it already reaches top_p
        drop = (torch.cumsum(sorted_probs, -1) - sorted_probs) >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
