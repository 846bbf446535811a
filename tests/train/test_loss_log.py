"""issue 33: ``losses.jsonl`` holds one run (a re-run into the same output_dir appended steps 1-40 again, a resume
wrote its resumed steps twice), the final train loss of a resumed run covers every step (it averaged the resumed
ones only), and two runs into one output_dir at the same time are refused (train/checkpoints.py, train/trainer.py).
The real transformers Trainer on the tiny Llama of test_checkpoints (seconds)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoints import _recipe, _train

from train.checkpoints import OutputDirInUse, lock_output_dir, read_loss_log, whole_run_loss


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _metrics(out: Path) -> dict:
    return json.loads((out / "trained" / "train_metrics.json").read_text())


def test_a_fresh_run_starts_a_fresh_log_and_keeps_the_previous_one(tmp_path):
    out = tmp_path / "out"
    _train(_recipe(out))
    first = (out / "losses.jsonl").read_text()
    _train(_recipe(out, learning_rate=3e-3))  # the same output_dir again, no resume: starts over
    assert _steps(out / "losses.jsonl") == [1, 2, 3, 4]  # once, not 1-4 twice
    assert (out / "losses.previous.jsonl").read_text() == first
    assert _metrics(out)["train_loss"] == pytest.approx(whole_run_loss(out / "losses.jsonl"), rel=1e-6)


def test_resume_truncates_the_log_and_the_final_loss_covers_every_step(tmp_path):
    out = tmp_path / "out"
    _train(_recipe(out, max_steps=6))  # checkpoints at 2, 4, 6
    straight = {r["step"]: r["loss"] for r in read_loss_log(out / "losses.jsonl")}
    # as after a kill at step 5 or 6: the log holds steps 1-6, the latest usable checkpoint is step 4
    shutil.rmtree(out / "checkpoint-6")
    with (out / "losses.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # and a line cut by the kill
    _train(_recipe(out, max_steps=6), resume=str(out / "checkpoint-4"))
    assert _steps(out / "losses.jsonl") == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 once each
    resumed = {r["step"]: r["loss"] for r in read_loss_log(out / "losses.jsonl")}
    for step in (5, 6):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5)
    metrics = _metrics(out)
    whole = sum(resumed.values()) / 6
    assert metrics["train_loss"] == pytest.approx(whole, rel=1e-6)
    # the Trainer's own number averages the 2 resumed steps only: kept apart, and clearly different
    assert metrics["train_loss_this_run"] == pytest.approx((resumed[5] + resumed[6]) / 2, rel=1e-3)
    assert abs(metrics["train_loss_this_run"] - whole) > 1e-3
    assert not (out / "losses.previous.jsonl").exists()  # a resume is the same run


def test_a_second_run_into_a_locked_output_dir_is_refused(tmp_path):
    out = tmp_path / "out"
    held = lock_output_dir(out)
    try:
        with pytest.raises(OutputDirInUse, match=rf"is in use by another run \(pid {os.getpid()} on .*\.lock"):
            lock_output_dir(out)
    finally:
        held.close()
    lock_output_dir(out).close()  # free again once the first run's file is closed (or its process ended)


def test_pod_refuses_an_output_dir_another_process_holds(tmp_path):
    """train/pod.py against an output_dir whose lock a live process holds: one error line, exit 2, before any
    stage (the holder here is a child process, as another pipeline would be)."""
    from tiny_setup import REPO, make_texts, make_tiny_model, tiny_recipe, write_recipe

    model = make_tiny_model(tmp_path / "model", layers=2)
    train_text, held = make_texts(tmp_path / "texts")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, model, train_text, held))
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from train.checkpoints import lock_output_dir; h = lock_output_dir(sys.argv[2]); "
                               "print('held', flush=True); time.sleep(120)", str(REPO), str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
        done = subprocess.run([sys.executable, str(REPO / "train" / "pod.py"), str(recipe), "--stages", "explore"],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "is in use by another run" in errors[0] and f"pid {holder.pid}" in errors[0], errors
    assert not (out / "exploration").exists()
