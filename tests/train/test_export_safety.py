"""Losing good data (issue 33 section 2): the export is written into a staging folder and renamed into place once
whole, so a crash mid-export keeps the previous export (intact and loadable); an incomplete export is refused by
every loader with what is missing; the eval stage's later writes into the export are atomic; a full disk is one line
naming the path, before training when a checkpoint cannot fit, and mid-save with the previous checkpoint kept."""

from __future__ import annotations

import errno
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from tiny_setup import make_texts, make_tiny_model, tiny_recipe

from sparse_models.model_files import EXPORT_MANIFEST, ModelPathError

ANCHORS = [[0, 0], [0, 0]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tiny_setup import tiny_pod_model

    return tiny_pod_model(tmp_path_factory.mktemp("export_safety"), ANCHORS)


def _export(setup, folder: Path) -> Path:
    from train.export import export_model

    recipe, model, tokenizer = setup
    return export_model(model, tokenizer, recipe, ANCHORS, folder, base_model="tiny")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _loads(folder: Path) -> None:
    from transformers import AutoTokenizer

    from sparse_models import PodkitLlamaForCausalLM

    PodkitLlamaForCausalLM.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)


def test_export_is_whole_with_its_manifest(setup, tmp_path):
    folder = _export(setup, tmp_path / "export")
    manifest = json.loads((folder / EXPORT_MANIFEST).read_text())
    assert manifest["complete"] is True
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "modeling_podkit.py", "recipe.yaml"):
        assert name in manifest["files"] and (folder / name).is_file(), name
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging folder left
    _loads(folder)


@pytest.mark.parametrize("crash", [OSError("simulated crash while writing the tokenizer"),
                                   KeyboardInterrupt("simulated kill")])
def test_crash_mid_export_keeps_the_previous_export(setup, tmp_path, monkeypatch, crash):
    folder = _export(setup, tmp_path / "export")
    before = _snapshot(folder)
    _, _, tokenizer = setup
    seen = {}

    def crashing_save(staging, *args, **kwargs):
        seen["staging"] = sorted(p.name for p in Path(staging).iterdir())  # the weights are written, config unfinished
        shutil.copytree(staging, tmp_path / "as_killed")  # what a kill -9 at this point would leave
        raise crash

    monkeypatch.setattr(tokenizer, "save_pretrained", crashing_save)
    with pytest.raises(type(crash)):
        _export(setup, folder)
    monkeypatch.undo()
    assert "model.safetensors" in seen["staging"] and "config.json" in seen["staging"]
    assert _snapshot(folder) == before  # the previous export, byte for byte
    _loads(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["as_killed", "export"]  # the staging folder went away
    # the state a kill -9 leaves is refused by name (it never sits at the export's path: it is the staging folder)
    from sparse_models import PodkitLlamaForCausalLM

    with pytest.raises(ModelPathError) as error:
        PodkitLlamaForCausalLM.from_pretrained(tmp_path / "as_killed")
    message = str(error.value)
    assert "is incomplete: it was interrupted while being written" in message and "no tokenizer files" in message \
        and "no modeling_podkit.py" in message and "re-run the export stage" in message and "\n" not in message


def test_stale_staging_folder_of_a_killed_export_is_replaced(setup, tmp_path):
    stale = tmp_path / ".export-staging"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    folder = _export(setup, tmp_path / "export")
    assert not stale.exists() and json.loads((folder / EXPORT_MANIFEST).read_text())["complete"]


def test_incomplete_export_refused_by_every_loader(setup, tmp_path, capsys):
    from sparse_models.generate import main as generate
    from train.models import load_model

    folder = _export(setup, tmp_path / "export")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    expected = f"export {folder} is incomplete: no tokenizer files (tokenizer_config.json and one of tokenizer.json"
    recipe, _, _ = setup
    with pytest.raises(ModelPathError, match=r"re-run the export stage") as error:
        load_model(recipe, str(folder), anchor_layers=ANCHORS, apply_recipe_config=False)
    assert str(error.value).startswith(expected)
    from eval.models import load_model as eval_load_model

    with pytest.raises(ModelPathError, match="no tokenizer files"):
        eval_load_model(str(folder))
    capsys.readouterr()
    assert generate(["--model", str(folder), "--prompt", "It is a truth"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_export_on_a_full_disk_is_one_line_and_keeps_the_previous(setup, tmp_path, monkeypatch):
    from train.checkpoints import StorageError

    folder = _export(setup, tmp_path / "export")
    before = _snapshot(folder)
    _, model, _ = setup

    def full(*args, **kwargs):  # what safetensors raises on ENOSPC
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model, "save_pretrained", full)
    with pytest.raises(StorageError) as error:
        _export(setup, folder)
    message = str(error.value)
    assert "no space left on the device" in message and str(tmp_path / ".export-staging") in message \
        and "the previous one is kept" in message and "\n" not in message
    assert _snapshot(folder) == before and not (tmp_path / ".export-staging").exists()


def test_card_update_is_atomic(setup, tmp_path, monkeypatch):
    """The eval stage rewrites the card in the finished export: a failing write leaves the old card whole."""
    from train.export import update_card_results

    folder = _export(setup, tmp_path / "export")
    card = (folder / "README.md").read_bytes()
    original = Path.write_text

    def half_then_fail(self, text, *args, **kwargs):
        original(self, text[:len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    recipe, _, _ = setup
    results = {"sources": {"held": {"dense": {"ppl": 10.0}, "pod_after": {"ppl": 11.0}}}}
    with pytest.raises(OSError):
        update_card_results(folder, recipe, ANCHORS, base_model="tiny", results=results)
    monkeypatch.undo()
    assert (folder / "README.md").read_bytes() == card
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    update_card_results(folder, recipe, ANCHORS, base_model="tiny", results=results)
    assert "## Evaluation" in (folder / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# A full disk around training


def test_checkpoint_size_estimate_matches_a_real_checkpoint(tmp_path):
    from test_checkpoints import _recipe, _train

    from tests.tiny_models import tiny_model
    from train.checkpoints import checkpoint_size_estimate

    def model():  # large enough (~0.4M parameters) that file headers do not matter
        return tiny_model(layers=2, seed=None, podkit=False, eval=False, vocab=64, heads=4, kv_heads=2, hidden=128,
                          positions=32)

    out = tmp_path / "out"
    _train(_recipe(out), model=model())
    files = {name: (out / "checkpoint-4" / name).stat().st_size for name in ("model.safetensors", "optimizer.pt")}
    estimate = checkpoint_size_estimate(model(), deepspeed=False, lora=False)
    assert 0.95 < files["model.safetensors"] / estimate["weights"] < 1.05, (files, estimate)
    assert 0.95 < files["optimizer.pt"] / estimate["optimizer"] < 1.05, (files, estimate)


DiskUsage = namedtuple("DiskUsage", "total used free")


def test_training_stops_before_any_step_when_a_checkpoint_cannot_fit(tmp_path, monkeypatch):
    from test_checkpoints import _recipe, _train

    from train.checkpoints import StorageError

    out = tmp_path / "out"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10 ** 6, 10 ** 6 - 2000, 2000))
    with pytest.raises(StorageError) as error:
        _train(_recipe(out))
    message = str(error.value)
    assert message.startswith(f"train.output_dir={str(out)!r} has 2.0 KiB free but one checkpoint needs about")
    assert "nothing was trained" in message and "\n" not in message
    assert not list(out.glob("checkpoint-*")) and not (out / "losses.jsonl").exists()


def test_pipeline_prints_one_line_for_a_full_disk(tmp_path, monkeypatch, capsys):
    """train/pod.py: the free-space stop is one line and exit 2 (a tiny local model, stage train only)."""
    from tiny_setup import write_recipe

    from sparse_models.calibration.pod_similarity import write_blocks_json
    from train import pod

    model_dir = make_tiny_model(tmp_path / "model", layers=2)
    train_text, held = make_texts(tmp_path / "texts")
    blocks = tmp_path / "blocks.json"
    write_blocks_json(blocks, ANCHORS, None)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, model_dir, train_text, held,
                                                          pod={"blocks_file": str(blocks)}))
    real = shutil.disk_usage
    out = tmp_path / "out"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10 ** 6, 10 ** 6 - 1000, 1000)
                        if str(out) in str(Path(path).absolute()) else real(path))
    capsys.readouterr()
    assert pod.main([str(recipe), "--stages", "train"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "one checkpoint needs about" in err[0], err
    assert not list(out.glob("checkpoint-*"))


def test_full_disk_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from test_checkpoints import _recipe, _train
    from transformers import Trainer

    from train.checkpoints import StorageError, checkpoint_problems, select_resume_checkpoint

    out = tmp_path / "out"
    original = Trainer._save_rng_state

    def full_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir) / "rng_state.pth"))
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", full_at_step_4)
    with pytest.raises(StorageError) as error:
        _train(_recipe(out))
    message = str(error.value)
    assert f"writing {out / '.checkpoint-staging' / 'checkpoint-4' / 'rng_state.pth'} failed: no space left" in message
    assert f"the previous checkpoint {out / 'checkpoint-2'} is kept" in message and "\n" not in message
    assert not (out / "checkpoint-4").exists() and not (out / ".checkpoint-staging" / "checkpoint-4").exists()
    assert checkpoint_problems(out / "checkpoint-2") == []
    assert select_resume_checkpoint("auto", out) == str(out / "checkpoint-2")
