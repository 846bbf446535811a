"""``python -m eval.bench train-multi-gpu``: the launcher runs ``deepspeed --num_gpus 2`` (CPU ranks, gloo) with
Ulysses SP 2, tiled MLP and checkpoint offload on a tiny shape, and writes the table's JSON; bad combinations are
refused before launching; the ``deepspeed`` launcher is found beside the interpreter, on PATH or as a module."""

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
    done = _bench("--num-gpus", "2", "--sp", "2", "--seq", "96", "--out", str(out), "--tiled-mlp", "--tiled-mlp-shards",
                  "3", "--activation-offload", *TINY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    (row,) = report["rows"]
    assert (row["tiled_mlp"], row["tiled_mlp_shards"], row["activation_offload"]) == (True, 3, True)
    assert (row["gpus"], row["sp"], row["replicas"], row["seq"], row["tokens_per_step"]) == (2, 2, 1, 96, 96)
    assert row["tokens_per_s"] > 0 and row["scaling_efficiency"] == 1.0
    assert math.isfinite(row["loss"]) and abs(row["loss"] - math.log(256)) < 0.5  # random init: ~ln(vocab)
    assert "efficiency" in done.stdout and "-> " in done.stdout


def _refused(capsys, *args) -> str:
    """``main(args)`` in this process (the refusal comes from argument checks, before any launch): its exit code
    must be 2; returns its stderr."""
    from eval.bench.train_multi_gpu import main

    with pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_bad_combinations_are_refused_before_launching(tmp_path, capsys):
    err = _refused(capsys, "--num-gpus", "3", "--sp", "2", "--seq", "97", "--out", str(tmp_path / "x.json"), *TINY)
    assert "--num-gpus 3: not a multiple of --sp 2" in err and "--seq 97: not divisible by --sp 2" in err
    err = _refused(capsys, "--num-gpus", "4", "--sp", "4", "--out", str(tmp_path / "x.json"), *TINY)
    assert "Ulysses needs --heads 4 and --kv-heads 2 divisible by it" in err
    err = _refused(capsys, "--num-gpus", "2", "--tiled-mlp-shards", "2", "--out", str(tmp_path / "x.json"), *TINY)
    assert "--tiled-mlp-shards 2: expected an integer >= 1, with --tiled-mlp" in err
    assert not (tmp_path / "x.json").exists()


def _executable(path, text="#!/bin/sh\nexit 0\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_launcher_beside_the_interpreter_then_on_path_then_the_module(tmp_path, monkeypatch):
    from eval.bench.train_multi_gpu import deepspeed_launcher

    venv_python, elsewhere = tmp_path / "venv" / "bin" / "python", tmp_path / "usr" / "local" / "bin" / "deepspeed"
    _executable(elsewhere)
    assert deepspeed_launcher(str(venv_python), search_path=str(elsewhere.parent)) == [str(elsewhere)]
    beside = _executable(venv_python.parent / "deepspeed")
    assert deepspeed_launcher(str(venv_python), search_path=str(elsewhere.parent)) == [str(beside)]
    beside.chmod(0o644)  # not executable: skipped
    assert deepspeed_launcher(str(venv_python), search_path=str(elsewhere.parent)) == [str(elsewhere)]
    bare = str(tmp_path / "bare" / "bin" / "python")
    monkeypatch.setattr(sys, "executable", bare)  # nothing beside it, nothing on PATH, but deepspeed imports
    assert deepspeed_launcher(search_path="") == [bare, "-m", "deepspeed.launcher.runner"]


def test_no_launcher_is_a_clear_error_before_anything_runs(tmp_path, monkeypatch, capsys):
    import importlib.util

    from eval.bench import train_multi_gpu

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "bench.json"
    assert train_multi_gpu.main(["--num-gpus", "2", "--out", str(out), *TINY]) == 2
    err = capsys.readouterr().err
    assert f"no DeepSpeed launcher: no executable {tmp_path / 'bare' / 'bin' / 'deepspeed'}, no 'deepspeed' on PATH" \
        in err and "pip install deepspeed" in err
    assert not out.exists()


def test_bench_runs_the_deepspeed_found_on_path(tmp_path, monkeypatch, capsys):
    """DeepSpeed installed elsewhere: the bench launches the ``deepspeed`` on PATH (here a stand-in that records
    its arguments and writes the worker's result file)."""
    from eval.bench import train_multi_gpu

    fake = _executable(tmp_path / "elsewhere" / "deepspeed", f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
open({str(tmp_path / 'argv.json')!r}, "w").write(json.dumps(args))
open(args[args.index("--worker") + 1], "w").write(json.dumps({{"gpus": 2, "sp": 1, "replicas": 2, "seq": 64,
    "tokens_per_s": 10.0, "tokens_per_s_per_gpu": 5.0, "seconds_per_step": 12.8, "tokens_per_step": 128,
    "peak_memory_gib_max_rank": None, "device": "stand-in", "loss": 5.5}}))
""")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "bin" / "python"))
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    out = tmp_path / "bench.json"
    assert train_multi_gpu.main(["--num-gpus", "2", "--seq", "64", "--out", str(out), *TINY]) == 0
    assert f"launcher: {fake}" in capsys.readouterr().out
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:2] == ["--num_gpus", "2"] and argv[argv.index("--seq") + 1] == "64"
    assert json.loads(out.read_text())["rows"][0]["device"] == "stand-in"


@pytest.mark.slow
def test_one_rank_lora_with_chunked_loss_equals_whole_logits(tmp_path):
    """One CPU rank, peft LoRA: only the adapters train, and the loss formed 8 tokens at a time (the logits never
    whole) is the loss of the whole [tokens x vocab] logits, step for step (same seed, same data)."""
    rows = {}
    for chunk in ("8", "0"):
        out = tmp_path / f"bench_{chunk}.json"
        done = _bench("--num-gpus", "1", "--seq", "40", "--out", str(out), "--method", "lora", "--lora-r", "4",
                      "--loss-chunk-tokens", chunk, "--master-port", "29541", *TINY)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (rows[chunk],) = json.loads(out.read_text())["rows"]
    chunked, whole = rows["8"], rows["0"]
    assert (chunked["method"], chunked["lora_r"], chunked["loss_chunk_tokens"]) == ("lora", 4, 8)
    assert whole["loss_chunk_tokens"] == 0
    # r=4 adapters on 7 projections x 2 layers: A [4 x in] + B [out x 4] each; nothing else trains
    hidden, kv, ffn = 64, 2 * 16, 128
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, ffn), (hidden, ffn), (ffn, hidden)]
    assert chunked["trainable_parameters"] == 2 * sum(4 * (i + o) for i, o in shapes)
    assert math.isfinite(chunked["loss"]) and abs(chunked["loss"] - whole["loss"]) < 1e-2 * whole["loss"]


def test_bad_loss_chunk_and_lora_rank_are_refused(tmp_path, capsys):
    err = _refused(capsys, "--num-gpus", "1", "--loss-chunk-tokens", "-1", "--lora-r", "0", "--out",
                   str(tmp_path / "x.json"), *TINY)
    assert "--loss-chunk-tokens -1: expected 0 (whole logits) or a positive integer" in err
    assert "--lora-r 0: expected an integer >= 1" in err
    assert not (tmp_path / "x.json").exists()


def _stand_in_launcher(tmp_path, monkeypatch, body: str):
    """A ``deepspeed`` on PATH that runs ``body`` with ``result`` = the worker's result path (killing the whole
    process group is tested in tests/eval/test_process_group.py)."""
    fake = _executable(tmp_path / "elsewhere" / "deepspeed", f"""#!{sys.executable}
import json, sys, time
args = sys.argv[1:]
result = args[args.index("--worker") + 1]
{body}
""")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "bin" / "python"))
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")


def test_a_launch_past_its_timeout_fails_saying_so(tmp_path, monkeypatch):
    from eval.bench import train_multi_gpu

    _stand_in_launcher(tmp_path, monkeypatch, "time.sleep(120)")
    out = tmp_path / "bench.json"
    assert train_multi_gpu.main(["--num-gpus", "1", "--seq", "64", "--timeout-s", "2", "--out", str(out), *TINY]) == 1
    (failure,) = json.loads(out.read_text())["failures"]
    assert "timed out after 2 s" in failure["output_tail"]


def test_a_result_written_before_a_teardown_timeout_is_kept_and_marked(tmp_path, monkeypatch):
    from eval.bench import train_multi_gpu

    monkeypatch.setattr(train_multi_gpu, "TEARDOWN_GRACE_S", 1)
    _stand_in_launcher(tmp_path, monkeypatch, """open(result, "w").write(json.dumps({"gpus": 1, "sp": 1, "replicas": 1,
    "seq": 64, "tokens_per_s": 10.0, "tokens_per_s_per_gpu": 10.0, "seconds_per_step": 6.4, "tokens_per_step": 64,
    "peak_memory_gib_max_rank": None, "device": "stand-in", "loss": 5.5}))
time.sleep(120)""")
    out = tmp_path / "bench.json"
    assert train_multi_gpu.main(["--num-gpus", "1", "--seq", "64", "--timeout-s", "600", "--out", str(out), *TINY]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["failures"] == [] and row["teardown_timed_out"] is True and row["tokens_per_s"] == 10.0


def test_each_launch_gets_a_free_port_unless_one_is_given(tmp_path, monkeypatch):
    from eval.bench import train_multi_gpu

    ports = []
    from eval.bench.process_group import JobOutcome

    monkeypatch.setattr(train_multi_gpu, "run_process_group",
                        lambda command, **kw: (ports.append(command[command.index("--master_port") + 1]),
                                               JobOutcome(1, "stand-in failure"))[1])
    monkeypatch.setattr(train_multi_gpu, "deepspeed_launcher", lambda: ["deepspeed"])
    args = ["--num-gpus", "1,1", "--seq", "64", "--out", str(tmp_path / "b.json"), *TINY]
    train_multi_gpu.main(args)
    train_multi_gpu.main(args + ["--master-port", "29999"])
    assert len(ports) == 4 and all(p.isdigit() and p != "29999" for p in ports[:2]) and ports[2:] == ["29999"] * 2
