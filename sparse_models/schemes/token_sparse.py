"""Token Sparse Attention for prefill (Jo et al., arXiv 2602.03216; METHODS.md C.1).

On a sparse layer: the last ``window`` queries score each prefix key (mean softmax probability,
``kernels.token_sparse_scores``), scores are smoothed by an average pool, a layer-level budget comes
from dynamic token coverage (drop the least important prefix tokens whose normalised mass stays
within ``coverage``, keep at least ``min_tokens``), each query head keeps its own top tokens plus the
window, attention runs among the kept tokens only (``kernels.sparse_prefill_attention``) and the
outputs are scattered back with zeros elsewhere, so the residual stream passes through unchanged at
dropped positions. Unlike the reference code, ragged batches work: each sequence gets its own budget.
Kept regions beyond the paper (options of the RULER variant sweep, BENCHMARKS.md "TidalDecode and Token Sparse
variants on RULER"): ``sink_tokens`` (the first tokens, always kept) and ``keep_window=False`` (the window competes
for the budget; METHODS.md C.1). ``score_reduce="max"`` ranks a key by the largest probability any one window query
gives it instead of the mean (a needle read by few queries; BENCHMARKS.md "Which ranking keeps RULER's answer
tokens").

Decode is untouched (the full K/V are written to the cache before compression).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import kernels
from kernels.reference import TOKEN_SPARSE_REDUCTIONS

from ..validation import check_int, check_layer_list, check_layers_exist, fail
from .base import Scheme
from .dense import fresh_prefill


@dataclass
class TokenSparseConfig:
    """Token Sparse Attention: per-head token compression in prefill (Jo et al., arXiv 2602.03216).

    On each sparse layer, the last ``window`` queries score every prefix key (mean softmax
    probability), scores are smoothed by an average pool of width ``pool_kernel``, the layer keeps
    the smallest prefix set whose dropped tail mass stays below ``coverage`` (at least
    ``min_tokens``), each head picks its own top tokens plus the window, attention runs on the
    compressed tokens and outputs scatter back with zeros elsewhere. ``sparse_layers=None`` takes
    the calibration file if given, else the second half of the layers. ``coverage=0`` is dense.

    Kept regions (podkit's options, not the paper's; the defaults are the paper's rule):

    - ``sink_tokens`` (int >= 0, default 0): every head keeps the first ``sink_tokens`` positions
      (the attention sink, Xiao et al., arXiv 2309.17453). They count inside the kept budget: the
      head's top-k fills the rest, so kept counts stay what the coverage rule chose unless the sink
      alone is larger.
    - ``keep_window`` (bool, default True): the last ``window`` tokens (a RULER prompt's question)
      are always kept. False: they still score the keys, but rank with the prefix over the whole
      sequence; coverage (or ``keep_ratio``) then sizes the budget over all tokens.

    Scoring (podkit's option; the default is the paper's):

    - ``score_reduce`` (``"mean"`` | ``"max"``, default ``"mean"``): how the window queries' softmax
      probabilities of a key combine into its score. ``"max"`` keeps a key that one query attends to
      sharply (a needle the question's last tokens read) although the others ignore it. Only the
      ranking changes: the coverage budget stays the paper's, on the mean (attention mass), so the
      two keep the same number of tokens. It costs a second scoring pass.
    """

    coverage: float = 0.005
    window: int = 128
    min_tokens: int = 1024
    pool_kernel: int = 7
    sparse_layers: list[int] | None = None
    calibration_file: str | None = None
    sink_tokens: int = 0
    keep_window: bool = True
    score_reduce: str = "mean"

    def __post_init__(self) -> None:
        if isinstance(self.coverage, bool) or not isinstance(self.coverage, (int, float)) or not 0.0 <= self.coverage < 1.0:
            fail("token_sparse.coverage", self.coverage, "expected a number in [0, 1) (paper: 0.005)")
        check_int("token_sparse.window", self.window, 1)
        check_int("token_sparse.min_tokens", self.min_tokens, 0)
        check_int("token_sparse.pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 == 0:
            fail("token_sparse.pool_kernel", self.pool_kernel, "expected an odd width so the pooling stays centred")
        check_layer_list("token_sparse.sparse_layers", self.sparse_layers)
        check_int("token_sparse.sink_tokens", self.sink_tokens, 0)
        if not isinstance(self.keep_window, bool):
            fail("token_sparse.keep_window", self.keep_window, "expected True or False")
        if self.score_reduce not in TOKEN_SPARSE_REDUCTIONS:
            fail("token_sparse.score_reduce", self.score_reduce,
                 f"expected one of {', '.join(map(repr, TOKEN_SPARSE_REDUCTIONS))} (paper: 'mean')")


@dataclass
class LayerSparsity:
    """What one sparse layer kept in one prefill: per sequence, its length and kept tokens (per head)."""

    layer: int
    seq_lens: list[int]
    kept: list[int]
    sparse: list[bool]

    @property
    def token_sparsity(self) -> list[float]:
        """Per sequence, the fraction of tokens each head dropped."""
        return [1.0 - k / n if n else 0.0 for k, n in zip(self.kept, self.seq_lens)]


@dataclass
class TokenSparseStats:
    """Achieved sparsity of the last prefill (``model.token_sparse_stats``), readable by eval/."""

    layers: dict[int, LayerSparsity] = field(default_factory=dict)

    @property
    def mean_token_sparsity(self) -> float:
        """Mean over sparse layers and sequences of the dropped-token fraction (0.0 when nothing ran)."""
        values = [s for rec in self.layers.values() for s in rec.token_sparsity]
        return sum(values) / len(values) if values else 0.0

    @property
    def sequence_token_sparsity(self) -> list[float]:
        """Per sequence of the batch, its dropped-token fraction averaged over the sparse layers (what
        :attr:`mean_token_sparsity` is for a batch of one); [] when nothing ran."""
        rows = [rec.token_sparsity for rec in self.layers.values()]
        return [sum(column) / len(column) for column in zip(*rows)]

    def to_dict(self) -> dict:
        return {"mean_token_sparsity": self.mean_token_sparsity,
                "layers": {layer: {"seq_lens": r.seq_lens, "kept": r.kept, "sparse": r.sparse,
                                   "token_sparsity": r.token_sparsity} for layer, r in self.layers.items()}}


def token_sparse_indices(q: torch.Tensor, k: torch.Tensor, seq_lens: torch.Tensor, cfg: TokenSparseConfig,
                         keep_ratio: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head kept positions.

    Args: q [B, Hq, S, D]; k [B, Hkv, S, D]; seq_lens [B] (tokens at slots [0, seq_lens)).
        keep_ratio: if given, each long-enough sequence keeps ceil(keep_ratio * ranked) ranked tokens per head
        (at least 1) instead of Dynamic Token Coverage's budget (a benchmark knob: the e2e benchmark sweeps
        fixed ratios); ``coverage`` is then ignored.
    The ranked tokens are the prefix (before the last ``window``) with ``cfg.keep_window``, else the whole
    sequence. Without ``keep_window`` a window key's score is its mean causal softmax probability over the
    window's queries, the earlier ones counting 0 (causal masking: the key at n - 1 - r gets the probability
    of r + 1 queries only, divided by all of them: the later a window key, the fewer queries vote for it);
    see :func:`_window_key_scores`. The first ``cfg.sink_tokens`` ranked positions are always
    among a head's kept tokens (inside the budget). ``cfg.score_reduce="max"`` ranks each head's tokens by the
    max instead of the mean of those votes; the budget still comes from the mean.
    Returns:
        indices [B, Hq, K] ascending, -1 padded; kept [B] tokens kept per head; sparse [B] bool
        (False where the sequence is too short, coverage is 0 or nothing could be dropped).
    """
    batch, num_heads, s, _ = q.shape
    lens = seq_lens.long()
    window = cfg.window
    pos = torch.arange(s, device=q.device)
    prefix_len = (lens - window).clamp(min=0)
    ranked_len = prefix_len if cfg.keep_window else lens  # [B] tokens that compete for the budget
    sparse = lens > (cfg.min_tokens + window)
    if cfg.coverage == 0 and keep_ratio is None:
        sparse = torch.zeros_like(sparse)
    k_keep = ranked_len.clone()
    if bool(sparse.any()):
        ranked = pos[None, :] < ranked_len[:, None]  # [B, S]
        # [B, Hq, S] each: the mean sizes coverage's budget (attention mass); score_reduce="max" ranks by the max
        # inside that budget, one more scoring pass (a fixed keep_ratio needs no mean)
        needs_mean = keep_ratio is None or cfg.score_reduce == "mean"
        pooled = _pooled_scores(q, k, lens, cfg, ranked, "mean") if needs_mean else None
        rank_scores = pooled if cfg.score_reduce == "mean" else _pooled_scores(q, k, lens, cfg, ranked, "max")
        if keep_ratio is not None:
            budget = torch.ceil(ranked_len.double() * keep_ratio).long().clamp(min=1)
        else:
            # dynamic token coverage: one layer-level budget per sequence, from the head-mean scores
            mean = pooled.mean(1)
            mean = mean / mean.sum(-1, keepdim=True).clamp_min(torch.finfo(mean.dtype).tiny)
            ordered = torch.where(ranked, mean, torch.full_like(mean, float("inf"))).sort(-1).values
            cum = torch.where(torch.isfinite(ordered), ordered, torch.zeros_like(ordered)).cumsum(-1)
            k_sparse = ((cum < cfg.coverage) & torch.isfinite(ordered)).sum(-1) + 1
            budget = torch.maximum(torch.full_like(ranked_len, cfg.min_tokens), ranked_len - k_sparse)
        # the sink sits inside the budget: it only raises a budget smaller than itself
        budget = torch.maximum(budget, torch.full_like(budget, cfg.sink_tokens))
        k_keep = torch.where(sparse, budget.clamp(max=ranked_len), ranked_len)
        ranking = rank_scores.masked_fill(~ranked[:, None, :], float("-inf"))
        sink = pos[None, :] < ranked_len.clamp(max=cfg.sink_tokens)[:, None]  # [B, S], never past the ranked span
        ranking = ranking.masked_fill(sink[:, None, :], float("inf"))
    else:
        ranking = torch.where(pos[None, None, :] < ranked_len[:, None, None], 0.0, float("-inf")).expand(batch, num_heads, s)
    sparse = sparse & (k_keep < ranked_len)
    k_max = int(k_keep.max())
    if k_max > 0:
        top = torch.topk(ranking, k_max, dim=-1).indices  # [B, Hq, k_max]
        top = torch.where(torch.arange(k_max, device=q.device)[None, None, :] < k_keep[:, None, None], top,
                          torch.full_like(top, -1))
    else:
        top = torch.empty(batch, num_heads, 0, dtype=torch.long, device=q.device)
    if cfg.keep_window:
        win = prefix_len[:, None] + torch.arange(window, device=q.device)[None, :]  # [B, W]
        win = torch.where(win < lens[:, None], win, torch.full_like(win, -1))
        idx = torch.cat([top, win[:, None, :].expand(-1, num_heads, -1)], dim=-1)
        kept = k_keep + torch.minimum(lens, torch.full_like(lens, window))
    else:
        idx, kept = top, k_keep
    big = s + 1
    idx = torch.where(idx < 0, torch.full_like(idx, big), idx).sort(-1).values
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
    return idx, kept, sparse


def _pooled_scores(q: torch.Tensor, k: torch.Tensor, lens: torch.Tensor, cfg: TokenSparseConfig,
                   ranked: torch.Tensor, reduce: str) -> torch.Tensor:
    """The window's votes for each key (``reduce``: mean or max over the voting queries), the window's own keys
    scored too without ``keep_window``, average-pooled over ``cfg.pool_kernel`` tokens and zero outside ``ranked``.

    Args: q [B, Hq, S, D]; k [B, Hkv, S, D]; lens [B]; ranked [B, S] bool. Returns [B, Hq, S] fp32.
    """
    batch, num_heads, s, _ = q.shape
    scores = kernels.token_sparse_scores(q, k, lens, cfg.window, reduce)  # [B, Hq, S], 0 at window keys
    if not cfg.keep_window:
        scores = scores + _window_key_scores(q, k, lens, cfg.window, reduce=reduce)
    pad = cfg.pool_kernel // 2
    pooled = F.avg_pool1d(scores.reshape(batch * num_heads, 1, s), cfg.pool_kernel, stride=1, padding=pad)
    return pooled.reshape(batch, num_heads, s).masked_fill(~ranked[:, None, :], 0.0)


def _window_key_scores(q: torch.Tensor, k: torch.Tensor, seq_lens: torch.Tensor, window: int,
                       chunk: int = 4096, reduce: str = "mean") -> torch.Tensor:
    """Token Sparse scores of the window's own keys, which ``kernels.token_sparse_scores`` leaves at 0.

    Args: q [B, Hq, S, D]; k [B, Hkv, S, D]; seq_lens [B]; window W (the last min(W, n) queries vote).
    Returns: [B, Hq, S] fp32: at a window key t, the mean (``reduce="max"``: the max) over the window queries i
        of softmax_{j <= i}(q_i.k_j / sqrt(D))[t] (0 for i < t, causal masking); 0 at prefix keys and padding.
        Added to the kernel's prefix scores (same ``reduce``) it gives each key's score over the whole sequence;
        with the mean, each query's full distribution, so a row sums to 1.
    Only ``keep_window=False`` needs it: plain torch, each window query's log-sum-exp over its keys taken
    in chunks of ``chunk`` keys so memory stays [B, Hq, W, chunk] at long contexts.
    """
    batch, num_heads, s, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    w = min(window, s)
    lens = seq_lens.long()
    qpos = (lens - window).clamp(min=0)[:, None] + torch.arange(w, device=q.device)[None, :]  # [B, w]
    valid = qpos < lens[:, None]
    qpos = qpos.clamp(max=s - 1)  # invalid slots are masked below; clamping keeps the gathers in range
    q_win = q.gather(2, qpos[:, None, :, None].expand(batch, num_heads, w, head_dim)).float()
    q_win = q_win.reshape(batch, num_kv, group, w, head_dim) * head_dim ** -0.5
    k_float = k.float()
    lse = torch.full((batch, num_kv, group, w), float("-inf"), device=q.device)
    for c0 in range(0, s, chunk):
        logits = torch.einsum("bhgwd,bhcd->bhgwc", q_win, k_float[:, :, c0:c0 + chunk])
        kpos = torch.arange(c0, min(c0 + chunk, s), device=q.device)
        causal = kpos[None, None, :] <= qpos[:, :, None]  # [B, w, C]
        lse = torch.logaddexp(lse, logits.masked_fill(~causal[:, None, None], float("-inf")).logsumexp(-1))
    k_win = k_float.gather(2, qpos[:, None, :, None].expand(batch, num_kv, w, head_dim))
    logits = torch.einsum("bhgwd,bhvd->bhgwv", q_win, k_win)  # [B, Hkv, G, w queries, w keys]
    causal = (torch.arange(w, device=q.device)[None, :] <= torch.arange(w, device=q.device)[:, None])
    allowed = causal[None] & valid[:, :, None] & valid[:, None, :]  # [B, w, w]
    probs = torch.exp(logits - lse[..., None]).masked_fill(~allowed[:, None, None], 0.0)
    if reduce == "max":
        per_key = probs.amax(3).reshape(batch, num_heads, w)
    else:
        voters = valid.sum(-1).clamp(min=1).float()  # [B], the kernel's divisor
        per_key = (probs.sum(3) / voters[:, None, None, None]).reshape(batch, num_heads, w)
    out = torch.zeros(batch, num_heads, s, device=q.device)
    return out.scatter_add(2, qpos[:, None, :].expand(batch, num_heads, w), per_key)


def token_sparse_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                         cfg: TokenSparseConfig, layer: int, stats: TokenSparseStats | None = None, *,
                         keep_ratio: float | None = None, scale: float | None = None) -> torch.Tensor:
    """Token Sparse attention of one layer: q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D].
    ``keep_ratio``: see :func:`token_sparse_indices`; ``scale``: softmax scale (None: D ** -0.5)."""
    indices, kept, sparse = token_sparse_indices(q, k, seq_lens, cfg, keep_ratio)
    if stats is not None:
        stats.layers[layer] = LayerSparsity(layer, seq_lens.tolist(), kept.tolist(), sparse.tolist())
    if not bool(sparse.any()):
        zeros = torch.zeros_like(seq_lens)
        return kernels.prefill_attention(q, k, v, zeros, seq_lens, scale=scale)
    return kernels.sparse_prefill_attention(q, k, v, indices, scale=scale)


def token_sparse_layers(config, num_layers: int) -> list[int]:
    """Token Sparse layers: the configured list, else the second half (METHODS.md C.2 fallback)."""
    layers = config.token_sparse.sparse_layers
    if layers is None:
        return list(range(num_layers // 2, num_layers))
    check_layers_exist("token_sparse.sparse_layers", layers, num_layers)
    return sorted(layers)


def _prefill_roles(config, num_layers: int, anchors) -> list[str]:
    sparse = set(token_sparse_layers(config, num_layers))
    return ["token-sparse" if layer in sparse else "dense" for layer in range(num_layers)]


def sparse_layer_prefill(layer, q, k, v, state, k_anchor=None, q_anchor=None) -> torch.Tensor:
    """Prefill role ``token-sparse`` (statistics go to ``state.stats``)."""
    return token_sparse_prefill(q, k, v, state.num_new, state.config.token_sparse, layer, state.stats,
                                keep_ratio=state.token_sparse_keep_ratio, scale=state.scale)


SCHEME = Scheme(
    name="token_sparse",
    summary="Token Sparse Attention: per-head token compression on low-drift layers (prefill)",
    config_key="token_sparse",
    config_cls=TokenSparseConfig,
    prefill_roles=_prefill_roles,
    prefill={"dense": fresh_prefill, "token-sparse": sparse_layer_prefill},
    prefill_stats=TokenSparseStats,
    display_name="Token Sparse Attention",
    order=40,
)
