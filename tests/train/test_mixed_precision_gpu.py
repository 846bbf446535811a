"""Every precision setting a user would try trains on the GPU: fp32 weights + bf16 autocast, bf16 weights,
each with and without DeepSpeed (ZeRO-2), with the distillation objective (the teacher runs in the same
precision setting). Tiny model, 3 optimizer steps each, through train/pod.py as a user runs it."""

import json
import math

import pytest
from pipeline_runs import pipeline_env, python_command, run
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe

COMBINATIONS = {
    "fp32-weights-bf16-autocast": ({"dtype": "float32"}, {"bf16": True}, None),
    "bf16-weights-pure-bf16": ({"dtype": "bfloat16"}, {"bf16": False}, None),
    "bf16-weights-bf16-flag": ({"dtype": "bfloat16"}, {"bf16": True}, None),
    "fp32-weights-deepspeed-bf16": ({"dtype": "float32"}, {"bf16": True}, "recipes/deepspeed/zero2.json"),
    "bf16-weights-deepspeed-bf16": ({"dtype": "bfloat16"}, {"bf16": True}, "recipes/deepspeed/zero2.json"),
}


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_assets_gpu")
    return (make_tiny_model(root / "model"),) + make_texts(root / "text")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_precision_combination_trains_on_gpu(name, tiny_assets, tmp_path):
    model_section, train_section, deepspeed = COMBINATIONS[name]
    model_dir, train_text, held_out = tiny_assets
    recipe = tiny_recipe(tmp_path, model_dir, train_text, held_out,
                         train={**train_section, "objective": "lm+distill", "max_steps": 3, "save_steps": 100},
                         deepspeed={"config": deepspeed}, eval={"perplexity": True, "every_steps": 3,
                                                                 "curve_max_tokens": 128})
    recipe["model"].update(model_section)
    path = write_recipe(tmp_path / "tiny.yaml", recipe)
    done = run(python_command(path), pipeline_env(OMP_NUM_THREADS=4, DS_ACCELERATOR="cuda"))
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3], done.stdout[-2000:]
    assert all(math.isfinite(r["loss"]) and r["kl"] > 0 for r in records)
    results = json.loads((out / "results.json").read_text())
    assert math.isfinite(results["perplexity"]["pod_after"]["ppl"])
    curve = json.loads((out / "learning_curve.json").read_text())
    assert [p["step"] for p in curve["points"]] == [0, 3]
