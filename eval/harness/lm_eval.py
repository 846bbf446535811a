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

import json
import os
import re
import sys
from pathlib import Path

from eval.models import is_default_model

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
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
    from sparse_models.smollm2 import default_model_path  # lazy: sparse_models imports torch (seconds)

    folder = str(default_model_path())
    return [_DEFAULT_PRETRAINED.sub(lambda m: f"{m.group(1)}pretrained={folder}", arg) for arg in argv]


def model_context_limit(model_args: dict) -> tuple[int | None, str]:
    """The longest context the podkit model takes: ``max_length`` if the model args give it, else the checkpoint's
    ``max_position_embeddings`` (what HFLM's ``max_length`` resolves to); with where the number comes from."""
    if model_args.get("max_length") is not None:
        return int(model_args["max_length"]), f"max_length={model_args['max_length']}"
    pretrained = str(model_args.get("pretrained", "default"))
    if is_default_model(pretrained):
        from sparse_models.smollm2 import default_model_path  # lazy: sparse_models imports torch (seconds)

        pretrained = str(default_model_path())
    config = Path(pretrained) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"pretrained={pretrained!r} is neither 'default' nor a folder with config.json")
    try:
        limit = json.loads(config.read_text()).get("max_position_embeddings")
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config} is not valid JSON ({error})") from None
    return (int(limit) if limit else None), f"max_position_embeddings={limit} of {pretrained}"


def check_context_lengths(model_args: dict, metadata: dict) -> None:
    """Refuse task lengths (``lengths``, RULER's ``max_seq_lengths``) beyond the model's context before any work:
    lm-eval would cut each prompt to its last ``max_length - max_gen_toks`` tokens and score that, silently
    (``{"lengths": [99999]}`` on SmolLM2 ran at 8184 tokens)."""
    lengths = []
    for key in ("lengths", "max_seq_lengths"):  # podkit's tasks read the first, lm-eval's RULER the second
        wanted = metadata.get(key)
        if wanted is None:
            continue
        try:
            lengths += [int(x) for x in (wanted if isinstance(wanted, (list, tuple)) else
                                         str(wanted).replace("[", "").replace("]", "").split(",")) if str(x).strip()]
        except ValueError:
            raise ValueError(f"--metadata {key}={wanted!r} is invalid: expected a list of token counts") from None
    if not lengths:
        return
    limit, source = model_context_limit(model_args)
    too_long = [n for n in lengths if limit is not None and n > limit]
    if too_long:
        raise ValueError(f"--metadata lengths {too_long} exceed the model's context ({source}): lm-eval would "
                         f"truncate each prompt to its last tokens and score that; use lengths <= {limit}")


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI; a bad argument (model argument, scheme value, task, length, path) is one line on stderr
    and exit status 2, before any work."""
    for name in OFFLINE_VARIABLES:
        os.environ.setdefault(name, "1")
    repo_root = str(TASKS_DIR.parent.parent)
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)  # task code under eval/tasks imports eval.*
    # HarnessCLI: what lm_eval.__main__.cli_evaluate runs, with a check in between
    from lm_eval._cli import HarnessCLI  # lazy: lm-eval is the optional eval extra
    from lm_eval.utils import setup_logging  # lazy: lm-eval is the optional eval extra

    import eval.harness.lm_eval_model  # noqa: F401  (registers "podkit")  lazy: it imports lm-eval
    from sparse_models.config import ConfigError  # lazy: sparse_models imports torch (seconds)

    try:
        argv = resolve_default_pretrained(sys.argv[1:] if argv is None else argv)
        sys.argv = [sys.argv[0]] + with_podkit_tasks(argv)
        setup_logging()
        cli = HarnessCLI()
        args = cli.parse_args()
        if getattr(args, "command", None) == "run" and getattr(args, "model", None) == "podkit":
            model_args = dict(getattr(args, "model_args", None) or {})
            eval.harness.lm_eval_model.check_model_args(model_args)
            check_context_lengths(model_args, model_args | dict(getattr(args, "metadata", None) or {}))
        cli.execute(args)
    except (ConfigError, ValueError, FileNotFoundError, NotADirectoryError) as error:
        # lm-eval's own input errors (unknown task, bad --metadata) are ValueErrors too
        print(f"eval.lm_eval: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
