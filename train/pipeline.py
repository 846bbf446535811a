"""The POD adaptation pipeline behind ``train/pod.py``: explore -> train -> export -> eval -> push.

Process roles (``deepspeed`` launcher or one plain process):
  * exploration runs on rank 0 and its anchor map is broadcast (ranks must agree exactly);
  * training runs on every rank (transformers Trainer, DeepSpeed when ``deepspeed.config`` is set;
    under ZeRO-3 the POD model is built on all ranks inside ``deepspeed.zero.Init``);
  * export, evaluation and push run on rank 0 after the DeepSpeed config is unset (otherwise
    a rank-0-only ``from_pretrained`` would enter a collective ``zero.Init`` and hang).

Outputs under ``train.output_dir``: ``exploration/{blocks.json,similarity.png}``, ``checkpoint-N/``,
``losses.jsonl``, ``runs/`` (tensorboard), ``trained/``, ``export/`` (or ``train.export_dir``),
``results.json``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from train.recipe import Recipe, resolve_input_path

ORDER = ("explore", "train", "export", "eval", "push")


def prepare_launch_environment(recipe: Recipe) -> None:
    """Environment for DeepSpeed as one plain process and on CPU."""
    if not recipe.deepspeed.config:
        return
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / ".torch_extensions"))
    if "RANK" not in os.environ:  # plain `python train/pod.py`: DeepSpeed would otherwise try MPI discovery
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if os.environ.get("PODKIT_DS_SHM") != "1":
            import deepspeed.ops  # skip the ~60 s JIT build of the shm comm op; plain gloo is used instead

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(recipe: Recipe) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1 and not recipe.deepspeed.config:
        return
    if recipe.deepspeed.config:
        import deepspeed

        deepspeed.init_distributed()
    elif not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _broadcast(value, rank: int):
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [value if rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _shutdown_distributed() -> None:
    """Leave the process group on every rank once the collective part is over.

    Ranks other than 0 exit while rank 0 still exports and pushes; a rank that exits with a live gloo
    group can abort in its C++ teardown ("terminate called without an active exception", exit -6)
    which fails the whole ``deepspeed`` launch although rank 0 finished. Destroying the group first
    makes the exit orderly.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _barrier()
        torch.distributed.destroy_process_group()


def run_pipeline(recipe: Recipe, stages: list[str], local_rank: int | None = None) -> int:
    from sparse_models.model_files import write_text_atomically
    from train.checkpoints import copy_file_atomically, make_folder
    from train.models import load_model, load_tokenizer, model_source, public_model_name
    from train.trainer import world_info

    started_wall, started_cpu = time.perf_counter(), time.process_time()
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    prepare_launch_environment(recipe)
    rank, local, world = world_info()
    log = print if rank == 0 else (lambda *a, **k: None)
    if "train" in stages:  # before any stage: a broken checkpoint must not cost an exploration first
        recipe, stages = _checked_resume(recipe, stages, log)
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        from train.threads import configure_cpu_threads

        configure_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)), log=log)
    init_distributed(recipe)
    if local == 0:  # each host's first process prepares its cache (e.g. the embedded model's conversion) first
        source = model_source(recipe)
    _barrier()
    if local != 0:
        source = model_source(recipe)
    tokenizer = load_tokenizer(recipe, source)
    from train.corpus.preflight import check_run_inputs  # shards a download would have to make: one line, now

    check_run_inputs(recipe, stages_to_run(recipe, stages), tokenizer, held_out_sources(recipe), log=log)
    out = make_folder(recipe.train.output_dir, "train.output_dir")  # after the model resolved: nothing written before
    from train.checkpoints import lock_output_dir  # one run per output_dir; the lock is held until the process ends
    run_lock = lock_output_dir(out) if rank == 0 else None  # noqa: F841  (kept open for the whole run)
    base_name = public_model_name(recipe)
    log(f"[podkit] {recipe.source_path}: base {base_name}, stages {','.join(stages_to_run(recipe, stages))}, "
        f"{world} process(es) on {device.type}")

    # -- explore ----------------------------------------------------------------------------
    if recipe.train.attention == "dense":
        anchors, blocks_path = None, None
        log("[explore] train.attention=dense: the dense fine-tune control (no exploration, no block map)")
    else:
        anchors, blocks_path = _exploration(recipe, stages, source, tokenizer, rank, device, log)
        if recipe.pod.protect_units == "auto":
            anchors, blocks_path = _auto_units(recipe, stages, source, tokenizer, anchors, blocks_path, rank, device,
                                               log)
        else:
            anchors, blocks_path = _final_map(recipe, anchors, blocks_path, rank, log)

    # -- train ------------------------------------------------------------------------------
    trained = out / "trained"
    if "train" in stages:
        from train.data import training_rows
        from train.learning_curve import tokens_per_step
        from train.trainer import train_model, training_arguments

        args = training_arguments(recipe)  # before the model: ZeRO-3 builds it inside zero.Init
        with args.main_process_first(desc="tokenise into shards"):  # the shards are built once, then memory-mapped
            packed = training_rows(recipe, tokenizer, log=log, rows_per_step=tokens_per_step(
                args, recipe.data.context_length, recipe.train.sequence_parallel_size) // recipe.data.context_length)
        dtype = _training_dtype(recipe)
        model = load_model(recipe, source, anchor_layers=anchors, dtype=dtype)
        sequence_parallel = None
        if recipe.train.sequence_parallel_size > 1:
            from train.sequence_parallel import setup_sequence_parallel

            sequence_parallel = setup_sequence_parallel(recipe.train.sequence_parallel_size)
            log(f"[train] Ulysses sequence parallelism: {sequence_parallel.size} ranks per sequence "
                f"({recipe.data.context_length // sequence_parallel.size} tokens each), "
                f"{world // sequence_parallel.size} data-parallel replica(s)")
        callbacks = []
        if recipe.eval.every_steps:
            callbacks.append(_learning_curve(recipe, tokenizer, args, source, log))
        train_model(model, packed, recipe, args, tokenizer=tokenizer, log=log, sequence_parallel=sequence_parallel,
                    teacher_factory=lambda: load_model(recipe, source, dtype=dtype), callbacks=callbacks)
        del model
        _barrier()
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    _shutdown_distributed()  # export, eval and push are rank 0 only: no collective after this point
    if rank != 0:
        return 0

    # -- export -----------------------------------------------------------------------------
    export_dir = recipe.export_dir
    if "export" in stages:
        from train.export import export_model

        adapted = _load_adapted(recipe, source, trained, anchors)
        export_model(adapted, tokenizer, recipe, anchors, export_dir, base_model=base_name, blocks_file=blocks_path)
        del adapted
        log(f"[export] {export_dir}")

    # -- eval -------------------------------------------------------------------------------
    if "eval" in stages and recipe.eval.perplexity:
        results = _evaluate(recipe, source, tokenizer, anchors, export_dir, device, log)
        write_text_atomically(out / "results.json", json.dumps(results, indent=1))
        if (export_dir / "config.json").is_file():
            from train.export import update_card_results

            # into the finished export: each file whole or not at all (tmp file + os.replace)
            write_text_atomically(export_dir / "eval_results.json", json.dumps(results, indent=1))  # the card's numbers
            for name in ("learning_curve.json", "learning_curve.png"):  # the card shows the curve
                if (out / name).is_file():
                    copy_file_atomically(out / name, export_dir / name)

            update_card_results(export_dir, recipe, anchors, base_model=base_name, results=results)

    # -- push -------------------------------------------------------------------------------
    if "push" in stages and recipe.hub.repo_id:
        from train.hub import HubPushError, push_export

        try:
            url = push_export(export_dir, recipe.hub.repo_id, private=recipe.hub.private,
                              commit_message=recipe.hub.commit_message)
        except HubPushError as error:
            print(f"[push] failed: {error}", file=sys.stderr)
            return 3
        log(f"[push] {recipe.hub.repo_id}: {url}")
    log(f"[podkit] done in {time.perf_counter() - started_wall:.0f}s wall, "
        f"{time.process_time() - started_cpu:.0f}s CPU (this process)")
    return 0


def stages_to_run(recipe: Recipe, stages: list[str]) -> list[str]:
    """The requested stages in pipeline order, without ``push`` when ``hub.repo_id`` is null (nothing to push
    to: the stage is skipped, so the banner does not list it)."""
    return [s for s in ORDER if s in stages and (s != "push" or recipe.hub.repo_id)]


def render_report_note(note: str, *, max_steps: int, device) -> str:
    """``eval.report_note`` with ``{max_steps}`` and ``{device}`` filled in from the run (other braces are left as
    they are), so a note written for the demo does not claim a 40-step CPU run for a longer one or a GPU run."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = device.type.upper()
    return note.replace("{max_steps}", str(max_steps)).replace("{device}", name)


def held_out_sources(recipe: Recipe) -> list[str]:
    """The held-out sources scored by the eval stage and the learning curve: data.eval (in-domain), then
    eval.out_of_domain."""
    from train.data import default_eval_source

    primary = default_eval_source(recipe)
    return [primary] + [s for s in recipe.eval.out_of_domain if s != primary]


def _held_out_windows(recipe: Recipe, tokenizer, source: str, max_tokens: int) -> torch.Tensor:
    from train.data import token_windows

    primary = source == recipe.data.eval
    return token_windows(source, tokenizer, recipe.eval_context_length, max_tokens,
                         config=recipe.data.eval_config if primary else None,
                         split=recipe.data.eval_split if primary else "train", text_field=recipe.data.text_field,
                         token_cache=recipe.data.token_cache)


def _learning_curve(recipe: Recipe, tokenizer, args, model_source: str, log):
    from train.learning_curve import learning_curve_callback, tokens_per_step

    windows = {source: _held_out_windows(recipe, tokenizer, source, recipe.eval.curve_max_tokens)
               for source in held_out_sources(recipe)}
    log(f"[curve] held-out ppl every {recipe.eval.every_steps} steps on "
        + ", ".join(f"{s} ({w.shape[0]} x {w.shape[1]})" for s, w in windows.items()))
    long_context = None
    if recipe.long_context.ruler and recipe.long_context.curve:
        if recipe.train.method == "lora":  # the engine reads the base projections, not peft's adapters
            log("[curve] long_context.curve: not scored during LoRA training (the eval stage scores the merged export)")
        else:
            long_context = _dev_ruler_probe(recipe, tokenizer, model_source, log)
    return learning_curve_callback(windows, recipe.eval.every_steps, Path(recipe.train.output_dir),
                                   objective=recipe.train.objective, batch_size=recipe.eval.batch_size,
                                   tokens_per_step=tokens_per_step(args, recipe.data.context_length,
                                                                   recipe.train.sequence_parallel_size), log=log,
                                   long_context=long_context)


def _ruler_setup(recipe: Recipe, source: str):
    """(samples folder, model name for the sample files, the model's context) of the long-context evaluation."""
    from train.models import load_config, public_model_name

    folder = Path(recipe.long_context.samples_dir or Path(recipe.train.output_dir) / "ruler_samples")
    return folder, public_model_name(recipe), getattr(load_config(recipe, source), "max_position_embeddings", None)


def _dev_ruler_probe(recipe: Recipe, tokenizer, source: str, log):
    """``model -> RULER summary`` on the dev split (never the test split: the curve is what checkpoints and
    settings are chosen on)."""
    from train.long_context_eval import protocol, scoring

    folder, name, max_positions = _ruler_setup(recipe, source)
    dev, _ = protocol.splits(recipe, max_positions, log)
    samples = protocol.split_samples(dev, tokenizer, folder, name)
    log(f"[curve] RULER {dev.describe()}")
    lc = recipe.long_context

    def probe(model) -> dict:
        from train.teacher import podkit_model_of

        podkit = podkit_model_of(model)
        return scoring.summarise(scoring.score_samples(podkit, tokenizer, samples, chat=lc.chat,
                                                       batch_size=lc.batch_size, label="dev", log=lambda *a: None))
    return probe


def _checked_resume(recipe: Recipe, stages: list[str], log) -> tuple[Recipe, list[str]]:
    """Validate the resume checkpoint (train/checkpoints.py) and pin it in the recipe; when resuming,
    the exploration the checkpoint was trained with is reused instead of being redone and rewritten."""
    import dataclasses

    from train.checkpoints import select_resume_checkpoint

    resume = select_resume_checkpoint(recipe.train.resume_from_checkpoint, recipe.train.output_dir, log)
    recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, resume_from_checkpoint=resume))
    blocks = Path(recipe.train.output_dir) / "exploration" / "blocks.json"
    if resume and "explore" in stages and not recipe.pod.blocks_file and blocks.is_file():
        log(f"[explore] resuming from {resume}: reusing {blocks} (the anchors it was trained with)")
        stages = [s for s in stages if s != "explore"]
    return recipe, stages


def _training_dtype(recipe: Recipe) -> torch.dtype:
    from train.models import DTYPE

    if not recipe.deepspeed.config and recipe.train.bf16:
        return torch.float32  # plain Trainer: fp32 master weights + bf16 autocast
    return DTYPE[recipe.model.dtype]


def _final_map(recipe, anchors, blocks_path, rank: int, log):
    """The block map that is trained: the explored (or reused) one with ``pod.protect_units`` made anchors
    (``protect_units``) and, under ``pod.min_kv_saving``, delta lowered over the exploration's similarity until
    the map saves that much (``delta_for_kv_saving``); under ``pod.kv_saving``, the largest delta from 1.0 down whose
    protected map saves that much (the least sharing that meets the budget, for a trade-off curve). Written beside the exploration as ``blocks_trained.json``
    (rank 0) when it differs, so the export's ``pod_blocks.json`` is the map that was trained; the explored
    ``blocks.json`` stays as it was. Deterministic, so every rank computes the same map."""
    units = [tuple(unit) for unit in recipe.pod.protect_units]
    target = recipe.pod.min_kv_saving
    exact = recipe.pod.kv_saving  # the least sharing that saves it: delta searched from 1.0 down
    if not units and target is None and exact is None:
        return anchors, blocks_path
    from sparse_models.calibration.pod_similarity import (
        delta_for_kv_saving,
        kv_saving_fraction,
        protect_units,
        read_blocks_json,
        shared_units,
        write_blocks_json,
    )

    length, proximal = recipe.data.context_length, (recipe.pod.sink_tokens, recipe.pod.recent_window)
    source = read_blocks_json(blocks_path) if blocks_path and Path(blocks_path).is_file() else {}
    similarity = torch.tensor(source["similarity"]) if "similarity" in source else None
    try:
        final, already = protect_units(anchors, units)
    except ValueError as error:
        raise SystemExit(f"pod.protect_units={recipe.pod.protect_units}: {error}") from None
    delta = source.get("delta", recipe.pod.delta)
    compare_with = source.get("compare_with", recipe.pod.compare_with)
    if exact is not None:
        if similarity is None:
            raise SystemExit(f"pod.kv_saving={exact}: the block map {blocks_path} has no similarity matrices to search "
                             f"delta over; run the exploration (pod.blocks_file: null) or use one written with them")
        try:
            delta, final = delta_for_kv_saving(similarity, exact, seq_len=length, sink=proximal[0], recent=proximal[1],
                                               start_delta=1.0, compare_with=compare_with, protect=units)
        except ValueError as error:
            raise SystemExit(f"pod.kv_saving={exact}: {error}") from None
        log(f"[explore] pod.kv_saving={exact}: delta {delta:.4f}, the least sharing that saves it")
    elif target is not None and kv_saving_fraction(final, length, *proximal) < target:
        if similarity is None:
            raise SystemExit(f"pod.min_kv_saving={target}: the block map {blocks_path} saves "
                             f"{kv_saving_fraction(final, length, *proximal):.1%} and has no similarity matrices to "
                             f"lower delta with; run the exploration (pod.blocks_file: null) or lower pod.min_kv_saving")
        try:
            delta, final = delta_for_kv_saving(similarity, target, seq_len=length, sink=proximal[0], recent=proximal[1],
                                               start_delta=delta, compare_with=compare_with, protect=units)
        except ValueError as error:
            raise SystemExit(f"pod.min_kv_saving={target}: {error}") from None
        log(f"[explore] pod.min_kv_saving={target}: delta lowered to {delta:.4f}")
    path = Path(recipe.train.output_dir) / "exploration" / "blocks_trained.json"
    if rank == 0:
        # a reused map may itself be a trained map (blocks_trained.json): its own provenance keys are replaced
        metadata = {k: v for k, v in source.items() if k not in (
            "format", "anchor_layers", "blocks", "similarity", "num_layers", "num_kv_heads", "anchor_fraction", "delta",
            "source_blocks", "protect_units", "already_anchors", "min_kv_saving", "kv_saving")}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_blocks_json(path, final, similarity, **{**metadata, "delta": delta}, source_blocks=str(blocks_path),
                          protect_units=[list(u) for u in units], already_anchors=[list(u) for u in already],
                          min_kv_saving=target, kv_saving=exact)
    log("[explore] "
        + (f"pod.protect_units: {len(units) - len(already)} unit(s) made anchors"
           + (f", {len(already)} already were ({already})" if already else "") + "; " if units else "")
        + f"shared units {len(shared_units(anchors))} -> {len(shared_units(final))}, KV saved at {length} "
        f"{100 * kv_saving_fraction(anchors, length, *proximal):.1f}% -> "
        f"{100 * kv_saving_fraction(final, length, *proximal):.1f}% -> {path}")
    return final, path


def _auto_units(recipe, stages, source, tokenizer, anchors, blocks_path, rank, device, log):
    """``pod.protect_units: auto``: the units that keep their own distant keys are chosen by learned gates under
    ``pod.min_kv_saving`` (train/unit_selection/run.py) on rank 0, and the map is broadcast. Without the explore
    stage (e.g. a resume) the run's earlier ``blocks_trained.json`` is the map."""
    path = Path(recipe.train.output_dir) / "exploration" / "blocks_trained.json"
    if "explore" not in stages:
        from sparse_models.calibration.pod_similarity import read_blocks_json

        if not path.is_file() or "unit_selection" not in read_blocks_json(path):
            raise SystemExit(f"pod.protect_units=auto: no selected map at {path}: run the explore stage")
        log(f"[explore] pod.protect_units=auto: reusing {path}")
        return read_blocks_json(path)["anchor_layers"], path
    final = None
    if rank == 0:
        from train.models import load_dense_reference
        from train.unit_selection.run import select_protected_units

        dense = load_dense_reference(recipe, source).to(device)
        final, _ = select_protected_units(recipe, dense, tokenizer, anchors, blocks_path, log)
        del dense
    return _broadcast(final, rank), path


def _exploration(recipe, stages, source, tokenizer, rank, device, log):
    from sparse_models.calibration.pod_similarity import read_blocks_json

    out_dir = Path(recipe.train.output_dir) / "exploration"
    if recipe.pod.blocks_file:
        path = resolve_input_path(recipe.pod.blocks_file)
        log(f"[explore] reusing {recipe.pod.blocks_file}")
        return read_blocks_json(path)["anchor_layers"], path
    path = out_dir / "blocks.json"
    if "explore" not in stages:
        if not path.is_file():
            raise SystemExit(f"no blocks file at {path}: run the explore stage or set pod.blocks_file")
        return read_blocks_json(path)["anchor_layers"], path
    anchors = None
    if rank == 0:
        from train.data import training_rows
        from train.explore import run_exploration
        from train.models import load_dense_reference, public_model_name

        # N rows of the training mixture (seeded, by weight) at the calibration length: [N, calibration_length]
        rows = training_rows(recipe, tokenizer, context_length=recipe.calibration_length,
                             num_rows=recipe.pod.calibration_samples, log=log, describe=False)
        log(f"[explore] {len(rows)} calibration rows of {recipe.calibration_length} tokens from {recipe.data.train}")
        samples = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
        dense = load_dense_reference(recipe, source).to(device)
        result = run_exploration(dense, samples, last_queries=recipe.pod.last_queries, delta=recipe.pod.delta,
                                 compare_with=recipe.pod.compare_with, out_dir=out_dir,
                                 metadata={"model": public_model_name(recipe)},
                                 log=log)
        anchors = result["anchor_layers"]
        del dense
    anchors = _broadcast(anchors, rank)
    return anchors, path


def _load_adapted(recipe, source, trained: Path, anchors):
    from train.models import load_model

    if not trained.is_dir():
        print(f"[export] no trained model at {trained}: exporting the base model with the POD structure")
        return load_model(recipe, source, anchor_layers=anchors)
    if recipe.train.method == "lora":
        from peft import PeftModel

        base = load_model(recipe, source, anchor_layers=anchors, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(trained)).merge_and_unload()
        return merged.to(getattr(torch, recipe.model.dtype))
    return load_model(recipe, str(trained), anchor_layers=anchors, apply_recipe_config=False)


def _comparison_rows(recipe, source, anchors, export_dir: Path) -> list[tuple[str, object]]:
    """(row, build) of every model the eval stage compares (train/long_context_eval/report.py names them): the
    original dense model; the dense fine-tune control (this run's export when it is the control, else
    ``eval.control_export``); POD before adaptation; the POD export and its weights run densely."""
    from train.models import load_dense_reference, load_model

    rows = [("dense", lambda: load_dense_reference(recipe, source))]
    exported = (export_dir / "config.json").is_file()

    def export_of(path, dense: bool = False):
        model = load_model(recipe, str(path), anchor_layers=anchors if path == export_dir else None,
                           apply_recipe_config=False)
        if dense:
            model.set_sparse_attention(prefill_scheme="dense", decode_scheme="dense")
        return model

    if recipe.train.attention == "dense":
        return rows + ([("control", lambda: export_of(export_dir))] if exported else [])
    if recipe.eval.control_export:
        control = resolve_input_path(recipe.eval.control_export)
        rows.append(("control", lambda: export_of(control)))
    rows.append(("pod_before", lambda: load_model(recipe, source, anchor_layers=anchors)))
    if exported:
        rows += [("pod_after", lambda: export_of(export_dir)), ("dense_after", lambda: export_of(export_dir, True))]
    return rows


def _evaluate(recipe, source, tokenizer, anchors, export_dir: Path, device, log) -> dict:
    """Held-out perplexity of every row of :func:`_comparison_rows` on every held-out source, the KV bytes POD
    saves, and (``long_context.ruler``) RULER's test split for the same rows (``long_context``; per-sample records
    in ``ruler_records.json``). ``perplexity`` holds the first source's (data.eval) scores; ``sources`` all."""
    from sparse_models.calibration.pod_similarity import kv_saving_fraction
    from train.evaluate import measured_kv_bytes, perplexity

    length = recipe.eval_context_length
    windows = {name: _held_out_windows(recipe, tokenizer, name, recipe.eval.max_tokens)
               for name in held_out_sources(recipe)}
    for name, w in windows.items():
        log(f"[eval] held-out perplexity on {name}: {w.shape[0]} windows x {length} tokens")
    primary = next(iter(windows))
    results = {"data": f"{primary}, {windows[primary].shape[0]} x {length} tokens", "sources": {}}
    candidates = _comparison_rows(recipe, source, anchors, export_dir)
    for name, build in candidates:
        model = build().to(device)
        for held_out, w in windows.items():
            scores = results["sources"].setdefault(held_out, {"windows": int(w.shape[0]), "tokens_per_window": length})
            scores[name] = perplexity(model, w, recipe.eval.batch_size, desc=f"[eval] {name} {held_out}")
            log(f"[eval] {name:<11} {held_out}: ppl {scores[name]['ppl']:.3f} ({scores[name]['seconds']:.1f}s)")
        if name == "pod_before":
            results["kv"] = measured_kv_bytes(model, windows[primary][0])
        del model
    results["perplexity"] = {k: v for k, v in results["sources"][primary].items() if isinstance(v, dict)}
    p = recipe.pod
    if "kv" in results:
        results["kv"]["closed_form_saving"] = kv_saving_fraction(anchors, length, p.sink_tokens, p.recent_window)
    lines = []
    for held_out, scores in results["sources"].items():
        dense = scores["dense"]["ppl"]
        lines += [f"held-out perplexity ({held_out}, {scores['windows']} x {length} tokens):",
                  f"  dense                  {dense:.3f}"]
        if "control" in scores:
            lines.append(f"  dense fine-tune control {scores['control']['ppl']:.3f}  "
                         f"({100 * (scores['control']['ppl'] / dense - 1):+.1f}% vs dense)")
        if "pod_before" in scores:
            lines.append(f"  POD before adaptation  {scores['pod_before']['ppl']:.3f}  "
                         f"({100 * (scores['pod_before']['ppl'] / dense - 1):+.1f}% vs dense)")
        if "pod_after" in scores and "pod_before" in scores:
            gap = scores["pod_before"]["ppl"] - dense
            closed = (scores["pod_before"]["ppl"] - scores["pod_after"]["ppl"]) / gap if gap > 0 else float("nan")
            lines.append(f"  POD after adaptation   {scores['pod_after']['ppl']:.3f}  "
                         f"({100 * (scores['pod_after']['ppl'] / dense - 1):+.1f}% vs dense, "
                         f"{100 * closed:.0f}% of the zero-shot gap closed)")
            lines.append(f"  adapted, run densely   {scores['dense_after']['ppl']:.3f}  "
                         f"({100 * (scores['dense_after']['ppl'] / dense - 1):+.1f}% vs dense)")
            scores["gap_closed"] = closed
    if "gap_closed" in results["sources"][primary]:
        results["gap_closed"] = results["sources"][primary]["gap_closed"]
    kv = results.get("kv")
    if kv:
        lines.append(f"KV cache at {kv['tokens']} tokens: {kv['kv_bytes']:,} bytes with POD vs {kv['dense_kv_bytes']:,} "
                 f"dense -> {kv['dense_kv_bytes'] - kv['kv_bytes']:,} bytes saved ({100 * kv['saving']:.1f}%; "
                     f"closed form {100 * kv['closed_form_saving']:.1f}%)")
    if recipe.long_context.ruler:
        from train.long_context_eval.report import result_lines, ruler_report

        folder, name, max_positions = _ruler_setup(recipe, source)
        rows = [(row, lambda build=build: build().to(device)) for row, build in candidates if row != "pod_before"]
        report = ruler_report(rows, tokenizer, recipe, folder=folder, model_name=name, max_positions=max_positions,
                              log=log)
        results["long_context"] = report["summary"]
        from sparse_models.calibration.outputs import write_json

        write_json(Path(recipe.train.output_dir) / "ruler_records.json", report["records"])
        lines += result_lines(report["summary"])
    if recipe.eval.report_note:
        note = render_report_note(recipe.eval.report_note, max_steps=recipe.train.max_steps, device=device)
        lines += [line.strip() for line in note.strip().splitlines()]
    print("\n".join("[result] " + line for line in lines))
    return results
