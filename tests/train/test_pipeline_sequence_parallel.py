"""train/pod.py with ``train.sequence_parallel_size=2`` under the deepspeed launcher (2 CPU processes, gloo,
ZeRO-3): each packed row is split over the 2 ranks. Its per-step losses must equal a one-process run of the
same recipe without sequence parallelism (same rows in the same order, same optimizer steps)."""

import json

import pytest
from pipeline_runs import deepspeed_command, pipeline_env, python_command, run
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


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "losses.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sequence_parallel_pipeline_matches_one_process(tmp_path):
    model_dir = _sharpen_attention(make_tiny_model(tmp_path / "model", heads=4, kv_heads=2))
    train_text, held_out = make_texts(tmp_path / "text")
    common = dict(deepspeed={"config": "recipes/deepspeed/zero3.json"}, eval={"perplexity": False})
    stages = ["--stages", "explore,train"]
    env = pipeline_env()
    train = {"max_steps": 3, "per_device_batch_size": 1, "save_steps": 100, "learning_rate": 3e-3}

    one = tiny_recipe(tmp_path / "one", model_dir, train_text, held_out, train=train, **common)
    run(python_command(write_recipe(tmp_path / "one.yaml", one), *stages), env)

    sp = tiny_recipe(tmp_path / "sp", model_dir, train_text, held_out,
                     train={**train, "sequence_parallel_size": 2}, **common)
    done = run(deepspeed_command(write_recipe(tmp_path / "sp.yaml", sp), *stages), env)
    assert "Ulysses sequence parallelism: 2 ranks per sequence (32 tokens each), 1 data-parallel replica(s)" \
        in done.stdout, done.stdout[-3000:]

    reference, sharded = _losses(tmp_path / "one" / "out"), _losses(tmp_path / "sp" / "out")
    assert len(reference) == len(sharded) == 3
    print("losses, one process:", reference, "SP=2:", sharded)
    for step, (a, b) in enumerate(zip(reference, sharded), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one process {a}, SP=2 {b}"
    assert (tmp_path / "sp" / "out" / "trained" / "config.json").is_file()
