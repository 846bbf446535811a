"""Trainer checkpoints: validation before a resume, crash-safe saving, and two resume details.

* :func:`select_resume_checkpoint` runs before any stage of the pipeline (train/pipeline.py). It checks
  the checkpoint that ``train.resume_from_checkpoint`` designates -- every ``*.safetensors`` header is
  readable and covers the file, every JSON parses (``trainer_state.json`` is required), every torch
  pickle (``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, DeepSpeed's ``global_step*/*.pt``) is a
  complete zip archive, and the files the Trainer needs exist (weights, trainer state, optimizer state
  or DeepSpeed's ``latest`` tag). With ``"auto"`` an unusable latest checkpoint is skipped for the
  previous complete one, with a printed line; an explicit path that is unusable raises
  :class:`CheckpointError` naming the file, what is wrong, and the previous complete checkpoint.
* :func:`save_checkpoint_atomically` (called by ``PodTrainer._save_checkpoint``, train/trainer.py)
  lets the Trainer write ``checkpoint-N`` into ``<output_dir>/.checkpoint-staging/`` and renames it
  into place once complete, so a crash mid-save leaves the previous checkpoints usable. The Trainer of
  transformers 5.17 and 5.24 builds the folder as ``os.path.join(self._get_output_dir(trial),
  "checkpoint-N")``; ``PodTrainer._get_output_dir`` returns the staging folder during a save.
* :func:`drop_tied_missing_keys`: a checkpoint of a model with tied embeddings stores ``lm_head.weight``
  once (as the embedding); the Trainer's "missing keys" warning about it is noise.
* :func:`follow_current_schedule`: a resumed run with a larger ``train.max_steps`` continues on the
  learning-rate schedule of the new ``max_steps`` (the restored scheduler state otherwise holds the old
  schedule's last value -- 0 for cosine/linear -- for the first resumed step).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
STAGING_DIR = ".checkpoint-staging"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
TORCH_PICKLES = (".pt", ".pth", ".bin")


class CheckpointError(ValueError):
    """A checkpoint chosen for resuming is unusable (the message names the file and the fix)."""


# ---------------------------------------------------------------------------------------------
# Validation


def _safetensors_problem(path: Path) -> str | None:
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
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return (f"is {'truncated' if size < expected else 'longer than its header says'}: the header describes "
                f"{expected} bytes, the file holds {size}")
    return None


def _zip_problem(path: Path) -> str | None:
    """torch.save writes zip archives: a truncated one has no central directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        return f"is not a complete torch archive ({error}; the save was probably interrupted)"
    return None


def _json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"is not valid JSON ({error}; the save was probably interrupted)"
    return None


def checkpoint_problems(folder: str | os.PathLike) -> list[str]:
    """Every reason the Trainer could not resume from ``folder`` (empty: usable). Reads only headers."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    problems = []
    if not (folder / "trainer_state.json").is_file():
        problems.append(f"{folder / 'trainer_state.json'} is missing (the Trainer needs it to know the step to "
                        f"resume at)")
    latest = folder / "latest"  # DeepSpeed's tag file: model + optimizer state under global_step*/
    if not latest.is_file() and not any((folder / name).is_file() for name in WEIGHT_FILES):
        problems.append(f"{folder} holds no model weights (expected one of {', '.join(WEIGHT_FILES)})")
    if latest.is_file():
        tag = latest.read_text().strip()
        if not tag or not (folder / tag).is_dir():
            problems.append(f"{latest} names {tag!r}, but {folder / tag} does not exist (DeepSpeed state missing)")
    elif not (folder / "optimizer.pt").is_file():
        problems.append(f"{folder / 'optimizer.pt'} is missing (and no DeepSpeed 'latest' tag): no optimizer state")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.suffix == ".safetensors":
            problem = _safetensors_problem(path)
        elif path.suffix == ".json":
            problem = _json_problem(path)
        elif path.suffix in TORCH_PICKLES and path.name != "training_args.bin":
            problem = _zip_problem(path)
        else:
            continue
        if problem:
            problems.append(f"{path} {problem}")
    return problems


def checkpoints_in(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir``, latest (highest N) first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_NAME.match(p.name).group(1)), reverse=True)


def _previous_complete(chosen: Path) -> Path | None:
    match = CHECKPOINT_NAME.match(chosen.name)
    step = int(match.group(1)) if match else None
    for candidate in checkpoints_in(chosen.parent):
        if (step is None or int(CHECKPOINT_NAME.match(candidate.name).group(1)) < step) \
                and not checkpoint_problems(candidate):
            return candidate
    return None


def select_resume_checkpoint(resume: str | None, output_dir: str | os.PathLike, log=print) -> str | None:
    """The checkpoint to resume from, validated; ``resume`` is ``train.resume_from_checkpoint``.

    ``None`` -> None. ``"auto"`` -> the latest complete ``checkpoint-N`` of ``output_dir`` (None when there
    is none at all); unusable later ones are skipped with a printed line. A path -> that path if usable.
    Raises :class:`CheckpointError` (naming files and the previous complete checkpoint) otherwise.
    """
    if resume is None:
        return None
    if resume == "auto":
        candidates = checkpoints_in(output_dir)
        skipped = []
        for candidate in candidates:
            problems = checkpoint_problems(candidate)
            if not problems:
                for name, reason in skipped:
                    log(f"[train] {name} is unusable ({reason}); resuming from {candidate} instead, the latest "
                        f"complete checkpoint")
                return str(candidate)
            skipped.append((candidate.name, "; ".join(problems)))
        if skipped:
            lines = "\n".join(f"  {name}: {reason}" for name, reason in skipped)
            raise CheckpointError(f"train.resume_from_checkpoint='auto': no complete checkpoint in {output_dir}:\n"
                                  f"{lines}\nDelete the broken folders and resume again, or set "
                                  f"train.resume_from_checkpoint=null to start over")
        return None
    chosen = Path(resume).expanduser()
    problems = checkpoint_problems(chosen)
    if not problems:
        return str(chosen)
    previous = _previous_complete(chosen) if chosen.is_dir() else None
    offer = (f"resume from the previous complete checkpoint with train.resume_from_checkpoint={previous} "
             f"(or 'auto', which skips broken checkpoints)" if previous else
             "no earlier complete checkpoint exists next to it; set train.resume_from_checkpoint=null to start over")
    raise CheckpointError(f"train.resume_from_checkpoint={resume!r} is unusable:\n"
                          + "\n".join(f"  {p}" for p in problems) + f"\n{offer}")


# ---------------------------------------------------------------------------------------------
# Crash-safe saving


def save_checkpoint_atomically(trainer, save, trial=None) -> None:
    """Run the Trainer's ``_save_checkpoint`` (``save()``) into a staging folder, then rename into place.

    Every rank writes its part (DeepSpeed shards) into ``<run_dir>/.checkpoint-staging/checkpoint-N``;
    after a barrier, the process that saves for the Trainer (``args.should_save``: the global main process,
    or each node's main one with ``save_on_each_node``, the Trainer's own file-system convention) renames
    it to ``<run_dir>/checkpoint-N`` (a rename within one file system is atomic), replacing a previous
    folder of the same name only once the new one is complete. Old checkpoints are rotated afterwards, as
    the Trainer would (``save_total_limit``).
    """
    from transformers.trainer_utils import rotate_checkpoints

    args = trainer.args
    run_dir = Path(trainer._get_output_dir(trial=trial))
    name = f"checkpoint-{trainer.state.global_step}"
    staging = run_dir / STAGING_DIR
    owner = args.should_save  # exactly one process per file system renames (two would race)
    if owner and (staging / name).exists():
        shutil.rmtree(staging / name)  # left by a crash mid-save
    trainer.accelerator.wait_for_everyone()
    trainer._checkpoint_staging = str(staging)
    try:
        save()
    finally:
        trainer._checkpoint_staging = None
    trainer.accelerator.wait_for_everyone()
    if owner and (staging / name).exists():
        final = run_dir / name
        replaced = run_dir / f"{STAGING_DIR}-replaced-{name}"
        if final.exists():
            if replaced.exists():
                shutil.rmtree(replaced)
            os.replace(final, replaced)
        os.replace(staging / name, final)
        shutil.rmtree(replaced, ignore_errors=True)
        try:
            staging.rmdir()
        except OSError:
            pass  # another rank's leftovers or a concurrent save: keep the folder
    trainer.accelerator.wait_for_everyone()
    if owner:
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


# ---------------------------------------------------------------------------------------------
# Resume details


def drop_tied_missing_keys(model, load_result):
    """``load_result`` without the missing keys whose parameter is tied to a loaded one.

    A model with tied embeddings saves the shared tensor once (``model.embed_tokens.weight``), so
    ``load_state_dict(strict=False)`` reports ``lm_head.weight`` as missing although it is loaded through
    the tie. ``load_result``: torch's ``_IncompatibleKeys`` (missing_keys, unexpected_keys).
    """
    missing = list(getattr(load_result, "missing_keys", []) or [])
    if not missing:
        return load_result
    by_name = dict(model.named_parameters(remove_duplicate=False))
    holders: dict[int, set[str]] = {}
    for name, param in by_name.items():
        holders.setdefault(id(param), set()).add(name)
    missing_set = set(missing)
    kept = [key for key in missing if key not in by_name or not (holders[id(by_name[key])] - missing_set)]
    if len(kept) == len(missing):
        return load_result
    return load_result._replace(missing_keys=kept)


def follow_current_schedule(scheduler, log=print) -> bool:
    """Set the optimizer's learning rates to the current schedule at the restored step.

    ``scheduler``: a ``LambdaLR`` whose lambdas were built for this run's ``max_steps`` and whose state
    (``last_epoch``, ``_last_lr``) was just restored from the checkpoint. torch restores the last
    learning rate into the optimizer, which belongs to the *old* schedule: a run resumed with a larger
    ``max_steps`` would train its first step at the old schedule's end value (0 for cosine / linear)
    and jump onto the new curve one step later. Returns whether anything changed (logged).
    """
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if not lambdas or not hasattr(scheduler, "base_lrs"):
        return False
    step = scheduler.last_epoch
    new = [base * fn(step) for base, fn in zip(scheduler.base_lrs, lambdas)]
    groups = scheduler.optimizer.param_groups
    old = [group["lr"] for group in groups]
    if all(abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1e-30) for a, b in zip(old, new)):
        return False
    for group, lr in zip(groups, new):
        group["lr"] = lr
    scheduler._last_lr = list(new)
    log(f"[train] learning-rate schedule: resumed at step {step} onto this run's schedule "
        f"(train.max_steps / epochs changed): lr {old[0]:.3g} -> {new[0]:.3g}")
    return True
