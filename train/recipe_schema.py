"""The recipe schema: one dataclass per YAML section, the :class:`Recipe` tree, and the coercion of
plain YAML data into it (unknown keys and wrong types become problem lines, never exceptions).

Plain dataclasses (no pydantic: the GPU image does not have it); each field's type comes from its
annotation. Ranges and cross-field rules live in ``train/recipe_checks.py``; reading, overrides and
the one-pass report in ``train/recipe.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparse_models.config import ConfigError
from train.inputs import resolve_input_path

LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES = ("bfloat16", "float16", "float32")


class RecipeError(ConfigError):
    """The recipe is invalid. ``problems`` holds one actionable line per problem.

    A :class:`sparse_models.config.ConfigError` (a ``ValueError``), like every podkit configuration error."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid recipe:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class ModelSection:
    """The base model. ``name_or_path``: a Hub id, a local folder, or ``podkit:smollm2-135m``."""

    name_or_path: str = ""
    revision: str | None = None
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    rope_theta: float | None = None           # set to extend the context (paper: a larger RoPE base)
    rope_scaling: dict | None = None          # e.g. {rope_type: linear, factor: 4.0}


@dataclass
class PodSection:
    """POD (arXiv 2412.02252) structure and exploration. Paper defaults: 16 sink + 4080 recent, delta 0.5."""

    sink_tokens: int = 16
    recent_window: int = 4080
    delta: float = 0.5                        # similarity threshold of the greedy grouping, in [0, 1]
    compare_with: str = "anchor"              # "anchor" (METHODS.md's recommendation) or "previous"
    blocks_file: str | None = None            # reuse an exploration's blocks JSON instead of exploring
    # [layer, KV head] units that keep their own distant keys: each becomes an anchor of the explored (or
    # reused) block map. Rank them with `python -m eval.retrieval_units` (pass-key retrieval; BENCHMARKS.md), or
    # "auto": learned gates on synthetic recall data choose them under pod.min_kv_saving (train/unit_selection/)
    protect_units: list[list[int]] | str = field(default_factory=list)
    unit_selection: dict = field(default_factory=dict)  # settings of "auto": UnitSelectionSection's fields
    # Fraction of the dense KV cache that must be saved at data.context_length (e.g. 0.3). When the explored
    # (and protected) map saves less, delta is lowered over the exploration's similarity until it does.
    min_kv_saving: float | None = None
    # A KV budget met with as little sharing as possible (a point of a RULER-against-KV-saved curve): delta is
    # searched from 1.0 down over the exploration's similarity, so the map saves at least this fraction and the
    # next higher delta would save less. Exclusive with min_kv_saving, which keeps an explored map that already
    # saves more.
    kv_saving: float | None = None
    calibration_samples: int = 8              # N
    calibration_length: int | None = None     # tokens per calibration sample (default: data.context_length)
    last_queries: int = 64                    # q: attention rows of the last q queries are compared
    sharing: str = "keys"                     # "keys" (paper v2) or "scores" (v1)
    gate_tau: float | None = None             # inference compute skipping (paper: 0.7); not used in training


@dataclass
class UnitSelectionSection:
    """``pod.unit_selection``, the settings of ``pod.protect_units: auto`` (train/unit_selection/; DuoAttention,
    arXiv 2410.10819, adapted to POD): gates of the shared units learned on synthetic recall episodes."""

    steps: int = 200                          # optimiser steps
    lr: float = 0.02                          # Adam learning rate of the gates (DuoAttention's)
    l1_weight: float = 0.05                   # lambda: weight of mean(alpha), the pressure toward sharing
    samples: int = 16                         # recall episodes (cycled over the steps)
    batch_size: int = 1                       # episodes per step
    length: int | None = None                 # tokens per episode (default: data.context_length)
    candidate_delta: float = 0.25             # the candidate map: greedy blocks at this delta, or lower if the
                                              # budget needs it (units are given back from there)
    data: str = "recall"                      # "recall": podkit:recall episodes over the training prose
    seed: int = 0


UNIT_SELECTION_DATA = ("recall",)


def unit_selection_settings(pod: "PodSection", problems: list[str] | None = None) -> UnitSelectionSection:
    """``pod.unit_selection`` as a :class:`UnitSelectionSection` (unknown keys and wrong types: problem lines)."""
    found: list[str] = []
    settings = build_section("pod.unit_selection", UnitSelectionSection, pod.unit_selection or {}, found)
    if problems is not None:
        problems.extend(found)
    elif found:
        raise RecipeError(found)
    return settings


@dataclass
class DataSection:
    """Training / held-out text. A source is ``podkit:<name>`` (embedded: ``podkit:austen``, a corpus
    source of ``train.corpus.registry``, ``podkit:heldout-indomain`` / ``podkit:heldout-ood``), a Hub
    dataset name, or a local .txt / .jsonl / .json / .parquet file or folder. ``train`` is one source
    or a weighted mixture (``train.corpus.mixture``): a list of sources / ``{source, weight}``, or
    ``"src=w,src=w"``. Training text is tokenised once into shards under ``token_cache``."""

    train: str | list[dict | str] = ""
    train_config: str | None = None
    train_split: str = "train"
    eval: str | None = None
    eval_config: str | None = None
    eval_split: str = "train"
    text_field: str = "text"
    context_length: int = 2048
    max_train_tokens: int | None = None       # training tokens drawn from the mixture (None: every row once)
    num_proc: int = 1
    token_cache: str | None = None            # token shard folder (default $PODKIT_TOKEN_CACHE or $PODKIT_CACHE/tokens)


@dataclass
class TrainSection:
    """transformers Trainer settings. ``method``: "full" (paper) or "lora" (peft). ``attention``: "pod" (the
    adaptation) or "dense": the fair control, the same model, data, steps, optimizer and objective with dense
    attention and no exploration, so POD's own cost is separated from what the fine-tuning costs."""

    output_dir: str = ""
    attention: str = "pod"
    method: str = "full"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    merge_lora: bool = True                   # export a merged model (False: export the adapter too)
    learning_rate: float = 1e-5
    lr_scheduler: str = "cosine"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_steps: int = -1
    num_train_epochs: float = 1.0
    per_device_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    bf16: bool = True
    gradient_checkpointing: bool = True
    logging_steps: int = 1
    save_steps: int = 500
    save_total_limit: int | None = 2
    seed: int = 42
    resume_from_checkpoint: str | None = None  # null, "auto" (latest checkpoint in output_dir) or a path
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    export_dir: str | None = None             # default: <output_dir>/export
    sequence_parallel_size: int = 1           # Ulysses SP: ranks sharing each sequence (train/sequence_parallel.py)
    objective: str = "lm"                     # "lm", "distill" (KL to the dense teacher) or "lm+distill"
    distill_weight: float = 0.5               # w in (1 - w) * lm + w * distill, for "lm+distill"
    distill_temperature: float = 1.0          # T: both distributions softened by T, the KL scaled by T^2
    loss_chunk_tokens: int | None = 4096      # tokens per LM-head chunk (train/losses.py); null: all at once
    tiled_mlp: bool = False                   # MLP over sequence slices, DeepSpeed's TiledMLP (train/long_context.py)
    tiled_mlp_shards: int | None = None       # slices per MLP call; null: ceil(tokens per rank / (4 * hidden_size))
    activation_offload: bool = False          # checkpointed layer inputs to CPU (needs gradient_checkpointing)


@dataclass
class DeepSpeedSection:
    """``config``: a DeepSpeed JSON (recipes/deepspeed/zero{2,3,3_offload}.json) or null for no DeepSpeed."""

    config: str | None = None


@dataclass
class HubSection:
    """Push the export to the Hugging Face Hub when ``repo_id`` is set. The token comes from the
    environment (HF_TOKEN) or huggingface_hub's login, never from the recipe."""

    repo_id: str | None = None
    private: bool = True
    commit_message: str = "POD adaptation (podkit)"


@dataclass
class EvalSection:
    """Held-out perplexity (dense, POD before, POD after adaptation) and the KV bytes saved."""

    perplexity: bool = True
    max_tokens: int = 16384                   # held-out tokens scored per model
    out_of_domain: list[str] = field(default_factory=list)  # more held-out sources, scored beside data.eval
    every_steps: int | None = None            # learning curve: held-out ppl every N optimizer steps
    curve_max_tokens: int = 8192              # held-out tokens per source at each learning-curve point
    report_note: str | None = None            # printed after the results (e.g. where a bigger run stands);
                                              # {max_steps} and {device} are filled in (pipeline.render_report_note)
    context_length: int | None = None         # default: data.context_length
    batch_size: int = 1
    # The export of a dense fine-tune control (a run of this recipe with train.attention=dense): scored as a row
    # beside the original dense model, POD and POD's weights run densely, in perplexity and RULER
    control_export: str | None = None


@dataclass
class LongContextSection:
    """RULER (arXiv 2404.06654, offline: train/long_context_eval/ruler.py) inside the pipeline.

    Two splits that never share a sample (train/long_context_eval/protocol.py): the *test* split (``seed``,
    ``tasks``, ``samples``) is what the eval stage reports in results.json and the model card; the *dev* split
    (``dev_seed``, ``dev_tasks``, ``dev_samples``) is what the learning curve scores and what settings, units and
    checkpoints are chosen on. Lengths: ``lengths``, or ``length_factors`` x data.context_length, capped at the
    model's context."""

    ruler: bool = False
    length_factors: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])
    lengths: list[int] | None = None
    tasks: list[str] | None = None            # null: all 13
    samples: int = 20                         # per task and length
    seed: int = 7919
    dev_tasks: list[str] = field(default_factory=lambda: ["niah_single_2", "niah_multikey_1", "niah_multivalue", "vt",
                                                          "cwe", "qa_1"])
    dev_samples: int = 5
    dev_seed: int = 104729
    curve: bool = True                        # score the dev split at every learning-curve point
    chat: bool = True                         # prompts in the model's chat template (RULER on an Instruct model)
    batch_size: int = 32                      # prompts per engine batch
    samples_dir: str | None = None            # generated samples cached here (default <output_dir>/ruler_samples)


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "pod": PodSection,
    "data": DataSection,
    "train": TrainSection,
    "deepspeed": DeepSpeedSection,
    "hub": HubSection,
    "eval": EvalSection,
    "long_context": LongContextSection,
}


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    pod: PodSection = field(default_factory=PodSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    hub: HubSection = field(default_factory=HubSection)
    eval: EvalSection = field(default_factory=EvalSection)
    long_context: LongContextSection = field(default_factory=LongContextSection)
    source_path: str | None = None            # the YAML file it came from (not part of the schema)

    def to_dict(self) -> dict[str, Any]:
        """The recipe as plain data (what the model card embeds), without ``source_path``."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @property
    def eval_context_length(self) -> int:
        return self.eval.context_length or self.data.context_length

    @property
    def calibration_length(self) -> int:
        return self.pod.calibration_length or self.data.context_length

    @property
    def export_dir(self) -> Path:
        return Path(self.train.export_dir) if self.train.export_dir else Path(self.train.output_dir) / "export"

    @property
    def deepspeed_config_path(self) -> Path | None:
        return resolve_input_path(self.deepspeed.config) if self.deepspeed.config else None


# ---------------------------------------------------------------------------------------------
# Coercion of YAML values into the schema


def build_section(name: str, cls: type, values: dict, problems: list[str]):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            problems.append(f"{name}.{key}: unknown field{suggest(key, known)}; allowed: {', '.join(sorted(known))}")
            continue
        coerced, ok = _coerce(value, hints[key])
        if not ok:
            problems.append(f"{name}.{key}={value!r}: expected {_describe(hints[key])}, got {type(value).__name__}")
            continue
        kwargs[key] = coerced
    return cls(**kwargs)


def _coerce(value: Any, hint: Any) -> tuple[Any, bool]:
    """(value converted to ``hint``, whether it fits). Ints are accepted for floats, and numeric
    strings too (PyYAML reads ``1e-5`` without a dot as a string)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        args = typing.get_args(hint)
        if value is None:
            return None, type(None) in args
        for arg in args:
            if arg is type(None):
                continue
            coerced, ok = _coerce(value, arg)
            if ok:
                return coerced, True
        return value, False
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            return value, False
        out = []
        for element in value:
            coerced, ok = _coerce(element, item)
            if not ok:
                return value, False
            out.append(coerced)
        return out, True
    if hint is bool:
        return value, isinstance(value, bool)
    if hint is int:
        return value, isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        if isinstance(value, bool):
            return value, False
        if isinstance(value, (int, float)):
            return float(value), True
        if isinstance(value, str):
            try:
                return float(value), True
            except ValueError:
                return value, False
        return value, False
    if hint is str:
        return value, isinstance(value, str)
    if hint is dict:
        return value, isinstance(value, dict)
    return value, isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        parts = [_describe(a) for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in typing.get_args(hint) else "")
    if origin is list:
        return f"a list of {_plural(typing.get_args(hint)[0])}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}.get(hint, str(hint))


def _plural(hint: Any) -> str:
    """The elements of a list, as a noun phrase: ``strings``, ``integers``, ``lists of integers``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        return " or ".join(_plural(a) for a in typing.get_args(hint) if a is not type(None)) + (
            " or nulls" if type(None) in typing.get_args(hint) else "")
    if origin is list:
        return f"lists of {_plural(typing.get_args(hint)[0])}"
    return {bool: "true/false values", int: "integers", float: "numbers", str: "strings", dict: "mappings"}.get(
        hint, f"{hint} values")


def suggest(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
