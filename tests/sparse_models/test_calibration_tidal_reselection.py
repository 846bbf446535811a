"""TidalDecode re-selection analysis: logits, top-k recall, the re-selection choice, outputs."""

import json
import math

import pytest
import torch

from sparse_models.calibration.tidal_reselection import (
    RecallAccumulator,
    analyse,
    last_query_logits,
    plot_reselection,
    read_selection_layers,
    reselection_scores,
    result_from_json,
    topk_mask,
    write_reselection_json,
)


@pytest.mark.parametrize("group", [1, 3, 4])
def test_last_query_logits_match_a_loop(group):
    kv_heads, queries, seq, dim = 2, 5, 19, 8
    q = torch.randn(2, kv_heads * group, queries, dim)
    k = torch.randn(2, kv_heads, seq, dim)
    logits = last_query_logits(q, k)
    for b in range(2):
        for h in range(kv_heads * group):
            for i in range(queries):
                position = seq - queries + i
                for j in range(seq):
                    value = logits[b, h, i, j]
                    if j < position:
                        assert value == pytest.approx(float(q[b, h, i] @ k[b, h // group, j]) / math.sqrt(dim), rel=1e-4, abs=1e-5)
                    else:
                        assert value == float("-inf")


def test_topk_mask_exact_and_short_rows():
    logits = torch.tensor([[[[3.0, 1.0, 2.0, -float("inf")], [0.5, -float("inf"), -float("inf"), -float("inf")]]]])
    mask = topk_mask(logits, 2)
    assert mask[0, 0, 0].tolist() == [True, False, True, False]
    assert mask[0, 0, 1].tolist() == [True, False, False, False]  # fewer finite keys than k: all of them


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_recall_identical_layers_is_one_and_random_layers_is_low(device):
    # On CUDA too: the accumulator's sums stay on the CPU while captured logits live on the GPU.
    torch.manual_seed(0)
    same = torch.randn(1, 3, 4, 200, device=device)
    acc = RecallAccumulator(3, budget=17)
    acc.add([same, same.clone(), torch.randn(1, 3, 4, 200, device=device)])
    recall = acc.recall()
    assert recall[0, 1] == pytest.approx(1.0) and recall[1, 0] == pytest.approx(1.0)
    assert torch.allclose(recall.diagonal(), torch.ones(3, dtype=torch.float64))
    assert recall[0, 2] < 0.3  # 16 of 200 at random: about 0.08
    probs = torch.softmax(same, -1)
    expected_mass = (probs * topk_mask(same, 16)).sum(-1).mean()
    assert acc.mass()[0, 1] == pytest.approx(float(expected_mass), rel=1e-6)
    assert acc.recall_sum.device.type == "cpu"


def test_reselection_scores_pick_the_block_boundary():
    num_layers = 10
    recall = torch.full((num_layers, num_layers), 0.2, dtype=torch.float64)
    for block in (range(0, 6), range(6, 10)):
        for l in block:
            for m in block:
                recall[l, m] = 0.9
    scores = reselection_scores(recall, full_layers=[0, 1], first_selection=2)
    assert max((c for c in scores if c is not None), key=scores.get) == 6
    assert scores[6] == pytest.approx(0.9) and scores[None] < scores[6]
    with pytest.raises(ValueError, match="first_selection=9"):
        reselection_scores(recall, [0, 1], 9)


def test_analyse_finds_where_attention_changes(tmp_path):
    """Layers 0-4 share queries/keys and layers 5-7 share other ones: re-select at 5."""
    torch.manual_seed(1)
    num_layers, heads, kv_heads, seq, dim = 8, 6, 2, 96, 16

    def capture(ids):
        gen = torch.Generator().manual_seed(int(ids.sum()))
        first = (torch.randn(1, heads, seq, dim, generator=gen) * 2, torch.randn(1, kv_heads, seq, dim, generator=gen))
        second = (torch.randn(1, heads, seq, dim, generator=gen) * 2, torch.randn(1, kv_heads, seq, dim, generator=gen))
        return {layer: first if layer < 5 else second for layer in range(num_layers)}

    samples = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])]
    result = analyse(samples, capture, num_layers=num_layers, budget=9, last_queries=8)
    assert result["reselection_layer"] == 5 and result["selection_layers"] == [2, 5]
    assert result["samples"] == 2
    path = write_reselection_json(tmp_path / "tidal.json", result, model="synthetic")
    data = json.loads(path.read_text())
    assert data["reselection_layer"] == 5 and len(data["recall"]) == num_layers
    assert data["scores"]["5"] > data["score_without_reselection"]
    assert read_selection_layers(path) == [2, 5]
    back = result_from_json(path)
    assert back["reselection_layer"] == 5 and back["scores"][None] == pytest.approx(result["scores"][None], abs=1e-5)
    torch.testing.assert_close(back["recall"], result["recall"], rtol=0, atol=1e-5)
    assert plot_reselection(back, tmp_path / "tidal.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_budget_is_rejected():
    with pytest.raises(ValueError, match="budget=1"):
        RecallAccumulator(4, budget=1)
