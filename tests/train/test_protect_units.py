"""``pod.protect_units``: units that keep their own distant keys, applied to the explored (or reused) block map
before training, checked before any heavy work, and carried into the export (train/pipeline.py ``_final_map``), and ``pod.min_kv_saving``: delta lowered over the exploration's similarity
until the map saves a KV budget."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from pipeline_runs import pipeline_env, python_command, run
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe

from sparse_models.calibration.pod_similarity import (
    delta_for_kv_saving,
    greedy_blocks,
    kv_saving_fraction,
    max_kv_saving,
    protect_units,
    shared_units,
    write_blocks_json,
)
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


@pytest.mark.parametrize("field, value, message", [
    ("protect_units", [[1, 2, 3]], "pod.protect_units[0]=[1, 2, 3]: expected a [layer, KV head] pair of integers >= 0"),
    ("protect_units", [[1, -1]], "pod.protect_units[0]=[1, -1]: expected a [layer, KV head] pair"),
    ("protect_units", [[1, 0], [1, 0]], "a unit is listed twice"),
    ("protect_units", [[4, 0]], "pod.protect_units[0]=[4, 0]: model.name_or_path="),
    ("protect_units", [[1, 2]], "has 4 layers and 2 KV heads; expected a layer in [0, 3] and a KV head in [0, 1]"),
    ("protect_units", "18,2", "pod.protect_units='18,2': expected"),
    ("min_kv_saving", 0.5, "pod.min_kv_saving=0.5: expected null or a fraction in (0, 0.5)"),
    ("min_kv_saving", 0.0, "pod.min_kv_saving=0.0: expected null or a fraction in (0, 0.5)"),
    ("min_kv_saving", 0.45, "pod.min_kv_saving=0.45: with 4 layers, 4 + 12 proximal tokens and "
                            "data.context_length=64, POD saves at most 0.281 of the KV cache"),
    ("kv_saving", 0.5, "pod.kv_saving=0.5: expected null or a fraction in (0, 0.5)"),
    ("kv_saving", 0.45, "pod.kv_saving=0.45: with 4 layers, 4 + 12 proximal tokens and "
                        "data.context_length=64, POD saves at most 0.281 of the KV cache; lower pod.kv_saving"),
])
def test_bad_pod_fields_are_reported_before_any_work(tiny, field, value, message):
    root, model, train_text, held_out = tiny
    recipe = tiny_recipe(root / "bad", model, train_text, held_out, pod={field: value})
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
    written = json.loads((out / "out" / "exploration" / "blocks_trained.json").read_text())
    assert written["anchor_layers"] == expected and written["protect_units"] == [[2, 0], [2, 1]]
    export = out / "out" / "export"
    assert json.loads((export / "pod_blocks.json").read_text())["anchor_layers"] == expected
    config = json.loads((export / "config.json").read_text())
    assert config["sparse_attention"]["pod"]["anchor_layers"] == expected
    assert "kept as anchors for retrieval (`pod.protect_units`): (2, 0), (2, 1)" in (export / "README.md").read_text()
    assert blocks.read_text() == before


def _random_similarity(layers=12, kv_heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    sim = torch.rand(kv_heads, layers, layers, generator=g) * 0.6 + 0.2
    return (sim + sim.transpose(1, 2)) / 2


@pytest.mark.parametrize("target", [0.1, 0.2, 0.3, 0.35])
def test_delta_for_kv_saving_is_the_largest_threshold_meeting_the_budget(target):
    sim = _random_similarity()
    protect = [(5, 1), (7, 0)]
    delta, anchors = delta_for_kv_saving(sim, target, seq_len=2048, sink=16, recent=240, start_delta=0.9,
                                         protect=protect)
    assert kv_saving_fraction(anchors, 2048, 16, 240) >= target
    assert all(anchors[layer][head] == layer for layer, head in protect)
    assert anchors == protect_units(greedy_blocks(sim, delta), protect)[0]
    # every larger candidate threshold falls short of the budget
    for larger in {round(float(v), 6) for v in sim.flatten().tolist() if delta < v < 0.9} | {0.9}:
        assert kv_saving_fraction(protect_units(greedy_blocks(sim, larger), protect)[0], 2048, 16, 240) < target


def test_delta_for_kv_saving_keeps_a_map_that_already_meets_the_budget():
    sim = _random_similarity()
    delta, anchors = delta_for_kv_saving(sim, 0.05, seq_len=2048, sink=16, recent=240, start_delta=0.5)
    assert delta == 0.5 and anchors == greedy_blocks(sim, 0.5)


def test_delta_for_kv_saving_names_the_best_reachable_saving():
    sim = _random_similarity(layers=4, kv_heads=2)
    ceiling = max_kv_saving(4, 2048, 16, 240)
    assert ceiling == pytest.approx(3 / 4 * (2048 - 256) / 4096)
    with pytest.raises(ValueError, match=r"saves 40.0% of the KV cache at 2048 tokens with 1 protected unit\(s\): "
                                         r"the most is 2\d.\d%"):
        delta_for_kv_saving(sim, 0.4, seq_len=2048, sink=16, recent=240, start_delta=0.5, protect=[(2, 0)])


def test_pipeline_lowers_delta_to_meet_min_kv_saving(tiny):
    """A reused map with similarity: the trained map meets the budget with the protected unit kept, the card
    names the lowered delta, and the reused file is unchanged. Without similarity it stops with a clear message."""
    root, model, train_text, held_out = tiny
    out = root / "budget"
    out.mkdir()
    sim = torch.tensor([[[1.0, 0.9, 0.2, 0.3], [0.9, 1.0, 0.4, 0.3], [0.2, 0.4, 1.0, 0.6], [0.3, 0.3, 0.6, 1.0]]] * 2)
    explored = greedy_blocks(sim, 0.5)          # head blocks 0-1 | 2-3
    blocks = write_blocks_json(root / "sim_blocks.json", explored, sim, delta=0.5, compare_with="anchor")
    before = blocks.read_text()
    recipe = tiny_recipe(out, model, train_text, held_out, eval={"perplexity": False},
                         pod={"blocks_file": str(blocks), "protect_units": [[3, 1]], "min_kv_saving": 0.15},
                         train={"max_steps": 1})
    done = run(python_command(write_recipe(root / "budget.yaml", recipe), "--stages", "explore,train,export"),
               pipeline_env())
    written = json.loads((out / "out" / "exploration" / "blocks_trained.json").read_text())
    length, sink, recent = recipe["data"]["context_length"], recipe["pod"]["sink_tokens"], recipe["pod"]["recent_window"]
    assert kv_saving_fraction(written["anchor_layers"], length, sink, recent) >= 0.15
    assert kv_saving_fraction(protect_units(explored, [(3, 1)])[0], length, sink, recent) < 0.15  # what it would be
    assert written["delta"] == pytest.approx(0.2) and written["anchor_layers"][3][1] == 3 and written["min_kv_saving"] == 0.15
    assert "pod.min_kv_saving=0.15: delta lowered to" in done.stdout
    card = (out / "out" / "export" / "README.md").read_text()
    assert "lowered from 0.5 to save at least 15% (`pod.min_kv_saving`)" in card
    assert blocks.read_text() == before

    bare = write_blocks_json(root / "bare_blocks.json", explored, delta=0.5)
    recipe["pod"]["blocks_file"] = str(bare)
    failed = subprocess.run(python_command(write_recipe(root / "bare.yaml", recipe), "--stages", "explore,train,export"),
                            capture_output=True, text=True, env=pipeline_env(), timeout=400)
    assert failed.returncode != 0
    assert "pod.min_kv_saving=0.15: the block map" in failed.stderr + failed.stdout
    assert "has no similarity matrices to lower delta with" in failed.stderr + failed.stdout


def test_the_2k_gpu_recipe_trains_the_measured_map():
    """recipes/smollm2_135m_gpu.yaml (pinned explored map + 4 protected units + a 30% budget) gives exactly the map
    of the measured run (benchmarks/h200_2026-12-01/pod_adaptation_kv_budget/2k_pinned_map: passkey 95%)."""
    from train.inputs import REPO_ROOT
    from train.recipe import load_recipe

    recipe = load_recipe(str(REPO_ROOT / "recipes" / "smollm2_135m_gpu.yaml"), [])
    pinned = json.loads((REPO_ROOT / recipe.pod.blocks_file).read_text())
    delta, anchors = delta_for_kv_saving(torch.tensor(pinned["similarity"]), recipe.pod.min_kv_saving,
                                         seq_len=recipe.data.context_length, sink=recipe.pod.sink_tokens,
                                         recent=recipe.pod.recent_window, start_delta=recipe.pod.delta,
                                         protect=[tuple(u) for u in recipe.pod.protect_units])
    measured = json.loads((REPO_ROOT / "benchmarks" / "h200_2026-12-01" / "pod_adaptation_kv_budget" / "2k_pinned_map"
                           / "exploration" / "blocks_trained.json").read_text())
    assert anchors == measured["anchor_layers"] and delta == pytest.approx(measured["delta"])
    assert kv_saving_fraction(anchors, 2048, 16, 240) >= 0.30


def test_a_trained_map_can_be_reused_as_blocks_file(tmp_path):
    """pod.blocks_file may point at a previous run's blocks_trained.json (it carries protect_units, delta and
    min_kv_saving itself): the new map is written with the new run's values, not a clash of keyword arguments."""
    from types import SimpleNamespace

    from train.pipeline import _final_map

    sim = _random_similarity(layers=6, kv_heads=2, seed=3)
    first = write_blocks_json(tmp_path / "trained.json", protect_units(greedy_blocks(sim, 0.5), [(2, 0)])[0], sim,
                              delta=0.5, compare_with="anchor", source_blocks="x.json", protect_units=[[2, 0]],
                              already_anchors=[], min_kv_saving=None)
    pod = SimpleNamespace(protect_units=[[2, 0], [4, 1]], min_kv_saving=0.1, kv_saving=None, delta=0.5,
                          compare_with="anchor", sink_tokens=4, recent_window=12)
    recipe = SimpleNamespace(pod=pod, data=SimpleNamespace(context_length=64),
                             train=SimpleNamespace(output_dir=str(tmp_path / "run")))
    anchors = json.loads(first.read_text())["anchor_layers"]
    final, path = _final_map(recipe, anchors, first, rank=0, log=lambda *a: None)
    written = json.loads(path.read_text())
    assert written["protect_units"] == [[2, 0], [4, 1]] and written["min_kv_saving"] == 0.1
    assert written["source_blocks"] == str(first) and written["anchor_layers"] == final
    assert final[4][1] == 4 and kv_saving_fraction(final, 64, 4, 12) >= 0.1


def test_kv_saving_is_exclusive_with_min_kv_saving_and_auto(tiny):
    root, model, train_text, held_out = tiny
    for pod, message in [({"kv_saving": 0.2, "min_kv_saving": 0.2}, "pod.kv_saving=0.2 and pod.min_kv_saving=0.2: set one"),
                         ({"kv_saving": 0.2, "protect_units": "auto", "min_kv_saving": None},
                          "pod.kv_saving=0.2: pod.protect_units='auto' selects under pod.min_kv_saving")]:
        recipe = tiny_recipe(root / "bad", model, train_text, held_out, pod=pod)
        with pytest.raises(RecipeError) as error:
            recipe_from_dict(recipe)
        assert message in str(error.value)


@pytest.mark.parametrize("target", [0.05, 0.1, 0.15, 0.2])
def test_kv_saving_takes_the_least_sharing_that_meets_it(tmp_path, target):
    """pod.kv_saving on a reused map that saves more than the target: the trained map shares fewer units (a point
    below the explored map on a trade-off curve), still saves the target with the protected unit kept, and the next
    higher similarity threshold would save less."""
    from types import SimpleNamespace

    from train.pipeline import _final_map

    sim = _random_similarity(layers=6, kv_heads=2, seed=5)
    explored = greedy_blocks(sim, 0.05)  # shares nearly everything
    blocks = write_blocks_json(tmp_path / "explored.json", explored, sim, delta=0.05, compare_with="anchor")
    length, sink, recent = 64, 4, 12
    assert kv_saving_fraction(explored, length, sink, recent) > 0.2
    pod = SimpleNamespace(protect_units=[[2, 0]], min_kv_saving=None, kv_saving=target, delta=0.05,
                          compare_with="anchor", sink_tokens=sink, recent_window=recent)
    recipe = SimpleNamespace(pod=pod, data=SimpleNamespace(context_length=length),
                             train=SimpleNamespace(output_dir=str(tmp_path / "run")))
    logged = []
    final, path = _final_map(recipe, explored, blocks, rank=0, log=logged.append)
    saving = kv_saving_fraction(final, length, sink, recent)
    assert saving >= target and final[2][0] == 2
    assert len(shared_units(final)) < len(shared_units(explored))
    written = json.loads(path.read_text())
    assert written["kv_saving"] == target and written["anchor_layers"] == final
    higher = sorted({v for v in sim.flatten().tolist() if v > written["delta"]})
    if higher:  # the next threshold up shares less and misses the budget
        fewer, _ = protect_units(greedy_blocks(sim, higher[0]), [(2, 0)])
        assert kv_saving_fraction(fewer, length, sink, recent) < target
    assert any("pod.kv_saving=" in line and "the least sharing" in line for line in logged)


def test_kv_saving_needs_similarity(tmp_path):
    from types import SimpleNamespace

    from train.pipeline import _final_map

    bare = write_blocks_json(tmp_path / "bare.json", ANCHORS, delta=0.5)
    pod = SimpleNamespace(protect_units=[], min_kv_saving=None, kv_saving=0.1, delta=0.5, compare_with="anchor",
                          sink_tokens=4, recent_window=12)
    recipe = SimpleNamespace(pod=pod, data=SimpleNamespace(context_length=64),
                             train=SimpleNamespace(output_dir=str(tmp_path / "run")))
    with pytest.raises(SystemExit, match="pod.kv_saving=0.1: the block map .* has no similarity matrices"):
        _final_map(recipe, ANCHORS, bare, rank=0, log=lambda *a: None)
