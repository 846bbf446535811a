"""The POD adaptation recipe: a YAML file with sections model / pod / data / train / deepspeed / hub / eval.

A recipe is read (``load_recipe``), ``key=value`` overrides are applied (``section.field=value``,
the value parsed as a YAML scalar), and the whole thing is validated *before* anything heavy
starts. Validation collects every problem it can find -- unknown keys, wrong types, out-of-range
values, impossible combinations, missing files, an unwritable output directory, a context length
above the model's positions without rope scaling -- and raises one :class:`RecipeError` whose
``problems`` are one actionable line each: type errors, value errors and environment problems come
in the same pass (a field with the wrong type is judged by no later rule). Nothing is written while
validating.

Three files: the schema and its coercion (``train/recipe_schema.py``), the rules
(``train/recipe_checks.py``: ``check_values`` and ``check_environment``), and this one, which reads,
overrides and runs them in one pass. Input path rules live in ``train/inputs.py``.

Paths in a recipe (``model.name_or_path`` when local, ``pod.blocks_file``, ``data.*`` local files,
``deepspeed.config``, ``train.output_dir``) are resolved against the current directory first and,
for inputs that do not exist there, against the repository root, so ``recipes/deepspeed/zero3.json``
works from anywhere inside a checkout.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from train import recipe_checks
from train.inputs import (  # noqa: F401  (re-exported: the recipe's public names)
    EMBEDDED_DATA_PREFIX,
    EMBEDDED_MODEL,
    EMBEDDED_MODEL_MAX_POSITIONS,
    REPO_ROOT,
    looks_like_local_path,
    resolve_input_path,
)
from train.recipe_schema import (  # noqa: F401  (re-exported)
    DTYPES,
    LORA_DEFAULT_TARGETS,
    SECTIONS,
    DataSection,
    DeepSpeedSection,
    EvalSection,
    HubSection,
    ModelSection,
    PodSection,
    Recipe,
    RecipeError,
    TrainSection,
    build_section,
    suggest,
)

# ---------------------------------------------------------------------------------------------
# Loading and overrides


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None, *, check_environment: bool = True) -> Recipe:
    """Read, override and validate a recipe. Raises :class:`RecipeError` listing every problem."""
    path = Path(path)
    if path.is_dir():
        found = sorted(str(p) for p in path.glob("*.yaml"))[:6]
        raise RecipeError([f"recipe {str(path)!r} is a folder, not a file: pass the path of a YAML recipe"
                           + (f", e.g. {', '.join(found)}" if found else " (see recipes/)")])
    if not path.is_file():
        raise RecipeError([f"recipe file {str(path)!r} does not exist: pass the path of a YAML recipe (see recipes/)"])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise RecipeError([f"recipe file {str(path)!r} is not a text file (not UTF-8: byte "
                           f"{error.object[error.start]:#04x} at offset {error.start}): pass a YAML recipe"]) from None
    except OSError as error:
        raise RecipeError([f"recipe file {str(path)!r} cannot be read ({error.strerror or error})"]) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise RecipeError([f"recipe file {str(path)!r} is not valid YAML: {error}"]) from None
    return recipe_from_dict(data, overrides, source_path=str(path), check_environment=check_environment)


def recipe_from_dict(data: Any, overrides: list[str] | None = None, *, source_path: str | None = None,
                     check_environment: bool = True) -> Recipe:
    """Build and validate a :class:`Recipe` from plain data (see :func:`load_recipe`)."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise RecipeError([f"the recipe must be a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}"])
    data = {key: (dict(value) if isinstance(value, dict) else value) for key, value in data.items()}
    for override in overrides or []:
        _apply_override(data, override, problems)
    recipe = Recipe(source_path=source_path)
    for key, value in data.items():
        if key not in SECTIONS:
            problems.append(f"unknown section {key!r}{suggest(key, SECTIONS)}; allowed sections: {', '.join(SECTIONS)}")
            continue
        if value is None:
            continue
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping of fields, got {type(value).__name__} {value!r}")
            continue
        setattr(recipe, key, build_section(key, SECTIONS[key], value, problems))
    # One pass reports everything: value and environment rules run on the fields that parsed (a field
    # with a wrong type keeps its default), and drop what repeats a field already reported.
    _extend_unreported(problems, recipe_checks.check_values, recipe)
    if check_environment:
        _extend_unreported(problems, recipe_checks.check_environment, recipe)
    if problems:
        raise RecipeError(problems)
    return recipe


_SUBJECT = re.compile(r"^([a-z_]+\.[a-z_0-9]+)\b")


def _extend_unreported(problems: list[str], check, recipe: "Recipe") -> None:
    """Run ``check(recipe, found)`` and add its problems, except those about a field already reported
    (a line starting with that ``section.field``, or mentioning a field whose value had the wrong type:
    the rule saw the default instead of the user's value)."""
    reported = {m.group(1) for m in map(_SUBJECT.match, problems) if m}
    mistyped = {m.group(1) for p in problems if ": expected" in p and (m := _SUBJECT.match(p))
                and "unknown field" not in p}
    found: list[str] = []
    check(recipe, found)
    for problem in found:
        subject = _SUBJECT.match(problem)
        if subject and subject.group(1) in reported:
            continue
        if any(re.search(rf"\b{re.escape(key)}\b", problem) for key in mistyped):
            continue
        problems.append(problem)


def _apply_override(data: dict, override: str, problems: list[str]) -> None:
    if "=" not in override:
        problems.append(f"override {override!r}: expected section.field=value, e.g. train.max_steps=10")
        return
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        problems.append(f"override {override!r}: expected section.field=value with one dot, e.g. pod.delta=0.6")
        return
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    section, name = parts
    current = data.get(section)
    if current is None:
        current = data[section] = {}
    if not isinstance(current, dict):
        problems.append(f"override {override!r}: section {section!r} is not a mapping in the recipe")
        return
    current[name] = value
