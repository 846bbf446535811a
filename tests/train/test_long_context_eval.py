"""The fine-tune control (train.attention: dense), the pipeline's RULER evaluation with its dev / test protocol
(train/long_context_eval), and the model card's long-context table, on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train.pipeline_runs import pipeline_env, python_command, run
from tests.train.tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe
from train.long_context_eval import protocol, report, scoring

pytest.importorskip("long_context_eval", reason="nvidia-long-context-eval is installed by the eval extra")
pytest.importorskip("lm_eval")

LONG_CONTEXT = {"ruler": True, "lengths": [1024], "tasks": ["niah_single_1", "niah_multikey_2"], "samples": 2, "seed": 11,
                "dev_tasks": ["niah_single_1"], "dev_samples": 1, "dev_seed": 12, "batch_size": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("long_context")
    model = make_tiny_model(folder / "model")
    train_text, held_out = make_texts(folder / "texts")
    return folder, model, train_text, held_out


@pytest.fixture(scope="module")
def control_and_pod(tiny):
    """A control run and a POD run of one recipe, the POD run scoring the control as a row."""
    folder, model, train_text, held_out = tiny
    env = pipeline_env(HF_HUB_OFFLINE="1")
    control = tiny_recipe(folder / "control", model, train_text, held_out, long_context=LONG_CONTEXT,
                          eval={"max_tokens": 128, "every_steps": 2})
    control["train"].update(attention="dense", output_dir=str(folder / "control" / "out"))
    run(python_command(write_recipe(folder / "control.yaml", control)), env, timeout=900)
    pod = tiny_recipe(folder / "pod", model, train_text, held_out, long_context=LONG_CONTEXT,
                      eval={"max_tokens": 128, "control_export": str(folder / "control" / "out" / "export")})
    pod["train"].update(output_dir=str(folder / "pod" / "out"))
    run(python_command(write_recipe(folder / "pod.yaml", pod)), env, timeout=900)
    return folder / "control" / "out", folder / "pod" / "out", model


def test_control_trains_and_exports_dense_attention(control_and_pod):
    control, _, base = control_and_pod
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparse_models import PodkitLlamaForCausalLM

    config = json.loads((control / "export" / "config.json").read_text())
    assert config["sparse_attention"]["prefill_scheme"] == "dense"
    assert config["sparse_attention"]["decode_scheme"] == "dense"
    assert not (control / "exploration").exists() and not (control / "export" / "pod_blocks.json").exists()
    adapted = PodkitLlamaForCausalLM.from_pretrained(control / "export", torch_dtype=torch.float32).eval()
    plain = LlamaForCausalLM(LlamaConfig.from_pretrained(base)).eval()
    missing = plain.load_state_dict(adapted.state_dict(), strict=False)
    assert not missing.missing_keys
    original = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(original.state_dict().values(), plain.state_dict().values())), \
        "the control did not train"
    ids = torch.randint(4, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, plain(ids).logits, atol=1e-4, rtol=1e-4)
    results = json.loads((control / "results.json").read_text())
    assert set(results["long_context"]["rows"]) == {"dense", "control"}
    curve = json.loads((control / "learning_curve.json").read_text())
    assert all("ruler" in point and "1024" in point["ruler"] for point in curve["points"])
    card = (control / "export" / "README.md").read_text()
    assert "Dense fine-tune control" in card and "## Long context (RULER)" in card


def test_pod_run_reports_every_row_on_the_test_split(control_and_pod):
    _, pod, _ = control_and_pod
    results = json.loads((pod / "results.json").read_text())
    lc = results["long_context"]
    assert list(lc["rows"]) == ["dense", "control", "pod_after", "dense_after"]
    assert lc["protocol"]["reported"]["seed"] == 11 and lc["protocol"]["dev"]["seed"] == 12
    for row in lc["rows"].values():
        assert set(row) == {"1024"} and 0 <= row["1024"]["average"] <= 100 and row["1024"]["samples"] == 4
    assert "control" in results["sources"][next(iter(results["sources"]))]
    records = json.loads((pod / "ruler_records.json").read_text())
    assert {r["seed"] for r in records} == {11} and len(records) == 4 * 4
    card = (pod / "export" / "README.md").read_text()
    assert "| dense fine-tune control (same data, steps, objective) |" in card and "| POD export |" in card


def test_dev_and_test_samples_are_disjoint(tiny, tmp_path):
    from transformers import AutoTokenizer

    from train.recipe import recipe_from_dict

    folder, model, train_text, held_out = tiny
    tokenizer = AutoTokenizer.from_pretrained(model)
    recipe = recipe_from_dict(tiny_recipe(tmp_path, model, train_text, held_out, long_context=LONG_CONTEXT),
                              check_environment=False)
    dev, test = protocol.splits(recipe, max_positions=None)
    dev_samples = protocol.split_samples(dev, tokenizer, tmp_path, "tiny")
    test_samples = protocol.split_samples(test, tokenizer, tmp_path, "tiny")
    assert {s.seed for s in dev_samples} == {12} and {s.seed for s in test_samples} == {11}
    assert not {s.input for s in dev_samples} & {s.input for s in test_samples}
    protocol.check_disjoint(dev_samples, test_samples)
    with pytest.raises(SystemExit, match="same instance as dev sample"):
        protocol.check_disjoint(dev_samples, test_samples + dev_samples[:1])


def test_recipe_refuses_a_test_seed_equal_to_the_dev_seed(tiny, tmp_path):
    from train.recipe import recipe_from_dict
    from train.recipe_schema import RecipeError

    _, model, train_text, held_out = tiny
    bad = dict(LONG_CONTEXT, dev_seed=LONG_CONTEXT["seed"], tasks=["niah_singel_1"])
    with pytest.raises(RecipeError) as error:
        recipe_from_dict(tiny_recipe(tmp_path, model, train_text, held_out, long_context=bad,
                                     train={"attention": "sparse"}))
    text = str(error.value)
    assert "long_context.seed=11 equals long_context.dev_seed" in text
    assert "'niah_singel_1' (did you mean 'niah_single_1'?)" in text
    assert "train.attention='sparse'" in text


def test_lengths_follow_the_training_length_and_the_model_context(tiny, tmp_path):
    from train.recipe import recipe_from_dict

    _, model, train_text, held_out = tiny
    recipe = recipe_from_dict(tiny_recipe(tmp_path, model, train_text, held_out,
                                          data={"context_length": 2048, "max_train_tokens": 4096},
                                          eval={"max_tokens": 4096}, long_context={"ruler": True}),
                              check_environment=False)
    assert protocol.split_lengths(recipe, 8192) == (2048, 4096, 8192)
    notes = []
    assert protocol.split_lengths(recipe, 4096, log=notes.append) == (2048, 4096)
    assert "8192" in notes[0]


def test_card_renders_the_long_context_table():
    rows = {}
    for name, score in (("dense", 80.0), ("control", 60.0), ("pod_after", 48.0), ("dense_after", 54.0)):
        records = [{"task": task, "length": length, "score": score} for task in ("niah_single_1", "vt")
                   for length in (2048, 4096)]
        rows[name] = scoring.summarise(records)
    dev, test = (protocol.RulerSplit("dev", 1, ("vt",), 5, (2048, 4096)),
                 protocol.RulerSplit("test", 2, ("niah_single_1", "vt"), 20, (2048, 4096)))
    summary = {"protocol": protocol.protocol_record(dev, test, True), "rows": rows,
               "relative_to_dense": scoring.relative(rows, "dense"),
               "relative_to_control": scoring.relative(rows, "control")}
    card = "\n".join(report.card_lines(summary))
    assert "| model | 2048 tokens | 4096 tokens |" in card
    assert "| original dense model | 80.0 | 80.0 |" in card
    assert "| POD export | 48.0 (60% / 80%) | 48.0 (60% / 80%) |" in card
    assert "test seed 2" in card and "dev seed 1" in card
    assert summary["rows"]["dense"]["2048"]["categories"] == {"retrieval": 80.0, "multi-hop tracing": 80.0}
