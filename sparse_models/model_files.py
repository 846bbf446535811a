"""Checks of a local model folder before transformers reads it, each problem one line naming the file.

One place for what a loadable folder is, used by every loader: the podkit model classes' ``from_pretrained``
(``modeling_common.py``; so ``train/models.py``, ``eval/models.py`` and ``sparse_models.generate`` too), the
recipe's environment rules for ``model.name_or_path`` (``train/recipe_checks.py``) and ``sparse_models.generate
--model``. A folder must hold a ``config.json`` that parses and names a ``model_type``, and complete weights
(every ``*.safetensors`` header readable and covering its file; a sharded index's shards present).

An export (``train/export.py``) also carries :data:`EXPORT_MANIFEST`, written first (``complete: false``)
and rewritten last with the files the export holds, so a folder whose export was interrupted, or that lost a
file since, is refused with what is missing ("export X is incomplete: no tokenizer files ...; re-run the export
stage") instead of loading and failing later. Folders without the manifest (``save_pretrained`` output,
Trainer checkpoints, exports of older podkit) get the generic checks only. Stdlib only.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

EXPORT_MANIFEST = "podkit_export.json"
EXPORT_FORMAT = "podkit-export"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
RERUN_EXPORT = "re-run the export stage (train/pod.py RECIPE --stages export)"


class ModelPathError(ValueError):
    """A model folder (or Hub id) that cannot be loaded; the message names it, the file and the fix."""


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (8-byte header length, JSON header, data), or None."""
    size = path.stat().st_size
    if size < 8:
        return f"is truncated ({size} bytes, not even the 8-byte header length)"
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            return f"is truncated: its header claims {header_len} bytes but the file holds {size}"
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return f"has an unreadable header ({error})"
    if not isinstance(header, dict):
        return "has an unreadable header (not a JSON object)"
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return (f"is {'truncated' if size < expected else 'longer than its header says'}: the header describes "
                f"{expected} bytes, the file holds {size}")
    return None


def _read_json(path: Path):
    """(data, None) or (None, why the file is not JSON)."""
    try:
        return json.loads(path.read_bytes().decode("utf-8")), None
    except UnicodeDecodeError as error:
        return None, f"{path} is not a JSON text file (not UTF-8: byte {error.object[error.start]:#04x} at offset {error.start})"
    except json.JSONDecodeError as error:
        return None, f"{path} is not valid JSON ({error})"


def _weight_problems(folder: Path) -> list[str]:
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        return [f"{folder} holds no model weights (expected one of {', '.join(WEIGHT_FILES)})"]
    problems, files = [], []
    for index in (name for name in present if name.endswith(".index.json")):
        data, problem = _read_json(folder / index)
        if problem:
            problems.append(problem)
            continue
        shards = sorted(set((data.get("weight_map") or {}).values())) if isinstance(data, dict) else []
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            problems.append(f"{folder / index} lists shards that are missing: {', '.join(missing)}")
        files += [folder / shard for shard in shards if shard not in missing]
    files += [folder / name for name in present if not name.endswith(".index.json")]
    for path in files:
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
            if problem:
                problems.append(f"{path} {problem}")
    return problems


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer_config.json").is_file() and any((folder / n).is_file() for n in TOKENIZER_FILES)


# What every export holds, described for the "incomplete" message: (description, present?)
EXPORT_PARTS = (
    ("no weights (model.safetensors)", lambda f: any((f / n).is_file() for n in WEIGHT_FILES)),
    (f"no tokenizer files (tokenizer_config.json and one of {', '.join(TOKENIZER_FILES)})", _has_tokenizer),
    ("no modeling_podkit.py", lambda f: (f / "modeling_podkit.py").is_file()),
    ("no model card (README.md)", lambda f: (f / "README.md").is_file()),
)


def write_export_manifest(folder: str | os.PathLike, *, complete: bool) -> Path:
    """Write ``folder``'s :data:`EXPORT_MANIFEST` (train/export.py): first with ``complete=False``, last with
    ``complete=True`` and the list of the files the folder then holds (atomic: tmp file + os.replace)."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != EXPORT_MANIFEST) if complete else []
    return write_text_atomically(folder / EXPORT_MANIFEST,
                                 json.dumps({"format": EXPORT_FORMAT, "complete": complete, "files": files}, indent=1)
                                 + "\n")


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write ``path`` through a temporary file of this process in its folder + os.replace: readers, and concurrent
    writers (two pytest workers, two ranks), see the old or the new text, never a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def export_problems(folder: str | os.PathLike) -> list[str]:
    """Why the export at ``folder`` is incomplete (empty: whole, or not an export: no manifest)."""
    folder = Path(folder)
    manifest_path = folder / EXPORT_MANIFEST
    if not manifest_path.is_file():
        return []
    manifest, problem = _read_json(manifest_path)
    if problem or not isinstance(manifest, dict):
        return [f"export {folder} is incomplete: {problem or f'{manifest_path} is not a JSON object'}; {RERUN_EXPORT}"]
    missing = [description for description, present in EXPORT_PARTS if not present(folder)]
    described = set(TOKENIZER_FILES) | set(WEIGHT_FILES) | {"tokenizer_config.json", "modeling_podkit.py", "README.md"}
    listed = [name for name in manifest.get("files") or [] if isinstance(name, str)]
    missing += [f"no {name}" for name in listed if name not in described and not (folder / name).is_file()]
    config, _ = _read_json(folder / "config.json") if (folder / "config.json").is_file() else (None, None)
    if isinstance(config, dict) and "auto_map" not in config:
        missing.append("no auto_map in config.json")
    if not manifest.get("complete"):
        missing.insert(0, f"it was interrupted while being written ({EXPORT_MANIFEST} says complete: false)")
    if not missing:
        return []
    return [f"export {folder} is incomplete: {'; '.join(missing)}; {RERUN_EXPORT}"]


def model_folder_problems(path: str | os.PathLike) -> list[str]:
    """Every reason ``from_pretrained`` could not load the local folder ``path`` (empty: loadable).
    Reads the config, the weights' headers and the export manifest only."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return [f"{folder} does not exist"]
    if not folder.is_dir():
        return [f"{folder} is a file, not a model folder (a folder with config.json and the weights, as "
                f"save_pretrained writes them)"]
    export = export_problems(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        return export or [f"{folder} has no config.json: not a model folder (a folder with config.json and the "
                          f"weights, as save_pretrained writes them)"]
    config, problem = _read_json(config_path)
    problems = []
    if problem:
        problems.append(problem)
    elif not isinstance(config, dict) or not config.get("model_type"):
        problems.append(f"{config_path} names no model_type (e.g. \"llama\"): not a transformers model config")
    weights = _weight_problems(folder)
    if export and not any((folder / name).is_file() for name in WEIGHT_FILES):
        weights = []  # the export's line already says so
    return problems + export + weights


def check_model_folder(path: str | os.PathLike, what: str | None = None) -> Path:
    """``path`` as a Path if it is a loadable model folder, else :class:`ModelPathError` with every problem on
    one line, prefixed by ``what`` (the option that named it, e.g. ``"--model 'x'"``)."""
    problems = model_folder_problems(path)
    if problems:
        raise ModelPathError((f"{what}: " if what else "") + "; ".join(problems))
    return Path(path).expanduser()
