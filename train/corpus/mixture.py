"""Weighted mixtures of token sources, and the training dataset that draws rows from them.

A mixture (``data.train``) is written as

* one source string: ``podkit:austen`` (weight 1);
* a YAML list whose items are source strings or ``{source: ..., weight: ...}`` mappings;
* a compact string for ``key=value`` overrides: ``"podkit:gcide=3,podkit:shakespeare=1,./samples=2"``
  (comma-separated ``source=weight``; ``=weight`` may be left out).

Weights are relative (normalised to sum 1). :class:`MixedRows` turns shard folders into a map-style
dataset of ``num_rows`` rows of ``context_length`` tokens: row ``k`` comes from source
``plan.source[k]``, at that source's aligned row ``plan.row[k]`` (tokens ``[r L, (r + 1) L)`` of its
stream). Source ``i`` receives ``round(num_rows * p_i)`` rows (largest remainder, so the counts are
exact), the order of sources is a seeded permutation, and each source walks through a seeded
permutation of its rows, re-permuted per pass when it has to repeat. Everything is a function of
``seed``: the same recipe gives the same rows, and no tokenisation happens while training.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

_WEIGHTED = re.compile(r"^(?P<source>.*?)=(?P<weight>[-+0-9.eE]+)$")


@dataclass(frozen=True)
class MixEntry:
    source: str
    weight: float = 1.0


class MixError(ValueError):
    """A bad mixture; ``problems`` holds one line per problem, each naming the field and value."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def parse_mix(value: Any, field: str = "data.train") -> list[MixEntry]:
    """The entries of a mixture (see the module docstring); raises :class:`MixError`."""
    problems: list[str] = []
    entries: list[MixEntry] = []
    allowed = ("a source string, 'source=weight,source=weight', or a list of sources / "
               "{source: ..., weight: ...} mappings")
    if isinstance(value, str):
        items: list[Any] = [part.strip() for part in value.split(",")] if value.strip() else []
    elif isinstance(value, list):
        items = value
    else:
        raise MixError([f"{field}={value!r}: expected {allowed}"])
    if not items:
        raise MixError([f"{field} is empty: expected {allowed}, e.g. podkit:austen"])
    for index, item in enumerate(items):
        where = f"{field}[{index}]"
        if isinstance(item, str):
            match = _WEIGHTED.match(item)
            source, raw = (match["source"].strip(), match["weight"]) if match else (item.strip(), 1.0)
            if not source:
                problems.append(f"{where}={item!r}: empty source; expected source or source=weight")
                continue
            try:
                weight = float(raw)
            except ValueError:
                problems.append(f"{where}={item!r}: weight {raw!r} is not a number")
                continue
        elif isinstance(item, dict):
            unknown = sorted(set(item) - {"source", "weight"})
            if unknown:
                problems.append(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: source, weight")
                continue
            source, weight = item.get("source"), item.get("weight", 1.0)
            if not isinstance(source, str) or not source.strip():
                problems.append(f"{where}.source={source!r}: expected a non-empty source string")
                continue
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                problems.append(f"{where}.weight={weight!r}: expected a positive number")
                continue
            source = source.strip()
        else:
            problems.append(f"{where}={item!r}: expected a source string or a {{source, weight}} mapping")
            continue
        if not math.isfinite(weight) or weight <= 0:
            problems.append(f"{where}: weight={weight!r} for {source!r}: expected a positive finite number")
            continue
        entries.append(MixEntry(source, float(weight)))
    seen: set[str] = set()
    for entry in entries:
        if entry.source in seen:
            problems.append(f"{field}: source {entry.source!r} is listed twice; give it one entry with the summed weight")
        seen.add(entry.source)
    if problems:
        raise MixError(problems)
    return entries


def mix_to_string(entries: list[MixEntry]) -> str:
    """The compact form of a mixture (inverse of :func:`parse_mix` on strings)."""
    return ",".join(f"{e.source}={e.weight:g}" for e in entries)


@dataclass
class MixPlan:
    """``source[k]`` / ``row[k]``: where dataset row ``k`` comes from. ``counts[i]``: rows of source ``i``."""

    source: np.ndarray   # [num_rows] int16
    row: np.ndarray      # [num_rows] int64
    counts: list[int]
    available: list[int]


def plan_rows(available: list[int], weights: list[float], num_rows: int, seed: int) -> MixPlan:
    """Deterministic assignment of ``num_rows`` rows to sources (see the module docstring).

    ``available[i]``: whole rows in source ``i`` (>= 1 for every source with a positive weight)."""
    if len(available) != len(weights) or not weights:
        raise ValueError("available and weights must be non-empty lists of equal length")
    for count, weight in zip(available, weights):
        if weight > 0 and count < 1:
            raise ValueError(f"a source with weight {weight} holds no full row")
    p = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    exact = p * num_rows
    counts = np.floor(exact).astype(np.int64)
    remainder = num_rows - int(counts.sum())
    if remainder:
        counts[np.argsort(-(exact - counts), kind="stable")[:remainder]] += 1
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(weights), dtype=np.int16), counts)
    labels = labels[rng.permutation(num_rows)]
    rows = np.empty(num_rows, dtype=np.int64)
    for i, count in enumerate(counts):
        if count == 0:
            continue
        source_rng = np.random.default_rng([seed, i])
        passes = -(-int(count) // available[i])
        order = np.concatenate([source_rng.permutation(available[i]) for _ in range(passes)])[:count]
        rows[labels == i] = order
    return MixPlan(labels, rows, [int(c) for c in counts], list(available))


def document_rows(doc_starts: np.ndarray, total_tokens: int, context_length: int) -> np.ndarray:
    """Row starts of a row-aligned source: each document that has ``context_length`` tokens of stream left
    (its own, then the next documents' as filler) starts one row. int64 ``[rows]``."""
    starts = np.asarray(doc_starts, dtype=np.int64)
    return starts[starts + context_length <= total_tokens]


class MixedRows:
    """Map-style dataset over shard folders (a ``torch.utils.data.Dataset`` by duck typing).

    ``dataset[k]`` -> ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}`` (equal: the model
    shifts), so transformers' ``default_data_collator`` stacks them into ``[B, L]``.

    ``aligned[i]``: source ``i``'s rows start at its documents (:func:`document_rows`) instead of every
    ``context_length`` tokens, so a document shorter than a row is never cut (podkit:recall-long's episodes:
    ``train.corpus.documents.row_aligned``)."""

    def __init__(self, sources: list, weights: list[float], context_length: int, *, num_rows: int | None = None,
                 seed: int = 0, aligned: list[bool] | None = None):
        if context_length < 2:
            raise ValueError(f"context_length={context_length}: expected an integer >= 2")
        self.sources = sources
        self.weights = [float(w) for w in weights]
        self.context_length = context_length
        aligned = [False] * len(sources) if aligned is None else list(aligned)
        if len(aligned) != len(sources):
            raise ValueError(f"aligned has {len(aligned)} entries for {len(sources)} sources")
        self._row_starts = [document_rows(s.doc_starts(), s.total_tokens, context_length) if a else None
                            for s, a in zip(sources, aligned)]
        available = [s.total_tokens // context_length if starts is None else len(starts)
                     for s, starts in zip(sources, self._row_starts)]
        empty = [s.source for s, n in zip(sources, available) if n == 0]
        if empty:
            raise ValueError(f"source(s) {', '.join(empty)} hold fewer than context_length={context_length} tokens")
        if num_rows is None:
            num_rows = sum(available)
        if num_rows < 1:
            raise ValueError(f"num_rows={num_rows}: expected >= 1")
        self.plan = plan_rows(available, self.weights, num_rows, seed)

    def __len__(self) -> int:
        return len(self.plan.source)

    def tokens(self, index: int) -> np.ndarray:
        """Row ``index`` as int64 ``[context_length]``."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} outside a dataset of {len(self)} rows")
        i, row = int(self.plan.source[index]), int(self.plan.row[index])
        starts = self._row_starts[i]
        start = row * self.context_length if starts is None else int(starts[row])
        return self.sources[i].read(start, self.context_length)

    def __getitem__(self, index: int) -> dict:
        import torch

        ids = torch.from_numpy(self.tokens(index))
        return {"input_ids": ids, "labels": ids.clone()}

    def summary(self) -> list[dict]:
        """Per source: weight share, rows drawn, rows available, passes over it."""
        total = sum(self.weights)
        return [{"source": s.source, "share": w / total, "rows": c, "available_rows": a,
                 "passes": round(c / a, 3), "tokens": c * self.context_length}
                for s, w, c, a in zip(self.sources, self.weights, self.plan.counts, self.plan.available)]
