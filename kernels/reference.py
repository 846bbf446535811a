"""Plain-PyTorch reference of every podkit attention op: the spec, and the CPU path.

Each function computes in fp32 (or fp64 when given fp64 inputs, which the tests use as the
"exact" answer) and returns the input dtype. Shapes and layout follow ARCHITECTURE.md:
``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``G = Hq // Hkv`` (query head ``h`` reads KV
head ``h // G``), ``D`` head dim. Caches use the "slot = position" layout: sequence ``b`` holds its
tokens at slots ``[0, seq_lens[b])``. Index lists are padded with ``-1``.

FP8 KV caches (kernels/fp8_kv.py): the decode functions take float8_e4m3fn caches with their fp32 scales
(``k_scale`` / ``v_scale`` [B, Hkv, N], POD's ``k_local_scale`` / ``k_anchor_scale``), dequantise them in the
compute dtype and run unchanged; ``quest_page_minmax`` bounds the dequantised keys.

These functions favour clarity over speed: they materialise full score matrices. The Triton kernels
in this package compute the same quantities without doing so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8_kv import (  # quantize_kv, dequantize_kv: public ops too
    check_recent_keys,
    check_scale,
    dequantize_kv,
    is_fp8,
    overlay_recent_keys,
    quantize_kv,
)

__all__ = [
    "decode_attention",
    "select_topk_positions",
    "selection_decode_attention",
    "sparse_decode_attention",
    "prefill_attention",
    "sparse_prefill_attention",
    "token_sparse_scores",
    "pod_prefill_attention",
    "pod_decode_attention",
    "pod_proximal_mask",
    "quest_page_scores",
    "quest_select_pages",
    "quest_page_minmax",
    "quantize_kv",
    "dequantize_kv",
]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, Hkv, ...] -> [B, Hq, ...] by repeating each KV head for its G query heads."""
    group = num_q_heads // x.shape[1]
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _scale(scale: float | None, head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else scale


def _kv(cache: torch.Tensor, scale, cache_name: str, scale_name: str, ct: torch.dtype) -> torch.Tensor:
    """A K/V cache as stored (float) or dequantised to ``ct`` (float8_e4m3fn with its scales); errors name both."""
    check_scale(scale_name, scale, cache_name, cache)
    return dequantize_kv(cache, scale, ct) if is_fp8(cache) else cache


def _keys(k_cache, k_scale, k_recent, seq_lens, ct: torch.dtype) -> torch.Tensor:
    """Keys as a decode op reads them: ``_kv``, then with ``k_recent`` [B, Hkv, W, D] (an FP8 cache's newest keys in
    the model's dtype, kernels/fp8_kv.py "Recent keys") the positions [seq_lens - W, seq_lens) from the ring."""
    k = _kv(k_cache, k_scale, "k_cache", "k_scale", ct)
    check_recent_keys(k_recent, k_cache)
    if k_recent is None:
        return k
    if seq_lens is None:
        raise ValueError("k_recent needs seq_lens (which positions are the newest W)")
    return overlay_recent_keys(k, k_recent, seq_lens)


def _masked_softmax_attend(logits: torch.Tensor, valid: torch.Tensor, v: torch.Tensor):
    """softmax(logits over valid) @ v, with rows that have no valid key returning 0 and lse -inf.

    logits/valid: [..., K] with v [..., K, D] (one query per row), or [..., S, K] with v [..., K, D]
    (S queries sharing the keys). Returns (out [..., D] or [..., S, D], lse [...]).
    """
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - safe_lse.unsqueeze(-1)).masked_fill(~valid, 0.0)
    if probs.dim() == v.dim():  # [..., S, K] @ [..., K, D]: a block of queries sharing keys
        return torch.matmul(probs, v), lse
    return torch.matmul(probs.unsqueeze(-2), v).squeeze(-2), lse  # one query per row


# ----------------------------------------------------------------------------------------------
# Decode: one query per sequence, at position seq_lens[b] - 1
# ----------------------------------------------------------------------------------------------

def decode_attention(q, k_cache, v_cache, seq_lens, *, scale=None, return_scores=False, k_scale=None, v_scale=None,
                     k_recent=None):
    """Dense decode attention over each sequence's cached tokens.

    Args:
        q: [B, Hq, D] the new token's queries (its own K/V already appended to the cache).
        k_cache, v_cache: [B, Hkv, N, D] post-RoPE keys and values, slot = position.
        seq_lens: [B] int, number of valid slots (the query sits at seq_lens - 1).
        return_scores: also return the raw logits q.k * scale, [B, Hq, N] fp32, -inf past seq_lens.
        k_scale, v_scale: [B, Hkv, N] fp32 for float8_e4m3fn caches (kernels/fp8_kv.py), else None.
        k_recent: FP8 caches only, [B, Hkv, W, D]: the keys of positions [seq_lens - W, seq_lens) at slot
            position % W, read instead of their FP8 copies (kernels/fp8_kv.py "Recent keys").
    Returns:
        out [B, Hq, D] in q.dtype (and scores).
    """
    ct = _compute_dtype(q)
    batch, num_heads, head_dim = q.shape
    n = k_cache.shape[2]
    k = _expand_kv(_keys(k_cache, k_scale, k_recent, seq_lens, ct), num_heads).to(ct)
    v = _expand_kv(_kv(v_cache, v_scale, "v_cache", "v_scale", ct), num_heads).to(ct)
    logits = torch.einsum("bhd,bhnd->bhn", q.to(ct), k) * _scale(scale, head_dim)
    valid = torch.arange(n, device=q.device)[None, None, :] < seq_lens.to(q.device)[:, None, None]
    out, _ = _masked_softmax_attend(logits, valid, v)
    if return_scores:
        return out.to(q.dtype), logits.masked_fill(~valid, float("-inf"))
    return out.to(q.dtype)


SELECTION_MODES = ("query_head", "kv_group", "group_union", "all_union")


def select_topk_positions(scores, seq_lens, budget, *, group_size=1, per_kv_group=False, mode=None, recent=1):
    """TidalDecode token selection (METHODS.md B.2): top-(budget-recent) older slots + the last ``recent`` slots.

    Args:
        scores: [B, Hq, N] raw logits (-inf or anything past seq_lens; those slots are never chosen).
        seq_lens: [B]; the current token sits at slot seq_lens - 1.
        budget: tokens kept per list, the current one included.
        group_size: G, query heads per KV head (used by every mode but ``query_head``).
        per_kv_group: the older spelling of ``mode="kv_group"`` (used when ``mode`` is None).
        mode: how the lists are formed (podkit's design space beyond the paper, METHODS.md B.2):
            ``"query_head"`` (paper): each query head its own top list;
            ``"kv_group"``: one list per KV head from the sum over its G query heads of their softmax
            probabilities (a GQA group shares reads);
            ``"group_union"``: one list per KV head, the union of its G heads' own top lists grown until it
            holds the budget (:func:`_union_order`);
            ``"all_union"``: the same over all Hq heads, one list shared by every KV head.
        recent: slots always kept at the end of each sequence, the current one included (1 = only the
            current token, the paper's rule); the selection ranks only slots < seq_lens - recent.
    Returns:
        indices [B, Hs, budget] int64, ascending, -1 padded where seq_lens < budget
        (Hs = Hq for ``query_head``, else Hq // group_size).
    """
    mode = mode if mode is not None else ("kv_group" if per_kv_group else "query_head")
    if mode not in SELECTION_MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {SELECTION_MODES}")
    if not 1 <= recent <= budget:
        raise ValueError(f"recent={recent!r} is invalid: expected 1 <= recent <= budget ({budget})")
    batch, num_heads, n = scores.shape
    seq_lens = seq_lens.to(scores.device)
    slots = torch.arange(n, device=scores.device)
    older = slots[None, :] < (seq_lens[:, None] - recent)  # [B, N]: the slots the selection ranks
    k = min(budget - recent, n)
    if mode in ("query_head", "kv_group"):
        chosen = _topk_lists(scores, seq_lens, older, k, group_size if mode == "kv_group" else 1)
    else:
        chosen = _union_lists(scores, seq_lens, older, k, group_size if mode == "group_union" else num_heads)
    out = torch.full((batch, chosen.shape[1], budget), -1, dtype=torch.int64, device=scores.device)
    out[..., :k] = chosen
    window = seq_lens[:, None] - recent + torch.arange(recent, device=scores.device)[None, :]  # [B, recent]
    window = torch.where(window >= 0, window, torch.full_like(window, -1))
    window[:, -1] = (seq_lens - 1).clamp(min=0)  # the current slot, as the paper's rule always had it
    out[..., budget - recent:] = window[:, None, :]
    # ascending order with -1 padding first is awkward for readers; put padding last.
    key = torch.where(out < 0, torch.full_like(out, n + 1), out)
    out = torch.gather(out, -1, key.argsort(-1))
    if mode == "all_union":  # one list for the layer, read by every KV head's sparse attention
        out = out.expand(batch, num_heads // group_size, budget).contiguous()
    return out


def _group_probs(scores, seq_lens, older, heads_per_list):
    """Softmax probabilities over each sequence's slots, summed over consecutive groups of heads:
    [B, H, N] -> [B, H // heads_per_list, N], 0 outside ``older`` [B, N]."""
    batch, num_heads, n = scores.shape
    valid = torch.arange(n, device=scores.device)[None, :] < seq_lens[:, None]
    probs = torch.softmax(scores.float().masked_fill(~valid[:, None, :], float("-inf")), -1)
    probs = probs.masked_fill(~older[:, None, :], 0.0)
    return probs.view(batch, num_heads // heads_per_list, heads_per_list, n).sum(2)


def _topk_lists(scores, seq_lens, older, k, heads_per_list):
    """The ``k`` best older slots per list by logit (one head per list) or by the group's summed probability:
    [B, H, N] -> [B, H // heads_per_list, k] slots, -1 where fewer than k slots are older."""
    if heads_per_list > 1:
        s = _group_probs(scores, seq_lens, older, heads_per_list).masked_fill(~older[:, None, :], float("-inf"))
    else:
        s = scores.float().masked_fill(~older[:, None, :], float("-inf"))
    if k <= 0:
        return s.new_empty(s.shape[0], s.shape[1], 0, dtype=torch.int64)
    top_vals, top_idx = torch.topk(s, k, dim=-1)
    return torch.where(torch.isfinite(top_vals), top_idx, torch.full_like(top_idx, -1))


def _union_order(scores, seq_lens, older, heads_per_list):
    """Older slots of each list of ``heads_per_list`` consecutive heads, best first: [B, H, N] -> [B, Hs, N].

    A slot's key is its best rank over the list's heads (rank 0 = that head's highest logit among the older
    slots; equal logits in a head rank the lower slot first), ties broken by the list's summed softmax
    probability (highest first), then by the lowest slot. A slot is in some head's top-r list exactly when its
    best rank is < r, so the first k entries are the union of the heads' top-r lists for the largest r whose
    union fits in k, completed by the most probable slots of best rank r. Non-older slots come last.
    Sorts every head's N logits: the plain statement of the rule, which :func:`_union_from_top_k` computes
    from each head's top-k alone (tests/sparse_models/test_tidal_variants.py holds the two equal).
    """
    batch, num_heads, n = scores.shape
    logits = scores.float().masked_fill(~older[:, None, :], float("-inf"))
    by_logit = torch.argsort(logits, dim=-1, descending=True, stable=True)
    positions = torch.arange(n, device=scores.device).expand_as(by_logit)
    rank = torch.empty_like(by_logit).scatter_(-1, by_logit, positions)  # [B, H, N]: each slot's rank per head
    best = rank.view(batch, num_heads // heads_per_list, heads_per_list, n).amin(2)
    best = best.masked_fill(~older[:, None, :], n)  # never ahead of an older slot
    by_prob = torch.argsort(_group_probs(scores, seq_lens, older, heads_per_list), dim=-1, descending=True,
                            stable=True)  # stable: equal probabilities keep the lower slot first
    by_rank = torch.argsort(best.gather(-1, by_prob), dim=-1, stable=True)  # stable: keeps the probability order
    return by_prob.gather(-1, by_rank)


def _head_order_keys(logits):
    """[B, H, N] fp32 logits -> int64 keys, distinct within a head, that order its slots as a stable descending
    sort of the logits does (higher logit first; equal logits: the lower slot first): the logit's bits mapped
    to an order-preserving int32 in the high half, the reversed slot in the low half."""
    n = logits.shape[-1]
    bits = (logits + 0.0).contiguous().view(torch.int32)  # + 0.0: -0.0 becomes +0.0, which it equals
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits, so ints order alike
    reversed_slot = n - 1 - torch.arange(n, device=logits.device)
    return (ordered.to(torch.int64) << 32) | reversed_slot


def _union_lists(scores, seq_lens, older, k, heads_per_list):
    """The first ``k`` slots of :func:`_union_order`: [B, H, N] -> [B, H // heads_per_list, k], -1 where fewer
    than k slots are older. Two exact routes to the same lists; the faster one was measured per batch size
    (BENCHMARKS.md, "TidalDecode's union lists from each head's top-k"): at batch 1 the sort of every slot
    (:func:`_union_from_sort`), above it each head's top-k (:func:`_union_from_top_k`). Shapes are static, so
    the choice is fixed per captured graph."""
    route = _union_from_sort if scores.shape[0] == 1 else _union_from_top_k
    return route(scores, seq_lens, older, k, heads_per_list)


def _union_from_sort(scores, seq_lens, older, k, heads_per_list):
    """:func:`_union_lists` by sorting all N slots of every head (:func:`_union_order`)."""
    if k <= 0:
        return torch.empty(scores.shape[0], scores.shape[1] // heads_per_list, 0, dtype=torch.int64,
                           device=scores.device)
    return _older_or_padding(_union_order(scores, seq_lens, older, heads_per_list)[..., :k], older)


def _older_or_padding(slots, older):
    """slots [B, Hs, k] with older [B, N] -> the slots, -1 where a slot is not older (fewer than k were)."""
    is_older = torch.gather(older[:, None, :].expand(-1, slots.shape[1], -1), -1, slots)
    return torch.where(is_older, slots, torch.full_like(slots, -1))


def _union_from_top_k(scores, seq_lens, older, k, heads_per_list):
    """:func:`_union_lists` from each head's top-k alone.

    Only slots of best rank < k can be among the first k (one head's own top-k already holds k older slots, and
    every head sees the same older slots), and those are the union of the heads' top-k lists. So each head's
    top-k is taken (``torch.topk`` on keys without ties, so ranks equal the stable sort's), and only those
    heads_per_list * k candidates per list are ordered, instead of sorting all N slots of every head."""
    batch, num_heads, n = scores.shape
    lists = num_heads // heads_per_list
    if k <= 0:
        return torch.empty(batch, lists, 0, dtype=torch.int64, device=scores.device)
    logits = scores.float().masked_fill(~older[:, None, :], float("-inf"))
    top = torch.topk(_head_order_keys(logits), k, dim=-1).indices  # [B, H, k], each head's best first
    candidates = top.view(batch, lists, heads_per_list * k)
    ranks = torch.arange(k, device=scores.device).repeat(heads_per_list).expand_as(candidates)
    best = torch.full((batch, lists, n), n, dtype=torch.int64, device=scores.device)
    best = best.scatter_reduce(-1, candidates, ranks, "amin").masked_fill(~older[:, None, :], n)
    probs = _group_probs(scores, seq_lens, older, heads_per_list).gather(-1, candidates)
    # (best rank, probability descending, slot): three stable sorts, last key first
    order = torch.argsort(candidates, dim=-1, stable=True)
    order = order.gather(-1, torch.argsort(probs.gather(-1, order), dim=-1, descending=True, stable=True))
    order = order.gather(-1, torch.argsort(best.gather(-1, candidates.gather(-1, order)), dim=-1, stable=True))
    ranked = candidates.gather(-1, order)  # a slot listed by several heads sits in adjacent copies
    repeat = torch.zeros_like(ranked, dtype=torch.bool)
    repeat[..., 1:] = ranked[..., 1:] == ranked[..., :-1]
    ranked = ranked.gather(-1, torch.argsort(repeat.to(torch.int8), dim=-1, stable=True))[..., :k]
    return _older_or_padding(ranked, older)


def selection_decode_attention(q, k_cache, v_cache, seq_lens, budget, *, scale=None, per_kv_group=False,
                               k_scale=None, v_scale=None, k_recent=None):
    """Decode attention that also selects the next layers' positions (TidalDecode selection layer).

    Returns (out [B, Hq, D], indices [B, Hs, budget]). k_scale / v_scale / k_recent: as in decode_attention.
    """
    out, scores = decode_attention(q, k_cache, v_cache, seq_lens, scale=scale, return_scores=True, k_scale=k_scale,
                                   v_scale=v_scale, k_recent=k_recent)
    group = q.shape[1] // k_cache.shape[1]
    return out, select_topk_positions(scores, seq_lens, budget, group_size=group, per_kv_group=per_kv_group)


def sparse_decode_attention(q, k_cache, v_cache, indices, *, scale=None, k_scale=None, v_scale=None, k_recent=None,
                            seq_lens=None):
    """Decode attention over per-head slot lists (TidalDecode sparse layers, Quest, StreamingLLM).

    Args:
        q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, N, D].
        indices: [B, Hs, K] slots (-1 = unused). Hs = Hq (per query head) or Hkv (one list per
            KV head, shared by its G query heads). Duplicate slots are counted once each (callers
            don't produce them).
        k_scale, v_scale: [B, Hkv, N] fp32 for float8_e4m3fn caches (kernels/fp8_kv.py), else None.
        k_recent, seq_lens: FP8 caches only, as in decode_attention (the lengths say which listed positions are
            among the newest W).
    Returns:
        out [B, Hq, D].
    """
    ct = _compute_dtype(q)
    batch, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    if indices.shape[1] == num_kv and num_kv != num_heads:
        indices = _expand_kv(indices, num_heads)
    valid = indices >= 0
    idx = indices.clamp(min=0)
    k = _expand_kv(_keys(k_cache, k_scale, k_recent, seq_lens, ct), num_heads).to(ct)
    v = _expand_kv(_kv(v_cache, v_scale, "v_cache", "v_scale", ct), num_heads).to(ct)
    gather_idx = idx.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    k_sel = torch.gather(k, 2, gather_idx)
    v_sel = torch.gather(v, 2, gather_idx)
    logits = torch.einsum("bhd,bhkd->bhk", q.to(ct), k_sel) * _scale(scale, head_dim)
    out, _ = _masked_softmax_attend(logits, valid, v_sel)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------

def prefill_attention(q, k, v, q_offsets, kv_lens, *, scale=None, return_lse=False):
    """Causal attention for a chunk of queries against a (possibly longer) key sequence.

    Args:
        q: [B, Hq, S, D]; query i of sequence b sits at position q_offsets[b] + i.
        k, v: [B, Hkv, N, D], slot = position; keys j < kv_lens[b] are valid.
        q_offsets, kv_lens: [B] ints.
    Returns:
        out [B, Hq, S, D] (rows at positions >= kv_lens[b] are 0) and, with return_lse,
        lse [B, Hq, S] fp32 (-inf for such rows).
    """
    ct = _compute_dtype(q)
    batch, num_heads, s, head_dim = q.shape
    n = k.shape[2]
    kk = _expand_kv(k, num_heads).to(ct)
    vv = _expand_kv(v, num_heads).to(ct)
    qpos = q_offsets.to(q.device)[:, None] + torch.arange(s, device=q.device)[None, :]  # [B, S]
    kpos = torch.arange(n, device=q.device)
    valid = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < kv_lens.to(q.device)[:, None, None])
    valid = valid & (qpos < kv_lens.to(q.device)[:, None])[:, :, None]
    if not return_lse and ct == torch.float32:
        # Same math through SDPA's memory-efficient path (the [B, H, S, N] logits of a long prompt
        # would not fit); rows without any valid key come back NaN and are zeroed.
        out = F.scaled_dot_product_attention(q.to(ct), kk, vv, attn_mask=valid[:, None], scale=_scale(scale, head_dim))
        out = out.masked_fill(~valid.any(-1)[:, None, :, None], 0.0)
        return out.to(q.dtype)
    logits = torch.einsum("bhsd,bhnd->bhsn", q.to(ct), kk) * _scale(scale, head_dim)
    valid = valid[:, None, :, :].expand_as(logits)
    out, lse = _masked_softmax_attend(logits, valid, vv)
    if return_lse:
        return out.to(q.dtype), lse.float() if ct != torch.float64 else lse
    return out.to(q.dtype)


def sparse_prefill_attention(q, k, v, indices, *, scale=None):
    """Token Sparse compressed attention (METHODS.md C.1 steps 6-8), without the gathers' copies.

    Args:
        q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] (same positions as q).
        indices: [B, Hq, K] kept positions per query head, ascending, -1 padded. They are both the
            kept queries and the kept keys.
    Returns:
        out [B, Hq, S, D]: causal attention among the kept positions written at their original
        position; 0 at positions a head did not keep (the residual stream passes through there).
    """
    ct = _compute_dtype(q)
    batch, num_heads, s, head_dim = q.shape
    valid = indices >= 0
    # scatter into one spare column so that -1 padding lands outside the sequence
    kept = torch.zeros(batch, num_heads, s + 1, dtype=torch.bool, device=q.device)
    kept.scatter_(2, torch.where(valid, indices, torch.full_like(indices, s)), True)
    kept = kept[..., :s]
    kk = _expand_kv(k, num_heads).to(ct)
    vv = _expand_kv(v, num_heads).to(ct)
    pos = torch.arange(s, device=q.device)
    causal = pos[None, :] <= pos[:, None]  # [S, S]
    mask = causal[None, None] & kept[:, :, None, :] & kept[:, :, :, None]
    if ct == torch.float32:
        # Same math through SDPA (as prefill_attention): no [B, Hq, S, S] fp32 logits and probabilities,
        # which made an 8K CPU prefill take minutes. A kept query always sees itself; the rows SDPA
        # returns as NaN (no valid key) are exactly the dropped queries, zeroed below.
        out = F.scaled_dot_product_attention(q.to(ct), kk, vv, attn_mask=mask, scale=_scale(scale, head_dim))
    else:
        logits = torch.einsum("bhsd,bhnd->bhsn", q.to(ct), kk) * _scale(scale, head_dim)
        out, _ = _masked_softmax_attend(logits, mask, vv)
    out = out.masked_fill(~kept.unsqueeze(-1), 0.0)
    return out.to(q.dtype)


TOKEN_SPARSE_REDUCTIONS = ("mean", "max")  # how the window's queries vote: the paper's mean, or the max (METHODS.md C.1)


def check_token_sparse_reduce(reduce) -> None:
    """One error for an unknown ``reduce`` of ``token_sparse_scores`` (reference and Triton alike)."""
    if reduce not in TOKEN_SPARSE_REDUCTIONS:
        raise ValueError(f"reduce={reduce!r} is invalid: expected one of {', '.join(TOKEN_SPARSE_REDUCTIONS)}")


def token_sparse_scores(q, k, seq_lens, window, reduce="mean"):
    """Token Sparse importance of each prefix key (METHODS.md C.1 step 2).

    s_h[t] = mean (``reduce="mean"``, the paper's) or max (``reduce="max"``) over the last `window` valid
    queries i of softmax_j(q_i.k_j / sqrt(D))[t], with the softmax over keys j <= i (causal). Keys inside the
    window and padding get 0.

    Args:
        q: [B, Hq, S, D]; k: [B, Hkv, S, D]; seq_lens: [B] valid length of each sequence.
        window: W, the number of last queries that vote.
        reduce: "mean" or "max" over the voting queries.
    Returns:
        scores [B, Hq, S] fp32 (fp64 for fp64 inputs).
    Only the window's rows of the probability matrix are formed ([B, Hq, W, S]), not all S x S.
    """
    check_token_sparse_reduce(reduce)
    ct = _compute_dtype(q)
    batch, num_heads, s, head_dim = q.shape
    w = min(window, s)
    lens = seq_lens.to(q.device).long()
    win_start = (lens - window).clamp(min=0)  # [B]
    q_pos = win_start[:, None] + torch.arange(w, device=q.device)[None, :]  # [B, w]
    q_ok = q_pos < lens[:, None]  # fewer than W voters when the sequence is shorter than the window
    q_pos = q_pos.clamp(max=s - 1)
    q_win = q.gather(2, q_pos[:, None, :, None].expand(batch, num_heads, w, head_dim)).to(ct)
    logits = torch.einsum("bhwd,bhnd->bhwn", q_win, _expand_kv(k, num_heads).to(ct)) * head_dim ** -0.5
    pos = torch.arange(s, device=q.device)
    visible = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < lens[:, None, None])  # [B, w, S]
    probs = torch.softmax(logits.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    probs = probs.masked_fill(~q_ok[:, None, :, None], 0.0)
    if reduce == "max":
        scores = probs.amax(2)
    else:
        scores = probs.sum(2) / q_ok.sum(-1).clamp(min=1).to(ct)[:, None, None]
    prefix = pos[None, :] < win_start[:, None]  # [B, S]
    scores = scores.masked_fill(~prefix[:, None, :], 0.0)
    return scores.float() if ct != torch.float64 else scores


# ----------------------------------------------------------------------------------------------
# POD
# ----------------------------------------------------------------------------------------------

def pod_proximal_mask(query_pos, key_pos, sink, recent):
    """Whether key position j is proximal to query position i: j < sink or i - j < recent (j <= i assumed)."""
    return (key_pos < sink) | ((query_pos - key_pos) < recent)


def pod_prefill_attention(q, k_own, k_anchor, v, seq_lens, *, sink, recent, scale=None, return_gate=False,
                          q_distant=None):
    """POD prefill / training attention (METHODS.md A.3), differentiable through autograd.

    Two masked passes merged by log-sum-exp: proximal pairs (j <= i, j < sink or i - j < recent)
    use the layer's own keys, distant pairs (j <= i otherwise) the anchor layer's keys; queries and
    values are the layer's own. o = g o_P + (1 - g) o_D with g = sigmoid(lse_P - lse_D), which
    equals one softmax over the concatenated logits.

    Args:
        q: [B, Hq, S, D]; k_own, k_anchor, v: [B, Hkv, S, D]; seq_lens: [B] (right padding).
        q_distant: [B, Hq, S, D] queries of the distant pairs (default ``q``: key sharing, paper v2). The anchor
            layer's queries give v1's score sharing: distant logits ``q_a . k_a``.
    Returns:
        out [B, Hq, S, D] (0 on padding rows) and, with return_gate, gate [B, Hq, S] (1 where no
        distant key exists).
    """
    ct = _compute_dtype(q)
    batch, num_heads, s, head_dim = q.shape
    sc = _scale(scale, head_dim)
    pos = torch.arange(s, device=q.device)
    lens = seq_lens.to(q.device)
    causal = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens[:, None, None]) \
        & (pos[None, :, None] < lens[:, None, None])  # [B, S, S]
    proximal = pod_proximal_mask(pos[:, None], pos[None, :], sink, recent)[None] & causal
    distant = causal & ~proximal
    qc = q.to(ct)
    vv = _expand_kv(v, num_heads).to(ct)
    if not return_gate and ct == torch.float32 and q_distant is None:
        # One softmax over [proximal keys ; distant keys] is the LSE merge of the two passes, so
        # SDPA over the concatenated keys (and values twice) computes it without [S, S] logits.
        keys = torch.cat([_expand_kv(k_own, num_heads), _expand_kv(k_anchor, num_heads)], dim=2).to(ct)
        values = torch.cat([vv, vv], dim=2)
        mask = torch.cat([proximal, distant], dim=-1)[:, None]  # [B, 1, S, 2S]
        out = F.scaled_dot_product_attention(qc, keys, values, attn_mask=mask, scale=sc)
        out = torch.where(causal.any(-1)[:, None, :, None], out, torch.zeros_like(out))
        return out.to(q.dtype)
    logits_p = torch.einsum("bhsd,bhnd->bhsn", qc, _expand_kv(k_own, num_heads).to(ct)) * sc
    qd = qc if q_distant is None else q_distant.to(ct)
    logits_d = torch.einsum("bhsd,bhnd->bhsn", qd, _expand_kv(k_anchor, num_heads).to(ct)) * sc
    logits_p = logits_p.masked_fill(~proximal[:, None], float("-inf"))
    logits_d = logits_d.masked_fill(~distant[:, None], float("-inf"))
    lse_p = torch.logsumexp(logits_p, -1)
    lse_d = torch.logsumexp(logits_d, -1)
    lse = torch.logaddexp(lse_p, lse_d)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1)
    probs = torch.exp(logits_p - safe) + torch.exp(logits_d - safe)
    out = torch.matmul(probs, vv)
    out = torch.where(torch.isfinite(lse).unsqueeze(-1), out, torch.zeros_like(out))
    if return_gate:
        gate = torch.exp(lse_p - safe.squeeze(-1))
        gate = torch.where(torch.isfinite(lse_p), gate, torch.zeros_like(gate))
        return out.to(q.dtype), gate.float() if ct != torch.float64 else gate
    return out.to(q.dtype)


def pod_decode_attention(q, k_local, k_anchor, v_cache, seq_lens, *, sink, recent, scale=None, gate_tau=None,
                         return_gate=False, gate_estimate=None, return_skip=False, return_scores=False,
                         k_local_scale=None, k_anchor_scale=None, v_scale=None, q_distant=None, k_local_recent=None,
                         k_anchor_recent=None):
    """POD decode: proximal keys from the layer's own sink + ring, distant keys from the anchor.

    Args:
        q: [B, Hq, D], the query at position p = seq_lens - 1.
        k_local: [B, Hkv, sink + recent, D]; slot t < sink holds position t, slot sink + (j % recent)
            holds position j for the last `recent` positions. None: the layer is its own anchor (proximal keys
            are k_anchor's), i.e. exact attention, with the gate a later layer's anchor estimate reads.
        k_anchor: [B, Hkv, N, D] the anchor layer's keys at every position (slot = position).
        v_cache: [B, Hkv, N, D] the layer's own values.
        gate_tau: if set, heads whose proximal gate g >= tau use proximal attention only.
        gate_estimate: [B, Hq] or None; if set (with gate_tau), it decides the skip instead of the
            exact gate (a gate pre-evaluated elsewhere, e.g. by the anchor layer: paper section 2.3
            under key sharing), and skipped heads report gate 1 (their distant part is never read).
        return_scores: also return the logits q.k * scale of every position [B, Hq, N] fp32, each with the key
            the layer attends it by (own key if proximal, anchor key if distant), -inf past seq_lens: what
            TidalDecode's top-k needs in a POD selection layer. Not with gate_estimate (skipped heads read no
            distant key).
        k_local_scale [B, Hkv, sink + recent], k_anchor_scale, v_scale [B, Hkv, N]: fp32 scales of float8_e4m3fn
            caches (kernels/fp8_kv.py: the ring keeps one scale per slot), else None.
        q_distant: [B, Hq, D] the query of the distant logits, default ``q`` (key sharing). The anchor layer's
            query of the same step gives v1's score sharing (distant logits ``q_a . k_a``, METHODS.md A.3); the
            proximal logits and the gate's proximal part keep ``q``.
        k_local_recent, k_anchor_recent: FP8 caches only, [B, Hkv, W, D] in the model's dtype: the layer's own and
            the anchor layer's keys of positions [seq_lens - W, seq_lens) at slot position % W, read instead of
            their FP8 copies (kernels/fp8_kv.py "Recent keys"; a layer that is its own anchor passes the second).
    Returns:
        out [B, Hq, D]; with return_gate also gate [B, Hq] (the exact gate, computed before any
        skipping); with return_skip also skip [B, Hq] bool (heads that dropped the distant part); with
        return_scores also scores [B, Hq, N]. Order: out, gate, skip, scores.
    """
    if gate_estimate is not None and gate_tau is None:
        raise ValueError("gate_estimate is given but gate_tau is None; the estimate only decides a skip at gate_tau")
    if return_scores and gate_estimate is not None:
        raise ValueError("return_scores with gate_estimate: skipped heads read no distant key, so their distant "
                         "logits do not exist; ask for scores without a gate estimate")
    ct = _compute_dtype(q)
    check_recent_keys(k_anchor_recent, k_anchor, "k_anchor")
    k_anchor_read = _kv(k_anchor, k_anchor_scale, "k_anchor", "k_anchor_scale", ct)
    if k_anchor_recent is not None:
        k_anchor_read = overlay_recent_keys(k_anchor_read, k_anchor_recent, seq_lens)
    v_cache = _kv(v_cache, v_scale, "v_cache", "v_scale", ct)
    if k_local is not None:
        check_recent_keys(k_local_recent, k_local, "k_local")
        k_local = _kv(k_local, k_local_scale, "k_local", "k_local_scale", ct)
    elif k_local_scale is not None or k_local_recent is not None:
        raise ValueError("k_local_scale / k_local_recent is given but k_local is None (a layer that is its own "
                         "anchor: its recent keys are k_anchor_recent)")
    k_anchor = k_anchor_read
    batch, num_heads, head_dim = q.shape
    n = v_cache.shape[2]
    sc = _scale(scale, head_dim)
    lens = seq_lens.to(q.device)
    p = lens - 1
    j = torch.arange(n, device=q.device)
    causal = j[None, :] <= p[:, None]  # [B, N]
    proximal = pod_proximal_mask(p[:, None], j[None, :], sink, recent) & causal
    distant = causal & ~proximal
    # effective proximal keys at every position (only proximal positions are read); k_local None: the layer
    # is its own anchor, its proximal keys are k_anchor's
    if k_local is None:
        k_prox = k_anchor
    else:
        local_slot = torch.where(j < sink, j, sink + (j % recent)).clamp(max=k_local.shape[2] - 1)
        k_prox = k_local[:, :, local_slot, :]  # [B, Hkv, N, D]
        if k_local_recent is not None:
            k_prox = overlay_recent_keys(k_prox, k_local_recent, seq_lens)
    qc = q.to(ct)
    qd = qc if q_distant is None else q_distant.to(ct)
    logits_p = torch.einsum("bhd,bhnd->bhn", qc, _expand_kv(k_prox, num_heads).to(ct)) * sc
    logits_d = torch.einsum("bhd,bhnd->bhn", qd, _expand_kv(k_anchor, num_heads).to(ct)) * sc
    logits_p = logits_p.masked_fill(~proximal[:, None], float("-inf"))
    logits_d = logits_d.masked_fill(~distant[:, None], float("-inf"))
    lse_p = torch.logsumexp(logits_p, -1)
    lse_d = torch.logsumexp(logits_d, -1)
    gate, skip = _pod_gate_skip(torch.sigmoid(lse_p - lse_d), gate_tau, gate_estimate)
    scores = torch.where(proximal[:, None], logits_p, logits_d).float() if return_scores else None
    logits_d = logits_d.masked_fill(skip.unsqueeze(-1), float("-inf"))
    logits = torch.where(proximal[:, None], logits_p, logits_d)
    valid = causal[:, None].expand_as(logits) & torch.isfinite(logits)
    out, _ = _masked_softmax_attend(logits, valid, _expand_kv(v_cache, num_heads).to(ct))
    results = _pod_results(out.to(q.dtype), gate, skip, return_gate, return_skip)
    if not return_scores:
        return results
    return (*(results if isinstance(results, tuple) else (results,)), scores)


def _pod_gate_skip(gate, gate_tau, gate_estimate):
    """(reported gate [B, Hq], skip [B, Hq] bool): heads whose gate (or gate_estimate) >= gate_tau drop their
    distant part; with an estimate, skipped heads report gate 1 (their distant part is never read)."""
    if gate_tau is None:
        return gate, torch.zeros_like(gate, dtype=torch.bool)
    skip = (gate_estimate.to(gate.device) if gate_estimate is not None else gate) >= gate_tau
    if gate_estimate is not None:
        gate = torch.where(skip, torch.ones_like(gate), gate)
    return gate, skip


def _pod_results(out, gate, skip, return_gate: bool, return_skip: bool):
    """out, then the gate (fp32) and the skip mask if asked for, in that order."""
    results = [out] + ([gate.float()] if return_gate else []) + ([skip] if return_skip else [])
    return tuple(results) if len(results) > 1 else results[0]


def pod_sparse_decode_attention(q, k_local, k_anchor, v_cache, indices, seq_lens, *, sink, recent, scale=None,
                                gate_tau=None, gate_estimate=None, return_gate=False, return_skip=False,
                                k_local_scale=None, k_anchor_scale=None, v_scale=None, q_distant=None,
                                k_local_recent=None, k_anchor_recent=None):
    """POD + TidalDecode: decode attention over selected positions with POD's key sharing and gate.

    Args:
        q: [B, Hq, D], the query at p = seq_lens - 1; k_local, k_anchor, v_cache, sink, recent,
            gate_tau, gate_estimate: as in pod_decode_attention.
        indices: [B, Hs, K] selected positions (Hs = Hq, or Hkv: one list per GQA group), -1 = none.
        k_local_scale, k_anchor_scale, v_scale: FP8 scales, as in pod_decode_attention.
        q_distant: [B, Hq, D] the query of the distant entries' logits (score sharing), as in
            pod_decode_attention; default q.
        k_local_recent, k_anchor_recent: recent keys, as in pod_decode_attention.
    A selected position j is proximal when j < sink or p - j < recent (key k_local at slot j or
    sink + j % recent), distant otherwise (key k_anchor[..., j, :]); values are v_cache[..., j, :].
    gate = sigmoid(lse_P - lse_D) over the selected positions (1 without distant ones, 0 without
    proximal ones); with gate_tau, heads whose gate (or gate_estimate) >= tau drop the distant part;
    with gate_estimate, skipped heads report gate 1.
    Returns:
        out [B, Hq, D] (0 where nothing is attended); with return_gate gate [B, Hq]; with return_skip
        skip [B, Hq] bool.
    """
    if gate_estimate is not None and gate_tau is None:
        raise ValueError("gate_estimate is given but gate_tau is None; the estimate only decides a skip at gate_tau")
    ct = _compute_dtype(q)
    check_recent_keys(k_local_recent, k_local, "k_local")
    check_recent_keys(k_anchor_recent, k_anchor, "k_anchor")
    k_local = _kv(k_local, k_local_scale, "k_local", "k_local_scale", ct)
    k_anchor = _kv(k_anchor, k_anchor_scale, "k_anchor", "k_anchor_scale", ct)
    if k_anchor_recent is not None:
        k_anchor = overlay_recent_keys(k_anchor, k_anchor_recent, seq_lens)
    v_cache = _kv(v_cache, v_scale, "v_cache", "v_scale", ct)
    batch, num_heads, head_dim = q.shape
    sc = _scale(scale, head_dim)
    if indices.shape[1] != num_heads:
        indices = indices.repeat_interleave(num_heads // indices.shape[1], dim=1)
    group = num_heads // v_cache.shape[1]
    valid = indices >= 0
    j = indices.clamp(min=0).long()  # [B, Hq, K]
    p = (seq_lens.to(q.device).long() - 1)[:, None, None]
    proximal = pod_proximal_mask(p, j, sink, recent)
    b = torch.arange(batch, device=q.device)[:, None, None]
    kvh = (torch.arange(num_heads, device=q.device) // group)[None, :, None]
    slot = torch.where(j < sink, j, sink + j % recent).clamp(max=k_local.shape[2] - 1)
    k_own = k_local[b, kvh, slot]
    if k_local_recent is not None:  # the layer's own key of a position among the newest W
        window = k_local_recent.shape[2]
        newest = (j >= p + 1 - window)[..., None]
        k_own = torch.where(newest, k_local_recent[b, kvh, j % window].to(k_own.dtype), k_own)
    k = torch.where(proximal[..., None], k_own, k_anchor[b, kvh, j]).to(ct)
    v = v_cache[b, kvh, j].to(ct)
    logits = torch.einsum("bhd,bhkd->bhk", q.to(ct), k) * sc
    if q_distant is not None:
        logits = torch.where(proximal, logits, torch.einsum("bhd,bhkd->bhk", q_distant.to(ct), k) * sc)
    logits = logits.masked_fill(~valid, float("-inf"))
    lse_p = torch.logsumexp(logits.masked_fill(~proximal, float("-inf")), -1)
    lse_d = torch.logsumexp(logits.masked_fill(proximal, float("-inf")), -1)
    inf = float("-inf")
    gate = torch.where((lse_p == inf) | (lse_d == inf), (lse_d == inf).to(lse_p.dtype), torch.sigmoid(lse_p - lse_d))
    gate, skip = _pod_gate_skip(gate, gate_tau, gate_estimate)
    logits = logits.masked_fill(skip[..., None] & ~proximal, float("-inf"))
    out, _ = _masked_softmax_attend(logits, torch.isfinite(logits), v)  # [B, Hq, D]
    return _pod_results(out.to(q.dtype), gate, skip, return_gate, return_skip)


# ----------------------------------------------------------------------------------------------
# Quest
# ----------------------------------------------------------------------------------------------

def quest_page_minmax(k_cache, seq_lens, page_size, *, k_scale=None):
    """Per-page, per-channel key max and min: ([B, Hkv, P, D], [B, Hkv, P, D]) fp32, P = ceil(N / page_size).

    Slots past seq_lens don't contribute; an empty page gets max -inf and min +inf. An FP8 cache (k_scale
    [B, Hkv, N]) is bounded after dequantisation: the bound holds for the keys attention reads (kernels/fp8_kv.py).
    """
    k_cache = _kv(k_cache, k_scale, "k_cache", "k_scale", torch.float32)
    batch, num_kv, n, head_dim = k_cache.shape
    pages = -(-n // page_size)
    pad = pages * page_size - n
    valid = torch.arange(pages * page_size, device=k_cache.device)[None, :] < seq_lens.to(k_cache.device)[:, None]
    k = F.pad(k_cache.float(), (0, 0, 0, pad)).view(batch, num_kv, pages, page_size, head_dim)
    valid = valid.view(batch, 1, pages, page_size, 1)
    page_max = k.masked_fill(~valid, float("-inf")).amax(3)
    page_min = k.masked_fill(~valid, float("inf")).amin(3)
    return page_max, page_min


def quest_page_scores(q, page_max, page_min, seq_lens, page_size):
    """Quest criticality upper bound per (head, page) (METHODS.md D.1).

    U = sum_i max(q_i M_i, q_i m_i), unscaled. Empty pages get -inf; the current (last) page +inf
    so that it is always selected.

    Args: q [B, Hq, D]; page_max, page_min [B, Hkv, P, D]; seq_lens [B].
    Returns: scores [B, Hq, P] fp32.
    """
    batch, num_heads, head_dim = q.shape
    pages = page_max.shape[2]
    qf = q.float()[:, :, None, :]
    mx = _expand_kv(page_max, num_heads).float()
    mn = _expand_kv(page_min, num_heads).float()
    prod = torch.maximum(qf * mx, qf * mn)
    prod = torch.nan_to_num(prod, nan=float("-inf"))  # 0 * inf on empty pages
    scores = prod.sum(-1)
    lens = seq_lens.to(q.device)
    page_ids = torch.arange(pages, device=q.device)
    num_pages = -(-lens // page_size)
    current = num_pages - 1
    scores = scores.masked_fill(~(page_ids[None, None, :] < num_pages[:, None, None]), float("-inf"))
    scores = torch.where(page_ids[None, None, :] == current[:, None, None], torch.full_like(scores, float("inf")), scores)
    return scores


def quest_select_pages(scores, seq_lens, page_size, budget):
    """Top budget // page_size pages per head (the current page included), as token slot lists.

    Returns indices [B, Hq, K] with K = (budget // page_size) * page_size, ascending, -1 padded
    (slots past seq_lens and unselected entries).
    """
    batch, num_heads, pages = scores.shape
    num_sel = max(1, min(budget // page_size, pages))
    top_vals, top_pages = torch.topk(scores, num_sel, dim=-1)
    top_pages = torch.where(torch.isfinite(top_vals) | (top_vals > 0), top_pages, torch.full_like(top_pages, -1))
    top_pages, _ = torch.sort(torch.where(top_pages < 0, torch.full_like(top_pages, pages + 1), top_pages), dim=-1)
    slots = top_pages[..., None] * page_size + torch.arange(page_size, device=scores.device)
    slots = slots.flatten(-2)
    valid = (top_pages[..., None] < pages).expand(-1, -1, -1, page_size).flatten(-2)
    valid = valid & (slots < seq_lens.to(scores.device)[:, None, None])
    return torch.where(valid, slots, torch.full_like(slots, -1))


def append_kv(key_buffer, value_buffer, k, v, positions, *, key_heads=None, ring=None, sink=0, recent=1,
              key_scale=None, value_scale=None, ring_scale=None):
    """Write one decode token per sequence into a static cache, in place.

    key_buffer: [Bmax, U, N, D]; value_buffer: [Bmax, Hkv, N, D]; k, v: [B, Hkv, D] (B <= Bmax); positions: [B]
    slot of sequence b's token. key_heads: None (U == Hkv: head h's keys in row h) or int [Hkv], head h's row in
    key_buffer or -1 (the head keeps no full keys: a POD non-anchor head). ring: None or
    [Bmax, Hkv, sink + recent, D], POD's proximal keys: position p at slot p if p < sink else sink + p % recent.
    Afterwards ``value_buffer[b, :, positions[b]] == v[b]``, ``key_buffer[b, row(h), positions[b]] == k[b, h]``
    for heads with a row, ``ring[b, :, slot(positions[b])] == k[b]``, for b < B, and nothing else changed.
    FP8 caches (kernels/fp8_kv.py: every buffer float8_e4m3fn): key_scale [Bmax, U, N], value_scale
    [Bmax, Hkv, N] and ring_scale [Bmax, Hkv, sink + recent] fp32 get each written row's scale, and the rows hold
    ``quantize_kv`` of k / v (one scale per token and KV head, the key's bytes and scale alike in key_buffer and
    ring). Returns None.
    """
    from ._value_checks import check_append_inputs, check_append_scales

    check_append_inputs(key_buffer, value_buffer, k, v, positions, key_heads=key_heads, ring=ring, sink=sink,
                        recent=recent)
    fp8 = check_append_scales(key_buffer, value_buffer, ring, key_scale, value_scale, ring_scale)
    rows = torch.arange(k.shape[0], device=k.device)
    if fp8:
        (k, k_s), (v, v_s) = quantize_kv(k), quantize_kv(v)  # [B, Hkv, D] fp8, [B, Hkv] fp32
        value_scale[rows, :, positions] = v_s
    value_buffer[rows, :, positions] = v.to(value_buffer.dtype)
    if key_heads is None:
        key_buffer[rows, :, positions] = k.to(key_buffer.dtype)
        if fp8:
            key_scale[rows, :, positions] = k_s
    else:
        for h, row in enumerate(key_heads.tolist()):
            if row >= 0:
                key_buffer[rows, row, positions] = k[:, h].to(key_buffer.dtype)
                if fp8:
                    key_scale[rows, row, positions] = k_s[:, h]
    if ring is not None:
        slots = torch.where(positions < sink, positions, sink + positions % recent)
        ring[rows, :, slots] = k.to(ring.dtype)
        if fp8:
            ring_scale[rows, :, slots] = k_s


def decode_linear(x, weights, biases=None, *, gated=False):
    """Several linear maps of one input, side by side: x [M, K], weights 1-3 tensors [N_i, K], biases None or
    one [N_i] / None each -> [M, sum N_i]; with ``gated=True`` (two weights of one shape: gate, up)
    ``silu(x W_0^T + b_0) * (x W_1^T + b_1)`` -> [M, N_0] (the SiLU-gated MLP's hidden activation).
    Products in x's dtype with fp32 accumulation, as ``F.linear`` does."""
    from ._value_checks import check_decode_linear_inputs

    weights, biases = check_decode_linear_inputs(x, weights, biases, gated)
    outs = [F.linear(x, w, b) for w, b in zip(weights, biases)]
    if gated:
        return F.silu(outs[0]) * outs[1]
    return torch.cat(outs, dim=-1)
