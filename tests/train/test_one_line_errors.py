"""train/pod.py's inputs that gave raw tracebacks (issue 33 section 4) are one line and exit 2: an uncached Hub id
with the network off (and no output folder created), a binary recipe, an output folder that cannot be created, a
model folder without config.json, a truncated model.safetensors (named)."""

from __future__ import annotations

import os

import pytest
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_line")
    return make_tiny_model(root / "model", layers=2), *make_texts(root / "texts")


def _run(capsys, recipe, *args) -> tuple[int, list[str]]:
    from train import pod

    capsys.readouterr()
    status = pod.main([str(recipe), *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error: ", "recipe error: "))]
    return status, lines


def test_uncached_hub_id_offline_is_one_line_and_writes_nothing(tiny, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the network off
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_hub_cache"))
    _, train_text, held = tiny
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, "podkit-tests/no-such-model", train_text, held))
    status, lines = _run(capsys, recipe)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: model.name_or_path='podkit-tests/no-such-model': not in the local Hugging Face "
                               "cache") and "HF_HUB_OFFLINE" in lines[0], lines
    assert not (tmp_path / "out").exists()  # the output folder is made only once the model is resolved


def test_binary_recipe(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"model:\n  name_or_path: \xff\xfe\x00\x89PNG")
    status, lines = _run(capsys, recipe)
    assert status == 2 and len(lines) == 1 and str(recipe) in lines[0] and "is not a text file" in lines[0], lines


def test_output_dir_under_a_broken_link(tiny, tmp_path, capsys):
    model, train_text, held = tiny
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "away")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, model, train_text, held,
                                                          train={"output_dir": str(tmp_path / "link" / "out")}))
    status, lines = _run(capsys, recipe)
    assert status == 2 and len(lines) == 1 and "is a symbolic link to" in lines[0], lines


@pytest.mark.parametrize("make_parent", ["file", "broken link"])
def test_output_dir_that_cannot_be_created(tiny, tmp_path, monkeypatch, capsys, make_parent):
    """What the recipe's read-only check cannot foresee (e.g. /proc/x/out as root) fails at mkdir: one line."""
    from train import recipe_checks

    model, train_text, held = tiny
    parent = tmp_path / "parent"
    if make_parent == "file":
        parent.write_text("a file")
    else:
        parent.symlink_to(tmp_path / "gone" / "away")
    monkeypatch.setattr(recipe_checks, "_check_writable", lambda *a, **k: None)
    out = parent / "out"
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, model, train_text, held,
                                                          train={"output_dir": str(out)}))
    status, lines = _run(capsys, recipe)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: train.output_dir={str(out)!r} cannot be created: "), lines


def test_model_folder_without_config_and_truncated_weights(tiny, tmp_path, capsys):
    import shutil

    model, train_text, held = tiny
    broken = shutil.copytree(model, tmp_path / "model")
    (broken / "config.json").unlink()
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, broken, train_text, held))
    status, lines = _run(capsys, recipe)
    assert status == 2 and len(lines) == 1 and "has no config.json: not a model folder" in lines[0], lines
    assert "model_type" not in lines[0]
    shutil.copyfile(model / "config.json", broken / "config.json")
    weights = broken / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    status, lines = _run(capsys, recipe)
    assert status == 2 and len(lines) == 1 and f"{weights} is truncated" in lines[0], lines
    assert not (tmp_path / "out").exists()
