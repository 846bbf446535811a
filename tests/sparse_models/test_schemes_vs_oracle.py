"""Every scheme, in prefill and decode, against the brute-force oracle (explicit masks, one sequence
at a time): tiny random Llama models, GQA groups 1/3/4, batch 2 with ragged left-padded prompts."""

import pytest
import torch
from sm_oracle import Oracle
from sm_tiny import GQA_SHAPES, pod_anchor_map, random_prompts, run_model, tiny_model

from sparse_models import SparseAttentionConfig

LAYERS = 4
TIDAL = {"budget": 5, "full_layers": [0], "selection_layers": [1]}


def pod(kv_heads, **extra):
    return {"sink_tokens": 2, "recent_window": 3, "anchor_layers": pod_anchor_map(LAYERS, kv_heads), **extra}


SCHEMES = {
    "dense": lambda hkv: {},
    "tidal": lambda hkv: {"decode_scheme": "tidal", "tidal": TIDAL},
    "tidal_kv_group": lambda hkv: {"decode_scheme": "tidal", "tidal": {**TIDAL, "selection": "kv_group"}},
    "tidal_reselect": lambda hkv: {"decode_scheme": "tidal",
                                   "tidal": {"budget": 4, "full_layers": [0], "selection_layers": [1, 3]}},
    "tidal_correction": lambda hkv: {"decode_scheme": "tidal", "tidal": {**TIDAL, "correction_period": 2}},
    "token_sparse": lambda hkv: {"prefill_scheme": "token_sparse",
                                 "token_sparse": {"coverage": 0.3, "window": 3, "min_tokens": 2, "pool_kernel": 3,
                                                  "sparse_layers": [1, 2]}},
    "quest": lambda hkv: {"decode_scheme": "quest", "quest": {"page_size": 4, "budget": 8, "dense_layers": [0]}},
    "streaming": lambda hkv: {"decode_scheme": "streaming", "streaming": {"sink_tokens": 2, "recent_window": 4}},
    "pod": lambda hkv: {"prefill_scheme": "pod", "decode_scheme": "pod", "pod": pod(hkv)},
    "pod_decode_only": lambda hkv: {"decode_scheme": "pod", "pod": pod(hkv)},
    "pod_tidal": lambda hkv: {"prefill_scheme": "pod", "decode_scheme": "pod+tidal", "pod": pod(hkv),
                              "tidal": TIDAL},
    "pod_tidal_scores": lambda hkv: {"prefill_scheme": "pod", "decode_scheme": "pod+tidal",
                                     "pod": pod(hkv, sharing="scores"), "tidal": TIDAL},
    "pod_tau_exact": lambda hkv: {"prefill_scheme": "pod", "decode_scheme": "pod",
                                  "pod": pod(hkv, gate_tau=0.5, gate_estimate="exact")},
    "pod_scores": lambda hkv: {"prefill_scheme": "pod", "decode_scheme": "pod", "pod": pod(hkv, sharing="scores")},
    "pod_scores_tau": lambda hkv: {"prefill_scheme": "pod", "decode_scheme": "pod",
                                   "pod": pod(hkv, sharing="scores", gate_tau=0.5)},
    "pod_tau_anchor": lambda hkv: {"prefill_scheme": "pod", "decode_scheme": "pod",
                                   "pod": pod(hkv, gate_tau=0.5, gate_estimate="anchor")},
}


CORE = ("dense", "tidal", "pod", "token_sparse", "quest", "streaming")
CASES = [(s, g) for s in sorted(SCHEMES) for g in sorted(GQA_SHAPES) if g != 1 or s in CORE]


@pytest.mark.parametrize("scheme,group", CASES)
def test_scheme_matches_oracle(scheme, group):
    hkv = GQA_SHAPES[group][1]
    sparse = SparseAttentionConfig.from_dict(SCHEMES[scheme](hkv))
    model = tiny_model(group, LAYERS, sparse, seed=group)
    prompts = random_prompts([13, 9])
    continuations = random_prompts([5, 5])
    prompt_logits, steps, _ = run_model(model, prompts, continuations)
    oracle = Oracle(model, sparse)
    for b in range(2):
        want_prompt, want_steps = oracle.run_sequence(prompts[b], continuations[b])
        torch.testing.assert_close(prompt_logits[b].double(), want_prompt.double(), atol=2e-4, rtol=1e-4,
                                   msg=lambda m: f"{scheme} G={group} row {b} prefill: {m}")
        for t, want in enumerate(want_steps):
            torch.testing.assert_close(steps[t][b].double(), want.double(), atol=2e-4, rtol=1e-4,
                                       msg=lambda m: f"{scheme} G={group} row {b} decode step {t}: {m}")


def test_sparse_schemes_really_differ_from_dense():
    """The small budgets above must actually change results (else the oracle test proves little)."""
    prompts, conts = random_prompts([13, 9]), random_prompts([5, 5])
    dense = run_model(tiny_model(3, LAYERS, None, seed=3), prompts, conts)
    for scheme in ("tidal", "quest", "streaming", "pod", "token_sparse"):
        other = run_model(tiny_model(3, LAYERS, SCHEMES[scheme](2), seed=3), prompts, conts)
        diff = max((a - b).abs().max().item() for a, b in zip(dense[1], other[1]))
        if scheme in ("pod", "token_sparse"):
            diff = max(diff, max((a - b).abs().max().item() for a, b in zip(dense[0], other[0])))
        assert diff > 1e-3, f"{scheme} gives the dense result: the test budget is too generous"
