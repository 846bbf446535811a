"""Checkpoints (train/checkpoints.py) and the PodTrainer's records (train/trainer.py), with a tiny Llama and
the real transformers Trainer (seconds): a broken checkpoint is named before anything runs, "auto" falls
back to the previous complete one, a crash mid-save leaves the latest checkpoint usable, losses.jsonl
equals the Trainer's logged loss under gradient accumulation, a tied lm_head is not reported missing,
and a resume with a larger max_steps follows the new learning-rate schedule."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from tests.tiny_models import tiny_model
from train.checkpoints import CheckpointError, checkpoint_problems, select_resume_checkpoint
from train.recipe import recipe_from_dict


def _recipe(out: Path, **train):
    values = {"output_dir": str(out), "learning_rate": 1e-3, "lr_scheduler": "cosine", "max_steps": 4,
              "per_device_batch_size": 2, "bf16": False, "gradient_checkpointing": False, "save_steps": 2,
              "save_total_limit": 3, "report_to": ["none"], "logging_steps": 1}
    values.update(train)
    return recipe_from_dict({"model": {"name_or_path": "tiny"}, "pod": {"sink_tokens": 2, "recent_window": 4, "last_queries": 8},
                             "data": {"train": "x.txt", "context_length": 16}, "train": values},
                            check_environment=False)


def _model(tied: bool = False):
    return tiny_model(layers=1, seed=0, podkit=False, eval=False, vocab=64, heads=2, kv_heads=1, hidden=16,
                      positions=32, tie_word_embeddings=tied)


def _data(n: int = 32):
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (16,), generator=generator) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _train(recipe, model=None, resume=None):
    """train_model of the pipeline with ``resume`` pinned as the pipeline does; returns the Trainer's log."""
    import dataclasses

    from train.trainer import train_model, training_arguments

    recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, resume_from_checkpoint=resume))
    train_model(model or _model(), _data(), recipe, training_arguments(recipe), log=lambda *a: None)
    out = Path(recipe.train.output_dir)
    final = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((final / "trainer_state.json").read_text())["log_history"]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "losses.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4 (shared, read-only: tests copy what they break)."""
    out = tmp_path_factory.mktemp("trained") / "out"
    _train(_recipe(out))
    return out


def _copy(trained: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(trained, tmp_path / "out"))


def test_saved_checkpoints_are_complete_and_no_staging_is_left(trained):
    assert sorted(p.name for p in trained.iterdir() if p.name.startswith("checkpoint-")) == \
        ["checkpoint-2", "checkpoint-4"]
    assert not any(p.name.startswith(".checkpoint-staging") for p in trained.iterdir())
    assert checkpoint_problems(trained / "checkpoint-4") == []
    assert select_resume_checkpoint("auto", trained) == str(trained / "checkpoint-4")


@pytest.mark.parametrize("name, cut, expected", [
    ("model.safetensors", 0.5, "model.safetensors is truncated"),
    ("trainer_state.json", 0.5, "trainer_state.json is not valid JSON"),
    ("optimizer.pt", 0.5, "optimizer.pt is not a complete torch archive"),
    ("trainer_state.json", None, "trainer_state.json is missing"),
])
def test_broken_checkpoint_named_and_previous_offered(trained, tmp_path, name, cut, expected):
    out = _copy(trained, tmp_path)
    path = out / "checkpoint-4" / name
    if cut is None:
        path.unlink()
    else:
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * cut)])
    problems = checkpoint_problems(out / "checkpoint-4")
    assert len(problems) == 1 and str(path) in problems[0] and expected in problems[0], problems
    with pytest.raises(CheckpointError) as error:
        select_resume_checkpoint(str(out / "checkpoint-4"), out)
    assert str(path) in str(error.value) and f"train.resume_from_checkpoint={out / 'checkpoint-2'}" in str(error.value)
    lines = []
    assert select_resume_checkpoint("auto", out, log=lines.append) == str(out / "checkpoint-2")
    assert len(lines) == 1 and "checkpoint-4 is unusable" in lines[0] and "resuming from" in lines[0]


def test_auto_with_no_complete_checkpoint_is_an_error(trained, tmp_path):
    out = _copy(trained, tmp_path)
    for step in (2, 4):
        (out / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"\x10")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        select_resume_checkpoint("auto", out)
    assert select_resume_checkpoint("auto", tmp_path / "empty") is None
    assert select_resume_checkpoint(None, out) is None


def test_pipeline_validates_before_any_stage(trained, tmp_path, monkeypatch):
    """A broken explicit checkpoint stops train/pod.py with exit 2 before the explore stage runs."""
    from train import pipeline, pod

    out = _copy(trained, tmp_path)
    (out / "checkpoint-4" / "model.safetensors").write_bytes(b"0123456789")
    ran = []
    monkeypatch.setattr(pipeline, "_exploration", lambda *a, **k: ran.append("explore"))
    monkeypatch.setattr("train.models.model_source", lambda *a, **k: ran.append("model") or 1 / 0)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps(_recipe(out).to_dict()))
    status = pod.main([str(recipe), f"train.resume_from_checkpoint={out / 'checkpoint-4'}",
                       "model.name_or_path=podkit:smollm2-135m", "data.train=podkit:austen"])
    assert status == 2 and ran == []


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from transformers import Trainer

    out = tmp_path / "out"
    original = Trainer._save_rng_state

    def crash_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise KeyboardInterrupt("simulated crash mid-save")
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", crash_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        _train(_recipe(out))
    monkeypatch.undo()
    assert not (out / "checkpoint-4").exists()  # the half-written one stays in the staging folder
    assert select_resume_checkpoint("auto", out) == str(out / "checkpoint-2")
    log = _train(_recipe(out), resume=select_resume_checkpoint("auto", out))
    assert checkpoint_problems(out / "checkpoint-4") == [] and not (out / ".checkpoint-staging").exists()
    assert [h["step"] for h in log if "loss" in h] == [1, 2, 3, 4]


def test_losses_jsonl_equals_trainer_log_with_accumulation(tmp_path):
    out = tmp_path / "out"
    log = _train(_recipe(out, gradient_accumulation_steps=2, max_steps=3, save_steps=3))
    logged = {h["step"]: h["loss"] for h in log if "loss" in h}
    recorded = _losses(out)
    assert sorted(recorded) == [1, 2, 3] == sorted(logged)
    for step, loss in recorded.items():
        assert loss == pytest.approx(logged[step], rel=1e-4), (step, recorded, logged)
        assert loss > 3.0  # cross-entropy over 64 tokens starts near ln 64 = 4.16, not half of it


def test_tied_lm_head_not_reported_missing(tmp_path):
    from transformers.utils import logging as hf_logging

    out = tmp_path / "out"
    _train(_recipe(out), model=_model(tied=True))
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect()
    logger = hf_logging.get_logger("transformers.trainer")
    logger.addHandler(handler)
    try:
        _train(_recipe(out, max_steps=6), model=_model(tied=True), resume=str(out / "checkpoint-4"))
    finally:
        logger.removeHandler(handler)
    assert not [m for m in records if "missing keys" in m], records


def test_resume_with_larger_max_steps_follows_new_schedule(trained, tmp_path, capsys):
    out = _copy(trained, tmp_path)
    log = _train(_recipe(out, max_steps=8), resume=str(out / "checkpoint-4"))
    lr = {h["step"]: h["learning_rate"] for h in log if "learning_rate" in h}
    # cosine over 8 steps: the optimizer step 5 uses the value after 4 scheduler steps, 1e-3 * cos(pi*4/8)/2+..
    assert lr[5] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 8)), rel=1e-6)
    assert lr[6] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 5 / 8)), rel=1e-6)
    assert "learning-rate schedule" in capsys.readouterr().out
