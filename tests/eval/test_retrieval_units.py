"""eval.studies.retrieval_units: block splitting, the unit list, and the teacher-forced answer score."""

import pytest
import torch

from eval.studies import retrieval_units as ru

ANCHORS = [[0, 0], [0, 1], [0, 1], [3, 1], [3, 4]]  # 5 layers x 2 KV heads


def test_split_block_makes_the_unit_an_anchor_and_reanchors_the_rest_of_its_block():
    from sparse_models.schemes.pod import validate_anchor_layers

    split = ru.split_block(ANCHORS, 1, 0)
    assert [row[0] for row in split] == [0, 1, 1, 3, 3]      # layers 1-2 now a block anchored at 1
    assert [row[1] for row in split] == [0, 1, 1, 1, 4]      # the other head is untouched
    validate_anchor_layers(split)
    assert ANCHORS[1][0] == 0                                # the input is not modified
    with pytest.raises(ValueError, match="already an anchor"):
        ru.split_block(ANCHORS, 3, 0)


def test_shared_units_and_curve_points():
    assert ru.shared_units(ANCHORS) == [(1, 0), (2, 0), (2, 1), (3, 1), (4, 0)]
    assert ru.curve_points(5) == [1, 2, 4, 5] and ru.curve_points(1) == [1]
    assert ru.greedy_order({(2, 0): 0.5, (1, 1): 0.5, (0, 1): 2.0}) == [(0, 1), (1, 1), (2, 0)]


class _Echo(torch.nn.Module):
    """Logits that put all mass on the token that follows in ``script`` (a perfect predictor)."""

    def __init__(self, script: torch.Tensor, vocab: int = 11):
        super().__init__()
        self.script, self.vocab, self.weight = script, vocab, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        nxt = torch.roll(input_ids, -1, dims=1)
        logits = torch.full((*input_ids.shape, self.vocab), -30.0)
        logits.scatter_(2, nxt[..., None], 0.0)
        return type("Out", (), {"logits": logits})()


def test_answer_scores_on_a_perfect_and_a_wrong_answer():
    model = _Echo(torch.arange(8))
    prompt, answer = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    perfect = ru.answer_scores(model, [prompt], [answer])
    assert perfect["exact"] == 1.0 and perfect["logprob"] == pytest.approx(0.0, abs=1e-6)

    class _Off(_Echo):
        def forward(self, input_ids, use_cache=False):
            out = super().forward(input_ids)
            out.logits = torch.roll(out.logits, 1, dims=2)   # every prediction one token id off
            return out

    wrong = ru.answer_scores(_Off(torch.arange(8)), [prompt, prompt], [answer, answer])
    assert wrong["exact"] == 0.0 and wrong["logprob"] < -20


@pytest.mark.slow
def test_main_on_a_tiny_model_writes_scores_curve_protected_map_and_heatmap(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    from tiny_setup import make_tiny_model

    from sparse_models.calibration.pod_similarity import read_blocks_json, write_blocks_json

    model = make_tiny_model(tmp_path / "model", layers=4, kv_heads=2)
    anchors = [[0, 0], [0, 1], [0, 1], [3, 1]]
    write_blocks_json(tmp_path / "blocks.json", anchors)
    out = tmp_path / "out"
    with pytest.raises(SystemExit):  # the base model's window (16 + 4080) covers 256 tokens: POD == dense
        ru.main(["--model", str(model), "--blocks", str(tmp_path / "blocks.json"), "--lengths", "256",
                 "--depths", "2", "--device", "cpu", "--out", str(out)])
    assert ru.main(["--model", str(model), "--blocks", str(tmp_path / "blocks.json"), "--lengths", "256",
                    "--depths", "2", "--device", "cpu", "--sink-tokens", "4", "--recent-window", "28",
                    "--out", str(out)]) == 0
    report = json.loads((out / "retrieval_units.json").read_text())
    assert report["proximal"] == 32
    assert report["pod"]["logprob"] != pytest.approx(report["dense"]["logprob"], abs=1e-4)  # POD is really on
    assert report["samples"] == 2 and set(report["dense"]) == {"logprob", "exact"}
    assert sorted((r["layer"], r["kv_head"]) for r in report["splits"]) == ru.shared_units(anchors)
    assert [p["splits"] for p in report["curve"]] == ru.curve_points(len(ru.shared_units(anchors)))
    assert report["curve"][-1]["shared_units"] == 0           # every unit split: dense keys everywhere
    assert report["curve"][-1]["logprob"] == pytest.approx(report["dense"]["logprob"], abs=1e-4)
    protected = read_blocks_json(out / "blocks_protected.json")   # a valid block map
    assert len(ru.shared_units(protected["anchor_layers"])) == report["protected"]["shared_units"]
    # the same units as a recipe's pod.protect_units give the same map
    from sparse_models.calibration.pod_similarity import protect_units
    assert len(report["protected"]["units"]) == report["protected"]["splits"]
    assert protect_units(anchors, report["protected"]["units"])[0] == protected["anchor_layers"]
    assert (out / "retrieval_units.png").stat().st_size > 0


@pytest.mark.slow
def test_tasks_pool_passkey_and_needle_prompts(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    from tiny_setup import make_tiny_model

    from eval.models import load_tokenizer
    from sparse_models.calibration.pod_similarity import write_blocks_json

    model = make_tiny_model(tmp_path / "model", layers=3, kv_heads=1)
    tokenizer = load_tokenizer(str(model))
    needle = ru.task_samples("needle", tokenizer, [200], 2)
    assert [s.haystack for s in needle] == ["pride_and_prejudice"] * 2 and all("secret" in s.prompt for s in needle)
    assert ru.task_samples("passkey", tokenizer, [200], 2)[0].haystack == "filler"
    write_blocks_json(tmp_path / "blocks.json", [[0], [0], [0]])
    out = tmp_path / "out"
    assert ru.main(["--model", str(model), "--blocks", str(tmp_path / "blocks.json"), "--lengths", "200",
                    "--depths", "2", "--device", "cpu", "--sink-tokens", "4", "--recent-window", "28",
                    "--tasks", "passkey", "needle", "--out", str(out)]) == 0
    report = json.loads((out / "retrieval_units.json").read_text())
    assert report["tasks"] == ["passkey", "needle"] and report["samples"] == 4
