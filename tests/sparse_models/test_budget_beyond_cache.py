"""issue 33: a decode budget that covers the cache (``--budget 100000`` on a short prompt) reads every position at
dense cost, says so once when it is beyond the context, and sizes no buffer by the budget.

Before: TidalDecode built [B, Hs, budget] index lists (11.7 s per token at budget 100000 on CPU), StreamingLLM an
``arange(recent_window)``; the sparse layers then read budget-long lists of -1 padding."""

import warnings

import pytest
from sm_tiny import left_padded, pod_anchor_map, random_prompts, tiny_model

import kernels
from sparse_models import SparseAttentionConfig
from sparse_models.engine import GenerationEngine

HUGE = 100_000  # tiny_model's max_position_embeddings is 512
NEW = 6
CAPACITY = 48  # the engine's max_seq_len in these tests

SCHEMES = {
    "tidal": ({"decode_scheme": "tidal", "tidal": {"budget": HUGE, "full_layers": [0], "selection_layers": [1]}},
              {"decode_scheme": "tidal", "tidal": {"budget": 4, "full_layers": [0], "selection_layers": [1]}}),
    "quest": ({"decode_scheme": "quest", "quest": {"page_size": 4, "budget": HUGE, "dense_layers": [0]}},
              {"decode_scheme": "quest", "quest": {"page_size": 4, "budget": 8, "dense_layers": [0]}}),
    "streaming": ({"decode_scheme": "streaming", "streaming": {"sink_tokens": 2, "recent_window": HUGE}},
                  {"decode_scheme": "streaming", "streaming": {"sink_tokens": 2, "recent_window": 4}}),
}
LIST_OPS = ("selection_decode_attention", "select_topk_positions", "sparse_decode_attention",
            "pod_sparse_decode_attention", "quest_select_pages")


@pytest.fixture()
def list_lengths(monkeypatch):
    """The length K of every position list a decode step builds or reads (the ops' budget / index argument)."""
    seen = []

    def wrap(name):
        original = getattr(kernels, name)

        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            if name in ("sparse_decode_attention", "pod_sparse_decode_attention"):
                seen.append(int(args[4 if name == "pod_sparse_decode_attention" else 3].shape[-1]))
            else:
                indices = out[1] if name == "selection_decode_attention" else out
                seen.append(int(indices.shape[-1]))
            return out
        monkeypatch.setattr(kernels, name, recorded)

    for name in LIST_OPS:
        wrap(name)
    return seen


def _generate_both(model, prompts):
    ids, mask = left_padded(prompts)
    model_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                  pad_token_id=0)[:, ids.shape[1]:].tolist()
    engine = GenerationEngine(model, max_batch_size=len(prompts), max_seq_len=CAPACITY)
    return model_tokens, engine.generate(prompts, max_new_tokens=NEW).tokens


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_huge_budget_is_dense_and_sizes_nothing_by_the_budget(scheme, list_lengths):
    huge, normal = SCHEMES[scheme]
    prompts = random_prompts([14, 9], seed=5)
    dense = _generate_both(tiny_model(3, 4, seed=7), prompts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        got = _generate_both(tiny_model(3, 4, huge, seed=7), prompts)
    assert got == dense, scheme
    assert list_lengths == [], f"{scheme}: position lists of lengths {sorted(set(list_lengths))} were built"
    notices = [w for w in caught if "covers the model's whole context" in str(w.message)]
    assert len(notices) == 1, [str(w.message) for w in caught]  # once: the model's load and the engine
    assert "max_position_embeddings=512" in str(notices[0].message)
    # the instrumentation sees a normal budget's lists (so an empty record above means none were built)
    _generate_both(tiny_model(3, 4, normal, seed=7), random_prompts([30, 24], seed=5))
    assert list_lengths and max(list_lengths) <= 8


def test_budget_covering_a_short_cache_is_silent_and_exact(list_lengths):
    """A budget within the context that covers this cache (2048 on a 20-slot run) runs exact attention without a
    word (the tokens are dense's: every slot would have been selected)."""
    prompts = random_prompts([14, 9], seed=6)
    dense = _generate_both(tiny_model(3, 4, seed=8), prompts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _generate_both(tiny_model(3, 4, {"decode_scheme": "tidal", "tidal": {"budget": 200}}, seed=8), prompts)
    assert got == dense and list_lengths == []
    assert not [w for w in caught if "covers" in str(w.message)]


def test_pod_tidal_huge_budget_equals_pod_decode():
    """POD + TidalDecode with a budget over the cache: every layer attends over POD's keys, as decode_scheme='pod'
    (no gate skip) does."""
    pod = {"sink_tokens": 2, "recent_window": 3, "anchor_layers": pod_anchor_map(4, 2)}
    prompts = random_prompts([14, 9], seed=9)
    ids, mask = left_padded(prompts)
    runs = {}
    for name, sparse in (("pod", {"decode_scheme": "pod", "pod": pod}),
                         ("pod+tidal", {"decode_scheme": "pod+tidal", "pod": pod, "tidal": {"budget": HUGE}})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model(3, 4, SparseAttentionConfig.from_dict(sparse), seed=10)
            runs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                        pad_token_id=0)[:, ids.shape[1]:].tolist()
    assert runs["pod+tidal"] == runs["pod"]


def test_budget_notice_reads_each_schemes_budget():
    from sparse_models.schemes.registry import budget_beyond_context

    for scheme, (huge, normal) in SCHEMES.items():
        assert budget_beyond_context(SparseAttentionConfig.from_dict(huge), 512) is not None, scheme
        assert budget_beyond_context(SparseAttentionConfig.from_dict(normal), 512) is None, scheme
    assert budget_beyond_context(SparseAttentionConfig(), 512) is None  # dense has no budget
