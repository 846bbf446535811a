"""Bad configurations and inputs fail early with a message naming the field, the value and what is allowed."""

import pytest
import torch
from sm_tiny import tiny_model

from sparse_models import ConfigError, PodkitLlamaForCausalLM, SparseAttentionConfig

BAD_CONFIGS = [
    ({"decode_scheme": "magic"}, "decode_scheme='magic'"),
    ({"prefill_scheme": "tidal"}, "prefill_scheme='tidal'"),
    ({"tidal": {"budget": 1}}, "tidal.budget=1"),
    ({"tidal": {"selection": "per_token"}}, "tidal.selection='per_token'"),
    ({"tidal": {"full_layers": [0, 1], "selection_layers": [1]}}, "tidal.selection_layers"),
    ({"tidal": {"correction_period": 0}}, "tidal.correction_period=0"),
    ({"token_sparse": {"coverage": 1.5}}, "token_sparse.coverage=1.5"),
    ({"token_sparse": {"pool_kernel": 4}}, "token_sparse.pool_kernel=4"),
    ({"quest": {"page_size": 16, "budget": 8}}, "quest.budget=8"),
    ({"pod": {"gate_tau": 1.7}}, "pod.gate_tau=1.7"),
    ({"pod": {"anchor_layers": [[0, 0], [1, 0], [0, 0]]}}, "pod.anchor_layers[2][0]"),
    ({"pod": {"sharing": "values"}}, "pod.sharing='values'"),
    ({"streaming": {"recent_window": 0}}, "streaming.recent_window=0"),
    ({"tidal": {"budgett": 3}}, "unknown field(s) budgett"),
]


@pytest.mark.parametrize("data,fragment", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_bad_config_is_rejected(data, fragment):
    with pytest.raises(ConfigError) as err:
        SparseAttentionConfig.from_dict(data)
    assert fragment in str(err.value)


BAD_FOR_MODEL = [
    ({"decode_scheme": "tidal", "tidal": {"selection_layers": [9]}}, "tidal.selection_layers=[9]"),
    ({"decode_scheme": "pod", "pod": {"anchor_layers": [[0, 0], [1, 1]]}}, "pod.anchor_layers"),
    ({"decode_scheme": "pod+tidal", "tidal": {"correction_period": 4}}, "tidal.correction_period=4"),
    ({"prefill_scheme": "token_sparse", "token_sparse": {"sparse_layers": [1, 4]}}, "token_sparse.sparse_layers"),
    ({"decode_scheme": "quest", "quest": {"dense_layers": [7]}}, "quest.dense_layers=[7]"),
    ({"decode_scheme": "tidal", "tidal": {"full_layers": [0, 1, 2, 3]}}, "tidal.full_layers"),
]


@pytest.mark.parametrize("data,fragment", BAD_FOR_MODEL, ids=[f for _, f in BAD_FOR_MODEL])
def test_config_that_does_not_fit_the_model_is_rejected(data, fragment):
    model = tiny_model(3, 4)
    with pytest.raises(ConfigError) as err:
        model.set_sparse_attention(SparseAttentionConfig.from_dict(data))
    assert fragment in str(err.value)
    assert model.sparse_config.decode_scheme == "dense"  # a failed switch leaves the model as it was


def test_unknown_override_is_rejected(tmp_path):
    model = tiny_model(3, 2)
    with pytest.raises(ConfigError, match="tidal_bugdet"):
        model.set_sparse_attention(tidal_bugdet=4)
    model.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"tidal\.budget=1"):
        PodkitLlamaForCausalLM.from_pretrained(tmp_path, tidal_budget=1)
    # issue 33: a misspelled flat override at load time names the close match (it used to reach the model's
    # __init__ as a TypeError); the same error eval.lm_eval prints for its model_args
    with pytest.raises(ConfigError, match=r"tidal_budgt=128 is not a sparse-attention option \(did you mean "
                                          r"tidal_budget\?\)"):
        PodkitLlamaForCausalLM.from_pretrained(tmp_path, decode_scheme="tidal", tidal_budgt=128)
    with pytest.raises(ConfigError, match=r"did you mean decode_scheme\?"):
        PodkitLlamaForCausalLM.from_pretrained(tmp_path, decode_schme="tidal")


def test_bad_inputs_are_rejected():
    model = tiny_model(3, 2)
    ids = torch.randint(1, 50, (2, 6))
    holes = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="attention_mask row 1 has holes"):
        model(ids, attention_mask=holes)
    with pytest.raises(ValueError, match="attention_mask row 0 has no tokens"):
        model(ids, attention_mask=torch.tensor([[0] * 6, [1] * 6]))
    with pytest.raises(ValueError, match="attention_mask has 5 columns"):
        model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="SparseKVCache"):
        from transformers import DynamicCache
        model(ids, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    cache = model.new_cache()
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="cache holds"):
        model(ids[:, :1], attention_mask=torch.tensor([[1] * 6 + [1], [0] + [1] * 5 + [1]]), cache=cache)
