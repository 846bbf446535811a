"""eval.models: scheme overrides given as command-line strings (lm-eval model_args) reach the config typed."""

import pytest

from eval.models import load_model, parse_override_value


@pytest.mark.parametrize("text, value", [("0.005", 0.005), ("64", 64), ("[1]", [1]), ("0,1", [0, 1]),
                                         ("null", None), ("none", None), ("kv_group", "kv_group"), (" tidal ", "tidal")])
def test_string_values_are_parsed(text, value):
    assert parse_override_value(text) == value


def test_typed_values_pass_through():
    assert parse_override_value(0.5) == 0.5 and parse_override_value([2, 3]) == [2, 3]


def test_load_model_with_string_overrides(tiny_model_dir):
    model = load_model(str(tiny_model_dir), prefill_scheme="token_sparse", token_sparse_coverage="0.01",
                       decode_scheme="tidal", tidal_budget="64", tidal_selection_layers="[1]",
                       tidal_full_layers="[0]", tidal_selection="kv_group")
    config = model.model.sparse_config
    assert config.token_sparse.coverage == 0.01 and config.tidal.budget == 64
    assert config.tidal.selection_layers == [1] and config.tidal.full_layers == [0]
    assert config.tidal.selection == "kv_group"


def test_load_model_names_a_bad_value(tiny_model_dir):
    with pytest.raises(ValueError, match="token_sparse.coverage"):
        load_model(str(tiny_model_dir), prefill_scheme="token_sparse", token_sparse_coverage="2")
