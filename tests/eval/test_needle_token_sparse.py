"""eval.studies.needle_token_sparse: the kept-share bookkeeping, and that the recomputed Token Sparse indices
are the ones the model's own prefill used (same kept counts as model.token_sparse_stats)."""

import pytest
import torch

from eval.studies.needle_token_sparse import PROTOCOLS, analyse_prompts, build_prompts, kept_shares, main, summarise
from eval.tasks.passkey import passkey_grid
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def tiny_token_sparse():
    model = tiny_model(3, 4, seed=0, vocab=400, intermediate=64, positions=2048)
    model.set_sparse_attention(prefill_scheme="token_sparse", token_sparse_coverage=0.3, token_sparse_window=8,
                               token_sparse_min_tokens=16, token_sparse_sparse_layers=[1, 3])
    return model


def test_kept_shares_counts_key_tokens_and_prefix():
    # 2 heads, 12 tokens, window 4 -> prefix [0, 8); head 0 keeps 0..3, head 1 keeps 2,5 (+ the window)
    window = [8, 9, 10, 11]
    indices = torch.tensor([[[0, 1, 2, 3] + window, [2, 5] + window + [-1, -1]]])
    key, prefix = kept_shares(indices, 12, 4, key_positions=[2, 5, 9])
    assert key == pytest.approx((2 + 3) / 6)   # head 0 keeps keys 2 and 9; head 1 keeps 2, 5 and 9
    assert prefix == pytest.approx((4 + 2) / 16)


def test_recomputed_indices_match_the_prefill_stats(tiny_token_sparse, tiny_tokenizer):
    prompts = build_prompts(tiny_tokenizer, passkey_grid(tiny_tokenizer, [160], 2))
    result = analyse_prompts(tiny_token_sparse, prompts, progress=False)
    assert result["sparse_layers"] == [1, 3] and len(result["records"]) == 2 * len(PROTOCOLS)
    for record in result["records"]:
        # rerun the same prefill through the model and compare with what its attention kept
        from sparse_models import capture_attention_inputs

        prompt = next(p for p in prompts if p["depth"] == record["depth"])
        ids = torch.tensor([prompt["ids"][record["protocol"]]])
        capture_attention_inputs(tiny_token_sparse, ids, layers=[1, 3])
        stats = tiny_token_sparse.token_sparse_stats
        for layer, values in record["layers"].items():
            prefix_len = ids.shape[1] - 8
            assert values["sparse"] == stats.layers[layer].sparse[0]
            assert round(values["prefix"] * prefix_len) + 8 == stats.layers[layer].kept[0]
    assert any(v["prefix"] < 1.0 for r in result["records"] for v in r["layers"].values())
    for record in result["records"]:
        prompt = next(p for p in prompts if p["depth"] == record["depth"])
        assert record["key_in_window"] == (min(prompt["key_positions"]) >= record["tokens"] - 8)
    summary = summarise(result)
    assert set(summary["by_length"]) == set(PROTOCOLS)
    outside = sum(not r["key_in_window"] for r in result["records"] if r["protocol"] == "decode")
    assert summary["by_length"]["decode"]["160"]["prompts"] == outside
    assert summarise(result, include_key_in_window=True)["by_length"]["decode"]["160"]["prompts"] == 2


def test_replot_recomputes_the_summaries(tmp_path):
    from eval.studies.needle_token_sparse import NEEDLE_TOKEN_SPARSE_FORMAT, write_outputs

    pytest.importorskip("matplotlib")
    layers = {"3": {"key": 0.5, "prefix": 0.8, "sparse": True}}
    records = [{"length": 2048, "depth": d, "protocol": p, "tokens": 2048, "key_in_window": d == 1.0,
                "layers": layers if d < 1 else {"3": {"key": 1.0, "prefix": 0.8, "sparse": True}},
                "key_kept": 0.5 if d < 1 else 1.0, "prefix_kept": 0.8} for d in (0.0, 1.0) for p in PROTOCOLS]
    payload = {"format": NEEDLE_TOKEN_SPARSE_FORMAT, "records": records, "summary": {"stale": True}}
    write_outputs(payload, tmp_path / "nts")
    assert main(["--replot", "--out", str(tmp_path / "nts")])["summary"]["by_length"]["decode"]["2048"] == \
        {"key_kept": 0.5, "prefix_kept": 0.8, "prompts": 1}
    assert (tmp_path / "nts.png").stat().st_size > 0


def test_dense_coverage_keeps_every_key(tiny_token_sparse, tiny_tokenizer):
    prompts = build_prompts(tiny_tokenizer, passkey_grid(tiny_tokenizer, [160], 1))
    tiny_token_sparse.set_sparse_attention(token_sparse_coverage=0.0)
    try:
        result = analyse_prompts(tiny_token_sparse, prompts, progress=False)
    finally:
        tiny_token_sparse.set_sparse_attention(token_sparse_coverage=0.3)
    for record in result["records"]:
        assert record["key_kept"] == 1.0 and record["prefix_kept"] == 1.0


def test_needs_the_token_sparse_prefill(tiny_tokenizer):
    model = tiny_model(3, 2, seed=None, eval=False, vocab=400, intermediate=64, positions=None)
    with pytest.raises(ValueError, match="prefill_scheme"):
        analyse_prompts(model, [], progress=False)


def test_cli_rejects_bad_input_before_loading(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--coverage", "1.5"])
    assert "--coverage" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--calibration", str(tmp_path / "missing.json")])
    assert "--calibration" in capsys.readouterr().err


def test_ruler_prompts_mark_the_answer_tokens_in_the_context(tiny_token_sparse, tiny_tokenizer):
    from eval.studies.needle_token_sparse import answer_token_positions, build_ruler_prompts
    from train.long_context_eval.ruler import RulerSample

    context = "Some filler text. " * 6 + "The special magic number for apple is: 4412. " + "More filler. " * 5
    positions = answer_token_positions(tiny_tokenizer, context, ["4412"])
    ids = tiny_tokenizer(context)["input_ids"]
    assert positions and "4412" in tiny_tokenizer.decode([ids[i] for i in positions]).replace(" ", "")
    assert answer_token_positions(tiny_tokenizer, context, ["9999"]) == []
    samples = [RulerSample(task="niah_single_1", index=0, seed=1, max_length=160, input=context + "\nWhat is it?",
                           question_start=len(context), gen_prefix="Answer:", outputs=["4412"],
                           tokens_to_generate=8, category="retrieval"),
               RulerSample(task="cwe", index=0, seed=1, max_length=160, input=context + "\nCount words.",
                           question_start=len(context), gen_prefix="Answer:", outputs=["absent"],
                           tokens_to_generate=8, category="aggregation")]
    samples.append(RulerSample(task="cwe", index=1, seed=1, max_length=160, input=context + "\nCount words.",
                               question_start=len(context), gen_prefix="Answer:", outputs=["filler"],
                               tokens_to_generate=8, category="aggregation"))
    prompts = build_ruler_prompts(tiny_tokenizer, samples, chat=False)
    assert [p["task"] for p in prompts] == ["niah_single_1"]   # no answer in its context, or not a needle: left out
    prompt = prompts[0]
    assert prompt["ids"]["prefill"][:len(prompt["ids"]["decode"])] == prompt["ids"]["decode"]
    assert len(prompt["ids"]["prefill"]) > len(prompt["ids"]["decode"])
    result = analyse_prompts(tiny_token_sparse, prompts, progress=False)
    assert {(r["task"], r["protocol"]) for r in result["records"]} == {("niah_single_1", p) for p in PROTOCOLS}


def test_cli_rejects_bad_ruler_input_before_loading(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--ruler-samples", str(tmp_path / "missing.json")])
    assert "--ruler-samples" in capsys.readouterr().err
    path = tmp_path / "samples_2048.json"
    path.write_text('{"samples": [{"task": "vt", "index": 0, "seed": 1, "max_length": 2048, "input": "x", '
                    '"question_start": 0, "gen_prefix": "", "outputs": ["a"], "tokens_to_generate": 4}]}')
    with pytest.raises(SystemExit):
        main(["--ruler-samples", str(path), "--tasks", "qa_1"])
    assert "--tasks qa_1 is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--ruler-samples", str(path), "--ruler-count", "0"])
    assert "--ruler-count 0 is invalid" in capsys.readouterr().err


def test_cli_refuses_ruler_samples_without_a_needle_before_the_model(capsys, tmp_path, monkeypatch, tiny_tokenizer):
    import eval.studies.needle_token_sparse as nts

    monkeypatch.setattr(nts, "load_tokenizer", lambda model: tiny_tokenizer)
    monkeypatch.setattr(nts, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    path = tmp_path / "samples_2048.json"
    path.write_text('{"samples": [{"task": "vt", "index": 0, "seed": 1, "max_length": 2048, "input": "x y", '
                    '"question_start": 1, "gen_prefix": "", "outputs": ["a"], "tokens_to_generate": 4, '
                    '"category": "multi-hop tracing"}]}')
    with pytest.raises(SystemExit):
        main(["--ruler-samples", str(path), "--calibration", "none"])
    assert "no retrieval sample with its answer in the context" in capsys.readouterr().err
