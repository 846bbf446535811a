"""sparse_models/engine/answers.py: batched engine answers equal the one-prompt loop (eval.runner.retrieval_generate,
question through the decode path) row by row, for dense and the budgeted decode schemes (CPU, eager)."""

from __future__ import annotations

import pytest

from eval.runner import apply_overrides, retrieval_generate
from sparse_models.engine.answers import engine_answers

CONTEXTS = ["The grass is green. " * 5 + "The pass key is 0123. " + "Here we go. " * 6,
            "Call me Ishmael. " * 3 + "There and back again. " * 10,
            "It is a truth universally acknowledged. " * 8]
QUESTIONS = [" What is the pass key? The pass key is", " Question: Answer:", " secret of"]
SETTINGS = [{}, {"decode_scheme": "tidal", "tidal_budget": 16, "tidal_full_layers": [0], "tidal_selection_layers": [1]},
            {"decode_scheme": "quest", "quest_budget": 32, "quest_dense_layers": [0]},
            {"decode_scheme": "streaming", "streaming_sink_tokens": 4, "streaming_recent_window": 12}]


MAX_NEW = [4, 2, 3]  # answer tokens per row: rows of one batch end at different steps


def one_prompt_answers(model, tokenizer, question_in_decode: bool = True) -> list[list[int]]:
    """Each row's answer token ids from eval.runner's one-prompt loop (question through the decode path, or
    prefilled with the context)."""
    return [retrieval_generate(model, tokenizer, c, q, max_new_tokens=n, question_in_decode=question_in_decode,
                               stop_at_newline=False).token_ids for c, q, n in zip(CONTEXTS, QUESTIONS, MAX_NEW)]


def encoded(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(contexts, questions) as token id lists, the contexts with the tokenizer's BOS."""
    return ([tokenizer(c).input_ids for c in CONTEXTS],
            [tokenizer(q, add_special_tokens=False).input_ids for q in QUESTIONS])


@pytest.fixture(scope="module")
def deep_model_dir(tiny_model_folder):
    """A folder with a 4-layer random Llama (the budgets act on layers 2-3) and the tiny tokenizer."""
    return tiny_model_folder("deep_llama", layers=4, positions=1024)


@pytest.fixture(scope="module")
def deep_model(deep_model_dir):
    from eval.models import load_model

    return load_model(str(deep_model_dir), device="cpu", dtype="float32")


@pytest.mark.parametrize("overrides", SETTINGS, ids=["dense", "tidal", "quest", "streaming"])
def test_batched_engine_matches_the_one_prompt_loop(deep_model, tiny_tokenizer, overrides):
    from sparse_models.engine import GenerationEngine

    base = deep_model.sparse_config
    apply_overrides(deep_model, base, overrides)
    try:
        loop = one_prompt_answers(deep_model, tiny_tokenizer)
        engine = GenerationEngine(deep_model, sparse_config=deep_model.sparse_config, max_batch_size=4,
                                  max_seq_len=512, use_cuda_graphs=False)
        contexts, questions = encoded(tiny_tokenizer)
        assert min(len(c) for c in contexts) > 40  # longer than every budget above
        batched = engine_answers(engine, contexts, questions, MAX_NEW, tiny_tokenizer.eos_token_id)
        assert batched == loop
        assert [len(a) for a in batched] == MAX_NEW  # a random model does not stop early here
        # the engine is reusable: a second batch in another order gives each row the same answer
        again = engine_answers(engine, contexts[::-1], questions[::-1], MAX_NEW[::-1], tiny_tokenizer.eos_token_id)
        assert again == loop[::-1]
    finally:
        apply_overrides(deep_model, base, {})


PREFILL_SETTINGS = SETTINGS[:2] + [{"prefill_scheme": "token_sparse", "token_sparse_sparse_layers": [2, 3],
                                    "token_sparse_window": 8, "token_sparse_coverage": 0.2}]


@pytest.mark.parametrize("overrides", PREFILL_SETTINGS, ids=["dense", "tidal", "token_sparse"])
def test_a_prefilled_question_matches_the_one_prompt_loop(deep_model, tiny_tokenizer, overrides):
    """Empty question ids: the question was prefilled with the context, the first answer token comes from the
    prefill's logits, as in retrieval_generate(question_in_decode=False); a batch may mix both kinds of row."""
    from sparse_models.engine import GenerationEngine

    base = deep_model.sparse_config
    apply_overrides(deep_model, base, overrides)
    try:
        loop = one_prompt_answers(deep_model, tiny_tokenizer, question_in_decode=False)
        engine = GenerationEngine(deep_model, sparse_config=deep_model.sparse_config, max_batch_size=4,
                                  max_seq_len=512, use_cuda_graphs=False)
        contexts, questions = encoded(tiny_tokenizer)
        prompts = [c + q for c, q in zip(contexts, questions)]
        batched = engine_answers(engine, prompts, [[] for _ in prompts], MAX_NEW, tiny_tokenizer.eos_token_id)
        assert batched == loop
        mixed = engine_answers(engine, [prompts[0], contexts[1]], [[], questions[1]], MAX_NEW[:2],
                               tiny_tokenizer.eos_token_id)
        assert mixed == [loop[0], one_prompt_answers(deep_model, tiny_tokenizer)[1]]
    finally:
        apply_overrides(deep_model, base, {})


TOKEN_SPARSE = {"prefill_scheme": "token_sparse", "token_sparse_sparse_layers": [2, 3], "token_sparse_window": 8,
                "token_sparse_coverage": 0.2, "token_sparse_min_tokens": 4}


@pytest.mark.parametrize("question_in_decode", [True, False], ids=["question_decoded", "question_prefilled"])
def test_the_engine_reports_each_rows_token_sparsity_as_the_one_prompt_loop(deep_model, tiny_tokenizer,
                                                                           question_in_decode):
    """engine_answers(stats=...) hands back Token Sparse's report with one entry per batch row, equal to what the
    one-prompt loop records for that prompt alone (the leaderboard's token_sparsity on either path)."""
    from sparse_models.engine import GenerationEngine

    base = deep_model.sparse_config
    apply_overrides(deep_model, base, TOKEN_SPARSE)
    try:
        loop = [retrieval_generate(deep_model, tiny_tokenizer, c, q, max_new_tokens=n, stop_at_newline=False,
                                   question_in_decode=question_in_decode).token_sparsity
                for c, q, n in zip(CONTEXTS, QUESTIONS, MAX_NEW)]
        assert all(0.0 < x < 1.0 for x in loop)  # every row drops some tokens and keeps some
        assert len(set(loop)) == len(loop)        # and a different share: a row mix-up would show
        engine = GenerationEngine(deep_model, sparse_config=deep_model.sparse_config, max_batch_size=4,
                                  max_seq_len=512, use_cuda_graphs=False)
        contexts, questions = encoded(tiny_tokenizer)
        if not question_in_decode:
            contexts, questions = [c + q for c, q in zip(contexts, questions)], [[] for _ in questions]
        stats: dict = {}
        engine_answers(engine, contexts, questions, MAX_NEW, tiny_tokenizer.eos_token_id, stats=stats)
        assert stats["token_sparse"].sequence_token_sparsity == pytest.approx(loop, abs=1e-12)
        dense: dict = {}
        apply_overrides(deep_model, base, {})
        engine = GenerationEngine(deep_model, sparse_config=deep_model.sparse_config, max_batch_size=4,
                                  max_seq_len=512, use_cuda_graphs=False)
        engine_answers(engine, contexts, questions, MAX_NEW, tiny_tokenizer.eos_token_id, stats=dense)
        assert "token_sparse" not in dense      # a dense prefill reports nothing: the record says None
    finally:
        apply_overrides(deep_model, base, {})


def test_sequence_token_sparsity_averages_each_row_over_the_sparse_layers():
    from sparse_models.schemes.token_sparse import LayerSparsity, TokenSparseStats

    stats = TokenSparseStats({2: LayerSparsity(2, [100, 40], [25, 40], [True, False]),
                              3: LayerSparsity(3, [100, 40], [75, 40], [True, False])})
    assert stats.sequence_token_sparsity == pytest.approx([0.5, 0.0])
    assert stats.mean_token_sparsity == pytest.approx(0.25)
    assert TokenSparseStats().sequence_token_sparsity == []


def test_bad_batches_are_refused(deep_model):
    from sparse_models.engine import GenerationEngine

    engine = GenerationEngine(deep_model, max_batch_size=1, max_seq_len=64, use_cuda_graphs=False)
    with pytest.raises(ValueError, match="2 contexts, 1 questions"):
        engine_answers(engine, [[1], [2]], [[3]], [1, 1], None)
    with pytest.raises(ValueError, match="needing 70 slots"):
        engine_answers(engine, [[1] * 60], [[3] * 5], [5], None)
    # rows advance together: the longest context plus the longest question + answer
    from sparse_models.engine.answers import slots_needed

    assert slots_needed([[1] * 50, [1] * 10], [[2] * 3, [2] * 9], [4, 20]) == 50 + 29


def test_leaderboard_engine_and_loop_write_the_same_records(deep_model_dir, tmp_path):
    """eval.harness.leaderboard end to end on a samples file (no generation): --engine and --no-engine agree."""
    import json

    from eval.harness import leaderboard
    from train.long_context_eval.ruler import RulerSample

    samples = [RulerSample(task="vt", index=i, seed=0, max_length=2048, input=c + "\nQuestion: Find all variables" + q,
                           question_start=len(c), gen_prefix="Answer:", outputs=["grass"], tokens_to_generate=2,
                           category="multi-hop tracing") for i, (c, q) in enumerate(zip(CONTEXTS[:2], QUESTIONS))]
    results = {}
    for engine in ("--engine", "--no-engine"):
        out = tmp_path / engine
        out.mkdir()
        (out / "samples_2048.json").write_text(json.dumps({"seed": 0, "samples": [s.to_dict() for s in samples]}))
        leaderboard.main(["--model", str(deep_model_dir), "--lengths", "2048", "--samples", "2", "--tasks", "vt",
                          "--settings", "dense", "streaming@1/128", "token_sparse@0.005", "--fractions", "1/128",
                          "--no-calibrate", "--plain", "--device", "cpu", engine, "--out", str(out)])
        records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        results[engine] = sorted((r["setting"], r["index"], r["generation"], r["kv_read"], r["token_sparsity"])
                                 for r in records)
    assert len(results["--engine"]) == 6 and results["--engine"] == results["--no-engine"]
    # both paths record Token Sparse's dropped share (0.0 here: these prompts are below its min_tokens), None elsewhere
    assert {r[0]: r[4] for r in results["--engine"]} == {"dense": None, "streaming@1/128": None,
                                                        "token_sparse@0.005": 0.0}
    assert {r[3] < 1 for r in results["--engine"] if r[0] == "streaming@1/128"} == {True}


POD = {"prefill_scheme": "pod", "decode_scheme": "pod", "pod_anchor_layers": [[0, 0], [0, 1], [2, 2], [2, 3]],
       "pod_sink_tokens": 2, "pod_recent_window": 8}


@pytest.mark.parametrize("overrides", [POD, {**POD, "pod_sharing": "scores"}], ids=["pod_keys", "pod_scores"])
def test_batched_pod_engine_matches_the_one_prompt_loop(deep_model, tiny_tokenizer, overrides):
    """POD prefill + decode, key sharing and v1 score sharing: ragged engine rows answer as one prompt at a time
    through the model's own cache does (RULER scoring's path, train/long_context_eval/scoring.py)."""
    from sparse_models.engine import GenerationEngine

    base = deep_model.sparse_config
    apply_overrides(deep_model, base, overrides)
    try:
        loop = one_prompt_answers(deep_model, tiny_tokenizer)
        contexts, questions = encoded(tiny_tokenizer)
        engine = GenerationEngine(deep_model, sparse_config=deep_model.sparse_config, max_batch_size=3,
                                  max_seq_len=512, use_cuda_graphs=False)
        assert engine_answers(engine, contexts, questions, MAX_NEW, tiny_tokenizer.eos_token_id) == loop
    finally:
        apply_overrides(deep_model, base, {})
