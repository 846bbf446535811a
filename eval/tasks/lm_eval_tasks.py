"""Dataset builders and scorers for podkit's local lm-eval tasks (the YAML files next to this file).

lm-eval calls ``custom_dataset`` functions with the task metadata, which is the model_args merged
with ``--metadata`` JSON: ``pretrained`` selects the tokenizer that sizes the prompts, and these keys
shape the grid (defaults in brackets):

* ``lengths`` [[2048, 4096, 8192]]: context lengths in tokens (a JSON list, or one integer);
* ``num_depths`` [10]: needle depths from 0 to 1;
* ``samples_per_cell`` [1]; ``seed`` [0]; ``haystack``: "filler" or a book name (per-task default);
* ``ppl_windows`` [2]: perplexity windows per length; ``ppl_text``: the book (default Emma).

Data is generated in memory (no ``data_files`` path to resolve against the CWD).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:  # lm-eval imports this file by path; eval.* lives at the repo root
    sys.path.insert(0, _REPO_ROOT)

from eval.models import load_tokenizer  # noqa: E402  (after the sys.path line above)
from eval.tasks.needle import needle_correct, needle_grid  # noqa: E402
from eval.tasks.passkey import passkey_correct, passkey_grid  # noqa: E402
from eval.tasks.perplexity import perplexity_windows  # noqa: E402
from train.long_context_eval.ruler import TASKS, generate, score  # noqa: E402

DEFAULT_LENGTHS = [2048, 4096, 8192]


def _grid_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    lengths = kwargs.get("lengths", DEFAULT_LENGTHS)
    if isinstance(lengths, (int, str)):
        lengths = [int(x) for x in str(lengths).replace("[", "").replace("]", "").split(",") if x.strip()]
    return {"lengths": [int(x) for x in lengths], "num_depths": int(kwargs.get("num_depths", 10)),
            "samples_per_cell": int(kwargs.get("samples_per_cell", 1)), "seed": int(kwargs.get("seed", 0))}


def _tokenizer(kwargs: dict[str, Any]):
    return load_tokenizer(kwargs.get("tokenizer") or kwargs.get("pretrained") or "default")


def _as_dataset(rows: list[dict[str, Any]]):
    import datasets  # lazy: datasets is optional (lm-eval's)

    return {"test": datasets.Dataset.from_list(rows)}


def passkey_dataset(**kwargs: Any):
    """Passkey prompts over lengths x depths; ``haystack`` defaults to the synthetic filler."""
    samples = passkey_grid(_tokenizer(kwargs), haystack=kwargs.get("haystack", "filler"), **_grid_args(kwargs))
    return _as_dataset([sample.to_dict() for sample in samples])


def passkey_text_dataset(**kwargs: Any):
    """Passkey prompts with a real-text haystack (Moby Dick unless ``haystack`` says otherwise)."""
    return passkey_dataset(**({"haystack": "moby_dick"} | kwargs))


def needle_dataset(**kwargs: Any):
    """Needle-QA prompts; the haystack defaults to Pride and Prejudice."""
    samples = needle_grid(_tokenizer(kwargs), haystack=kwargs.get("haystack", "pride_and_prejudice"),
                          **_grid_args(kwargs))
    return _as_dataset([sample.to_dict() for sample in samples])


def perplexity_dataset(**kwargs: Any):
    """Held-out book windows, one document per window, ``lengths`` tokens each."""
    tokenizer = _tokenizer(kwargs)
    rows = []
    for length in _grid_args(kwargs)["lengths"]:
        for index, ids in enumerate(perplexity_windows(tokenizer, length, int(kwargs.get("ppl_windows", 2)),
                                                       text=kwargs.get("ppl_text"))):
            rows.append({"text": tokenizer.decode(ids), "length": length, "window": index, "num_tokens": len(ids)})
    return _as_dataset(rows)


def process_passkey(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"acc": float(passkey_correct(results[0], doc["passkey"]))}


def process_needle(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"acc": float(needle_correct(results[0], doc["passkey"]))}


def process_perplexity(doc: dict[str, Any], results: list[float]) -> dict[str, Any]:
    (loglikelihood,) = results
    text = doc["text"]
    return {"token_perplexity": (loglikelihood, doc["num_tokens"]),
            "word_perplexity": (loglikelihood, len(text.split())),
            "bits_per_byte": (loglikelihood, len(text.encode("utf-8")))}


def token_perplexity(items: list[tuple[float, int]]) -> float:
    """exp(-sum loglik / sum tokens): perplexity per model token over all windows."""
    return math.exp(-sum(ll for ll, _ in items) / sum(n for _, n in items))


# ---------------------------------------------------------------------------------------------- RULER
# podkit_ruler_<task> (eval/tasks/podkit_ruler_*.yaml, tag podkit_ruler): samples from train.long_context_eval.ruler at
# ``lengths`` (default [4096]; the budget counts prompt + answer tokens), ``num_samples`` per length [20],
# ``seed`` [0]. ``lengths`` and ``num_samples`` can be given as RULER's ``max_seq_lengths`` / ``num_samples``.

RULER_DEFAULT_LENGTHS = [4096]


def ruler_dataset(task: str, **kwargs: Any):
    """One RULER task's samples over ``lengths``; each row has ``input``, ``gen_prefix``, ``outputs``,
    ``max_length`` (the budget it was sized to) and ``task``."""
    lengths = kwargs.get("lengths", kwargs.get("max_seq_lengths", RULER_DEFAULT_LENGTHS))
    lengths = _grid_args({"lengths": lengths})["lengths"]
    num_samples, seed = int(kwargs.get("num_samples", 20)), int(kwargs.get("seed", 0))
    tokenizer = _tokenizer(kwargs)
    rows = []
    for length in lengths:
        rows += [sample.to_dict() for sample in generate(task, tokenizer, length, num_samples, seed)]
    return _as_dataset(rows)


def process_ruler(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """RULER's score of the generation (train.long_context_eval.ruler.score): ``string_match_all``, or ``part`` for QA."""
    return {"score": score(doc["task"], results[0], doc["outputs"])}


def _ruler_builder(task: str):
    def build(**kwargs: Any):
        return ruler_dataset(task, **kwargs)

    build.__name__ = build.__qualname__ = f"ruler_{task}"
    build.__doc__ = f"RULER {task} (see ruler_dataset)."
    return build


def _register_ruler_builders() -> None:
    for task in TASKS:
        globals()[f"ruler_{task}"] = _ruler_builder(task)


_register_ruler_builders()
