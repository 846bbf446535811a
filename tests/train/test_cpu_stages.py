"""The pipeline's CPU path: sane torch thread counts (train/threads.py), applied by run_pipeline before
any stage, and a progress bar per eval window (train/evaluate.py)."""

from __future__ import annotations

import os

import pytest
import torch

from train.threads import configure_cpu_threads, cpu_thread_count


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores, processes, load, expected", [
    (2, 1, 0.3, 2),   # idle: every core
    (2, 1, 4.0, 1),   # load 3-4 from other work (issue 16's 77 s explore): one thread
    (16, 2, 0.0, 8),  # two DeepSpeed processes share the cores
    (16, 2, 5.0, 6),  # ... minus the 4 cores others keep busy
    (1, 4, 0.0, 1),
])
def test_thread_count(cores, processes, load, expected):
    assert cpu_thread_count(cores, processes, load) == expected


def test_configure_sets_torch_and_environment(restore_threads):
    environ, lines = {}, []
    assert configure_cpu_threads(1, environ=environ, cores=3, load=0.0, log=lines.append) == 3
    assert torch.get_num_threads() == 3 and environ["OMP_NUM_THREADS"] == "3"
    assert "3 torch thread(s)" in lines[0]
    environ = {"OMP_NUM_THREADS": "1"}  # the user's choice wins
    assert configure_cpu_threads(1, environ=environ, cores=8, load=0.0, log=lines.append) == 1
    assert torch.get_num_threads() == 1 and environ == {"OMP_NUM_THREADS": "1"}


def test_pipeline_applies_thread_count(tmp_path, monkeypatch, restore_threads):
    """run_pipeline on CPU sets the count before the first stage (stopped here at the model lookup)."""
    from train import pipeline, threads
    from train.recipe import recipe_from_dict

    monkeypatch.setenv("OMP_NUM_THREADS", "")  # recorded, so that the value the pipeline sets is undone
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr("train.models.model_source", stop)
    torch.set_num_threads(3)
    recipe = recipe_from_dict({"model": {"name_or_path": "tiny"}, "data": {"train": "x.txt", "context_length": 64},
                               "pod": {"sink_tokens": 2, "recent_window": 8, "last_queries": 8},
                               "train": {"output_dir": str(tmp_path / "out")}}, check_environment=False)
    with pytest.raises(Stop):
        pipeline.run_pipeline(recipe, ["explore"])
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"


def test_eval_perplexity_shows_progress_per_window(capsys):
    from tests.tiny_models import tiny_model
    from train.evaluate import perplexity

    model = tiny_model(layers=1, seed=None, podkit=False, eval=False, vocab=32, heads=2, kv_heads=1, hidden=16,
                       positions=None)
    windows = torch.randint(0, 32, (3, 8))
    result = perplexity(model, windows, desc="[eval] dense")
    err = capsys.readouterr().err
    assert "[eval] dense" in err and "3/3" in err and "window" in err
    assert result["tokens"] == 3 * 7
    perplexity(model, windows)  # no label: no bar
    assert "[eval]" not in capsys.readouterr().err
