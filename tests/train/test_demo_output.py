"""What ``make demo`` prints (issue 33 s5): no doubled ``[data]`` lines, no ``push`` stage without a Hub repo, a
report note that says what ran, plain English in recipe errors."""

from __future__ import annotations

import re

import pytest
import torch
from pipeline_runs import pipeline_env, python_command, run
from tiny_setup import REPO, make_texts, make_tiny_model, tiny_recipe, write_recipe

DEMO = REPO / "recipes" / "smollm2_135m.yaml"


def _demo(*overrides):
    from train.recipe import load_recipe

    return load_recipe(DEMO, list(overrides), check_environment=False)


@pytest.mark.parametrize("override, message", [
    ("train.report_to=7", "expected a list of strings, got int"),
    ("pod.protect_units=3", "expected a list of lists of integers or a string, got int"),
    ("eval.out_of_domain=5", "expected a list of strings, got int"),
])
def test_recipe_type_errors_read_as_english(override, message):
    from train.recipe import RecipeError

    with pytest.raises(RecipeError) as caught:
        _demo(override)
    assert any(message in problem for problem in caught.value.problems), caught.value.problems
    assert not any("a list of a" in problem for problem in caught.value.problems)


def test_push_is_not_a_stage_without_a_hub_repo():
    from train.pipeline import ORDER, stages_to_run

    assert "push" not in stages_to_run(_demo(), list(ORDER))  # hub.repo_id: null
    assert stages_to_run(_demo("hub.repo_id=me/pod"), list(ORDER)) == list(ORDER)
    assert stages_to_run(_demo(), ["eval", "explore"]) == ["explore", "eval"]


def test_demo_report_note_says_what_ran():
    from train.pipeline import render_report_note

    note = _demo().eval.report_note
    assert "40-step CPU" not in note
    assert render_report_note(note, max_steps=40, device=torch.device("cpu")).startswith(
        "This was a 40-step demonstration on CPU.")
    longer = _demo("train.max_steps=400")
    assert render_report_note(longer.eval.report_note, max_steps=longer.train.max_steps,
                              device=torch.device("cpu")).startswith("This was a 400-step demonstration on CPU.")
    assert render_report_note("braces {kept}", max_steps=1, device=torch.device("cpu")) == "braces {kept}"


def test_model_card_leaves_the_report_note_out(tmp_path):
    from train.export import write_model_card

    recipe = _demo()
    layers = 30
    card = write_model_card(tmp_path, recipe, [[0, 0, 0]] * layers, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    text = card.read_text()
    assert "demonstration" not in text and "report_note" not in text
    assert "max_steps: 40" in text  # the recipe itself is still there


def test_data_lines_count_the_rows_the_run_reads():
    from train.data import describe_rows

    summary = [{"source": "podkit:austen", "share": 0.5, "rows": 1000, "available_rows": 1500},
               {"source": "podkit:shakespeare", "share": 0.5, "rows": 1000, "available_rows": 3000}]

    class Rows:
        context_length = 512

        def __len__(self):
            return 2000

        def summary(self):
            return summary

    lines = describe_rows(Rows(), 80)  # 40 steps x 2 rows
    assert lines[0] == "[data] podkit:austen: 50.0% of rows, ~40 rows of 512 (0.0267 passes over 1,500 available)"
    assert lines[-1] == "[data] the run reads 80 rows (40,960 tokens) of a 2,000-row mixture (0.04 passes)"
    whole = describe_rows(Rows())
    assert whole[1] == "[data] podkit:shakespeare: 50.0% of rows, 1,000 rows of 512 (0.333 passes over 3,000 available)"
    assert whole[-1] == "[data] the run reads 2,000 rows (1,024,000 tokens) of a 2,000-row mixture"


def test_pipeline_prints_the_data_lines_once(tmp_path):
    model = make_tiny_model(tmp_path / "model", layers=2)
    train_text, held = make_texts(tmp_path / "texts")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, model, train_text, held))
    done = run(python_command(recipe, "--stages", "explore,train"), pipeline_env(HF_HUB_OFFLINE="1"))
    out = done.stdout
    banner = next(line for line in out.splitlines() if line.startswith("[podkit]") and "stages" in line)
    assert "stages explore,train," in banner and "push" not in banner
    data = [line for line in out.splitlines() if line.startswith("[data]")]
    assert len(data) == 2, data  # one source + the total, from the training stage only
    assert data[-1] == "[data] the run reads 8 rows (512 tokens) of a 24-row mixture (0.333 passes)", data
    assert re.search(r"^\[explore\] 2 calibration rows of \d+ tokens from ", out, flags=re.M), out[-3000:]


def test_model_card_says_which_sharing_was_trained(tmp_path):
    """The card's summary of POD names what the member layers read from their anchor: keys (v2) or scores (v1)."""
    from train.export import write_model_card

    texts = {}
    for sharing in ("keys", "scores"):
        out = tmp_path / sharing
        out.mkdir()
        card = write_model_card(out, _demo(f"pod.sharing={sharing}"), [[0, 0, 0]] * 30,
                                base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
        texts[sharing] = card.read_text()
    assert "v2 key sharing" in texts["keys"] and "score sharing" not in texts["keys"]
    assert "attention scores" in texts["scores"] and "v1 score sharing" in texts["scores"]
