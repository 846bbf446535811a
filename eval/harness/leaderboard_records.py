"""The RULER leaderboard's record format, shared by podkit's sweep (eval/harness/leaderboard.py) and the peers'
runner (eval/harness/peers_kvpress.py, which runs in its own virtualenv): standard library only.

One JSON line per (setting, task, length, sample index, seed)::

    {"source": "podkit" | "kvpress", "setting": "tidal@1/8", "method": "tidal", "task": "niah_single_1",
     "category": "retrieval", "length": 4096, "index": 0, "seed": 0, "score": 1.0,
     "generation": "...", "outputs": ["..."], "prompt_tokens": 3870, "kv_kept": 1.0, "kv_read": 0.13,
     "budget": 512, "compression_ratio": null, "seconds": 2.1, "device": "...", "model": "..."}

``kv_kept``: fraction of the context's KV cache held in memory after prefill; ``kv_read``: fraction of it
that one generated token's attention reads, both averaged over layers and KV heads (1 = dense). kvpress
presses evict at prefill (kept = read = 1 - compression ratio); podkit's decode schemes keep everything
and read a budget per step (e.g. TidalDecode, Quest, StreamingLLM), POD keeps fewer keys and reads all positions.

Each source appends to its own ``records*.jsonl`` in the output folder; :func:`load_all` merges them (a
later line with the same key replaces an earlier one, so a rerun can overwrite), and a rerun skips the
keys already there (:func:`record_key`), so a sweep resumes where it stopped.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

REQUIRED = ("source", "setting", "method", "task", "category", "length", "index", "seed", "score", "kv_kept",
            "kv_read")


def record_key(record: dict) -> tuple:
    return (record["setting"], record["task"], int(record["length"]), int(record["index"]), int(record["seed"]))


def check_record(record: dict) -> dict:
    """``record`` if it has every required field with a valid value; else ValueError naming the field."""
    missing = [name for name in REQUIRED if name not in record]
    if missing:
        raise ValueError(f"leaderboard record {record.get('setting')}/{record.get('task')} lacks {', '.join(missing)}")
    for name in ("score", "kv_kept", "kv_read"):
        value = record[name]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1 or math.isnan(value):
            raise ValueError(f"leaderboard record field {name}={value!r} is invalid: expected a number in [0, 1]")
    return record


class RecordFile:
    """Append-only JSONL of records; ``done`` holds the keys already written (resume)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records = load(self.path)
        self.done = {record_key(r) for r in self.records}

    def append(self, record: dict) -> None:
        check_record(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.records.append(record)
        self.done.add(record_key(record))


def load(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a killed run: the sample is redone on resume
            print(f"warning: {path}:{number} is not JSON (an interrupted write?): skipped")
    return records


def load_all(folder: str | Path) -> list[dict]:
    """Every record of every ``records*.jsonl`` in ``folder``, merged by key (later lines win)."""
    merged: dict[tuple, dict] = {}
    for path in sorted(Path(folder).glob("records*.jsonl")):
        for record in load(path):
            merged[record_key(check_record(record))] = record
    return list(merged.values())


def summarise(records: Iterable[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """``summary[setting][length]``: per-task mean score (0-100), the RULER average over the tasks present
    (each task weighs the same), per-category means, mean ``kv_kept`` / ``kv_read``, samples, source."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["setting"], int(record["length"]))].append(record)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for (setting, length), rows in sorted(groups.items()):
        by_task: dict[str, list[float]] = defaultdict(list)
        categories: dict[str, str] = {}
        for row in rows:
            by_task[row["task"]].append(row["score"])
            categories[row["task"]] = row["category"]
        tasks = {task: 100 * sum(scores) / len(scores) for task, scores in sorted(by_task.items())}
        by_category: dict[str, list[float]] = defaultdict(list)
        for task, value in tasks.items():
            by_category[categories[task]].append(value)
        summary.setdefault(setting, {})[str(length)] = {
            "average": sum(tasks.values()) / len(tasks), "tasks": tasks,
            "categories": {name: sum(v) / len(v) for name, v in sorted(by_category.items())},
            "categories_of": dict(sorted(categories.items())),
            "kv_kept": sum(r["kv_kept"] for r in rows) / len(rows),
            "kv_read": sum(r["kv_read"] for r in rows) / len(rows),
            "n": len(rows), "source": rows[0]["source"], "method": rows[0]["method"],
            "compression_ratio": rows[0].get("compression_ratio"), "budget": rows[0].get("budget"),
        }
    return summary


def _sample(record: dict) -> tuple[str, int, int]:
    """The sample a record scored: (task, index, seed)."""
    return record["task"], int(record["index"]), int(record["seed"])


def common_samples(records: Iterable[dict], reference: str = "dense",
                   threshold: float = 10.0) -> dict[str, dict[str, Any]]:
    """The board on the samples every row has scored, per length, so that rows cut short (a time limit, a
    slow press) are compared with the others on the same samples rather than on their own subsets.

    ``common[length]``: ``tasks``, every task some row ran at that length; ``incomplete``, the rows with no
    sample of some of those tasks, left out so that one partial row does not empty the view, each as
    ``{"missing": [tasks], "n", "average", "reference_average"}`` (the row and the reference on the samples
    both scored; without a reference, the row on all its samples and ``None``); ``samples`` (``{task: [[index, seed], ...]}``), the samples
    that every other row (``rows``) has scored, ``n`` of them; ``summary``, :func:`summarise` of each of
    those rows on exactly those samples (plus ``delta``, its average minus the reference's);
    ``reference``, the row compared with (``None`` if it is not among ``rows``); ``losses``,
    :func:`losses` on that view."""
    by_length: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_length[int(record["length"])].append(record)
    common: dict[str, dict[str, Any]] = {}
    for length, rows in sorted(by_length.items()):
        scored: dict[str, set[tuple[str, int, int]]] = defaultdict(set)
        for record in rows:
            scored[record["setting"]].add(_sample(record))
        tasks = {task for keys in scored.values() for task, _, _ in keys}
        incomplete = {setting: sorted(tasks - {task for task, _, _ in keys})
                      for setting, keys in sorted(scored.items())}
        incomplete = {setting: missing for setting, missing in incomplete.items() if missing}
        complete = sorted(setting for setting in scored if setting not in incomplete)
        shared = set.intersection(*(scored[s] for s in complete)) if complete else set()
        summary = summarise(r for r in rows if r["setting"] in complete and _sample(r) in shared)
        base = summary.get(reference, {}).get(str(length))
        for lengths in summary.values():
            entry = lengths[str(length)]
            entry["delta"] = entry["average"] - base["average"] if base else None
        for setting, missing in list(incomplete.items()):
            paired = scored[setting] & scored[reference] if reference in scored else scored[setting]
            pair = summarise(r for r in rows if r["setting"] in (setting, reference) and _sample(r) in paired)
            incomplete[setting] = {
                "missing": missing, "n": len(paired),
                "average": pair[setting][str(length)]["average"] if setting in pair else None,
                "reference_average": pair[reference][str(length)]["average"] if reference in pair else None}
        samples: dict[str, list[list[int]]] = defaultdict(list)
        for task, index, seed in sorted(shared):
            samples[task].append([index, seed])
        common[str(length)] = {
            "n": len(shared), "tasks": sorted(tasks), "rows": complete if shared else [],
            "incomplete": incomplete, "reference": reference if base else None, "samples": dict(samples),
            "summary": {setting: lengths[str(length)] for setting, lengths in summary.items()},
            "losses": losses(summary, reference, threshold),
        }
    return common


def losses(summary: dict, reference: str = "dense", threshold: float = 10.0) -> list[str]:
    """For each (setting, length) more than ``threshold`` points below ``reference`` on the tasks both ran:
    which RULER task categories (retrieval, multi-hop tracing, aggregation, question answering) it loses,
    largest loss first."""
    lines = []
    for setting, lengths in summary.items():
        if setting == reference:
            continue
        for length, entry in lengths.items():
            base = summary.get(reference, {}).get(length)
            common = sorted(set(entry["tasks"]) & set(base["tasks"])) if base else []
            if not common:
                continue
            mine = sum(entry["tasks"][t] for t in common) / len(common)
            theirs = sum(base["tasks"][t] for t in common) / len(common)
            if theirs - mine <= threshold:
                continue
            drops = []
            for category in sorted({entry["categories_of"][t] for t in common}):
                tasks = [t for t in common if entry["categories_of"][t] == category]
                drop = sum(base["tasks"][t] - entry["tasks"][t] for t in tasks) / len(tasks)
                if drop > 0:
                    drops.append((drop, category))
            detail = ", ".join(f"{c} {-d:+.0f}" for d, c in sorted(drops, reverse=True))
            lines.append(f"- {setting} at {length}: {mine:.1f} vs {reference} {theirs:.1f} on {len(common)} tasks "
                         f"({detail})")
    return lines
