"""``python -m eval.lm_eval ...``: lm-eval's own command line, with the ``podkit`` model registered.

lm-eval 0.4.x has no plugin discovery for models, and builds the model before it reads task code,
so a third-party model needs a wrapper that imports the registering module first and then runs
``lm_eval.__main__.cli_evaluate()`` (environment.md §5). Every lm-eval flag works unchanged.
podkit's local tasks (eval/tasks/*.yaml) are added with ``--include_path`` unless the caller gave one,
and the HF offline switches are set unless the caller set them, so it runs with no network.

    python -m eval.lm_eval run --model podkit --model_args pretrained=default decode_scheme=tidal budget=128 \\
        --tasks podkit_passkey --metadata '{"lengths": [2048], "num_depths": 10}' --device cpu
"""

from __future__ import annotations

import os
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


def main(argv: list[str] | None = None) -> None:
    for name in OFFLINE_VARIABLES:
        os.environ.setdefault(name, "1")
    repo_root = str(TASKS_DIR.parent.parent)
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)  # task code under eval/tasks imports eval.*
    from lm_eval.__main__ import cli_evaluate

    import eval.lm_eval_model  # noqa: F401  (registers "podkit")

    sys.argv = [sys.argv[0]] + with_podkit_tasks(sys.argv[1:] if argv is None else argv)
    cli_evaluate()


if __name__ == "__main__":
    main()
