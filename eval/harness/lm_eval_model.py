"""lm-evaluation-harness model ``podkit``: an HFLM whose model_args choose checkpoint and schemes.

    python -m eval.lm_eval run --model podkit \\
        --model_args pretrained=default decode_scheme=tidal budget=128 \\
        --tasks podkit_passkey --metadata '{"lengths": [2048, 4096]}' --device cpu --batch_size 1

model_args (besides every HFLM argument such as ``batch_size`` or ``max_length``):

* ``pretrained``: ``default`` (the embedded SmolLM2-135M-Instruct) or a checkpoint folder;
* ``dtype``: ``auto`` (bf16 on CUDA, fp32 on CPU), ``float32``, ``bfloat16``, ``float16``;
* any flat scheme override of sparse_models.config (``prefill_scheme``, ``decode_scheme``,
  ``tidal_budget``, ``token_sparse_coverage``, ``pod_blocks_file``, ...);
* ``budget``: shorthand for the decode scheme's budget (see :func:`eval.schemes.budget_overrides`).

lm-eval also hands model_args to task code as metadata; the local tasks (eval/tasks) use
``pretrained`` to pick the tokenizer that sizes their prompts.

Note on phases: lm-eval feeds each request's whole prompt through prefill, so a *decode* scheme
only acts on generated tokens after the first (and not at all on log-likelihood requests).
``python -m eval.quality`` puts the passkey question in the decode phase instead (see there).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from eval.models import load_model, load_tokenizer, parse_override_value
from eval.schemes import budget_overrides
from sparse_models.config import SparseAttentionConfig, is_override_key, unknown_option_error
from sparse_models.validation import ConfigError


def split_model_args(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(scheme overrides, remaining HFLM kwargs); ``budget`` expands to the decode scheme's field."""

    overrides = {key: kwargs[key] for key in kwargs if is_override_key(key)}
    rest = {key: value for key, value in kwargs.items() if key not in overrides and key != "budget"}
    if kwargs.get("budget") is not None:
        decode_scheme = overrides.get("decode_scheme", "dense")
        expanded = budget_overrides(decode_scheme, int(kwargs["budget"]))
        overrides = expanded | {k: v for k, v in overrides.items() if k not in expanded or k == "decode_scheme"}
    return overrides, rest


PODKIT_ARGS = ("pretrained", "dtype", "device", "budget")
# model arguments that must be whole numbers, with their least value: lm-eval passes them on as typed from the
# command line ('abc' stays a string), and int() would fail later with no field named
INTEGER_ARGS = {"budget": 1, "max_length": 1, "max_gen_toks": 1}


def hflm_arguments() -> list[str]:
    """The keyword arguments HFLM's constructor names (its ``**kwargs`` only reach ``from_pretrained`` of a model
    HFLM loads itself, which a podkit model never is)."""
    params = inspect.signature(HFLM.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def check_integer_argument(key: str, value: Any, minimum: int) -> None:
    """Refuse a model argument ``key`` that is given (not None) and is not an integer >= ``minimum``
    (``budget=abc``, ``max_length=1.5``), naming the field, the value and what is allowed."""
    if value is None:
        return
    try:
        number = int(str(value).strip())  # '128' or 128; '1.5', 'abc' and True ('True') are refused
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ConfigError(f"{key}={value!r} is invalid: expected an integer >= {minimum}")


def check_model_args(kwargs: dict[str, Any]) -> None:
    """Refuse a model argument that is neither podkit's, a sparse-attention override nor an HFLM argument
    (``tidal_budgt=128`` would otherwise be dropped and the default settings scored), and bad override values,
    before any model is loaded. The error (sparse_models.config.unknown_option_error) names the close matches."""

    known = set(PODKIT_ARGS) | set(hflm_arguments())
    for key, value in kwargs.items():
        if key not in known and not is_override_key(key):
            raise unknown_option_error(key, value, also_known=sorted(known), what="a podkit model argument",
                                       expected="expected pretrained, dtype, budget, a sparse-attention override "
                                                "(prefill_scheme, decode_scheme, <method>_<field> such as "
                                                "tidal_budget) or an HFLM argument (batch_size, max_length, ...)")
    for key, minimum in INTEGER_ARGS.items():
        check_integer_argument(key, kwargs.get(key), minimum)
    overrides, _ = split_model_args(kwargs)
    if overrides:
        SparseAttentionConfig().with_overrides(**{k: parse_override_value(v) for k, v in overrides.items()})


# HFLM's warnings about a model object in ``pretrained``: podkit builds the model itself (the scheme overrides apply
# at load time, eval.models.load_model) and hands HFLM the object, by design, in one process.
_PREBUILT_NOTICES = ("model kwarg is not of type `str`", "Passed an already-initialized model through `pretrained`")


class _PrebuiltModelNotice(logging.Filter):
    """Drops HFLM's two warnings about a prebuilt model (``_PREBUILT_NOTICES``) while PodkitLM builds HFLM."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(notice in message for notice in _PREBUILT_NOTICES)


@register_model("podkit")
class PodkitLM(HFLM):
    """HFLM over a podkit model (sparse_models classes) built by :func:`eval.models.load_model`."""

    def __init__(self, pretrained: str = "default", dtype: str = "auto", device: str | None = None,
                 **kwargs: Any) -> None:
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "cuda" if torch.cuda.is_available() else "cpu"  # lm-eval's default is cuda:0
        check_model_args(kwargs)
        overrides, rest = split_model_args(kwargs)
        rest.pop("tokenizer", None)  # the tokenizer always comes with the checkpoint
        rest.pop("trust_remote_code", None)
        self.podkit_pretrained = pretrained
        self.podkit_overrides = overrides
        model = load_model(pretrained, device=device, dtype=dtype, **overrides)
        tokenizer = load_tokenizer(pretrained)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        rest.setdefault("backend", "causal")  # podkit_* model types are causal LMs that lm-eval's registry lacks
        hf_logger = logging.getLogger("lm_eval.models.huggingface")
        notice = _PrebuiltModelNotice()
        hf_logger.addFilter(notice)
        try:
            super().__init__(pretrained=model, tokenizer=tokenizer, device=device, **rest)
        finally:
            hf_logger.removeFilter(notice)
