"""POD: Proximal tokens Over Distant tokens (Ma et al., arXiv 2412.02252; METHODS.md A).

A query attends to proximal keys (the first ``sink`` positions and the last ``recent`` positions up
to itself) with the layer's own keys and to every other position with the keys of its block's anchor
layer (per KV head); one softmax over both, i.e. the log-sum-exp merge with gate
g = sigmoid(lse_P - lse_D). Anchor layers are plain causal attention.

Prefill/training: ``kernels.pod_prefill_attention`` (differentiable); the anchor keys come in as an
argument (the decoder loop passes them explicitly, which keeps gradient checkpointing correct).
Decode: ``kernels.pod_decode_attention`` over the cache's sink + ring buffer and the anchor's keys.

Compute skipping (``pod.gate_tau``, decode only): where the proximal gate g >= tau the distant part is
dropped. ``gate_estimate="exact"`` uses this layer's own gate (the kernel's skip); ``"anchor"`` uses
the gate the anchor layer computed for the same query head (METHODS.md A.4, reading ii). In the
plain-PyTorch path both parts are still computed; the saving only exists in a kernel that skips.
"""

from __future__ import annotations

import torch

import kernels

from ..cache import SparseKVCache, local_slot_positions
from ..config import PodConfig


def assemble_anchor_keys(anchors: tuple[int, ...], keys_by_layer: dict[int, torch.Tensor]) -> torch.Tensor:
    """[B, Hkv, S, D]: KV head h takes the keys of layer ``anchors[h]`` (same head)."""
    return torch.stack([keys_by_layer[a][:, h] for h, a in enumerate(anchors)], dim=1)


def assemble_anchor_queries(anchors: tuple[int, ...], queries_by_layer: dict[int, torch.Tensor]) -> torch.Tensor:
    """[B, Hq, S, D]: query head qh takes the queries of the anchor layer of its KV head (v1 score sharing)."""
    group = next(iter(queries_by_layer.values())).shape[1] // len(anchors)
    return torch.stack([queries_by_layer[anchors[qh // group]][:, qh] for qh in range(group * len(anchors))], dim=1)


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1) if heads != x.shape[1] else x


def pod_scores_prefill(q: torch.Tensor, q_anchor: torch.Tensor, k_own: torch.Tensor, k_anchor: torch.Tensor,
                       v: torch.Tensor, seq_lens: torch.Tensor, cfg: PodConfig) -> torch.Tensor:
    """POD v1 "score sharing" (METHODS.md A.3): distant logits are the anchor layer's own q_a . k_a,
    proximal logits the layer's q . k; one softmax over both, applied to the layer's own values.

    Plain PyTorch with explicit [S, S] masks (an option for study, not a long-context path).
    q, q_anchor [B, Hq, S, D]; k_own, k_anchor, v [B, Hkv, S, D] -> [B, Hq, S, D] (differentiable).
    """
    heads, s, d = q.shape[1], q.shape[2], q.shape[3]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    pos = torch.arange(s, device=q.device)
    lens = seq_lens.to(q.device)
    causal = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens[:, None, None])
    proximal = (pos[None, :] < cfg.sink_tokens) | ((pos[:, None] - pos[None, :]) < cfg.recent_window)
    lp = torch.einsum("bhsd,bhnd->bhsn", q.to(ct), _expand(k_own, heads).to(ct))
    ld = torch.einsum("bhsd,bhnd->bhsn", q_anchor.to(ct), _expand(k_anchor, heads).to(ct))
    logits = torch.where(proximal[None, None], lp, ld) * d ** -0.5
    logits = logits.masked_fill(~causal[:, None], float("-inf"))
    rows = (pos[None, :] < lens[:, None])[:, None, :, None]  # padding rows have no key at all
    probs = torch.softmax(logits.masked_fill(~rows, 0.0), dim=-1)
    out = torch.matmul(probs, _expand(v, heads).to(ct)).masked_fill(~rows, 0.0)
    return out.to(q.dtype)


def pod_scores_decode(q: torch.Tensor, q_anchor: torch.Tensor, k_local: torch.Tensor, k_anchor: torch.Tensor,
                      v_cache: torch.Tensor, seq_lens: torch.Tensor, cfg: PodConfig,
                      shared_heads: torch.Tensor | None = None) -> torch.Tensor:
    """POD v1 decode: q, q_anchor [B, Hq, D]; k_local [B, Hkv, sink + recent, D]; k_anchor, v [B, Hkv, N, D].

    With ``cfg.gate_tau`` the gate is exact and cheap here (the distant logits are the anchor's), so a
    query head with g >= tau attends to proximal positions only; ``shared_heads`` [Hq] bool limits
    that to heads that are not their own anchor.
    """
    heads, d = q.shape[1], q.shape[2]
    n = v_cache.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    sink, recent = cfg.sink_tokens, cfg.recent_window
    p = (seq_lens.long() - 1).to(q.device)
    j = torch.arange(n, device=q.device)
    causal = j[None, :] <= p[:, None]
    proximal = ((j[None, :] < sink) | ((p[:, None] - j[None, :]) < recent)) & causal
    slot = torch.where(j < sink, j, sink + j % recent).clamp(max=k_local.shape[2] - 1)
    lp = torch.einsum("bhd,bhnd->bhn", q.to(ct), _expand(k_local[:, :, slot], heads).to(ct))
    ld = torch.einsum("bhd,bhnd->bhn", q_anchor.to(ct), _expand(k_anchor, heads).to(ct))
    lp = (lp * d ** -0.5).masked_fill(~proximal[:, None], float("-inf"))
    ld = (ld * d ** -0.5).masked_fill(~(causal & ~proximal)[:, None], float("-inf"))
    if cfg.gate_tau is not None:
        gate = torch.sigmoid(torch.logsumexp(lp, -1) - torch.logsumexp(ld, -1))
        skip = gate >= cfg.gate_tau
        if shared_heads is not None:
            skip = skip & shared_heads.to(skip.device)[None, :]
        ld = ld.masked_fill(skip[..., None], float("-inf"))
    probs = torch.softmax(torch.where(proximal[:, None], lp, ld), dim=-1)
    return torch.einsum("bhn,bhnd->bhd", probs, _expand(v_cache, heads).to(ct)).to(q.dtype)


def pod_prefill(q: torch.Tensor, k_own: torch.Tensor, k_anchor: torch.Tensor, v: torch.Tensor,
                seq_lens: torch.Tensor, cfg: PodConfig) -> torch.Tensor:
    """q [B, Hq, S, D]; k_own, k_anchor, v [B, Hkv, S, D] -> [B, Hq, S, D] (differentiable)."""
    return kernels.pod_prefill_attention(q, k_own, k_anchor, v, seq_lens, sink=cfg.sink_tokens,
                                         recent=cfg.recent_window)


def proximal_only_decode(q: torch.Tensor, k_local: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                         cfg: PodConfig) -> torch.Tensor:
    """Attention over proximal positions only (the output when distant attention is skipped).

    q [B, Hq, D]; k_local [B, Hkv, sink + recent, D]; v_cache [B, Hkv, N, D] -> [B, Hq, D].
    """
    sink, recent = cfg.sink_tokens, cfg.recent_window
    pos = local_slot_positions(seq_lens, sink, recent)  # [B, L]
    query = (seq_lens.long() - 1)[:, None]
    slot = torch.arange(pos.shape[1], device=pos.device)[None, :]
    # ring slots holding a sink position duplicate a sink slot: count each position once
    proximal = (pos >= 0) & (pos <= query) & ((slot < sink) | ((pos >= sink) & (query - pos < recent)))
    v_local = torch.gather(v_cache, 2, pos.clamp(min=0)[:, None, :, None].expand(-1, v_cache.shape[1], -1,
                                                                                  v_cache.shape[3]))
    indices = torch.where(proximal, slot.expand_as(pos), torch.full_like(pos, -1))
    big = pos.shape[1] + 1
    indices = torch.where(indices < 0, torch.full_like(indices, big), indices).sort(-1).values
    indices = torch.where(indices == big, torch.full_like(indices, -1), indices)
    indices = indices[:, None, :].expand(-1, k_local.shape[1], -1).contiguous()
    return kernels.sparse_decode_attention(q, k_local, v_local, indices)


def pod_decode(layer: int, anchors: tuple[int, ...], q: torch.Tensor, cache: SparseKVCache, seq_lens: torch.Tensor,
               cfg: PodConfig, gates: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """POD decode of one layer: q [B, Hq, D] at position seq_lens - 1 -> [B, Hq, D].

    ``gates`` collects each layer's proximal gate [B, Hq] when ``cfg.gate_tau`` is set (the anchor
    estimate of later layers reads it).
    """
    v = cache.layer_values(layer)
    own_only = all(a == layer for a in anchors)
    tau = cfg.gate_tau
    if own_only and tau is None:
        return kernels.decode_attention(q, cache.anchor_keys(layer), v, seq_lens)
    k_local = cache.local_key_view(layer, seq_lens)
    k_anchor = cache.anchor_keys(layer)
    common = dict(sink=cfg.sink_tokens, recent=cfg.recent_window)
    if tau is None:
        return kernels.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, **common)
    group = q.shape[1] // len(anchors)
    shared_q = torch.tensor([anchors[qh // group] != layer for qh in range(q.shape[1])], device=q.device)
    if cfg.gate_estimate == "exact" and bool(shared_q.all()):
        # the kernel's own skip: every head of this layer reads distant keys from an anchor
        out, gate = kernels.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, gate_tau=tau, return_gate=True,
                                                 **common)
        if gates is not None:
            gates[layer] = gate
        return out
    out, gate = kernels.pod_decode_attention(q, k_local, k_anchor, v, seq_lens, return_gate=True, **common)
    if gates is not None:
        gates[layer] = gate
    if own_only:
        return out  # anchor heads never skip: their distant keys are their own (exact attention)
    if cfg.gate_estimate == "exact":
        estimate = gate
    else:
        estimate = torch.stack([gates[anchors[qh // group]][:, qh] if anchors[qh // group] != layer else gate[:, qh]
                                for qh in range(q.shape[1])], dim=1)  # [B, Hq]
    skip = (estimate >= tau) & shared_q[None, :]
    if not bool(skip.any()):
        return out
    prox = proximal_only_decode(q, k_local, v, seq_lens, cfg)
    return torch.where(skip[..., None], prox, out)
