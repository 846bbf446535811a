"""Every scheme equals dense when its budget covers every token; podkit's loop equals transformers'
own Llama / Mistral / Qwen2 (incl. Llama-3.1 rope scaling) on plain checkpoints."""

import pytest
import torch
from sm_tiny import GQA_SHAPES, left_padded, random_prompts, run_model, tiny_model

from sparse_models import SparseAttentionConfig
from tests.tiny_models import tiny_model as factory_model

COVERING = {
    "tidal": {"decode_scheme": "tidal", "tidal": {"budget": 64, "full_layers": [0], "selection_layers": [1]}},
    "tidal_kv_group": {"decode_scheme": "tidal", "tidal": {"budget": 64, "full_layers": [], "selection": "kv_group"}},
    "token_sparse": {"prefill_scheme": "token_sparse", "token_sparse": {"coverage": 0.0, "window": 2, "min_tokens": 0}},
    "token_sparse_short": {"prefill_scheme": "token_sparse",
                           "token_sparse": {"coverage": 0.5, "window": 4, "min_tokens": 16}},  # too short to sparsify
    "pod_own_anchors": {"prefill_scheme": "pod", "decode_scheme": "pod", "pod": {"sink_tokens": 1, "recent_window": 2}},
    "pod_tidal_own": {"prefill_scheme": "pod", "decode_scheme": "pod+tidal",
                      "pod": {"sink_tokens": 1, "recent_window": 2}, "tidal": {"budget": 64}},
    "pod_big_window": {"prefill_scheme": "pod", "decode_scheme": "pod",
                       "pod": {"sink_tokens": 0, "recent_window": 64,
                               "anchor_layers": [[0, 0], [0, 1], [2, 1], [2, 3]]}},
    "quest": {"decode_scheme": "quest", "quest": {"page_size": 4, "budget": 64, "dense_layers": []}},
    "streaming": {"decode_scheme": "streaming", "streaming": {"sink_tokens": 2, "recent_window": 64}},
}


@pytest.mark.parametrize("group", [3, 4])
@pytest.mark.parametrize("scheme", sorted(COVERING))
def test_covering_budget_equals_dense(scheme, group):
    if scheme == "pod_big_window" and GQA_SHAPES[group][1] != 2:
        pytest.skip("anchor map written for 2 KV heads")
    prompts, conts = random_prompts([12, 7]), random_prompts([4, 4])
    dense = run_model(tiny_model(group, 4, None, seed=7), prompts, conts)
    other = run_model(tiny_model(group, 4, SparseAttentionConfig.from_dict(COVERING[scheme]), seed=7), prompts, conts)
    for a, b in zip(dense[0], other[0]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    for a, b in zip(dense[1], other[1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_tidal_selection_at_every_layer_is_dense_whatever_the_budget(group):
    """A TidalDecode selection layer attends to every key before it selects, so with every non-full
    layer a selection layer nothing is sparse, even at budget 2 (BENCHMARKS.md's ``tidal@128[all]``
    ablation equals dense for this reason; it is not evidence about the sparse path)."""
    prompts, conts = random_prompts([12, 7]), random_prompts([4, 4])
    config = SparseAttentionConfig.from_dict({"decode_scheme": "tidal",
                                              "tidal": {"budget": 2, "full_layers": [0], "selection_layers": [1, 2, 3]}})
    dense = run_model(tiny_model(group, 4, None, seed=7), prompts, conts)
    every_layer = run_model(tiny_model(group, 4, config, seed=7), prompts, conts)
    for a, b in zip(dense[1], every_layer[1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    sparse = SparseAttentionConfig.from_dict({"decode_scheme": "tidal",
                                              "tidal": {"budget": 2, "full_layers": [0], "selection_layers": [1]}})
    reused = run_model(tiny_model(group, 4, sparse, seed=7), prompts, conts)
    assert any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(dense[1], reused[1]))


def _reference_pair(family):
    # GQA 3 (6 query / 2 KV heads, hidden 48); the caller's RNG state draws ref's weights, then ours'
    common = dict(layers=3, seed=None, vocab=53, intermediate=80, positions=256)
    if family == "llama31":
        common.update(family="llama", rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16})
    elif family == "mistral":
        common.update(family="mistral", sliding_window=None)
    else:
        common.update(family="qwen2")
    ref = factory_model(podkit=False, **common)
    ours = factory_model(podkit=True, **common)
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.mark.parametrize("family", ["llama31", "mistral", "qwen2"])
def test_matches_transformers_reference(family):
    torch.manual_seed(1)
    ref, ours = _reference_pair(family)
    if family == "qwen2":
        assert ours.model.layers[0].self_attn.q_proj.bias is not None
    prompts = random_prompts([40, 25])  # past original_max_position_embeddings: rope scaling matters
    ids, mask = left_padded([[t % 53 for t in p] for p in prompts])
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        for b, p in enumerate(prompts):
            want = ref(ids[b:b + 1, ids.shape[1] - len(p):]).logits[0]
            torch.testing.assert_close(got[b, ids.shape[1] - len(p):], want, atol=2e-5, rtol=1e-5)
        g_ours = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        g_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(g_ours, g_ref)
