"""Loading a model + tokenizer for evaluation, by name: ``"default"`` (the embedded SmolLM2) or a path.

All evaluation entry points (lm-eval model, ``eval.quality``, ``eval.fidelity``, calibration
commands) go through :func:`load_model` / :func:`load_tokenizer`, so ``pretrained=default`` means the
same thing everywhere. Scheme overrides (``decode_scheme="tidal", tidal_budget=128``) are handed to
the podkit model classes, which validate them (sparse_models.config). Nothing here imports lm-eval,
datasets or deepspeed: it runs on the GPU image too.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAMES = ("default", "smollm2", "smollm2-135m-instruct")

# model_type of a plain transformers checkpoint -> podkit class name (ARCHITECTURE.md, sparse_models)
PODKIT_CLASSES = {
    "llama": "PodkitLlamaForCausalLM", "podkit_llama": "PodkitLlamaForCausalLM",
    "mistral": "PodkitMistralForCausalLM", "podkit_mistral": "PodkitMistralForCausalLM",
    "qwen2": "PodkitQwen2ForCausalLM", "podkit_qwen2": "PodkitQwen2ForCausalLM",
}


def is_default_model(pretrained: str) -> bool:
    return str(pretrained).lower() in DEFAULT_MODEL_NAMES


def resolve_torch_dtype(dtype: Any, device: str):
    """``"auto"``/None -> bf16 on CUDA, fp32 on CPU (the CPU has no fast bf16 matmul)."""
    import torch  # lazy: torch imports in seconds; eval.models stays light for eval.lm_eval and the lm-eval task code

    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if str(dtype) not in names:
        raise ValueError(f"dtype={dtype!r} is invalid: expected auto or one of {', '.join(names)}")
    return names[str(dtype)]


def podkit_class(model_type: str):
    """The podkit model class for a checkpoint's ``model_type`` (looked up in sparse_models)."""
    name = PODKIT_CLASSES.get(model_type)
    if name is None:
        raise ValueError(f"model_type={model_type!r} has no podkit class: supported {', '.join(sorted(PODKIT_CLASSES))}")
    for module_name in ("sparse_models", f"sparse_models.modeling_{model_type.replace('podkit_', '')}"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(f"sparse_models does not provide {name} yet (looked in sparse_models and "
                      f"sparse_models.modeling_{model_type.replace('podkit_', '')})")


def parse_override_value(value: Any) -> Any:
    """Command-line values (lm-eval model_args, ``--set``) arrive as strings: parse them as
    ``sparse_models.config.parse_override_value`` does ('0.005' -> 0.005, '[15, 16]' / '15,16' ->
    a list, 'none' / 'null' -> None); values that are already typed pass through."""
    if isinstance(value, str):
        from sparse_models.config import parse_override_value as parse_text  # lazy: sparse_models imports torch

        return parse_text(value.strip())
    return value


def load_model(pretrained: str = "default", *, device: str = "cpu", dtype: Any = "auto", **overrides: Any):
    """A podkit model in eval mode on ``device``; ``overrides`` are flat scheme overrides.

    ``pretrained``: ``"default"`` (SmolLM2-135M-Instruct via sparse_models.smollm2) or a folder with a
    plain Llama/Mistral/Qwen2 checkpoint or a podkit export.
    """
    torch_dtype = resolve_torch_dtype(dtype, device)
    overrides = {key: parse_override_value(value) for key, value in overrides.items()}
    if is_default_model(pretrained):
        from sparse_models.smollm2 import load_default_model  # lazy: sparse_models imports torch

        model = load_default_model(dtype=torch_dtype, **overrides)
    else:
        path = Path(pretrained)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"pretrained={pretrained!r} is neither 'default' nor a folder with config.json")
        model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
        try:
            cls = podkit_class(model_type)
        except ImportError:
            if overrides:
                raise
            # Dense with no overrides is plain transformers: still evaluable while sparse_models lacks the class.
            # lazy: transformers imports slowly; only this fallback
            from transformers import AutoModelForCausalLM as cls

            warnings.warn(f"podkit model classes are not importable; loading {pretrained} with plain transformers "
                          "(dense attention only)", stacklevel=2)
        model = cls.from_pretrained(str(path), dtype=torch_dtype, **overrides)
    return model.to(device).eval()


def load_tokenizer(pretrained: str = "default"):
    """The tokenizer that goes with :func:`load_model`'s model."""
    if is_default_model(pretrained):
        from sparse_models import smollm2  # lazy: sparse_models imports torch

        return smollm2.load_default_tokenizer()
    from transformers import AutoTokenizer  # lazy: transformers imports slowly (eval.models stays light)

    return AutoTokenizer.from_pretrained(str(pretrained))
