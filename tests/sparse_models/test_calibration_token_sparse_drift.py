"""Token Sparse drift calibration (arXiv 2602.03216 Eq. 1-2): math, hooks on a real forward, outputs."""

import json

import pytest
import torch

from sparse_models.calibration.token_sparse_drift import (
    DriftAccumulator,
    calibrate,
    layer_drifts,
    plot_drift,
    read_sparse_layers,
    result_from_json,
    select_sparse_layers,
    token_drift,
    write_drift_json,
)
from tests.tiny_models import tiny_model, twin_config


def tiny_llama(num_layers=4, heads=6, kv_heads=2, seed=0):
    return tiny_model(layers=num_layers, seed=seed, podkit=False, vocab=97, heads=heads, kv_heads=kv_heads, hidden=48,
                      intermediate=64, positions=256)


def test_token_drift_matches_definition():
    h_in, h_out = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    expected = torch.stack([torch.stack([(h_out[b, t] - h_in[b, t]).norm() / (h_in[b, t].norm() + 1e-8)
                                         for t in range(7)]) for b in range(2)])
    torch.testing.assert_close(token_drift(h_in, h_out), expected)
    assert token_drift(h_in, h_in).abs().max() == 0
    with pytest.raises(ValueError, match="equal"):
        token_drift(h_in, h_out[:, :3])


def test_select_sparse_layers_takes_the_low_half():
    drift = torch.tensor([0.9, 0.1, 0.5, 0.2, 0.8, 0.3])
    layers, threshold = select_sparse_layers(drift, 0.5)
    assert layers == [1, 3, 5]
    assert threshold == pytest.approx(float(torch.quantile(drift / drift.sum(), 0.5)))
    assert select_sparse_layers(drift, 1.0)[0] == list(range(6))
    with pytest.raises(ValueError, match="delta=0"):
        select_sparse_layers(drift, 0.0)


def test_accumulator_ignores_padding():
    acc = DriftAccumulator(2, num_buckets=4)
    d0, d1 = torch.rand(2, 8), torch.rand(2, 8)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 5:] = False
    d0[1, 5:] = 1e6  # padding values must not leak into the mean
    acc.add([d0, d1], valid)
    torch.testing.assert_close(acc.drift()[0], d0[valid].double().mean())
    torch.testing.assert_close(acc.drift()[1], d1[valid].double().mean())
    assert acc.tokens == 13 and acc.samples == 2


def test_hooks_match_hidden_states_and_see_the_last_layer_unnormed():
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 33))
    drifts = layer_drifts(model, ids)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    for layer in range(3):  # hidden_states[l] is layer l's input for every layer but the final norm
        torch.testing.assert_close(drifts[layer], token_drift(hidden[layer], hidden[layer + 1]))
    assert not torch.allclose(drifts[3], token_drift(hidden[3], hidden[4]))  # hidden[4] is post-norm


def test_identity_layer_has_zero_drift_and_is_chosen():
    model = tiny_llama(num_layers=6)
    with torch.no_grad():
        for layer in (2, 4):  # make these layers add nothing to the residual stream
            model.model.layers[layer].self_attn.o_proj.weight.zero_()
            model.model.layers[layer].mlp.down_proj.weight.zero_()
    result = calibrate(model, [torch.randint(0, 97, (1, 40)) for _ in range(2)], delta=0.2)
    assert result["drift"][2] == 0 and result["drift"][4] == 0
    assert result["sparse_layers"] == [2, 4]
    assert result["samples"] == 2 and result["tokens"] == 80


def test_json_and_png(tmp_path):
    model = tiny_llama()
    result = calibrate(model, [torch.randint(0, 97, (1, 24))], num_buckets=4)
    path = write_drift_json(tmp_path / "drift.json", result, model="tiny")
    data = json.loads(path.read_text())
    assert data["num_layers"] == 4 and abs(sum(data["normalised_drift"]) - 1) < 1e-4
    assert read_sparse_layers(path) == result["sparse_layers"]
    back = result_from_json(path)
    torch.testing.assert_close(back["drift"], result["drift"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(back["bucket_drift"], result["bucket_drift"].float(), rtol=1e-5, atol=1e-6,
                               equal_nan=True)
    png = plot_drift(back, tmp_path / "drift.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "other.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(ValueError, match="not a Token Sparse drift file"):
        read_sparse_layers(tmp_path / "other.json")


def test_podkit_model_matches_plain_llama_drift():
    """podkit's decoder loop (capture_residual_stream) and hooks on plain transformers agree."""
    pytest.importorskip("sparse_models")
    plain = tiny_llama(num_layers=3)
    podkit = tiny_model(seed=None, config=twin_config(plain.config, podkit=True))
    podkit.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 97, (1, 29))
    for a, b in zip(layer_drifts(plain, ids), layer_drifts(podkit, ids)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
