"""KV fractions from the schemes' own declarations (:class:`~sparse_models.schemes.base.Footprint`).

What fraction of a ``num_tokens`` context's KV cache a decode scheme keeps after prefill and reads per
decode query, averaged over layers (and KV heads). Nothing here names a scheme: a layer whose decode role
is one of its scheme's ``footprint.budget_roles`` reads ``Budget.reads(config)`` positions (capped at the
context), every other layer reads every position; ``footprint.kept`` says what a layer holds.
"""

from __future__ import annotations

from .registry import get_scheme


def kv_fractions(config, plan, num_kv_heads: int, num_tokens: int) -> tuple[float, float]:
    """(kept, read), each in (0, 1], for ``config``'s decode scheme over ``plan`` (``sparse_models.plan.build_plan``)
    at a context of ``num_tokens`` tokens."""
    scheme = get_scheme(config.decode_scheme, "decode")
    footprint = scheme.footprint
    budget = scheme.budget.reads(config) if scheme.budget is not None and scheme.budget.reads is not None else None
    read = [min(1.0, budget / num_tokens) if budget is not None and row.decode in footprint.budget_roles else 1.0
            for row in plan]
    kept = [footprint.kept(config, row, num_kv_heads, num_tokens) if footprint.kept is not None else 1.0
            for row in plan]
    return sum(kept) / len(kept), sum(read) / len(read)
