"""Recipe rules of ``train.sequence_parallel_size`` (Ulysses): one actionable line per problem, raised before
anything heavy; valid combinations pass."""

import json
from pathlib import Path

import pytest
import yaml

from train.recipe import RecipeError, recipe_from_dict

REPO = Path(__file__).resolve().parents[2]


def _base(tmp_path, **train) -> dict:
    data = yaml.safe_load((REPO / "recipes" / "smollm2_135m.yaml").read_text())
    data["train"]["output_dir"] = str(tmp_path / "out")
    data["train"].update(train)
    return data


def _local_model(tmp_path, heads: int, kv_heads: int) -> str:
    folder = tmp_path / f"model_{heads}_{kv_heads}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": heads,
                                                    "num_key_value_heads": kv_heads,
                                                    "max_position_embeddings": 131072}))
    (folder / "model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")  # no tensors: a complete, empty file
    return str(folder)


def _problems(data, monkeypatch, world: str | None = "4") -> list[str]:
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    try:
        recipe_from_dict(data)
    except RecipeError as error:
        return error.problems
    return []


def test_valid_sequence_parallel_recipe(tmp_path, monkeypatch):
    data = _base(tmp_path, sequence_parallel_size=4)
    data["model"]["name_or_path"] = _local_model(tmp_path, 32, 8)  # the Llama-3-8B head counts
    data["deepspeed"] = {"config": "recipes/deepspeed/zero3.json"}
    assert _problems(data, monkeypatch, world="8") == []
    data["train"]["sequence_parallel_size"] = 8
    assert _problems(data, monkeypatch, world="16") == []


@pytest.mark.parametrize("train,deepspeed,world,expected", [
    ({"sequence_parallel_size": 0}, "zero3", "4", "train.sequence_parallel_size=0: expected an integer >= 1 (1 = off)"),
    ({"sequence_parallel_size": 2}, None, "4",
     "train.sequence_parallel_size=2 needs DeepSpeed (its Ulysses all-to-all and process groups): set deepspeed.config"),
    ({"sequence_parallel_size": 3}, "zero3", "6",
     "data.context_length=512 is not divisible by train.sequence_parallel_size=3"),
    ({"sequence_parallel_size": 4}, "zero3", "6",
     "train.sequence_parallel_size=4 does not divide the world size 6 (WORLD_SIZE)"),
    ({"sequence_parallel_size": 2}, "zero3", None,
     "train.sequence_parallel_size=2 does not divide the world size 1 (WORLD_SIZE)"),
])
def test_sequence_parallel_problems(tmp_path, monkeypatch, train, deepspeed, world, expected):
    data = _base(tmp_path, **train)
    data["model"]["name_or_path"] = _local_model(tmp_path, 32, 8)
    data["deepspeed"] = {"config": f"recipes/deepspeed/{deepspeed}.json" if deepspeed else None}
    problems = _problems(data, monkeypatch, world)
    assert any(expected in p for p in problems), problems


def test_heads_must_divide(tmp_path, monkeypatch):
    data = _base(tmp_path, sequence_parallel_size=4)
    data["deepspeed"] = {"config": "recipes/deepspeed/zero3.json"}
    data["model"]["name_or_path"] = _local_model(tmp_path, 12, 6)
    problems = _problems(data, monkeypatch, world="4")
    assert any("Ulysses needs the attention heads (12) and KV heads (6)" in p and "use a divisor of 6" in p
               for p in problems), problems
    # the embedded SmolLM2-135M has 9 heads / 3 KV heads: SP 3 works, SP 2 does not
    data = _base(tmp_path, sequence_parallel_size=2)
    data["deepspeed"] = {"config": "recipes/deepspeed/zero3.json"}
    data["data"]["context_length"] = 1024
    assert any("attention heads (9) and KV heads (3)" in p for p in _problems(data, monkeypatch, world="2"))


def test_shipped_sequence_parallel_recipe(monkeypatch):
    from train.recipe import load_recipe

    monkeypatch.setenv("WORLD_SIZE", "8")
    recipe = load_recipe(REPO / "recipes" / "llama3_1_8b_sp.yaml")
    assert (recipe.train.sequence_parallel_size, recipe.data.context_length) == (8, 131072)
    assert json.loads(recipe.deepspeed_config_path.read_text())["zero_optimization"]["stage"] == 3
    monkeypatch.setenv("WORLD_SIZE", "12")
    with pytest.raises(RecipeError, match="does not divide the world size 12"):
        load_recipe(REPO / "recipes" / "llama3_1_8b_sp.yaml")
