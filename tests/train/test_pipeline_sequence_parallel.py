"""train/pod.py with ``train.sequence_parallel_size=2`` (2 CPU processes, gloo, ZeRO-3): each packed row is split
over the 2 ranks. Its per-step losses must equal a one-process run of the same recipe without sequence
parallelism (same rows in the same order, same optimizer steps), across a two-host launch (DeepSpeed hostfile)
and a mid-epoch resume."""

import json
import subprocess

import pytest
from pipeline_runs import REPO, VENV_BIN, deepspeed_command, free_port, pipeline_env, python_command, run
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe

pytest.importorskip("deepspeed", reason="sequence parallelism uses DeepSpeed's Ulysses all-to-all")


def _sharpen_attention(model_dir, factor: float = 6.0):
    """Scale q/k projections so that the random model's attention is peaked: then a wrong position or a
    wrong key order changes the loss well beyond float noise (at init, attention is nearly uniform)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    model.save_pretrained(model_dir)
    return model_dir


def run_two_hosts(tmp_path, recipe, *args, env) -> str:
    """``deepspeed --hostfile`` with two hosts of one slot each, both on this machine: the launcher runs once
    per host (``--no_ssh --node_rank``), as on a cluster without ssh between nodes. Returns host 0's stdout."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("host0 slots=1\nhost1 slots=1\n")
    port = str(free_port())

    def command(node):
        return [str(VENV_BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                "--master_addr", "127.0.0.1", "--master_port", port, str(REPO / "train" / "pod.py"), str(recipe), *args]

    other = subprocess.Popen(command(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        done = run(command(0), env)
    finally:
        tail, _ = other.communicate(timeout=120)
    assert other.returncode == 0, f"host 1 exited {other.returncode}\n{tail[-4000:]}"
    return done.stdout


def _losses(out) -> dict[int, float]:
    """step -> loss; a resumed run appends its steps again, and the later record wins."""
    records = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        item = json.loads(line)
        records[item["step"]] = item["loss"]
    return records


@pytest.mark.slow
def test_sequence_parallel_pipeline_matches_one_process(tmp_path):
    """One process trains 5 steps. SP=2 trains 3 steps (checkpoint-3) as a two-host job (DeepSpeed hostfile,
    one process per "host", launched per host with --no_ssh), then resumes to 5 from that checkpoint as a
    one-host job (the SP data loader fast-forwards 3 micro-batches: one whole exchange + one slice). All 5
    losses agree."""
    model_dir = _sharpen_attention(make_tiny_model(tmp_path / "model", heads=4, kv_heads=2))
    train_text, held_out = make_texts(tmp_path / "text")
    common = dict(deepspeed={"config": "recipes/deepspeed/zero3.json"}, eval={"perplexity": False})
    stages = ["--stages", "explore,train"]
    env = pipeline_env()
    train = {"max_steps": 5, "per_device_batch_size": 1, "save_steps": 3, "learning_rate": 3e-3}

    one = tiny_recipe(tmp_path / "one", model_dir, train_text, held_out, train=train, **common)
    run(python_command(write_recipe(tmp_path / "one.yaml", one), *stages), env)

    sp = tiny_recipe(tmp_path / "sp", model_dir, train_text, held_out,
                     train={**train, "sequence_parallel_size": 2}, **common)
    path = write_recipe(tmp_path / "sp.yaml", sp)
    done = run_two_hosts(tmp_path, path, *stages, "train.max_steps=3", env=env)
    assert "Ulysses sequence parallelism: 2 ranks per sequence (32 tokens each), 1 data-parallel replica(s)" \
        in done, done[-3000:]
    assert (tmp_path / "sp" / "out" / "checkpoint-3").is_dir()
    run(deepspeed_command(path, "--stages", "train", "train.resume_from_checkpoint=auto"), env)

    reference, sharded = _losses(tmp_path / "one" / "out"), _losses(tmp_path / "sp" / "out")
    print("losses, one process:", reference, "SP=2:", sharded)
    assert sorted(reference) == sorted(sharded) == [1, 2, 3, 4, 5]
    for step in reference:
        a, b = reference[step], sharded[step]
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one process {a}, SP=2 {b}"
    assert (tmp_path / "sp" / "out" / "trained" / "config.json").is_file()
