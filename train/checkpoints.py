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
* The same crash-safe pieces for other folders and files: :func:`replace_folder` (the rename above),
  :func:`staged_folder` (the export, train/export.py, is written into ``.<name>-staging`` next to it and renamed
  into place once whole), :func:`copy_file_atomically` and ``sparse_models.model_files.write_text_atomically`` (tmp
  file + os.replace: the eval stage's writes into a finished export).
* A full disk: :func:`checkpoint_size_estimate` (weights + optimizer state from the parameters) and
  :func:`free_space_check` stop a run before training when ``train.output_dir`` cannot hold one checkpoint;
  a save that fails on a full disk anyway raises :class:`StorageError` (one line naming the path; the staged
  half is removed, the previous checkpoint kept). :func:`make_folder` turns an output folder that cannot be
  created into the same one-line error. train/pod.py prints these and exits 2.
* :func:`drop_tied_missing_keys`: a checkpoint of a model with tied embeddings stores ``lm_head.weight``
  once (as the embedding); the Trainer's "missing keys" warning about it is noise.
* :func:`follow_current_schedule`: a resumed run with a larger ``train.max_steps`` continues on the
  learning-rate schedule of the new ``max_steps`` (the restored scheduler state otherwise holds the old
  schedule's last value -- 0 for cosine/linear -- for the first resumed step).
* Run records: :func:`prepare_loss_log` makes ``losses.jsonl`` hold one run (a fresh run keeps the previous log
  as ``losses.previous.jsonl``; a resume cuts it back to the checkpoint's step), :func:`with_whole_run_loss`
  gives the final train loss over all of its steps, and :func:`lock_output_dir` (``fcntl.flock`` on
  ``<output_dir>/.lock``, taken by the pipeline's rank 0) refuses a second run into the same folder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

from sparse_models.model_files import safetensors_problem

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
STAGING_DIR = ".checkpoint-staging"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
TORCH_PICKLES = (".pt", ".pth", ".bin")


class CheckpointError(ValueError):
    """A checkpoint chosen for resuming is unusable (the message names the file and the fix)."""


# ---------------------------------------------------------------------------------------------
# Validation


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
            problem = safetensors_problem(path)
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


class StorageError(RuntimeError):
    """A folder podkit writes to cannot be created or has no room; one line naming the path and the fix
    (train/pod.py prints it and exits 2)."""


ENOSPC_MARKERS = ("no space left on device", "os error 28", "disk quota exceeded", "storagefull")


def out_of_space(error: BaseException, folder: str | os.PathLike) -> bool:
    """Whether ``error``, raised while writing into ``folder``, is a full disk. OSError carries ENOSPC; safetensors
    raises SafetensorError("... No space left on device (os error 28)"); torch.save only a RuntimeError about a
    file position, so a nearly full file system (under 1 MiB available) counts too."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(marker in str(seen).lower() for marker in ENOSPC_MARKERS):
            return True
        seen = seen.__cause__ or seen.__context__
    return free_bytes(folder) < 2 ** 20


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def free_bytes(folder: str | os.PathLike) -> int:
    """Bytes available to this user on the file system of ``folder`` (or of its nearest existing parent)."""
    probe = Path(folder).expanduser().absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def make_folder(path: str | os.PathLike, key: str) -> Path:
    """``path`` created (with its parents) or :class:`StorageError` naming ``key`` (the recipe field) and why."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        where = f" ({error.filename})" if error.filename and str(error.filename) != str(path) else ""
        raise StorageError(f"{key}={str(path)!r} cannot be created: {error.strerror or error}{where}; choose a "
                           f"folder you can write to") from None
    return path


def replace_folder(new: Path, final: Path, aside: Path | None = None) -> None:
    """Rename the complete folder ``new`` to ``final`` (same file system: each rename is atomic). A previous
    ``final`` is moved to ``aside`` first and removed only once ``new`` is in place."""
    new, final = Path(new), Path(final)
    aside = Path(aside) if aside is not None else final.with_name(f".{final.name}-replaced")
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
    os.replace(new, final)
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(final: str | os.PathLike, key: str):
    """Yield an empty staging folder next to ``final`` (``.<name>-staging``, same file system); when the block
    ends normally it replaces ``final`` (:func:`replace_folder`), so ``final`` is the previous complete folder
    until then. An exception removes the staging folder (a full disk becomes :class:`StorageError`); a killed
    process leaves it, and the next call clears it."""
    final = Path(final).expanduser()
    parent = make_folder(final.parent, key)
    staging = parent / f".{final.name}-staging"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        yield staging
    except Exception as error:
        full = out_of_space(error, staging)
        shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise StorageError(f"writing {getattr(error, 'filename', None) or staging} failed: no space left on the "
                               f"device ({_describe(error)}); {final} was not replaced"
                               + (" (the previous one is kept)" if final.exists() else "")
                               + f"; free space there or choose another {key}") from None
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_folder(staging, final)


def copy_file_atomically(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """shutil.copy2 through a temporary file next to ``target`` + os.replace."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        shutil.copy2(source, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


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
    except Exception as error:
        if not out_of_space(error, staging):
            raise
        shutil.rmtree(staging / name, ignore_errors=True)  # the space it took, back for the next try
        with contextlib.suppress(OSError):
            staging.rmdir()
        kept = next((c for c in checkpoints_in(run_dir) if not checkpoint_problems(c)), None)
        raise StorageError(f"writing {getattr(error, 'filename', None) or staging / name} failed: no space left on "
                           f"the device ({_describe(error)}); {name} was not saved; "
                           + (f"the previous checkpoint {kept} is kept" if kept else "no earlier checkpoint exists")
                           + f"; free space in {run_dir} (or choose another train.output_dir) and resume with "
                           f"train.resume_from_checkpoint=auto") from None
    finally:
        trainer._checkpoint_staging = None
    trainer.accelerator.wait_for_everyone()
    if owner and (staging / name).exists():
        replace_folder(staging / name, run_dir / name, aside=run_dir / f"{STAGING_DIR}-replaced-{name}")
        try:
            staging.rmdir()
        except OSError:
            pass  # another rank's leftovers or a concurrent save: keep the folder
    trainer.accelerator.wait_for_everyone()
    if owner:
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


# ---------------------------------------------------------------------------------------------
# Free space before training


def checkpoint_size_estimate(model, *, deepspeed: bool, lora: bool) -> dict:
    """Bytes of one ``checkpoint-N`` of ``model`` (after LoRA wrapping), from its parameters.

    ``weights``: what the Trainer saves as the model (the adapter alone for LoRA), in each parameter's dtype.
    ``optimizer``: AdamW's state, two moments per trainable parameter in its dtype (``optimizer.pt``); under
    DeepSpeed the ZeRO optimizer states (fp32 master weights + two fp32 moments, 12 bytes per trainable
    parameter) plus the module states saved beside the weights (another copy of them). ZeRO-3 partitions report
    their full size (``ds_numel``). Small files (trainer state, scheduler, RNG) are left out.
    """
    weights = optimizer = 0
    for param in model.parameters():
        numel = int(getattr(param, "ds_numel", 0) or param.numel())
        size = numel * param.element_size()
        if param.requires_grad:
            optimizer += 12 * numel if deepspeed else 2 * size
        if param.requires_grad or not lora:
            weights += size
    total = weights * (2 if deepspeed else 1) + optimizer
    return {"weights": weights, "optimizer": optimizer, "total": total}


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def free_space_check(output_dir: str | os.PathLike, estimate: dict, *, saves: int,
                     keep: int | None) -> tuple[str | None, str | None]:
    """(problem, warning) about the free space in ``output_dir`` for a run that saves ``saves`` checkpoints,
    ``keep`` of them at once (``train.save_total_limit``; one more exists while a save is renamed into place),
    then ``trained/`` (the weights). The problem (training cannot save even once) stops the run before it
    starts; the warning (the whole run may not fit) is printed."""
    free = free_bytes(output_dir)
    first = estimate["total"] if saves else estimate["weights"]
    at_once = min(saves, keep + 1) if keep else saves
    peak = estimate["total"] * at_once + estimate["weights"]
    what = (f"one checkpoint needs about {_size(estimate['total'])} ({_size(estimate['weights'])} of weights + "
            f"{_size(estimate['optimizer'])} of optimizer state)" if saves else
            f"the trained weights need about {_size(estimate['weights'])}")
    if free < first:
        return (f"train.output_dir={str(output_dir)!r} has {_size(free)} free but {what}: free space there or "
                f"choose another train.output_dir (nothing was trained)"), None
    if free < peak:
        return None, (f"[train] warning: train.output_dir has {_size(free)} free; {at_once} checkpoint(s) at once "
                      f"and trained/ need about {_size(peak)} ({what}): the run may stop on a full disk (lower "
                      f"train.save_total_limit or free space)")
    return None, None


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


# ---------------------------------------------------------------------------------------------
# Run records: losses.jsonl holds one run, and one run at a time per output_dir

LOSS_LOG = "losses.jsonl"
PREVIOUS_LOSS_LOG = "losses.previous.jsonl"
LOCK_FILE = ".lock"


class OutputDirInUse(CheckpointError):
    """Another run holds ``train.output_dir``'s lock (:func:`lock_output_dir`)."""


def checkpoint_step(checkpoint: str | os.PathLike) -> int:
    """The optimizer step a checkpoint was saved at: ``trainer_state.json``'s ``global_step``, else its name."""
    folder = Path(checkpoint)
    try:
        return int(json.loads((folder / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        match = CHECKPOINT_NAME.match(folder.name)
        if match:
            return int(match.group(1))
        raise CheckpointError(f"{folder}: cannot tell the step it was saved at (trainer_state.json has no "
                              f"global_step and the folder is not named checkpoint-N)") from None


def read_loss_log(path: str | os.PathLike) -> list[dict]:
    """The records of a ``losses.jsonl``, one per step (the last record of a step wins; a line cut by a killed run
    is skipped), in step order."""
    path = Path(path)
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "loss" in record:
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def prepare_loss_log(path: str | os.PathLike, resume: str | os.PathLike | None, log=print) -> None:
    """Make ``losses.jsonl`` hold this run's steps only, before its first step (``PodTrainer.train``, rank 0).

    A fresh run (``resume`` None) starts a fresh log: an earlier run's log in the same output_dir is kept as
    ``losses.previous.jsonl`` (replacing an older one); the run itself starts over, as it always has, its
    checkpoints replacing the earlier run's. A resumed run keeps the records up to the checkpoint's step and drops
    the later ones (those steps are trained again), so each step is in the log once.
    """
    path = Path(path)
    if resume is None:
        if path.is_file():
            previous = path.with_name(PREVIOUS_LOSS_LOG)
            os.replace(path, previous)
            log(f"[train] a fresh run (no resume): the earlier run's {path.name} is kept as {previous.name}")
        return
    step = checkpoint_step(resume)
    records = read_loss_log(path)
    kept = [record for record in records if record["step"] <= step]
    if path.is_file():
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(record) + "\n" for record in kept))
        os.replace(tmp, path)
    if len(kept) < len(records):
        log(f"[train] resuming at step {step}: {path.name} keeps its steps up to {step}, the "
            f"{len(records) - len(kept)} later ones are trained again")


def whole_run_loss(path: str | os.PathLike) -> float | None:
    """The mean loss over every step of ``losses.jsonl`` (a resumed run's earlier steps included), or None."""
    records = read_loss_log(path)
    return sum(float(record["loss"]) for record in records) / len(records) if records else None


def with_whole_run_loss(result, path: str | os.PathLike):
    """The Trainer's ``TrainOutput`` with ``training_loss`` and ``metrics["train_loss"]`` over the whole run's
    log: after a resume the Trainer's own number averages the resumed steps only (kept as
    ``metrics["train_loss_this_run"]``)."""
    loss = whole_run_loss(path)
    if loss is None:
        return result
    metrics = dict(result.metrics or {})
    if "train_loss" in metrics:
        metrics["train_loss_this_run"] = metrics["train_loss"]
    metrics["train_loss"] = loss
    return result._replace(training_loss=loss, metrics=metrics)


def lock_output_dir(output_dir: str | os.PathLike):
    """Hold ``<output_dir>/.lock`` (``fcntl.flock``, exclusive, non-blocking) for as long as the returned file stays
    open: the pipeline's rank 0 keeps it for the whole run, and the OS drops it when the process ends (``kill -9``
    included). A second run into the same folder raises :class:`OutputDirInUse` naming the holder, before it
    writes anything there."""
    import fcntl
    import socket
    import time

    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that did not say which"
        handle.close()
        raise OutputDirInUse(f"train.output_dir={str(folder)!r} is in use by another run ({holder}; lock file "
                             f"{path}): wait for it to finish or choose another train.output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle
