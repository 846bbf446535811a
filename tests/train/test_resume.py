"""SIGKILL the training process mid-run, restart with resume_from_checkpoint=auto: the losses of the next
steps equal those of an uninterrupted run (DeepSpeed ZeRO-2, one plain process)."""

import json
import os
import signal
import subprocess
import time

import pytest
from pipeline_runs import pipeline_env, python_command, run
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe

MAX_STEPS = 6


def _losses(out) -> dict[int, float]:
    """step -> loss; a resumed run appends its steps again, and the later record wins."""
    records = {}
    path = out / "losses.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        item = json.loads(line)
        records[item["step"]] = item["loss"]
    return records


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model")
    train_text, held_out = make_texts(tmp_path / "text")
    common = dict(deepspeed={"config": "recipes/deepspeed/zero2.json"}, eval={"perplexity": False})
    stages = ["--stages", "explore,train"]
    env = pipeline_env()

    straight = tiny_recipe(tmp_path / "a", model_dir, train_text, held_out,
                           train={"max_steps": MAX_STEPS, "save_steps": 2, "learning_rate": 3e-3}, **common)
    (tmp_path / "a").mkdir()
    run(python_command(write_recipe(tmp_path / "a.yaml", straight), *stages), env)
    reference = _losses(tmp_path / "a" / "out")
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))

    interrupted = tiny_recipe(tmp_path / "b", model_dir, train_text, held_out,
                              train={"max_steps": MAX_STEPS, "save_steps": 2, "learning_rate": 3e-3}, **common)
    (tmp_path / "b").mkdir()
    recipe_b = write_recipe(tmp_path / "b.yaml", interrupted)
    out_b = tmp_path / "b" / "out"
    process = subprocess.Popen(python_command(recipe_b, *stages), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    try:
        while 3 not in _losses(out_b):  # checkpoint-2 is written, step 3 done, step 4 not yet saved
            assert process.poll() is None, "training ended before it could be killed"
            assert time.time() < deadline, "training did not reach step 3 in time"
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert (out_b / "checkpoint-2").is_dir()
    killed_at = max(_losses(out_b))
    assert killed_at < MAX_STEPS, "the run finished before the kill"

    done = run(python_command(recipe_b, *stages, "train.resume_from_checkpoint=auto"), env)
    assert "resuming from" in done.stdout
    resumed = _losses(out_b)
    assert sorted(resumed) == list(range(1, MAX_STEPS + 1))
    for step in range(3, MAX_STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), (step, resumed, reference)
    # the losses change from step to step: the comparison is not trivially equal
    assert len({round(v, 6) for v in reference.values()}) > 1
