"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv
2309.17453, §3.2) as a decode baseline: attention sinks + a recent window.

The full cache is kept (this is a quality baseline, not a memory one); each decode step reads the
first ``sink_tokens`` positions and the last ``recent_window`` positions (the current one included).
Budget: ``--budget B`` = B positions read per step = ``sink_tokens`` + ``recent_window``, the same
count TidalDecode and Quest budgets mean (``sink_tokens`` stays as given, default 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import check_int
from .base import Budget, Footprint, Scheme, covers_cache


@dataclass
class StreamingConfig:
    """StreamingLLM (Xiao et al., 2023): decode attends to ``sink_tokens`` + the ``recent_window`` latest."""

    sink_tokens: int = 4
    recent_window: int = 2044

    def __post_init__(self) -> None:
        check_int("streaming.sink_tokens", self.sink_tokens, 0)
        check_int("streaming.recent_window", self.recent_window, 1)


def streaming_indices(seq_lens: torch.Tensor, num_kv_heads: int, cfg: StreamingConfig) -> torch.Tensor:
    """[B, Hkv, sink + window] ascending positions, -1 padded (at the end) where a sequence is shorter."""
    sink, window = cfg.sink_tokens, cfg.recent_window
    lens = seq_lens.long()
    sinks = torch.arange(sink, device=lens.device)[None, :].expand(lens.shape[0], -1)
    sinks = torch.where(sinks < lens[:, None], sinks, torch.full_like(sinks, -1))
    recent = lens[:, None] - window + torch.arange(window, device=lens.device)[None, :]
    recent = torch.where(recent >= sink, recent, torch.full_like(recent, -1))
    idx = torch.cat([sinks, recent], dim=1)
    # ascending with the -1 padding last (kernels read lists front to back)
    big = torch.iinfo(idx.dtype).max
    idx = torch.where(idx < 0, torch.full_like(idx, big), idx).sort(dim=1).values
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
    return idx[:, None, :].expand(-1, num_kv_heads, -1).contiguous()


def streaming_decode(view, q: torch.Tensor, row, step) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D], attending to sinks + recent window."""
    cfg = view.config.streaming
    if covers_cache(view, cfg.sink_tokens + cfg.recent_window):  # sinks + window reach every slot: exact attention
        return view.full(q)
    return view.sparse(q, streaming_indices(view.lens, view.num_kv_heads, view.config.streaming))


def _budget_overrides(budget: int, given: dict) -> dict:
    sink = given.get("streaming_sink_tokens", StreamingConfig.sink_tokens)
    if isinstance(sink, int) and budget <= sink:
        from ..validation import ConfigError

        raise ConfigError(f"budget={budget} is invalid for decode_scheme='streaming': it counts the {sink} sink tokens "
                          f"plus the recent window, so expected > {sink}")
    return {"streaming_sink_tokens": sink, "streaming_recent_window": budget - sink}


SCHEME = Scheme(
    name="streaming",
    summary="StreamingLLM: attention sinks + a recent window (decode)",
    config_key="streaming",
    config_cls=StreamingConfig,
    decode_roles=lambda config, num_layers, anchors, family: [("streaming", None)] * num_layers,
    decode={"streaming": streaming_decode},
    budget=Budget("positions read per step = streaming.sink_tokens (default 4) + streaming.recent_window",
                  _budget_overrides,
                  reads=lambda config: config.streaming.sink_tokens + config.streaming.recent_window),
    footprint=Footprint(budget_roles=("streaming",)),  # the full cache is kept (a quality baseline)
    display_name="StreamingLLM",
    order=30,
)
