"""eval.studies.needle_heads: key-token location, selection masks against the kernels' reference selection,
selection sources from the layer plan, and the kept-mass bookkeeping on hand-made and real forwards."""

import json

import pytest
import torch

from eval.studies.needle_heads import (
    SCHEME_MODES,
    SELECTIONS,
    NeedleMassAccumulator,
    analyse_prompts,
    current_token_logits,
    key_token_positions,
    main,
    result_from_json,
    scheme_selection_mask,
    selection_masks,
    selection_sources,
    teacher_forced_prompt,
)
from eval.tasks.passkey import make_passkey_sample
from kernels.reference import select_topk_positions
from sparse_models.calibration.tidal_reselection import last_query_logits


@pytest.fixture(scope="module")
def tiny_podkit():
    from tests.tiny_models import tiny_model

    return tiny_model(3, 6, seed=0, vocab=400, intermediate=64, positions=2048)


def test_key_token_positions_overlap_rule():
    offsets = [(0, 3), (3, 5), (5, 6), (6, 6), (6, 9), (9, 12)]
    assert key_token_positions(offsets, [(4, 7)]) == [1, 2, 4]   # partial overlaps count, empty tokens do not
    assert key_token_positions(offsets, [(0, 3), (9, 10)]) == [0, 5]
    assert key_token_positions(offsets, [(12, 14)]) == []


def test_teacher_forced_prompt_finds_both_key_mentions(tiny_tokenizer):
    sample = make_passkey_sample(tiny_tokenizer, 300, 0.5)
    prompt = teacher_forced_prompt(tiny_tokenizer, sample)
    context_ids = tiny_tokenizer(sample.context)["input_ids"]
    key_text = "".join(tiny_tokenizer.decode([context_ids[p]]) for p in prompt.key_positions)
    assert key_text.count(sample.passkey) == 2 and set(key_text) <= set(sample.passkey)
    answer = tiny_tokenizer(sample.answer, add_special_tokens=False)["input_ids"]
    assert prompt.answer_ids == answer
    question = tiny_tokenizer(sample.question, add_special_tokens=False)["input_ids"]
    assert prompt.input_ids == context_ids + question + answer[:-1]


@pytest.mark.parametrize("group_size", [1, 3])
def test_selection_masks_match_the_reference_selection(group_size):
    """query_head and kv_group masks = kernels.reference.select_topk_positions for a one-query decode
    (the current token's logit set very low so that both normalise over the same past keys)."""
    torch.manual_seed(1)
    num_kv, seq, budget = 2, 70, 9
    logits = torch.randn(1, num_kv * group_size, 1, seq)
    causal = logits.clone()
    causal[..., -1] = float("-inf")  # last_query_logits excludes the current token
    reference_scores = logits[:, :, 0].clone()
    reference_scores[..., -1] = -1e4
    masks = selection_masks(causal, budget, group_size)
    seq_lens = torch.tensor([seq])
    for name, per_kv_group in (("query_head", False), ("kv_group", True)):
        index = select_topk_positions(reference_scores, seq_lens, budget, group_size=group_size,
                                      per_kv_group=per_kv_group)
        if per_kv_group:
            index = index.repeat_interleave(group_size, dim=1)
        expected = torch.zeros(1, num_kv * group_size, seq, dtype=torch.bool).scatter_(-1, index[..., :-1], True)
        assert torch.equal(masks[name][:, :, 0], expected), name
    union = masks["query_head"].any(dim=1, keepdim=True)
    assert torch.equal(masks["union_of_heads"], union.expand_as(masks["query_head"]))


def test_selection_sources_follow_the_layer_plan(tiny_podkit):
    assert selection_sources(tiny_podkit, [2, 4], [0, 1]) == [None, None, None, 2, None, 4]
    sources = selection_sources(tiny_podkit, [3], [0])
    assert sources[0] is None and sources[3] is None and sources[4:] == [3, 3]
    with pytest.raises(Exception, match="selection_layers"):
        selection_sources(tiny_podkit, [2, 9], [0, 1])


def test_accumulator_on_a_hand_made_case():
    """Two layers, two heads, one query, 6 keys; the key sits at position 1. Layer 1 reads layer 0's
    selection. Head 0 of layer 0 ranks the key first, head 1 ranks it last, so at budget 2 (one past
    key) head 1 of layer 1 loses its needle mass under per-head selection and keeps it under the union."""
    neg = float("-inf")
    layer0 = torch.tensor([[[[0.0, 5.0, 1.0, 0.0, 0.0, neg]], [[0.0, -5.0, 3.0, 0.0, 0.0, neg]]]])
    layer1 = torch.tensor([[[[0.0, 0.0, 0.0, 0.0, 0.0, neg]], [[0.0, 4.0, 0.0, 0.0, 0.0, neg]]]])
    acc = NeedleMassAccumulator(2, 2, [2, 6], group_size=1, full_layers=[0])
    acc.add([layer0, layer1], key_positions=[1], sources=[None, 0])
    needle_l1h1 = float(torch.softmax(layer1[0, 1, 0], -1)[1])
    assert float(acc.needle[1, 1]) == pytest.approx(needle_l1h1)
    assert float(acc.kept_fraction("query_head", 2)[1, 1]) == 0.0     # head 1 selected position 2 at layer 0
    assert float(acc.kept_fraction("query_head", 2)[1, 0]) == pytest.approx(1.0)
    assert float(acc.kept_fraction("union_of_heads", 2)[1, 1]) == pytest.approx(1.0)
    assert float(acc.kept_fraction("own_topk", 2)[1, 1]) == pytest.approx(1.0)
    for name in SELECTIONS:  # layer 0 reads every key; budget 6 covers every key
        assert torch.allclose(acc.kept_fraction(name, 2)[0], torch.ones(2, dtype=torch.float64))
        assert torch.allclose(acc.kept_fraction(name, 6), torch.ones(2, 2, dtype=torch.float64))


def test_full_budget_keeps_every_needle_and_small_budgets_do_not(tiny_podkit, tiny_tokenizer):
    prompts = [teacher_forced_prompt(tiny_tokenizer, make_passkey_sample(tiny_tokenizer, 200, depth))
               for depth in (0.0, 0.6)]
    longest = max(len(p.input_ids) for p in prompts)
    result = analyse_prompts(tiny_podkit, prompts, budgets=[4, longest + 1], selection_layers=[2, 4],
                             full_layers=[0, 1], head_threshold=0.01, progress=False)
    assert result["answer_queries"] == sum(p.num_answer_queries for p in prompts)
    for name in SELECTIONS:
        assert torch.allclose(result["kept"][name][longest + 1], torch.ones(6, 6, dtype=torch.float64), atol=1e-9)
    small = result["kept"]["query_head"][4]
    assert torch.all(small[[0, 1, 2, 4]] == 1.0)  # full and selection layers read every key
    assert torch.all(result["kept"]["own_topk"][4][[0, 1]] == 1.0)  # the oracle keeps the full layers dense
    assert float(small[[3, 5]].min()) < 1.0
    # the union of the heads' lists contains each head's own list
    assert torch.all(result["kept"]["union_of_heads"][4] >= small - 1e-9)


def test_cli_rejects_bad_input_before_loading(capsys):
    with pytest.raises(SystemExit):
        main(["--budgets", "1", "128"])
    assert "--budgets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--head-threshold", "0"])
    assert "--head-threshold" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--haystack", "nope"])
    assert "haystack" in capsys.readouterr().err


def test_json_round_trip_and_replot(tmp_path, tiny_podkit, tiny_tokenizer):
    from eval.studies.needle_heads import plot_needle_heads, write_needle_heads_json

    prompts = [teacher_forced_prompt(tiny_tokenizer, make_passkey_sample(tiny_tokenizer, 150, 0.3))]
    result = analyse_prompts(tiny_podkit, prompts, budgets=[4, 8], selection_layers=[2], full_layers=[0, 1],
                             head_threshold=0.01, progress=False)
    path = write_needle_heads_json(tmp_path / "nh.json", result, model="tiny")
    data = json.loads(path.read_text())
    assert data["format"] == "podkit.needle_heads/1" and data["selection_source_per_layer"] == [None] * 3 + [2] * 3
    back = result_from_json(path)
    assert torch.allclose(back["kept"]["kv_group"][8], result["kept"]["kv_group"][8].float(), atol=1e-5)
    assert torch.allclose(back["kept"]["all_union"][4], result["kept"]["all_union"][4].float(), atol=1e-5)
    assert set(data["needle_tokens_kept"]["retrieval_heads"]["any"]) == set(SELECTIONS)
    assert data["needle_tokens_kept"]["sparse_layer_heads"]["tokens"]["group_union"].keys() == {"4", "8"}
    pytest.importorskip("matplotlib")
    assert plot_needle_heads(back, tmp_path / "nh.png", budget=8).stat().st_size > 0


@pytest.mark.parametrize("mode", SCHEME_MODES)
@pytest.mark.parametrize("group_size", [1, 3])
def test_union_masks_are_the_schemes_selection_one_decode_step_per_query(mode, group_size):
    """scheme_selection_mask = kernels.reference.select_topk_positions(mode=...) run separately for each
    answer query on the keys before it (its current slot dropped, a KV list shared by its G heads)."""
    torch.manual_seed(2)
    num_kv, queries, keys, budget = 2, 4, 40, 7
    num_heads = num_kv * group_size
    logits = last_query_logits(torch.randn(1, num_heads, queries, 8), torch.randn(1, num_kv, keys, 8))
    current = torch.randn(1, num_heads, queries)
    mask = scheme_selection_mask(logits, budget, group_size, mode, current)
    assert mask.shape == logits.shape and mask.dtype == torch.bool
    for a in range(queries):
        position = keys - queries + a
        scores = logits[0, :, a, :position + 1].clone()
        scores[:, position] = current[0, :, a]
        index = select_topk_positions(scores[None], torch.tensor([position + 1]), budget, group_size=group_size,
                                      mode=mode)[0]  # [Hkv, budget]
        assert index.shape[0] == num_kv and int((index == position).sum()) == num_kv  # the current slot, once each
        for head in range(num_heads):
            expected = torch.zeros(keys, dtype=torch.bool)
            listed = index[head // group_size]
            expected[listed[(listed >= 0) & (listed != position)]] = True
            assert torch.equal(mask[0, head, a], expected), (mode, a, head)


def test_all_union_is_budgeted_and_the_diagnostic_union_is_not():
    """At budget k every list of group_union / all_union holds k - 1 past keys (k with the current one), the
    same ones for all heads under all_union; the unbudgeted union of the heads' lists holds more."""
    torch.manual_seed(3)
    num_kv, group_size, queries, keys, budget = 2, 3, 3, 64, 6
    logits = last_query_logits(torch.randn(1, num_kv * group_size, queries, 8), torch.randn(1, num_kv, keys, 8))
    masks = selection_masks(logits, budget, group_size)
    for name in ("query_head", "kv_group", "group_union", "all_union"):
        assert torch.all(masks[name].sum(-1) == budget - 1), name
    assert torch.equal(masks["all_union"], masks["all_union"][:, :1].expand_as(masks["all_union"]))
    grouped = masks["group_union"].view(1, num_kv, group_size, queries, keys)
    assert torch.equal(grouped, grouped[:, :, :1].expand_as(grouped))
    assert int(masks["union_of_heads"].sum(-1).max()) > budget - 1
    # the budgeted unions are subsets of the diagnostic one: their slots have best rank < k - 1
    for name in ("group_union", "all_union"):
        assert torch.all(masks["union_of_heads"] >= masks[name]), name


def test_current_token_logits_are_the_masked_diagonal():
    torch.manual_seed(4)
    q, k = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 10, 8)
    group = 3
    full = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * 8 ** -0.5  # [1,6,3,10]
    expected = torch.stack([full[:, :, a, 10 - 3 + a] for a in range(3)], dim=-1)
    assert torch.allclose(current_token_logits(q, k), expected, atol=1e-6)


def test_tiny_model_union_rows_budgeted_in_range_and_full_at_full_budget(tiny_podkit, tiny_tokenizer, monkeypatch):
    import eval.studies.needle_heads as needle_heads

    seen = []
    real = needle_heads.scheme_selection_mask

    def recording(logits, budget, group_size, mode, current=None):
        mask = real(logits, budget, group_size, mode, current)
        seen.append((mode, budget, logits.shape[-1], int(mask.sum(-1).max()), current is not None))
        return mask

    monkeypatch.setattr(needle_heads, "scheme_selection_mask", recording)
    prompts = [teacher_forced_prompt(tiny_tokenizer, make_passkey_sample(tiny_tokenizer, 200, depth))
               for depth in (0.2, 0.7)]
    longest = max(len(p.input_ids) for p in prompts)
    budgets = [4, 16, longest + 1]
    result = analyse_prompts(tiny_podkit, prompts, budgets=budgets, selection_layers=[2, 4], full_layers=[0, 1],
                             head_threshold=0.01, progress=False)
    assert {"group_union", "all_union"} <= set(SELECTIONS) and {"group_union", "all_union"} <= set(result["kept"])
    assert {(mode, b) for mode, b, *_ in seen} == {(mode, b) for mode in SCHEME_MODES for b in budgets}
    for mode, budget, keys, most, has_current in seen:  # k - 1 past keys at most (k with the current token)
        assert has_current and most <= min(budget - 1, keys), (mode, budget, most)
    assert any(most == b - 1 for mode, b, _, most, _ in seen if mode == "all_union" and b == 16)
    for name in SELECTIONS:
        for b in budgets:
            kept, pooled = result["kept"][name][b], result["retrieval_kept"][name][b]
            assert float(kept.min()) >= 0.0 and float(kept.max()) <= 1.0 + 1e-9, (name, b)
            assert 0.0 <= pooled <= 1.0 + 1e-9
            for group in ("retrieval_heads", "sparse_layer_heads", "sparse_layer_retrieval_heads"):
                for measure in ("any", "tokens"):
                    value = result["needle_tokens_kept"][group][measure][name][b]
                    assert 0.0 <= value <= 1.0 + 1e-9, (group, measure, name, b)
        full = result["kept"][name][longest + 1]
        assert torch.allclose(full, torch.ones_like(full), atol=1e-9), name
        assert result["retrieval_kept"][name][longest + 1] == pytest.approx(1.0)
        for group in ("retrieval_heads", "sparse_layer_heads", "sparse_layer_retrieval_heads"):
            assert result["needle_tokens_kept"][group]["any"][name][longest + 1] == pytest.approx(1.0)
            assert result["needle_tokens_kept"][group]["tokens"][name][longest + 1] == pytest.approx(1.0)
    # at budget 4 (3 past keys) the sparse layers cannot hold every key token of every list
    assert result["needle_tokens_kept"]["sparse_layer_heads"]["tokens"]["all_union"][4] < 1.0
    # the budgeted all_union's list is the union's subset: it never keeps more than the diagnostic union
    assert torch.all(result["kept"]["all_union"][4] <= result["kept"]["union_of_heads"][4] + 1e-9)
