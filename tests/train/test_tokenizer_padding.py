"""issue 33: the training tokenizer (saved into the export as it is) pads on the left, so README's
``model.generate(**tokenizer(prompts, return_tensors="pt", padding=True))`` continues every row, short ones included."""

from __future__ import annotations

import json

from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe


def test_training_tokenizer_saves_left_padding(tmp_path):
    from transformers import AutoTokenizer

    from train.models import load_tokenizer
    from train.recipe import load_recipe

    model = make_tiny_model(tmp_path / "model", layers=2)
    assert AutoTokenizer.from_pretrained(model).padding_side == "right"  # the source pads on the right
    train_text, held = make_texts(tmp_path / "texts")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, model, train_text, held)))
    tokenizer = load_tokenizer(recipe, str(model))
    assert tokenizer.padding_side == "left"
    tokenizer.save_pretrained(tmp_path / "export")  # what train/export.py does with it
    assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["padding_side"] == "left"
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "export")
    batch = reloaded(["It is a truth universally acknowledged", "Emma"], padding=True)
    assert [row[-1] for row in batch["attention_mask"]] == [1, 1]  # every row ends in a real token
