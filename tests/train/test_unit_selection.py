"""``pod.protect_units: auto`` (train/unit_selection/): DuoAttention-style gates (arXiv 2410.10819) over POD's
shared units, the selection under the KV budget, the recipe's checks and the pipeline step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from pipeline_runs import pipeline_env, python_command, run
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe

from sparse_models.calibration.pod_similarity import greedy_blocks, kv_saving_fraction, protect_units, shared_units
from train.recipe import RecipeError, recipe_from_dict
from train.unit_selection.budget import rank_units, select_units
from train.unit_selection.episodes import answer_spans, recall_samples
from train.unit_selection.gated_forward import GatedPodForward
from train.unit_selection.optimise import optimise_gates

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sparse_models"))
from sm_tiny import pod_anchor_map, tiny_model  # noqa: E402

SINK, RECENT = 2, 5


def _pod_model(group: int, layers: int, anchors, sharing: str = "keys"):
    return tiny_model(group, layers, sparse={"prefill_scheme": "pod", "decode_scheme": "pod",
                                             "pod": {"anchor_layers": anchors, "sink_tokens": SINK,
                                                     "recent_window": RECENT, "sharing": sharing}})


@pytest.mark.parametrize("sharing", ["keys", "scores"])
@pytest.mark.parametrize("group", [1, 3])
def test_alpha_one_is_the_dense_model_and_alpha_zero_the_pod_model(group, sharing):
    layers = 4
    dense = tiny_model(group, layers)
    anchors = pod_anchor_map(layers, dense.config.num_key_value_heads)
    gated = GatedPodForward(dense, anchors, sink=SINK, recent=RECENT, sharing=sharing)
    ids = torch.randint(0, dense.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    ones = torch.ones(layers, dense.config.num_key_value_heads)
    with torch.no_grad():
        expected_dense = dense(input_ids=ids).logits
        expected_pod = _pod_model(group, layers, anchors, sharing)(input_ids=ids).logits
        assert torch.allclose(gated.logits(ids, ones), expected_dense, atol=1e-5, rtol=0)
        assert torch.allclose(gated.logits(ids, torch.zeros_like(ones)), expected_pod, atol=1e-5, rtol=0)
        assert (expected_pod - expected_dense).abs().max() > 1e-2  # the two ends differ: the check has teeth
        if sharing == "scores":  # and score sharing is not key sharing
            other = _pod_model(group, layers, anchors, "keys")(input_ids=ids).logits
            assert (expected_pod - other).abs().max() > 1e-3


@pytest.mark.parametrize("sharing", ["keys", "scores"])
def test_gradients_reach_every_shared_gate_and_no_anchor(sharing):
    model = tiny_model(3, 4)
    anchors = pod_anchor_map(4, 2)
    gated = GatedPodForward(model, anchors, sink=SINK, recent=RECENT, sharing=sharing)
    gated.freeze()
    alpha = torch.full((4, 2), 0.5, requires_grad=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    gated(ids, alpha)[:, 20:].pow(2).sum().backward()
    shared = gated.shared_mask()
    assert bool((alpha.grad[shared].abs() > 0).all())
    assert bool((alpha.grad[~shared] == 0).all())
    assert all(p.grad is None for p in model.parameters())


def test_a_unit_reading_corrupted_anchor_keys_keeps_a_higher_gate_than_a_harmless_one():
    """Planted effect: 2 layers x 2 KV heads, both layer-1 units share layer 0's keys. Layer 0's keys of KV head 0
    are replaced by large random ones (unit (1, 0) reads garbage for distant positions), and unit (1, 1)'s output
    is cut off by zeroing its o_proj columns (its attention cannot matter). The L1 pressure must drive the harmless
    gate to 0 while the corrupted unit's gate stays high."""
    model = tiny_model(3, 2)
    d, group = model.config.head_dim, 3
    with torch.no_grad():
        k0 = model.model.layers[0].self_attn.k_proj.weight
        k0[:d].normal_(0, 3.0, generator=torch.Generator().manual_seed(3))
        model.model.layers[1].self_attn.o_proj.weight[:, group * d:] = 0
    gated = GatedPodForward(model, [[0, 0], [0, 0]], sink=SINK, recent=RECENT)
    ids = torch.randint(0, model.config.vocab_size, (4, 48), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 24:] = True
    result = optimise_gates(gated, ids, mask, steps=40, lr=0.05, l1_weight=0.05, batch_size=2)
    alpha = result["alpha"]
    assert float(alpha[1, 1]) < 0.05
    assert float(alpha[1, 0]) > 0.5
    assert float(alpha[0, 0]) == float(alpha[0, 1]) == 1.0  # anchors report 1
    assert rank_units([[0, 0], [0, 0]], alpha) == [(1, 0), (1, 1)]
    assert len(result["curve"]) == 40 and result["curve"][-1]["mean_alpha"] < result["curve"][0]["mean_alpha"]


def _random_similarity(layers=12, kv_heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    sim = torch.rand(kv_heads, layers, layers, generator=g) * 0.6 + 0.2
    return (sim + sim.transpose(1, 2)) / 2


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("target", [0.1, 0.2, 0.3])
def test_selection_keeps_the_highest_gates_and_never_breaks_the_budget(seed, target):
    candidate = greedy_blocks(_random_similarity(seed=seed), 0.2)
    alpha = torch.rand(12, 3, generator=torch.Generator().manual_seed(seed))
    length, sink, recent = 2048, 16, 240
    chosen, final = select_units(candidate, alpha, min_kv_saving=target, seq_len=length, sink=sink, recent=recent)
    assert kv_saving_fraction(final, length, sink, recent) >= target
    ranked = rank_units(candidate, alpha)
    assert chosen == ranked[:len(chosen)]
    assert [float(alpha[u]) for u in ranked] == sorted((float(alpha[u]) for u in ranked), reverse=True)
    assert final == protect_units(candidate, chosen)[0]
    assert all(final[layer][head] == layer for layer, head in chosen)
    if len(chosen) < len(ranked):  # one more unit would cross the budget
        assert kv_saving_fraction(protect_units(final, [ranked[len(chosen)]])[0], length, sink, recent) < target


def test_selection_refuses_a_candidate_below_the_budget():
    candidate = [[0, 0], [1, 0], [2, 2], [2, 2]]
    saving = kv_saving_fraction(candidate, 64, 4, 12)
    with pytest.raises(ValueError, match=rf"the candidate block map saves {saving:.1%} of the KV cache at 64 tokens, "
                                         r"below the budget 25.0%: no unit can keep its own keys; lower the candidate "
                                         r"delta \(pod.unit_selection.candidate_delta\) or pod.min_kv_saving"):
        select_units(candidate, torch.ones(4, 2), min_kv_saving=0.25, seq_len=64, sink=4, recent=12)


# ---- data -------------------------------------------------------------------------------------

class _CharTokenizer:
    """One token per character (offsets exact), enough to check the answer marks."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"input_ids": [ord(c) % 256 for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}


PROSE = ["\n\n".join(f"Paragraph {d}.{i} of plain training prose about gardens and rivers." for i in range(40))
         for d in range(3)]


def test_recall_samples_mark_exactly_the_answer_values_at_one_length():
    ids, mask = recall_samples(_CharTokenizer(), PROSE, length=1200, count=5, seed=1)
    assert ids.shape == mask.shape == (5, 1200)
    for row, marks in zip(ids, mask):
        text = "".join(chr(int(t)) for t in row)
        quiz = text.index("\n\nQuiz.\n")
        predicted = "".join(text[t + 1] for t in torch.nonzero(marks).flatten().tolist())
        values = "".join(text[s:e] for s, e in answer_spans(text[:text.rindex(".\n") + 2]))
        assert predicted == values and predicted
        assert int(torch.nonzero(marks).min()) > quiz
    again, _ = recall_samples(_CharTokenizer(), PROSE, length=1200, count=5, seed=1)
    assert torch.equal(ids, again)


def test_recall_samples_say_when_the_length_is_too_short():
    with pytest.raises(ValueError, match=r"could not fit a recall episode \(facts and quiz\) into 60 tokens"):
        recall_samples(_CharTokenizer(), PROSE, length=60, count=1)


def test_the_gate_data_shares_no_wording_with_the_reported_tasks():
    """Not RULER's templates (train/long_context_eval/ruler.py) nor eval/tasks' pass key and needle."""
    from eval.tasks import needle, passkey
    from train.corpus.recall import EVALUATION_PHRASES
    from train.long_context_eval import ruler

    ids, _ = recall_samples(_CharTokenizer(), PROSE, length=1500, count=8, seed=2)
    text = "\n".join("".join(chr(int(t)) for t in row) for row in ids).lower()
    fragments = [piece.strip().lower() for template in (ruler.NIAH_TEMPLATE, ruler.NIAH_NEEDLE, passkey.NEEDLE)
                 for piece in template.split("{") for piece in [piece.split("}")[-1]] if len(piece.strip()) >= 12]
    assert fragments
    for phrase in fragments + [p.lower() for p in EVALUATION_PHRASES]:
        assert phrase not in text, phrase
    assert "secret" in Path(needle.__file__).read_text()  # EVALUATION_PHRASES tracks the needle's wording


# ---- recipe ------------------------------------------------------------------------------------

def _recipe(**pod):
    return {"model": {"name_or_path": "podkit:smollm2-135m"}, "data": {"train": "podkit:austen", "context_length": 2048},
            "pod": {"sink_tokens": 16, "recent_window": 240, **pod}, "train": {"output_dir": "unused"}}


@pytest.mark.parametrize("pod, message", [
    ({"protect_units": "some"}, "pod.protect_units='some': expected a list of [layer, KV head] pairs (e.g. [[18, 2]]) "
                                "or 'auto'"),
    ({"protect_units": "auto"}, "pod.protect_units='auto': needs the KV budget it selects under; set pod.min_kv_saving"),
    ({"protect_units": "auto", "min_kv_saving": 0.3, "unit_selection": {"steps": 0}},
     "pod.unit_selection.steps=0: expected an integer >= 1"),
    ({"protect_units": "auto", "min_kv_saving": 0.3, "unit_selection": {"stepz": 3}},
     "pod.unit_selection.stepz: unknown field (did you mean 'steps'?)"),
    ({"protect_units": "auto", "min_kv_saving": 0.3, "unit_selection": {"lr": "fast"}},
     "pod.unit_selection.lr='fast': expected a number"),
    ({"protect_units": "auto", "min_kv_saving": 0.3, "unit_selection": {"data": "ruler"}},
     "pod.unit_selection.data='ruler': expected one of recall"),
    ({"protect_units": "auto", "min_kv_saving": 0.3, "unit_selection": {"candidate_delta": 1.5}},
     "pod.unit_selection.candidate_delta=1.5: expected a number in [0, 1]"),
    ({"protect_units": "auto", "min_kv_saving": 0.3, "unit_selection": {"length": 200}},
     "pod.unit_selection.length=200: the episodes must be longer than POD's proximal window (16 + 240 tokens)"),
    ({"protect_units": [[1, 0]], "unit_selection": {"steps": 5}},
     "pod.unit_selection={'steps': 5}: only used with pod.protect_units: auto"),
])
def test_bad_unit_selection_settings_are_reported_before_any_work(pod, message):
    with pytest.raises(RecipeError) as error:
        recipe_from_dict(_recipe(**pod))
    assert message in str(error.value)


def test_auto_takes_either_sharing():
    """The gates are learned for the sharing the recipe trains (the gated forward's POD branch follows it)."""
    for sharing in ("keys", "scores"):
        recipe = recipe_from_dict(_recipe(protect_units="auto", min_kv_saving=0.3, sharing=sharing))
        assert recipe.pod.protect_units == "auto" and recipe.pod.sharing == sharing
    with pytest.raises(ValueError, match="sharing='values'"):
        GatedPodForward(tiny_model(1, 2), pod_anchor_map(2, 2), sink=SINK, recent=RECENT, sharing="values")


def test_auto_parses_from_the_command_line_override():
    recipe = recipe_from_dict(_recipe(min_kv_saving=0.3), ["pod.protect_units=auto",
                                                          "pod.unit_selection={steps: 10, l1_weight: 0.1}"])
    assert recipe.pod.protect_units == "auto" and recipe.pod.unit_selection == {"steps": 10, "l1_weight": 0.1}


# ---- pipeline ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sharing", ["keys", "scores"])
def test_pipeline_selects_units_under_the_budget_and_trains_that_map(tmp_path, sharing):
    model = make_tiny_model(tmp_path / "model", layers=4, kv_heads=2)
    train_text, held_out = make_texts(tmp_path / "text")
    recipe = tiny_recipe(tmp_path, model, train_text, held_out, eval={"perplexity": False}, train={"max_steps": 1},
                         pod={"protect_units": "auto", "min_kv_saving": 0.12, "sharing": sharing,
                              "unit_selection": {"steps": 4, "samples": 2, "length": 384, "candidate_delta": 0.0}})
    done = run(python_command(write_recipe(tmp_path / "auto.yaml", recipe), "--stages", "explore,train,export"),
               pipeline_env())
    exploration = tmp_path / "out" / "exploration"
    gates = json.loads((exploration / "unit_gates.json").read_text())
    assert (exploration / "unit_gates.png").stat().st_size > 0
    candidate, final = gates["candidate_anchor_layers"], gates["anchor_layers"]
    assert len(gates["loss_curve"]) == 4 and gates["min_kv_saving"] == 0.12
    assert kv_saving_fraction(final, 64, 4, 12) >= 0.12
    assert shared_units(final) and gates["chosen_units"]  # units were given back, some stay shared
    # every split adds one anchor: protecting one more unit would cross the budget
    assert kv_saving_fraction(protect_units(final, [shared_units(final)[0]])[0], 64, 4, 12) < 0.12
    assert final == protect_units(candidate, [tuple(u) for u in gates["chosen_units"]])[0]
    assert [[a is None for a in row] for row in gates["alpha"]] == [[a == layer for a in row]
                                                                     for layer, row in enumerate(candidate)]
    trained = json.loads((exploration / "blocks_trained.json").read_text())
    assert trained["anchor_layers"] == final and trained["protect_units"] == gates["chosen_units"]
    export = tmp_path / "out" / "export"
    assert json.loads((export / "pod_blocks.json").read_text())["anchor_layers"] == final
    assert "chosen by learned gates under the KV budget" in (export / "README.md").read_text()
    assert "keep their own distant keys" in done.stdout
    assert json.loads((export / "config.json").read_text())["sparse_attention"]["pod"]["sharing"] == sharing
    print(done.stdout)


def test_without_the_explore_stage_the_selected_map_is_reused_or_asked_for(tmp_path):
    """A resume skips the explore stage (pipeline._checked_resume): the run's selected map is reused, and a run
    without one stops with one line naming the file instead of training some other map."""
    from sparse_models.calibration.pod_similarity import write_blocks_json
    from train.pipeline import _auto_units

    recipe = recipe_from_dict(_recipe(protect_units="auto", min_kv_saving=0.3) | {"train": {"output_dir": str(tmp_path)}})
    path = tmp_path / "exploration" / "blocks_trained.json"
    with pytest.raises(SystemExit, match=f"pod.protect_units=auto: no selected map at {path}: run the explore stage"):
        _auto_units(recipe, ["train"], None, None, None, None, 0, None, lambda *a: None)
    write_blocks_json(path, [[0, 0], [1, 0]], unit_selection="unit_gates.json")
    assert _auto_units(recipe, ["train"], None, None, None, None, 0, None, lambda *a: None) == ([[0, 0], [1, 0]], path)
