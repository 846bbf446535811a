"""Recipe rules of ``train.tiled_mlp`` / ``train.tiled_mlp_shards`` / ``train.activation_offload``
(train/long_context.py): one actionable line per problem, before anything heavy; valid combinations pass."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from train.recipe import RecipeError, recipe_from_dict

REPO = Path(__file__).resolve().parents[2]


def _problems(tmp_path, **train) -> list[str]:
    data = yaml.safe_load((REPO / "recipes" / "smollm2_135m.yaml").read_text())
    data["train"]["output_dir"] = str(tmp_path / "out")
    data["train"].update(train)
    try:
        recipe = recipe_from_dict(data)
    except RecipeError as error:
        return error.problems
    for name, value in train.items():
        assert getattr(recipe.train, name) == value
    return []


def test_defaults_are_off(tmp_path):
    data = yaml.safe_load((REPO / "recipes" / "smollm2_135m.yaml").read_text())
    data["train"]["output_dir"] = str(tmp_path / "out")
    t = recipe_from_dict(data).train
    assert (t.tiled_mlp, t.tiled_mlp_shards, t.activation_offload) == (False, None, False)


@pytest.mark.parametrize("train", [
    {"tiled_mlp": True},
    {"tiled_mlp": True, "tiled_mlp_shards": 8},
    {"activation_offload": True, "gradient_checkpointing": True},
    {"tiled_mlp": True, "activation_offload": True, "gradient_checkpointing": True},
])
def test_valid_combinations(tmp_path, train):
    assert _problems(tmp_path, **train) == []


@pytest.mark.parametrize("train, line", [
    ({"tiled_mlp": True, "tiled_mlp_shards": 0},
     "train.tiled_mlp_shards=0: expected an integer >= 1, or null for ceil(tokens per rank / (4 * hidden_size))"),
    ({"tiled_mlp_shards": 4},
     "train.tiled_mlp_shards=4 has no effect with train.tiled_mlp: false; set train.tiled_mlp: true or remove "
     "train.tiled_mlp_shards"),
    ({"activation_offload": True, "gradient_checkpointing": False},
     "train.activation_offload: true offloads the inputs that gradient checkpointing keeps, so it needs "
     "train.gradient_checkpointing: true"),
    ({"tiled_mlp": "yes"}, "train.tiled_mlp='yes': expected true/false, got str"),
    ({"tiled_mlp": True, "tiled_mlp_shards": 2.5}, "train.tiled_mlp_shards=2.5: expected an integer or null, got float"),
])
def test_bad_values_report_one_line(tmp_path, train, line):
    assert _problems(tmp_path, **train) == [line]
    assert not (tmp_path / "out").exists()


def test_missing_deepspeed_is_reported(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert _problems(tmp_path, tiled_mlp=True) == [
        "train.tiled_mlp: true uses DeepSpeed's ALST components, but deepspeed is not installed (pip install deepspeed)"]


@pytest.mark.parametrize("name", ["llama3_1_8b", "llama3_1_8b_sp"])
def test_shipped_128k_recipes_tile_and_offload(name, monkeypatch):
    from train.recipe import load_recipe

    monkeypatch.setenv("WORLD_SIZE", "8")
    t = load_recipe(REPO / "recipes" / f"{name}.yaml").train
    assert (t.tiled_mlp, t.tiled_mlp_shards, t.activation_offload, t.gradient_checkpointing) == (True, None, True, True)


def test_two_gpu_override_of_the_sp_recipe(monkeypatch):
    """The 2-GPU line of recipes/llama3_1_8b_sp.yaml: SP 2, ZeRO-3 with the Adam state on the CPU only."""
    import json

    from train.recipe import load_recipe

    monkeypatch.setenv("WORLD_SIZE", "2")
    recipe = load_recipe(REPO / "recipes" / "llama3_1_8b_sp.yaml", [
        "train.sequence_parallel_size=2", "deepspeed.config=recipes/deepspeed/zero3_offload_optimizer.json"])
    zero = json.loads(recipe.deepspeed_config_path.read_text())["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
