"""The tiny recipe end to end with 2 processes under the deepspeed launcher (CPU, gloo), ZeRO-2 and ZeRO-3:
exploration -> a few training steps -> export -> push to a local Hub server -> reload -> generate."""

import json

import pytest
import torch
from fake_hub import FakeHub  # tests/train is on sys.path
from pipeline_runs import deepspeed_command, pipeline_env, run
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe

TOKEN = "hf_pipeline_test_token_9f8e7d"


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_assets")
    return (make_tiny_model(root / "model"),) + make_texts(root / "text")


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_deepspeed_pipeline_push_reload_generate(tmp_path, tiny_assets, zero, monkeypatch):
    import huggingface_hub.constants as constants
    from huggingface_hub import snapshot_download

    from sparse_models import PodkitLlamaForCausalLM

    model_dir, train_text, held_out = tiny_assets
    repo_id = f"tester/tiny-pod-{zero}"
    # ZeRO-2: lm+distill with a learning curve and an out-of-domain source; ZeRO-3: distill, with the frozen
    # teacher copy sharded like the student (an optimizer-less DeepSpeed engine)
    objective = "lm+distill" if zero == "zero2" else "distill"
    evaluation = ({"perplexity": True, "every_steps": 2, "curve_max_tokens": 128, "out_of_domain": [str(train_text)]}
                  if zero == "zero2" else {"perplexity": False})
    recipe = tiny_recipe(tmp_path, model_dir, train_text, held_out, deepspeed={"config": f"recipes/deepspeed/{zero}.json"},
                         hub={"repo_id": repo_id}, eval=evaluation,
                         train={"report_to": ["tensorboard"] if zero == "zero2" else ["none"], "objective": objective,
                                "loss_chunk_tokens": 50})
    path = write_recipe(tmp_path / "tiny.yaml", recipe)
    out = tmp_path / "out"
    with FakeHub(token=TOKEN) as hub:
        done = run(deepspeed_command(path), pipeline_env(HF_ENDPOINT=hub.endpoint, HF_TOKEN=TOKEN))
        assert f"[push] {repo_id}" in done.stdout, done.stdout[-3000:]
        pushed = dict(hub.repos[repo_id])
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        local = snapshot_download(repo_id, endpoint=hub.endpoint, cache_dir=tmp_path / "hf_cache", token=TOKEN)

    # both ranks trained; the launcher reports 2 processes
    assert "2 process(es)" in done.stdout
    records = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["kl"] > 0 and r["lm"] > 0 for r in records)  # the POD student differs from its dense teacher
    if objective == "distill":
        assert all(r["loss"] == pytest.approx(r["kl"], rel=1e-4) for r in records)
    else:
        assert all(r["loss"] == pytest.approx(0.5 * r["lm"] + 0.5 * r["kl"], rel=1e-4) for r in records)
        curve = json.loads((out / "learning_curve.json").read_text())
        assert [p["step"] for p in curve["points"]] == [0, 2, 4]
        assert curve["objective"] == "lm+distill" and curve["tokens_per_step"] == 2 * 2 * 64
        first = curve["points"][0]["sources"]
        assert set(first) == {str(held_out), str(train_text)}
        assert all(abs(v["dense_gap"]) < 1e-9 and v["pod_gap"] > 0 for v in first.values())
        assert (out / "learning_curve.png").stat().st_size > 1000
        results = json.loads((out / "results.json").read_text())
        assert set(results["sources"]) == {str(held_out), str(train_text)}
        assert {"dense", "pod_before", "pod_after", "dense_after"} <= set(results["sources"][str(train_text)])
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    assert (out / "exploration" / "similarity.png").stat().st_size > 1000
    anchors = json.loads((out / "exploration" / "blocks.json").read_text())["anchor_layers"]

    # what was pushed: the export, with the block map and scheme defaults, no secrets, no local paths
    export = out / "export"
    assert set(pushed) == {p.name for p in export.iterdir()}
    assert {"model.safetensors", "config.json", "README.md", "recipe.yaml", "pod_blocks.json", "tokenizer.json",
            "modeling_podkit.py"} <= set(pushed)
    config = json.loads(pushed["config.json"])
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_podkit.PodkitLlamaForCausalLM"
    assert config["sparse_attention"]["prefill_scheme"] == "pod" and config["sparse_attention"]["decode_scheme"] == "pod"
    assert config["sparse_attention"]["pod"]["anchor_layers"] == anchors
    for name, data in pushed.items():
        assert TOKEN.encode() not in data, name
        if not name.endswith(".safetensors"):
            assert str(tmp_path).encode() not in data, f"{name} carries a local path"
    assert TOKEN not in done.stdout + done.stderr
    card = pushed["README.md"].decode()
    assert "## Block map" in card and "## Recipe" in card and "KV saving" in card
    if zero == "zero2":
        assert "POD after adaptation" in card  # eval results made it into the card
        assert any((out / "runs").rglob("events.out.tfevents.*"))

    # reload from the Hub copy: identical logits to the local export, and generation works
    reloaded = PodkitLlamaForCausalLM.from_pretrained(local).eval()
    exported = PodkitLlamaForCausalLM.from_pretrained(export).eval()
    base = PodkitLlamaForCausalLM.from_pretrained(model_dir).eval()
    assert reloaded.sparse_config.prefill_scheme == "pod"
    ids = torch.randint(3, config["vocab_size"], (2, 40))
    with torch.no_grad():
        logits = reloaded(ids).logits
        assert torch.equal(logits, exported(ids).logits)
        assert not torch.allclose(logits, base(ids).logits)  # training changed the weights
        generated = reloaded.generate(ids, max_new_tokens=6, do_sample=False)
    assert generated.shape == (2, 46) and torch.equal(generated[:, :40], ids)
