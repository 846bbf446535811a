"""``python -m eval.lm_eval ...``: lm-eval's own command line, with the ``podkit`` model registered.

lm-eval 0.4.x has no plugin discovery for models, and builds the model before it reads task code,
so a third-party model needs a wrapper that imports the registering module first and then runs
``lm_eval.__main__.cli_evaluate()`` (lm-eval 0.4.x's own CLI). Every lm-eval flag works unchanged.
podkit's local tasks (eval/tasks/*.yaml) are added with ``--include_path`` unless the caller gave one,
and the HF offline switches are set unless the caller set them, so it runs with no network. ``pretrained=default`` is rewritten to the converted SmolLM2 folder
so that task code reading a tokenizer from the model args (RULER) works too.

    python -m eval.lm_eval run --model podkit --model_args pretrained=default decode_scheme=tidal budget=128 \\
        --tasks podkit_passkey --metadata '{"lengths": [2048], "num_depths": 10}' --device cpu
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def with_podkit_tasks(argv: list[str]) -> list[str]:
    """``argv`` plus ``--include_path eval/tasks`` if it names no include path (and isn't a bare help call)."""
    if any(arg == "--include_path" or arg.startswith("--include_path=") for arg in argv):
        return list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        return list(argv)
    if argv[0] in ("ls", "validate", "run") or any(arg.startswith("--") for arg in argv):
        return list(argv) + ["--include_path", str(TASKS_DIR)]
    return list(argv)


_DEFAULT_PRETRAINED = re.compile(r"(^|,)pretrained=(default|smollm2|smollm2-135m-instruct)(?=,|$)", re.IGNORECASE)


def resolve_default_pretrained(argv: list[str]) -> list[str]:
    """``pretrained=default`` -> the converted SmolLM2 folder, so that task code that loads a tokenizer
    from ``pretrained`` (lm-eval's RULER tasks, via the metadata) finds a real folder."""
    if not any(_DEFAULT_PRETRAINED.search(arg) for arg in argv):
        return list(argv)
    from sparse_models.smollm2 import default_model_path

    folder = str(default_model_path())
    return [_DEFAULT_PRETRAINED.sub(lambda m: f"{m.group(1)}pretrained={folder}", arg) for arg in argv]


def main(argv: list[str] | None = None) -> None:
    for name in OFFLINE_VARIABLES:
        os.environ.setdefault(name, "1")
    repo_root = str(TASKS_DIR.parent.parent)
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)  # task code under eval/tasks imports eval.*
    from lm_eval.__main__ import cli_evaluate

    import eval.lm_eval_model  # noqa: F401  (registers "podkit")

    argv = resolve_default_pretrained(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0]] + with_podkit_tasks(argv)
    cli_evaluate()


if __name__ == "__main__":
    main()
