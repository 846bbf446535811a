"""``pod.protect_units``: units that keep their own distant keys, applied to the explored (or reused) block map
before training, checked before any heavy work, and carried into the export (train/pipeline.py ``_protected``)."""

from __future__ import annotations

import json

import pytest
from pipeline_runs import pipeline_env, python_command, run
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe

from sparse_models.calibration.pod_similarity import protect_units, shared_units, write_blocks_json
from train.recipe import RecipeError, recipe_from_dict

# 5 layers x 2 KV heads: head 0 is one block 0-4; head 1 is blocks 0-1 and 2-4
ANCHORS = [[0, 0], [0, 0], [0, 2], [0, 2], [0, 2]]


def test_protect_units_splits_in_order_and_keeps_blocks_consecutive():
    protected, already = protect_units(ANCHORS, [(3, 0), (1, 0)])
    assert already == []
    assert [row[0] for row in protected] == [0, 1, 1, 3, 3]  # 0 | 1-2 | 3-4
    assert [row[1] for row in protected] == [0, 0, 2, 2, 2]  # head 1 untouched
    assert len(shared_units(protected)) == len(shared_units(ANCHORS)) - 2
    assert ANCHORS == [[0, 0], [0, 0], [0, 2], [0, 2], [0, 2]]  # the input is not modified


def test_protect_units_reports_units_that_already_are_anchors():
    protected, already = protect_units(ANCHORS, [(2, 1), (0, 0), (4, 1)])
    assert already == [(2, 1), (0, 0)]
    assert [row[1] for row in protected] == [0, 0, 2, 2, 4]


@pytest.mark.parametrize("unit", [(5, 0), (0, 2), (-1, 0)])
def test_protect_units_outside_the_map_names_the_unit(unit):
    with pytest.raises(ValueError, match=rf"unit \(layer {unit[0]}, KV head {unit[1]}\) is outside the block map: "
                                         r"expected layer in \[0, 4\] and KV head in \[0, 1\]"):
        protect_units(ANCHORS, [unit])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("protect")
    model = make_tiny_model(root / "model", layers=4, kv_heads=2)
    train_text, held_out = make_texts(root / "text")
    return root, model, train_text, held_out


@pytest.mark.parametrize("units, message", [
    ([[1, 2, 3]], "pod.protect_units[0]=[1, 2, 3]: expected a [layer, KV head] pair of integers >= 0"),
    ([[1, -1]], "pod.protect_units[0]=[1, -1]: expected a [layer, KV head] pair"),
    ([[1, 0], [1, 0]], "a unit is listed twice"),
    ([[4, 0]], "pod.protect_units[0]=[4, 0]: model.name_or_path="),
    ([[1, 2]], "has 4 layers and 2 KV heads; expected a layer in [0, 3] and a KV head in [0, 1]"),
    ("18,2", "pod.protect_units='18,2': expected"),
])
def test_bad_protect_units_are_reported_before_any_work(tiny, units, message):
    root, model, train_text, held_out = tiny
    recipe = tiny_recipe(root / "bad", model, train_text, held_out, pod={"protect_units": units})
    with pytest.raises(RecipeError) as error:
        recipe_from_dict(recipe)
    assert message in str(error.value)


def test_the_embedded_model_is_checked_against_its_30_layers():
    with pytest.raises(RecipeError, match=r"pod.protect_units\[0\]=\[30, 0\]: .* has 30 layers and 3 KV heads"):
        recipe_from_dict({"model": {"name_or_path": "podkit:smollm2-135m"}, "data": {"train": "podkit:austen"},
                          "pod": {"protect_units": [[30, 0]]}})


def test_pipeline_trains_and_exports_the_protected_map(tiny):
    """Reused blocks file + protect_units -> the export's map has the units as anchors; the input file is kept."""
    root, model, train_text, held_out = tiny
    out = root / "run"
    out.mkdir()
    blocks = write_blocks_json(root / "blocks.json", [[0, 0], [0, 0], [0, 2], [0, 2]], delta=0.5)
    before = blocks.read_text()
    recipe = tiny_recipe(out, model, train_text, held_out, eval={"perplexity": False},
                         pod={"blocks_file": str(blocks), "protect_units": [[2, 0], [2, 1]]},
                         train={"max_steps": 1})
    done = run(python_command(write_recipe(root / "protect.yaml", recipe), "--stages", "explore,train,export"),
               pipeline_env())
    assert "pod.protect_units: 1 unit(s) made anchors, 1 already were ([(2, 1)])" in done.stdout
    assert "shared units 5 -> 4" in done.stdout
    expected = [[0, 0], [0, 0], [2, 2], [2, 2]]
    written = json.loads((out / "out" / "exploration" / "blocks_protected.json").read_text())
    assert written["anchor_layers"] == expected and written["protect_units"] == [[2, 0], [2, 1]]
    export = out / "out" / "export"
    assert json.loads((export / "pod_blocks.json").read_text())["anchor_layers"] == expected
    config = json.loads((export / "config.json").read_text())
    assert config["sparse_attention"]["pod"]["anchor_layers"] == expected
    assert "kept as anchors for retrieval (`pod.protect_units`): (2, 0), (2, 1)" in (export / "README.md").read_text()
    assert blocks.read_text() == before
