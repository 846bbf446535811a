"""The recipe's rules: value rules (no file system access) and environment rules (read-only checks of
files, folders, packages and the launch). Each appends one actionable line per problem to a list;
``train/recipe.py`` runs them in one pass and raises one :class:`train.recipe_schema.RecipeError`.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from train.inputs import (
    EMBEDDED_DATA_PREFIX,
    EMBEDDED_MODEL,
    EMBEDDED_MODEL_MAX_POSITIONS,
    looks_like_local_path,
    resolve_input_path,
)
from train.recipe_schema import DTYPES, Recipe, suggest

# ---------------------------------------------------------------------------------------------
# Value rules (no file system access)


def check_values(r: Recipe, problems: list[str]) -> None:
    add = problems.append
    if not r.model.name_or_path:
        add("model.name_or_path is missing: set a Hub id, a local model folder, or podkit:smollm2-135m")
    if r.model.dtype not in DTYPES:
        add(f"model.dtype={r.model.dtype!r}: expected one of {', '.join(DTYPES)}")
    if r.model.rope_theta is not None and r.model.rope_theta <= 0:
        add(f"model.rope_theta={r.model.rope_theta!r}: expected a positive number")
    if r.model.rope_scaling is not None and "rope_type" not in r.model.rope_scaling and "type" not in r.model.rope_scaling:
        add(f"model.rope_scaling={r.model.rope_scaling!r}: expected a mapping with rope_type (e.g. linear, dynamic, llama3, yarn)")

    p = r.pod
    if p.sink_tokens < 0:
        add(f"pod.sink_tokens={p.sink_tokens}: expected an integer >= 0 (paper: 16)")
    if p.recent_window < 1:
        add(f"pod.recent_window={p.recent_window}: expected an integer >= 1 (paper: 4080)")
    if not 0.0 <= p.delta <= 1.0:
        add(f"pod.delta={p.delta}: expected a number in [0, 1] (a similarity threshold; paper: 0.5)")
    if p.compare_with not in ("anchor", "previous"):
        add(f"pod.compare_with={p.compare_with!r}: expected 'anchor' (compare with the block's anchor) or 'previous'")
    if p.sharing not in ("keys", "scores"):
        add(f"pod.sharing={p.sharing!r}: expected 'keys' (paper v2) or 'scores' (paper v1)")
    if isinstance(p.protect_units, str):
        _check_unit_selection(r, add)
    else:
        for i, unit in enumerate(p.protect_units):
            if len(unit) != 2 or min(unit) < 0:
                add(f"pod.protect_units[{i}]={unit}: expected a [layer, KV head] pair of integers >= 0, "
                    f"e.g. [18, 2]")
        if len({tuple(unit) for unit in p.protect_units}) != len(p.protect_units):
            add(f"pod.protect_units={p.protect_units}: a unit is listed twice; list each [layer, KV head] once")
        if p.unit_selection:
            add(f"pod.unit_selection={p.unit_selection}: only used with pod.protect_units: auto; set that or remove "
                f"pod.unit_selection")
    if p.min_kv_saving is not None and not 0.0 < p.min_kv_saving < 0.5:
        add(f"pod.min_kv_saving={p.min_kv_saving}: expected null or a fraction in (0, 0.5) (POD shares keys only, "
            f"so at most half of the KV cache can be saved; the paper saves 0.35)")
    if p.kv_saving is not None:
        if not 0.0 < p.kv_saving < 0.5:
            add(f"pod.kv_saving={p.kv_saving}: expected null or a fraction in (0, 0.5) (POD shares keys only, so at "
                f"most half of the KV cache can be saved; the paper saves 0.35)")
        if p.min_kv_saving is not None:
            add(f"pod.kv_saving={p.kv_saving} and pod.min_kv_saving={p.min_kv_saving}: set one (kv_saving: the least "
                f"sharing that saves it; min_kv_saving: the explored map, delta lowered only when it saves less)")
        if p.protect_units == "auto":
            add(f"pod.kv_saving={p.kv_saving}: pod.protect_units='auto' selects under pod.min_kv_saving; set that "
                f"instead")
    if p.gate_tau is not None and not 0.0 < p.gate_tau <= 1.0:
        add(f"pod.gate_tau={p.gate_tau}: expected null or a number in (0, 1] (paper: 0.7)")
    if p.calibration_samples < 1:
        add(f"pod.calibration_samples={p.calibration_samples}: expected an integer >= 1")
    if p.calibration_length is not None and p.calibration_length < 2:
        add(f"pod.calibration_length={p.calibration_length}: expected an integer >= 2 or null")
    if p.last_queries < 1:
        add(f"pod.last_queries={p.last_queries}: expected an integer >= 1")
    elif p.last_queries > r.calibration_length:
        add(f"pod.last_queries={p.last_queries} exceeds the calibration length {r.calibration_length}: "
            f"lower pod.last_queries or raise pod.calibration_length")

    d = r.data
    if not d.train:
        add("data.train is missing: set podkit:austen, a Hub dataset name, or a local .txt/.jsonl/.parquet path")
    else:
        from train.corpus.mixture import MixError, parse_mix

        try:
            mix = parse_mix(d.train, "data.train")
        except MixError as error:
            problems.extend(error.problems)
        else:
            _check_recall_context(mix, d.context_length, add)
    if d.context_length < 2:
        add(f"data.context_length={d.context_length}: expected an integer >= 2")
    elif p.sink_tokens + p.recent_window >= d.context_length:
        add(f"pod.recent_window={p.recent_window} (+ pod.sink_tokens={p.sink_tokens}) >= data.context_length="
            f"{d.context_length}: no token would be distant, so POD would change nothing; lower the window "
            f"or raise the context length")
    if d.max_train_tokens is not None and d.max_train_tokens < d.context_length:
        add(f"data.max_train_tokens={d.max_train_tokens} is below data.context_length={d.context_length}: "
            f"not even one packed sequence; raise it or set null")
    if d.num_proc < 1:
        add(f"data.num_proc={d.num_proc}: expected an integer >= 1")

    t = r.train
    if not t.output_dir:
        add("train.output_dir is missing: set a folder for checkpoints, logs and the export")
    if t.attention not in ("pod", "dense"):
        add(f"train.attention={t.attention!r}: expected 'pod' (the adaptation) or 'dense' (the fine-tune control)")
    if t.method not in ("full", "lora"):
        add(f"train.method={t.method!r}: expected 'full' (paper) or 'lora'")
    if t.method == "lora":
        if t.lora_r < 1:
            add(f"train.lora_r={t.lora_r}: expected an integer >= 1")
        if not t.lora_target_modules:
            add("train.lora_target_modules is empty: list the projections to adapt, e.g. [q_proj, k_proj, v_proj, o_proj]")
        if not 0.0 <= t.lora_dropout < 1.0:
            add(f"train.lora_dropout={t.lora_dropout}: expected a number in [0, 1)")
    if t.learning_rate <= 0:
        add(f"train.learning_rate={t.learning_rate}: expected a positive number (paper: 1e-5)")
    schedulers = ("cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial")
    if t.lr_scheduler not in schedulers:
        add(f"train.lr_scheduler={t.lr_scheduler!r}: expected one of {', '.join(schedulers)}")
    for name in ("warmup_steps", "logging_steps", "save_steps", "per_device_batch_size", "gradient_accumulation_steps"):
        minimum = 0 if name == "warmup_steps" else 1
        if getattr(t, name) < minimum:
            add(f"train.{name}={getattr(t, name)}: expected an integer >= {minimum}")
    if not 0.0 <= t.warmup_ratio < 1.0:
        add(f"train.warmup_ratio={t.warmup_ratio}: expected a number in [0, 1)")
    if t.max_steps == 0 or t.max_steps < -1:
        add(f"train.max_steps={t.max_steps}: expected a positive integer, or -1 to use train.num_train_epochs")
    if t.max_steps == -1 and t.num_train_epochs <= 0:
        add(f"train.num_train_epochs={t.num_train_epochs} with train.max_steps=-1: nothing would be trained")
    if t.save_total_limit is not None and t.save_total_limit < 1:
        add(f"train.save_total_limit={t.save_total_limit}: expected an integer >= 1 or null")
    _check_objective(r, problems)
    _check_sequence_parallel(r, problems)
    _check_long_context(r, problems)
    reporters = ("tensorboard", "none")
    for reporter in t.report_to:
        if reporter not in reporters:
            add(f"train.report_to contains {reporter!r}: expected items from {', '.join(reporters)} (offline machines)")

    if r.hub.repo_id is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+|[\w.-]+", r.hub.repo_id):
        add(f"hub.repo_id={r.hub.repo_id!r}: expected 'user/name' or 'org/name' (letters, digits, - _ .)")

    e = r.eval
    if e.max_tokens < 1:
        add(f"eval.max_tokens={e.max_tokens}: expected an integer >= 1")
    if e.batch_size < 1:
        add(f"eval.batch_size={e.batch_size}: expected an integer >= 1")
    if e.every_steps is not None and e.every_steps < 1:
        add(f"eval.every_steps={e.every_steps}: expected an integer >= 1, or null for no learning curve")
    if e.curve_max_tokens < 1:
        add(f"eval.curve_max_tokens={e.curve_max_tokens}: expected an integer >= 1")
    if e.context_length is not None:
        if e.context_length < 2:
            add(f"eval.context_length={e.context_length}: expected an integer >= 2 or null")
        elif e.max_tokens < e.context_length:
            add(f"eval.max_tokens={e.max_tokens} is below eval.context_length={e.context_length}: no window to score")
    elif e.max_tokens < d.context_length and e.perplexity:
        add(f"eval.max_tokens={e.max_tokens} is below the eval context length {d.context_length}: no window to score")
    _check_ruler(r, problems)


def _check_recall_context(mix, context_length: int, add) -> None:
    """A recall source whose episodes need longer rows than ``data.context_length`` (train/corpus/recall.py)."""
    from train.corpus.documents import PREFIX
    from train.corpus.recall import SHAPES

    for entry in mix:
        shape = SHAPES.get(entry.source[len(PREFIX):]) if entry.source.startswith(PREFIX) else None
        if shape is not None and context_length < shape.min_context:
            add(f"data.train: {entry.source} needs data.context_length >= {shape.min_context}, got {context_length}: "
                f"its episodes are up to ~{shape.episode_chars[1] // 4000}K tokens, and a shorter row keeps the "
                f"prose but cuts off the quiz; use podkit:recall at this length")


def _check_ruler(r: Recipe, problems: list[str]) -> None:
    """long_context.* (train/long_context_eval): task names, sizes, and a dev seed apart from the test seed."""
    from train.long_context_eval.ruler import MIN_LENGTH, MIN_LENGTHS, TASKS

    lc, add = r.long_context, problems.append
    for key in ("tasks", "dev_tasks"):
        for task in getattr(lc, key) or []:
            if task not in TASKS:
                add(f"long_context.{key} contains {task!r}{suggest(task, TASKS)}: expected RULER tasks from "
                    f"{', '.join(TASKS)}")
    for key in ("samples", "dev_samples", "batch_size"):
        if getattr(lc, key) < 1:
            add(f"long_context.{key}={getattr(lc, key)}: expected an integer >= 1")
    if lc.seed == lc.dev_seed:
        add(f"long_context.seed={lc.seed} equals long_context.dev_seed: the test split (reported) and the dev split "
            "(for choosing settings) need different seeds")
    if lc.lengths is not None:
        if not lc.lengths:
            add("long_context.lengths=[]: expected a list of token counts, or null for length_factors")
        tasks = set(lc.tasks or TASKS) | set(lc.dev_tasks)
        shortest = max(MIN_LENGTHS.get(task, MIN_LENGTH) for task in tasks)
        for length in lc.lengths:
            if length < shortest:
                add(f"long_context.lengths contains {length}: expected lengths >= {shortest} tokens for the tasks asked")
    elif not lc.length_factors or any(f <= 0 for f in lc.length_factors):
        add(f"long_context.length_factors={lc.length_factors}: expected a non-empty list of positive numbers "
            "(multiples of data.context_length)")


def _check_objective(r: Recipe, problems: list[str]) -> None:
    """train.objective and its knobs (train/losses.py)."""
    from train.losses import OBJECTIVES

    t, add = r.train, problems.append
    if t.objective not in OBJECTIVES:
        add(f"train.objective={t.objective!r}: expected one of {', '.join(OBJECTIVES)}")
    if not 0.0 <= t.distill_weight <= 1.0:
        add(f"train.distill_weight={t.distill_weight}: expected a number in [0, 1] (weight of the KL term)")
    if t.distill_temperature <= 0:
        add(f"train.distill_temperature={t.distill_temperature}: expected a positive number (1 = no softening)")
    if t.loss_chunk_tokens is not None and t.loss_chunk_tokens < 1:
        add(f"train.loss_chunk_tokens={t.loss_chunk_tokens}: expected an integer >= 1, or null for no chunking")
    if t.objective != "lm" and t.sequence_parallel_size > 1:
        add(f"train.objective={t.objective!r} with train.sequence_parallel_size={t.sequence_parallel_size}: "
            f"distillation under sequence parallelism is not supported; use objective lm or SP size 1")


def _check_sequence_parallel(r: Recipe, problems: list[str]) -> None:
    """Ulysses (train/sequence_parallel.py): P ranks share each sequence, each holding 1/P of its tokens."""
    sp = r.train.sequence_parallel_size
    if sp < 1:
        problems.append(f"train.sequence_parallel_size={sp}: expected an integer >= 1 (1 = off)")
        return
    if sp == 1:
        return
    if not r.deepspeed.config:
        problems.append(f"train.sequence_parallel_size={sp} needs DeepSpeed (its Ulysses all-to-all and process "
                        f"groups): set deepspeed.config, e.g. recipes/deepspeed/zero3.json")
    if r.data.context_length % sp:
        problems.append(f"data.context_length={r.data.context_length} is not divisible by train.sequence_parallel_size="
                        f"{sp}: each rank holds context_length / {sp} tokens of every sequence")


def _check_long_context(r: Recipe, problems: list[str]) -> None:
    """Tiled MLP and checkpoint offload (train/long_context.py)."""
    t = r.train
    if t.tiled_mlp_shards is not None and t.tiled_mlp_shards < 1:
        problems.append(f"train.tiled_mlp_shards={t.tiled_mlp_shards}: expected an integer >= 1, or null for "
                        f"ceil(tokens per rank / (4 * hidden_size))")
    elif t.tiled_mlp_shards is not None and not t.tiled_mlp:
        problems.append(f"train.tiled_mlp_shards={t.tiled_mlp_shards} has no effect with train.tiled_mlp: false; "
                        f"set train.tiled_mlp: true or remove train.tiled_mlp_shards")
    if t.activation_offload and not t.gradient_checkpointing:
        problems.append("train.activation_offload: true offloads the inputs that gradient checkpointing keeps, "
                        "so it needs train.gradient_checkpointing: true")


def _check_long_context_packages(r: Recipe, problems: list[str]) -> None:
    """Both options are DeepSpeed components: the package must be importable (checked without importing)."""
    import importlib.util

    wanted = [name for name in ("tiled_mlp", "activation_offload") if getattr(r.train, name)]
    if not wanted:
        return
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        problems.append(f"train.{wanted[0]}: true uses DeepSpeed's ALST components, but deepspeed is not "
                        f"installed (pip install deepspeed)")
        return
    root = Path(next(iter(spec.submodule_search_locations or []), ""))
    if r.train.activation_offload and not (root / "runtime/activation_checkpointing/offload_activations.py").is_file():
        problems.append(f"train.activation_offload: true needs deepspeed.runtime.activation_checkpointing."
                        f"offload_activations, which the installed deepspeed ({root}) lacks: upgrade deepspeed")


def _check_sequence_parallel_world(r: Recipe, problems: list[str]) -> None:
    """The launch: WORLD_SIZE processes (set by the deepspeed launcher; 1 for a plain ``python`` run)."""
    sp = r.train.sequence_parallel_size
    world = os.environ.get("WORLD_SIZE", "1")
    if sp > 1 and world.isdigit() and int(world) % sp:
        problems.append(f"train.sequence_parallel_size={sp} does not divide the world size {world} (WORLD_SIZE): "
                        f"launch a multiple of {sp} processes, e.g. deepspeed --num_gpus {sp} train/pod.py ...")


def _attention_shape(model_config: dict) -> tuple[int | None, int | None, int | None]:
    """(layers, attention heads, KV heads) of a transformers config dict (a multimodal one's text part)."""
    text = model_config.get("text_config") or model_config
    heads = text.get("num_attention_heads")
    return text.get("num_hidden_layers"), heads, text.get("num_key_value_heads") or heads


def _check_sequence_parallel_heads(r: Recipe, model_config: dict, problems: list[str]) -> None:
    """Ulysses gives each rank H/P query heads and Hkv/P KV heads: both counts must divide by P."""
    sp = r.train.sequence_parallel_size
    _, heads, kv_heads = _attention_shape(model_config)
    if sp > 1 and heads and kv_heads and (heads % sp or kv_heads % sp):
        problems.append(f"train.sequence_parallel_size={sp}: Ulysses needs the attention heads ({heads}) and KV heads "
                        f"({kv_heads}) of model.name_or_path={r.model.name_or_path!r} divisible by it; use a divisor "
                        f"of {math.gcd(heads, kv_heads)}")


def _check_kv_target(r: Recipe, model_config: dict, problems: list[str]) -> None:
    """pod.min_kv_saving / pod.kv_saving must be reachable on this model and window: every unit but layer 0's shared saves
    (L - 1) / L x (S - proximal) / 2S (sparse_models/calibration/pod_similarity.py ``max_kv_saving``)."""
    from sparse_models.calibration.pod_similarity import max_kv_saving

    layers, _, _ = _attention_shape(model_config)
    p, length = r.pod, r.data.context_length
    field_name, target = ("kv_saving", p.kv_saving) if p.kv_saving is not None else ("min_kv_saving", p.min_kv_saving)
    if target is None or not layers or not 0.0 < target < 0.5 or p.sink_tokens + p.recent_window >= length:
        return
    ceiling = max_kv_saving(layers, length, p.sink_tokens, p.recent_window)
    if target > ceiling:
        problems.append(f"pod.{field_name}={target}: with {layers} layers, {p.sink_tokens} + {p.recent_window} "
                        f"proximal tokens and data.context_length={length}, POD saves at most {ceiling:.3f} of the "
                        f"KV cache; lower pod.{field_name} or the proximal window")


def _check_protect_units(r: Recipe, model_config: dict, problems: list[str]) -> None:
    """Each protected [layer, KV head] must exist in the model, before any exploration or training starts."""
    layers, _, kv_heads = _attention_shape(model_config)
    if isinstance(r.pod.protect_units, str):
        return  # "auto": the selection only picks units of the model
    for i, unit in enumerate(r.pod.protect_units):
        if len(unit) != 2 or min(unit) < 0:
            continue  # reported by the value rules
        layer, head = unit
        if (layers and layer >= layers) or (kv_heads and head >= kv_heads):
            problems.append(f"pod.protect_units[{i}]={unit}: model.name_or_path={r.model.name_or_path!r} has "
                            f"{layers} layers and {kv_heads} KV heads; expected a layer in [0, {(layers or 1) - 1}] "
                            f"and a KV head in [0, {(kv_heads or 1) - 1}]")


def _check_unit_selection(r: Recipe, add) -> None:
    """``pod.protect_units: auto`` (train/unit_selection/): a budget to select under and sane gate settings."""
    from train.recipe_schema import UNIT_SELECTION_DATA, unit_selection_settings

    p = r.pod
    if p.protect_units != "auto":
        add(f"pod.protect_units={p.protect_units!r}: expected a list of [layer, KV head] pairs (e.g. [[18, 2]]) or "
            f"'auto' (units chosen by learned gates under pod.min_kv_saving)")
        return
    if p.min_kv_saving is None:
        add("pod.protect_units='auto': needs the KV budget it selects under; set pod.min_kv_saving (e.g. 0.3)")
    problems: list[str] = []
    s = unit_selection_settings(p, problems)
    for problem in problems:
        add(problem)
    for name, value, ok, allowed in (
            ("steps", s.steps, s.steps >= 1, "an integer >= 1"),
            ("lr", s.lr, s.lr > 0, "a number > 0"),
            ("l1_weight", s.l1_weight, s.l1_weight >= 0, "a number >= 0"),
            ("samples", s.samples, s.samples >= 1, "an integer >= 1"),
            ("batch_size", s.batch_size, s.batch_size >= 1, "an integer >= 1"),
            ("candidate_delta", s.candidate_delta, 0.0 <= s.candidate_delta <= 1.0, "a number in [0, 1]"),
            ("data", s.data, s.data in UNIT_SELECTION_DATA, f"one of {', '.join(UNIT_SELECTION_DATA)}")):
        if not ok:
            add(f"pod.unit_selection.{name}={value!r}: expected {allowed}")
    length = s.length or r.data.context_length
    if length <= p.sink_tokens + p.recent_window:
        add(f"pod.unit_selection.length={length}: the episodes must be longer than POD's proximal window "
            f"({p.sink_tokens} + {p.recent_window} tokens), or no key is distant and every gate is moot")


# ---------------------------------------------------------------------------------------------
# Environment rules (read-only file system checks)


def check_environment(r: Recipe, problems: list[str]) -> None:
    add = problems.append
    model_config = None
    name = r.model.name_or_path
    if name == EMBEDDED_MODEL:
        model_config = {"max_position_embeddings": EMBEDDED_MODEL_MAX_POSITIONS, "num_attention_heads": 9,
                        "num_key_value_heads": 3, "num_hidden_layers": 30}
    elif name.startswith(EMBEDDED_DATA_PREFIX):
        add(f"model.name_or_path={name!r}: the only embedded model is {EMBEDDED_MODEL!r}")
    elif looks_like_local_path(name):
        from sparse_models.model_files import model_folder_problems  # the loaders' own checks

        folder = resolve_input_path(name)
        found = model_folder_problems(folder)
        if not folder.exists():
            add(f"model.name_or_path={name!r}: no model folder with a config.json there; fix the path or use a Hub id")
        else:
            if found:
                add(f"model.name_or_path={name!r}: {'; '.join(found)}; fix the path or use a Hub id")
            try:  # a config that parses still feeds the shape rules below
                model_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                model_config = None
            if not isinstance(model_config, dict):
                model_config = None
    else:
        model_config = _cached_hub_config(name, r.model.revision)

    _check_sequence_parallel_world(r, problems)
    _check_long_context_packages(r, problems)
    if r.eval.control_export and not (resolve_input_path(r.eval.control_export) / "config.json").is_file():
        add(f"eval.control_export={r.eval.control_export!r}: no export with a config.json there; run this recipe "
            "with train.attention=dense first (its export is the control), or set eval.control_export: null")
    if model_config is not None:
        _check_sequence_parallel_heads(r, model_config, problems)
        _check_protect_units(r, model_config, problems)
        _check_kv_target(r, model_config, problems)
        max_positions = model_config.get("max_position_embeddings")
        has_scaling = bool(r.model.rope_scaling or model_config.get("rope_scaling")
                           or (model_config.get("rope_parameters") or {}).get("rope_type", "default") != "default")
        for key, length in (("data.context_length", r.data.context_length), ("eval.context_length", r.eval.context_length),
                            ("pod.calibration_length", r.pod.calibration_length)):
            if length and max_positions and length > max_positions and not has_scaling and r.model.rope_theta is None:
                add(f"{key}={length} is above the model's max_position_embeddings={max_positions} and no rope scaling "
                    f"is set: add model.rope_scaling (e.g. {{rope_type: linear, factor: {-(-length // max_positions)}}}) "
                    f"or model.rope_theta, or lower {key}")

    if r.pod.blocks_file and not resolve_input_path(r.pod.blocks_file).is_file():
        add(f"pod.blocks_file={r.pod.blocks_file!r} does not exist: run the exploration once "
            f"(train/pod.py RECIPE --stages explore) or set pod.blocks_file: null")

    from train.corpus.mixture import MixError, parse_mix

    try:
        mix = parse_mix(r.data.train)
    except MixError:  # reported by the value rules
        mix = []
    sources = [("data.train" if len(mix) == 1 else f"data.train[{i}]", e.source) for i, e in enumerate(mix)]
    sources += [("data.eval", r.data.eval)]
    sources += [(f"eval.out_of_domain[{i}]", source) for i, source in enumerate(r.eval.out_of_domain)]
    for key, source in sources:
        if not source:
            continue
        if source.startswith(EMBEDDED_DATA_PREFIX):
            _check_embedded_data(key, source, problems)
        elif looks_like_local_path(source) and not resolve_input_path(source).exists():
            add(f"{key}={source!r}: no such file or folder")

    if r.deepspeed.config:
        path = resolve_input_path(r.deepspeed.config)
        if not path.is_file():
            add(f"deepspeed.config={r.deepspeed.config!r}: no such file; use recipes/deepspeed/zero2.json, zero3.json, "
                f"zero3_offload.json or null")
        else:
            try:
                ds = json.loads(path.read_text())
                stage = (ds.get("zero_optimization") or {}).get("stage", 0)
                if stage == 3 and r.train.method == "lora" and r.train.merge_lora is False:
                    pass  # allowed; the adapter is saved from gathered weights
                if ds.get("fp16", {}).get("enabled") is True and r.train.bf16:
                    add(f"deepspeed.config={r.deepspeed.config!r} enables fp16 while train.bf16 is true: pick one")
            except (OSError, json.JSONDecodeError) as error:
                add(f"deepspeed.config={r.deepspeed.config!r} is not valid JSON ({error})")

    if r.train.output_dir:
        _check_writable("train.output_dir", Path(r.train.output_dir).expanduser(), problems)
    if r.train.export_dir:
        _check_writable("train.export_dir", Path(r.train.export_dir).expanduser(), problems)
    resume = r.train.resume_from_checkpoint
    if resume not in (None, "auto") and not Path(resume).expanduser().is_dir():
        add(f"train.resume_from_checkpoint={resume!r}: no such checkpoint folder; use null, 'auto' or a checkpoint-N path")


def _check_embedded_data(key: str, source: str, problems: list[str]) -> None:
    from train.corpus.documents import podkit_names as embedded_corpus_names  # the corpus owns the names

    name = source[len(EMBEDDED_DATA_PREFIX):]
    if name not in embedded_corpus_names():
        problems.append(f"{key}={source!r}: unknown embedded corpus; expected podkit:<one of "
                        f"{', '.join(embedded_corpus_names())}>")


def _check_writable(key: str, path: Path, problems: list[str]) -> None:
    """The folder, or its nearest existing ancestor, must be a writable directory (nothing is created)."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if path.exists() and not path.is_dir():
        problems.append(f"{key}={str(path)!r} exists and is not a folder: choose another path")
        return
    reason = None
    dangling = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is not None:
        reason = f"{str(dangling)!r} is a symbolic link to {os.readlink(dangling)!r}, which does not exist"
    elif not probe.is_dir():
        reason = f"{str(probe)!r} is a file, not a folder"
    elif not os.access(probe, os.W_OK | os.X_OK):
        reason = f"{str(probe)!r} does not accept new files"
    elif os.statvfs(probe).f_flag & os.ST_RDONLY:
        reason = f"{str(probe)!r} is on a read-only file system"
    if reason:
        problems.append(f"{key}={str(path)!r} is not writable ({reason}): choose a folder you can write to")


def _cached_hub_config(repo_id: str, revision: str | None) -> dict | None:
    """The Hub model's config.json if it is already in the local cache (no network during validation)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        if isinstance(cached, str):
            return json.loads(Path(cached).read_text())
    except Exception:  # noqa: BLE001 - an unknown config only skips the positions check
        return None
    return None
