"""What POD's compute skipping (``pod.gate_tau``) skips at decode, recorded from ``pod_decode``.

    from sparse_models.schemes.pod_skip_stats import record_gate_skips, skip_summary
    with record_gate_skips() as recorder:
        ...  # decode steps of a POD model (one token per sequence and forward)
    summary = skip_summary(recorder.records)              # what the run's gate_tau skipped
    at_07 = skip_summary(recorder.records, tau=0.7)       # what tau 0.7 would skip at the recorded gates

While a recorder is active, every decode call of :func:`sparse_models.schemes.pod.pod_decode` appends
one :class:`GateRecord` (one layer of one decode step): the estimated gate of every query head, the
skip decision, which heads are shared (read distant keys from an earlier anchor layer) and the
sequence lengths. Anchor layers are recorded too (no shared head): the byte fractions count their
distant reads. With ``gate_tau`` None the layer's output is exactly the unrecorded one; its gate is
computed on the side (one more attention per layer), so a no-tau run gives the gate distribution
that a tau would act on. No recorder active: ``pod_decode`` reads one module-level list, nothing else.

Fractions (:func:`skip_summary`), over all recorded (step, layer) calls and batch rows b:

* head skip fraction = skipped (step, layer, query head) of shared heads / all shared ones;
* group skip fraction = (step, layer, KV head) of shared KV heads whose G query heads all skip /
  all shared (step, layer, KV head): only such a group saves bytes in the Triton kernel (a group with
  one reading head loads its distant K/V rows for all G heads);
* distant bytes skipped = sum over skipped groups of D_b / sum over every (step, layer, KV head) of
  D_b, with D_b = max(0, seq_len_b - sink - recent) the distant positions of the step. The
  denominator counts every layer's distant rows, anchor layers' included (an anchor reads all its
  positions, its distant ones among them, and never skips); a distant row is one anchor-key row plus
  one own-value row, the same size for every (layer, KV head), so rows stand for bytes;
* KV bytes skipped = the same numerator / sum over every (step, layer, KV head) of seq_len_b (all K/V
  rows the step's attention reads, proximal and distant).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class GateRecord:
    """One layer of one decode step, on the CPU.

    estimate [B, Hq] float32: the gate that decides the skip (the anchor layer's gate for a shared head
    under ``gate_estimate="anchor"``, the layer's own gate otherwise); skip [B, Hq] bool: the heads that
    dropped their distant part (all False without gate_tau); shared_q [Hq] bool: heads that read distant
    keys from another layer; group: query heads per KV head; seq_lens [B]: tokens in the cache, current
    one included.
    """

    layer: int
    step: int
    estimate: torch.Tensor
    skip: torch.Tensor
    shared_q: torch.Tensor
    group: int
    seq_lens: torch.Tensor
    sink: int
    recent: int
    tau: float | None

    @property
    def distant_rows(self) -> torch.Tensor:
        """[B] distant positions of this step (neither sink nor recent): max(0, seq_len - sink - recent)."""
        return (self.seq_lens - self.sink - self.recent).clamp(min=0)


@dataclass(eq=False)  # compared by identity: nested recorders are told apart
class GateSkipRecorder:
    records: list[GateRecord] = field(default_factory=list)
    _steps: dict[int, int] = field(default_factory=dict)

    def add(self, layer: int, estimate: torch.Tensor, skip: torch.Tensor, shared_q: torch.Tensor, group: int,
            seq_lens: torch.Tensor, sink: int, recent: int, tau: float | None) -> None:
        step = self._steps.get(layer, 0)
        self._steps[layer] = step + 1
        self.records.append(GateRecord(
            layer=layer, step=step, estimate=estimate.detach().float().cpu().clone(),
            skip=skip.detach().bool().cpu().clone(), shared_q=shared_q.detach().bool().cpu().clone(), group=int(group),
            seq_lens=seq_lens.detach().long().cpu().clone(), sink=int(sink), recent=int(recent), tau=tau))

    def clear(self) -> None:
        self.records.clear()
        self._steps.clear()


_ACTIVE: list[GateSkipRecorder] = []


def active_recorder() -> GateSkipRecorder | None:
    """The innermost active recorder, or None (``pod_decode`` records nothing)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def record_gate_skips() -> Iterator[GateSkipRecorder]:
    """Record every POD decode call inside the ``with`` block (see the module docstring)."""
    recorder = GateSkipRecorder()
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.remove(recorder)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def skip_summary(records: list[GateRecord], tau: float | None = None) -> dict:
    """Head / group skip fractions (overall and per layer) and the byte fractions of the module docstring.

    ``tau`` None: the recorded skip decisions; a number: heads whose recorded estimate is >= tau (what
    that tau would skip at these gates, the later layers' inputs left as they were recorded).
    """
    if tau is not None and not 0.0 < float(tau) <= 1.0:
        raise ValueError(f"tau={tau!r} is invalid: expected a number in (0, 1]")
    per_layer: dict[int, dict[str, float]] = {}
    heads = heads_skipped = groups = groups_skipped = 0
    distant_total = distant_skipped = rows_total = 0.0
    steps = set()
    for record in records:
        steps.add(record.step)
        batch, num_q = record.estimate.shape
        num_kv = num_q // record.group
        skip = (record.estimate >= tau) if tau is not None else record.skip
        skip = skip & record.shared_q[None, :]
        shared_kv = record.shared_q.view(num_kv, record.group).all(dim=1)  # [Hkv]
        if bool(record.shared_q.view(num_kv, record.group).any(1).ne(shared_kv).any()):
            raise ValueError(f"layer {record.layer}: the query heads of one KV head must all be shared or all not")
        group_skip = skip.view(batch, num_kv, record.group).all(dim=2) & shared_kv[None, :]  # [B, Hkv]
        distant = record.distant_rows.double()
        n_heads = batch * int(record.shared_q.sum())
        n_groups = batch * int(shared_kv.sum())
        n_heads_skipped = int(skip.sum())
        n_groups_skipped = int(group_skip.sum())
        heads, heads_skipped = heads + n_heads, heads_skipped + n_heads_skipped
        groups, groups_skipped = groups + n_groups, groups_skipped + n_groups_skipped
        distant_total += float(distant.sum()) * num_kv
        distant_skipped += float((group_skip.double() * distant[:, None]).sum())
        rows_total += float(record.seq_lens.double().sum()) * num_kv
        if n_heads:
            entry = per_layer.setdefault(record.layer, {"shared_heads": 0, "heads_skipped": 0, "shared_groups": 0,
                                                        "groups_skipped": 0})
            entry["shared_heads"] += n_heads
            entry["heads_skipped"] += n_heads_skipped
            entry["shared_groups"] += n_groups
            entry["groups_skipped"] += n_groups_skipped
    for entry in per_layer.values():
        entry["head_skip_fraction"] = _ratio(entry["heads_skipped"], entry["shared_heads"])
        entry["group_skip_fraction"] = _ratio(entry["groups_skipped"], entry["shared_groups"])
    return {
        "tau": tau if tau is not None else (records[0].tau if records else None),
        "from": "recorded skips" if tau is None else "recorded gates >= tau",
        "steps": len(steps),
        "shared_heads": heads, "heads_skipped": heads_skipped, "head_skip_fraction": _ratio(heads_skipped, heads),
        "shared_groups": groups, "groups_skipped": groups_skipped,
        "group_skip_fraction": _ratio(groups_skipped, groups),
        "distant_rows": distant_total, "distant_rows_skipped": distant_skipped,
        "distant_bytes_skipped_fraction": _ratio(distant_skipped, distant_total),
        "kv_rows": rows_total, "kv_bytes_skipped_fraction": _ratio(distant_skipped, rows_total),
        "per_layer": {str(layer): per_layer[layer] for layer in sorted(per_layer)},
    }


def gate_histogram(records: list[GateRecord], bins: int = 20) -> dict:
    """Histogram of the estimated gates of shared heads over [0, 1] in ``bins`` equal bins (a gate of
    exactly 1 falls in the last bin): ``{"edges": [bins + 1], "counts": [bins], "total": n, "exactly_one": m}``
    (``exactly_one``: estimates equal to 1, the only ones tau = 1 skips)."""
    counts = torch.zeros(bins, dtype=torch.long)
    ones = 0
    for record in records:
        values = record.estimate[:, record.shared_q].reshape(-1)
        if values.numel():
            index = (values.clamp(0.0, 1.0) * bins).floor().long().clamp(max=bins - 1)
            counts += torch.bincount(index, minlength=bins)
            ones += int((values >= 1.0).sum())
    return {"edges": [i / bins for i in range(bins + 1)], "counts": counts.tolist(), "total": int(counts.sum()),
            "exactly_one": ones}
