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


_SIGNED_INTEGER = re.compile(r"[+-]\d+")


def signed_integers_as_typed(model_args: dict, argv: list[str]) -> dict:
    """``model_args`` with each value the user wrote as a signed integer (``tidal_budget=-1``) an int again.

    lm-eval's CLI parser reads a value as an int only when ``str.isnumeric()`` holds, which a sign breaks, so
    ``-1`` arrives as ``-1.0`` and podkit's error would name a value nobody typed. The raw text comes from
    ``argv``: the words after ``--model_args`` up to the next flag, split at commas (the pieces of a list value
    never read as one signed integer, so they are left as lm-eval parsed them)."""
    raw: dict[str, str] = {}
    words = iter(argv)
    for word in words:
        if word.startswith("--model_args="):
            chunks = [word.split("=", 1)[1]]
        elif word == "--model_args":
            chunks = []
            for follow in words:
                if follow.startswith("--"):
                    break
                chunks.append(follow)
        else:
            continue
        for chunk in chunks:
            for item in chunk.split(","):
                key, sep, value = item.partition("=")
                if sep:
                    raw[key.strip()] = value.strip()
    fixed = dict(model_args)
    for key, value in model_args.items():
        if isinstance(value, float) and _SIGNED_INTEGER.fullmatch(raw.get(key, "")):
            fixed[key] = int(raw[key])
    return fixed


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


# podkit's tasks whose ``lengths`` count the prompt alone (eval/tasks/passkey.py, needle.py; their default grid is
# eval.tasks.lm_eval_tasks.DEFAULT_LENGTHS): lm-eval keeps the task's max_gen_toks free for the answer, so a prompt
# fits whole only at lengths <= context - max_gen_toks. RULER's lengths already count the answer
# (train/long_context_eval/ruler.py) and podkit_ppl scores rolling windows, which lm-eval never cuts.
PROMPT_SIZED_TASKS = ("podkit_passkey", "podkit_passkey_text", "podkit_needle")
PROMPT_SIZED_DEFAULT_LENGTHS = (2048, 4096, 8192)


def metadata_lengths(metadata: dict, key: str) -> list[int]:
    """The token counts ``metadata[key]`` gives (a list, one integer or '2048,4096'); [] when absent."""
    wanted = metadata.get(key)
    if wanted is None:
        return []
    items = wanted if isinstance(wanted, (list, tuple)) else str(wanted).replace("[", "").replace("]", "").split(",")
    try:
        return [int(x) for x in items if str(x).strip()]
    except ValueError:
        raise ValueError(f"--metadata {key}={wanted!r} is invalid: expected a list of token counts") from None


def task_answer_tokens(tasks: list[str], gen_kwargs: dict | None = None) -> dict[str, int]:
    """{task: tokens lm-eval keeps free for its answer} for the named tasks of ``PROMPT_SIZED_TASKS`` (a tag such as
    ``podkit_longctx`` names every task file that carries it): the YAML's ``max_gen_toks``, or
    ``--gen_kwargs max_gen_toks=N``, which lm-eval applies to every task."""
    override = (gen_kwargs or {}).get("max_gen_toks")
    answers = {}
    for task in PROMPT_SIZED_TASKS:
        text = (TASKS_DIR / f"{task}.yaml").read_text()
        tags = re.search(r"^tag:\s*\[([^\]]*)\]", text, re.MULTILINE)
        names = {task} | ({t.strip() for t in tags.group(1).split(",")} if tags else set())
        if names & set(tasks):
            answers[task] = int(override if override is not None else
                                re.search(r"^\s+max_gen_toks:\s*(\d+)", text, re.MULTILINE).group(1))
    return answers


def check_context_lengths(model_args: dict, metadata: dict, tasks: list[str] | None = None,
                          gen_kwargs: dict | None = None) -> None:
    """Refuse task lengths beyond the model's context before any work: lm-eval would cut each prompt to its last
    ``max_length - max_gen_toks`` tokens and score that, with one warning among its log lines (``{"lengths":
    [99999]}`` on SmolLM2 ran at 8184 tokens; so did the passkey's default 8192, which leaves no room for the
    answer). ``lengths`` (podkit's tasks) and ``max_seq_lengths`` (lm-eval's RULER) must fit the context; the
    prompt-sized tasks' lengths, given or default, must leave their answer tokens free as well."""
    lengths = metadata_lengths(metadata, "lengths") + metadata_lengths(metadata, "max_seq_lengths")
    answers = task_answer_tokens(list(tasks or []), gen_kwargs)
    if not lengths and not answers:
        return
    limit, source = model_context_limit(model_args)
    if limit is None:
        return
    too_long = [n for n in lengths if n > limit]
    if too_long:
        raise ValueError(f"--metadata lengths {too_long} exceed the model's context ({source}): lm-eval would "
                         f"truncate each prompt to its last tokens and score that; use lengths <= {limit}")
    given = metadata_lengths(metadata, "lengths")
    for task, answer in answers.items():
        fit = limit - answer
        wanted = given or list(PROMPT_SIZED_DEFAULT_LENGTHS)
        too_long = [n for n in wanted if n > fit]
        if too_long:
            which = "--metadata lengths" if given else "default lengths (no --metadata lengths given)"
            fitting = [n for n in wanted if n <= fit] or [fit]
            raise ValueError(f"{task}: {which} {too_long} leave no room for its {answer} answer tokens in the "
                             f"model's context ({source}): lm-eval would cut each prompt to its last {fit} tokens "
                             f"and score that; use lengths <= {fit}, e.g. --metadata '{json.dumps({'lengths': fitting})}'")


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
            model_args = signed_integers_as_typed(dict(getattr(args, "model_args", None) or {}), argv)
            args.model_args = model_args
            eval.harness.lm_eval_model.check_model_args(model_args)
            check_context_lengths(model_args, model_args | dict(getattr(args, "metadata", None) or {}),
                                  list(getattr(args, "tasks", None) or []), getattr(args, "gen_kwargs", None))
        cli.execute(args)
    except (ConfigError, ValueError, FileNotFoundError, NotADirectoryError) as error:
        # lm-eval's own input errors (unknown task, bad --metadata) are ValueErrors too
        print(f"eval.lm_eval: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
