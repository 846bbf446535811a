"""Recipe schema: every shipped recipe validates, overrides apply, bad recipes give their one line each,
and the CLI exits non-zero writing nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from train.recipe import RecipeError, load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ["llama3_8b", "llama3_1_8b", "llama3_8b_lora", "smollm2_135m"]


def _base(tmp_path) -> dict:
    data = yaml.safe_load((REPO / "recipes" / "smollm2_135m.yaml").read_text())
    data["train"]["output_dir"] = str(tmp_path / "out")
    return data


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_validate(name):
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    assert recipe.pod.sink_tokens == 16 and recipe.pod.delta == 0.5
    if name.startswith("llama3"):
        assert recipe.train.learning_rate > 0 and recipe.train.bf16 and recipe.train.gradient_checkpointing
        assert recipe.deepspeed_config_path.is_file()


def test_paper_recipe_values():
    r = load_recipe(REPO / "recipes" / "llama3_8b.yaml")
    assert (r.data.context_length, r.pod.recent_window, r.train.method, r.train.lr_scheduler) == (32768, 4080, "full", "cosine")
    assert r.train.learning_rate == pytest.approx(1e-5)
    assert json.loads(r.deepspeed_config_path.read_text())["zero_optimization"]["stage"] == 3
    for name in ("zero2", "zero3", "zero3_offload"):
        json.loads((REPO / "recipes" / "deepspeed" / f"{name}.json").read_text())


def test_overrides_parse_yaml_scalars(tmp_path):
    r = recipe_from_dict(_base(tmp_path), ["train.max_steps=3", "pod.delta=0.7", "train.learning_rate=1e-4",
                                           "train.report_to=[none]", "hub.repo_id=me/model", "pod.blocks_file="])
    assert (r.train.max_steps, r.pod.delta, r.train.report_to, r.hub.repo_id) == (3, 0.7, ["none"], "me/model")
    assert r.train.learning_rate == pytest.approx(1e-4)  # "1e-4" is a YAML string: coerced for float fields
    assert r.pod.blocks_file is None


BAD = [
    ({"trainer": {}}, "unknown section 'trainer' (did you mean 'train'?)"),
    ({"pod": {"detla": 0.5}}, "pod.detla: unknown field (did you mean 'delta'?)"),
    ({"train": {"max_steps": "ten"}}, "train.max_steps='ten': expected an integer, got str"),
    ({"train": {"bf16": "yes"}}, "train.bf16='yes': expected true/false"),
    ({"pod": {"delta": 1.5}}, "pod.delta=1.5: expected a number in [0, 1]"),
    ({"pod": {"recent_window": 4080}}, "pod.recent_window=4080 (+ pod.sink_tokens=16) >= data.context_length=512"),
    ({"model": {"name_or_path": ""}}, "model.name_or_path is missing"),
    ({"model": {"name_or_path": "./no/such/model"}}, "model.name_or_path='./no/such/model': no model folder with a config.json"),
    ({"deepspeed": {"config": "recipes/deepspeed/zero9.json"}}, "deepspeed.config='recipes/deepspeed/zero9.json': no such file"),
    ({"data": {"context_length": 16384}, "eval": {"max_tokens": 32768}}, "data.context_length=16384 is above the model's max_position_embeddings=8192 and no rope scaling"),
    ({"train": {"method": "qlora"}}, "train.method='qlora': expected 'full' (paper) or 'lora'"),
    ({"pod": {"blocks_file": "missing_blocks.json"}}, "pod.blocks_file='missing_blocks.json' does not exist"),
    ({"hub": {"repo_id": "a/b/c"}}, "hub.repo_id='a/b/c': expected 'user/name'"),
    ({"train": {"learning_rate": -1.0}}, "train.learning_rate=-1.0: expected a positive number"),
    ({"data": {"train": "podkit:tolstoy"}}, "data.train='podkit:tolstoy': unknown embedded corpus"),
    ({"train": {"report_to": ["wandb"]}}, "train.report_to contains 'wandb'"),
    ({"pod": {"last_queries": 4096}}, "pod.last_queries=4096 exceeds the calibration length 512"),
]


def _merge(base: dict, patch: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in patch.items():
        out.setdefault(section, {}).update(values)
    return out


@pytest.mark.parametrize("patch,expected", BAD, ids=[line.split(":")[0].split("=")[0] for _, line in BAD])
def test_bad_recipe_reports_its_line(tmp_path, patch, expected):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(_merge(_base(tmp_path), patch))
    assert any(expected in problem for problem in info.value.problems), info.value.problems
    assert len(info.value.problems) == 1, info.value.problems  # one problem, one line
    assert not (tmp_path / "out").exists()


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(_merge(_base(tmp_path), {"train": {"output_dir": str(blocker / "out")}}))
    assert info.value.problems == [f"train.output_dir={str(blocker / 'out')!r} is not writable ({str(blocker)!r} is a "
                                   f"file, not a folder): choose a folder you can write to"]
    with pytest.raises(RecipeError, match="exists and is not a folder"):
        recipe_from_dict(_merge(_base(tmp_path), {"train": {"output_dir": str(blocker)}}))


def test_problems_are_reported_together(tmp_path):
    patch = {"pod": {"delta": -0.1, "compare_with": "next"}, "train": {"method": "x", "lr_scheduler": "step"},
             "hub": {"repo_id": "bad id"}}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(_merge(_base(tmp_path), patch))
    assert len(info.value.problems) == 5, info.value.problems


def test_type_errors_and_unknown_keys_together(tmp_path):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({**_merge(_base(tmp_path), {"pod": {"delta": "high", "sinks": 4}}), "extra": 1})
    assert len(info.value.problems) == 3


def test_bad_override_syntax(tmp_path):
    with pytest.raises(RecipeError, match="expected section.field=value"):
        recipe_from_dict(_base(tmp_path), ["train.max_steps"])
    with pytest.raises(RecipeError, match="train.nope: unknown field"):
        recipe_from_dict(_base(tmp_path), ["train.nope=1"])


def test_rope_scaling_allows_longer_context(tmp_path):
    data = _merge(_base(tmp_path), {"data": {"context_length": 16384}, "eval": {"max_tokens": 16384}, "model": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}})
    assert recipe_from_dict(data).data.context_length == 16384


def test_local_model_positions_read_from_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    with pytest.raises(RecipeError, match="max_position_embeddings=256"):
        recipe_from_dict(_merge(_base(tmp_path), {"model": {"name_or_path": str(model)}}))


def test_cli_exits_nonzero_and_writes_nothing(tmp_path):
    data = _merge(_base(tmp_path), {"pod": {"delta": 2.0}, "train": {"method": "qlora"}})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    before = sorted(p.name for p in tmp_path.iterdir())
    done = subprocess.run([sys.executable, str(REPO / "train" / "pod.py"), str(path), "--local_rank=0", "eval.batch_size=0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("recipe error: ")]
    assert len(lines) == 3, done.stderr
    assert any("pod.delta=2.0" in line for line in lines) and any("eval.batch_size=0" in line for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_type_and_value_errors_in_one_pass(tmp_path):
    """issue 16: `pod.delta=-1 train.max_steps=abc` reports both; a wrong type is not judged again by its default."""
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(_base(tmp_path), ["pod.delta=-1", "train.max_steps=abc", "data.context_length=big"])
    problems = info.value.problems
    assert any(p.startswith("pod.delta=-1.0: expected a number in [0, 1]") for p in problems), problems
    assert any(p.startswith("train.max_steps='abc': expected an integer") for p in problems), problems
    assert any(p.startswith("data.context_length='big': expected an integer") for p in problems), problems
    assert len(problems) == 3, problems  # no rule compared anything with the default context length


def test_unknown_section_does_not_hide_value_errors(tmp_path):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({**_merge(_base(tmp_path), {"pod": {"delta": 2.0}}), "trainer": {"max_steps": 3}})
    problems = info.value.problems
    assert len(problems) == 2 and any("unknown section 'trainer'" in p for p in problems) \
        and any(p.startswith("pod.delta=2.0") for p in problems), problems


def test_environment_problems_reported_with_value_errors(tmp_path):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(_merge(_base(tmp_path), {"pod": {"delta": 2.0, "blocks_file": "missing_blocks.json"}}))
    assert len(info.value.problems) == 2, info.value.problems


def test_folder_as_recipe_path(tmp_path):
    from train.recipe import load_recipe

    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / "recipes")
    (problem,) = info.value.problems
    assert "is a folder, not a file" in problem and "smollm2_135m.yaml" in problem
