"""eval.runner: the prefill/decode protocols on a tiny random podkit Llama (exactness under dense,
budget >= length equals dense, small budgets differ, scheme switching in place)."""

import math

import pytest
import torch

from eval.runner import apply_overrides, retrieval_generate, window_perplexity
from tests.tiny_models import tiny_model

sparse_models = pytest.importorskip("sparse_models")


@pytest.fixture(scope="module")
def tiny_podkit():
    model = tiny_model(3, 5, seed=0, vocab=101, intermediate=64, positions=512)
    return model, model.sparse_config


def full_nll(model, ids, first, last):
    """NLL of tokens ids[first..last) from one dense forward (positions first-1 .. last-2 predict them)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return -sum(float(logp[t - 1, ids[t]]) for t in range(first, last))


def test_dense_decode_protocol_is_exact(tiny_podkit):
    model, base = tiny_podkit
    apply_overrides(model, base, {})
    ids = torch.randint(0, 101, (70,)).tolist()
    nll = window_perplexity(model, ids, decode_tokens=20)
    assert nll.prefill_tokens == 49 and nll.decode_tokens == 19
    assert nll.prefill_nll == pytest.approx(full_nll(model, ids, 1, 50), rel=1e-4)
    assert nll.decode_nll == pytest.approx(full_nll(model, ids, 51, 70), rel=1e-4)
    assert math.isfinite(nll.decode_ppl) and nll.token_sparsity is None


def test_budget_covering_everything_equals_dense_and_small_budget_differs(tiny_podkit):
    model, base = tiny_podkit
    ids = torch.randint(0, 101, (90,)).tolist()
    apply_overrides(model, base, {})
    dense = window_perplexity(model, ids, decode_tokens=24)
    apply_overrides(model, base, {"decode_scheme": "tidal", "tidal_budget": 128, "tidal_selection_layers": [2]})
    assert model.sparse_config.decode_scheme == "tidal"
    tidal_all = window_perplexity(model, ids, decode_tokens=24)
    assert tidal_all.decode_nll == pytest.approx(dense.decode_nll, rel=1e-4)
    apply_overrides(model, base, {"decode_scheme": "streaming", "streaming_sink_tokens": 2,
                                  "streaming_recent_window": 6})
    streaming = window_perplexity(model, ids, decode_tokens=24)
    assert streaming.prefill_nll == pytest.approx(dense.prefill_nll, rel=1e-5)  # decode schemes leave prefill alone
    assert abs(streaming.decode_nll - dense.decode_nll) > 1e-3
    apply_overrides(model, base, {})
    assert model.sparse_config.decode_scheme == "dense"


def test_retrieval_question_in_decode_matches_full_prompt_under_dense(tiny_podkit, tiny_tokenizer):
    model = tiny_model(layers=3, seed=1, vocab=len(tiny_tokenizer), heads=3, kv_heads=1, hidden=48, intermediate=64,
                       positions=512)
    context, question = "The grass is green. The pass key is 12345. Remember it.", "\n\nWhat is the pass key? The pass key is"
    in_decode = retrieval_generate(model, tiny_tokenizer, context, question, max_new_tokens=6, stop_at_newline=False)
    in_prefill = retrieval_generate(model, tiny_tokenizer, context, question, max_new_tokens=6, stop_at_newline=False,
                                    question_in_decode=False)
    assert in_decode.token_ids == in_prefill.token_ids and len(in_decode.token_ids) == 6
    ids = tiny_tokenizer(context + question)["input_ids"]
    with torch.no_grad():  # greedy by full forwards, no cache
        for _ in range(6):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert in_decode.token_ids == ids[-6:]


def test_bad_decode_tokens(tiny_podkit):
    model, base = tiny_podkit
    with pytest.raises(ValueError, match="decode_tokens=10"):
        window_perplexity(model, list(range(10)), decode_tokens=10)


def test_token_sparse_prefill_reports_sparsity_and_changes_the_cache(tiny_podkit):
    model, base = tiny_podkit
    ids = torch.randint(0, 101, (120,)).tolist()
    apply_overrides(model, base, {})
    dense = window_perplexity(model, ids, decode_tokens=10)
    apply_overrides(model, base, {"prefill_scheme": "token_sparse", "token_sparse_coverage": 0.3,
                                  "token_sparse_min_tokens": 4, "token_sparse_window": 8,
                                  "token_sparse_sparse_layers": [2, 3, 4]})
    sparse = window_perplexity(model, ids, decode_tokens=10)
    apply_overrides(model, base, {})
    assert sparse.token_sparsity is not None and 0.0 < sparse.token_sparsity < 1.0
    assert abs(sparse.decode_nll - dense.decode_nll) > 1e-4  # the decode steps read a cache built sparsely


def test_dense_setting_is_dense_on_a_model_whose_own_config_is_pod(tiny_podkit):
    """A POD export loads with POD as its config: the "dense" setting must still evaluate dense attention."""
    from eval.schemes import dense, pod_zero_shot

    model, base = tiny_podkit
    pod_base = base.with_overrides(prefill_scheme="pod", decode_scheme="pod",
                                   pod_anchor_layers=[[0, 0], [0, 0], [0, 0], [3, 3], [3, 3]],
                                   pod_sink_tokens=2, pod_recent_window=4)
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(1))
    try:
        apply_overrides(model, pod_base, pod_zero_shot(None).overrides)
        with torch.no_grad():
            pod_logits = model(input_ids=ids, use_cache=False).logits
        apply_overrides(model, pod_base, dense().overrides)
        assert model.sparse_config.prefill_scheme == "dense" and model.sparse_config.decode_scheme == "dense"
        with torch.no_grad():
            dense_logits = model(input_ids=ids, use_cache=False).logits
        apply_overrides(model, base, {})
        with torch.no_grad():
            reference = model(input_ids=ids, use_cache=False).logits
    finally:
        apply_overrides(model, base, {})
    torch.testing.assert_close(dense_logits, reference)
    assert not torch.allclose(pod_logits, reference, atol=1e-3)
