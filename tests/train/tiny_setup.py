"""Tiny local model + tokenizer + text + recipe for the pipeline tests (no hub, seconds on CPU)."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def make_tiny_model(folder: Path, *, layers: int = 4, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A random Llama (hidden 64) with a byte-level BPE tokenizer (vocab ~300) trained on Austen text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import tiny_model
    from train.corpus.texts import load_text

    folder.mkdir(parents=True, exist_ok=True)
    corpus = load_text("persuasion")[:200_000]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator([corpus[i:i + 2000] for i in range(0, len(corpus), 2000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(folder)
    tiny_model(layers=layers, seed=seed, podkit=False, eval=False, vocab=len(fast), heads=heads, kv_heads=kv_heads,
               hidden=64, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
               pad_token_id=fast.pad_token_id, tie_word_embeddings=False).save_pretrained(folder)
    return folder


TRAIN_TEXT = "northanger_abbey"  # the tiny runs' training text; HELD_OUT_TEXT (train/corpus/texts.py) is held out


def make_texts(folder: Path) -> tuple[Path, Path]:
    from train.corpus.texts import HELD_OUT_TEXT, load_text

    folder.mkdir(parents=True, exist_ok=True)
    train = folder / "train.txt"
    train.write_text(load_text(TRAIN_TEXT)[:60_000])
    held = folder / "heldout.jsonl"
    import json

    held.write_text("\n".join(json.dumps({"text": load_text(HELD_OUT_TEXT)[i:i + 6000]}) for i in range(0, 24_000, 6000)))
    return train, held


def tiny_recipe(tmp: Path, model: Path, train_text: Path, held_out: Path, **sections) -> dict:
    recipe = {
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "pod": {"sink_tokens": 4, "recent_window": 12, "delta": 0.5, "calibration_samples": 2, "last_queries": 8},
        "data": {"train": str(train_text), "eval": str(held_out), "context_length": 64, "max_train_tokens": 64 * 24,
                 "token_cache": str(tmp / "tokens")},
        "train": {"output_dir": str(tmp / "out"), "learning_rate": 1e-3, "lr_scheduler": "constant", "max_steps": 4,
                  "per_device_batch_size": 2, "gradient_accumulation_steps": 1, "bf16": False,
                  "gradient_checkpointing": True, "save_steps": 2, "save_total_limit": 3, "report_to": ["none"]},
        "deepspeed": {"config": None},
        "eval": {"max_tokens": 256},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def tiny_pod_model(root: Path, anchors: list[list[int]]):
    """(recipe, POD model with ``anchors``, tokenizer) on a 2-layer tiny model under ``root``."""
    from train.models import load_model, load_tokenizer
    from train.recipe import recipe_from_dict

    model_dir = make_tiny_model(root / "model", layers=2)
    train_text, held = make_texts(root / "texts")
    recipe = recipe_from_dict(tiny_recipe(root, model_dir, train_text, held))
    model = load_model(recipe, str(model_dir), anchor_layers=anchors)
    return recipe, model, load_tokenizer(recipe, str(model_dir))
