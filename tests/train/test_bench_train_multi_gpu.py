"""``python -m eval.bench train-multi-gpu``: the launcher runs ``deepspeed --num_gpus 2`` (CPU ranks, gloo) with
Ulysses SP 2 on a tiny shape, and writes the table's JSON; bad combinations are refused before launching."""

import json
import math
import subprocess
import sys

import pytest
from pipeline_runs import REPO, pipeline_env

pytest.importorskip("deepspeed", reason="the benchmark launches DeepSpeed")

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "256",
        "--sink", "4", "--recent", "12", "--warmup", "1", "--steps", "1"]


def _bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "eval.bench", "train-multi-gpu", *args], capture_output=True,
                          text=True, env=pipeline_env(), cwd=REPO, timeout=timeout)


@pytest.mark.slow
def test_two_rank_sequence_parallel_bench(tmp_path):
    out = tmp_path / "bench.json"
    done = _bench("--num-gpus", "2", "--sp", "2", "--seq", "96", "--out", str(out), *TINY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    (row,) = report["rows"]
    assert (row["gpus"], row["sp"], row["replicas"], row["seq"], row["tokens_per_step"]) == (2, 2, 1, 96, 96)
    assert row["tokens_per_s"] > 0 and row["scaling_efficiency"] == 1.0
    assert math.isfinite(row["loss"]) and abs(row["loss"] - math.log(256)) < 0.5  # random init: ~ln(vocab)
    assert "efficiency" in done.stdout and "-> " in done.stdout


def test_bad_combinations_are_refused_before_launching(tmp_path):
    done = _bench("--num-gpus", "3", "--sp", "2", "--seq", "97", "--out", str(tmp_path / "x.json"), *TINY)
    assert done.returncode == 2
    assert "--num-gpus 3: not a multiple of --sp 2" in done.stderr and "--seq 97: not divisible by --sp 2" in done.stderr
    done = _bench("--num-gpus", "4", "--sp", "4", "--out", str(tmp_path / "x.json"), *TINY)
    assert "Ulysses needs --heads 4 and --kv-heads 2 divisible by it" in done.stderr
    assert not (tmp_path / "x.json").exists()
