"""The pipeline's three models agree where they must (the zero-shot POD loss is real damage, not a bug).

On the pipeline's own loaders (train/models.py), a random Llama with GQA and a ragged batch:
  * the dense baseline (podkit class, dense schemes) equals stock transformers' SDPA Llama;
  * POD with every (layer, KV head) its own anchor equals dense;
  * POD with a proximal window covering the whole sequence equals dense, whatever the anchors;
  * POD with shared heads and a short window differs from dense (the test can fail).
The same checks on SmolLM2-135M (512 tokens of Emma) gave identical losses, 3.57545 for all
three degenerate cases, and 5.632 for the explored blocks (69/90 units shared, 16 sink + 48 recent).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import tiny_model
from train.models import load_dense_reference, load_model
from train.recipe import recipe_from_dict

LAYERS, HEADS = 4, 8
SHARED = [[0, 0], [0, 1], [0, 1], [3, 1]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero_shot")
    # scale 3: sharper attention than the near-uniform random init
    model = tiny_model(layers=LAYERS, seed=1, podkit=False, eval=False, scale=3.0, vocab=101, heads=HEADS, kv_heads=2,
                       hidden=64, intermediate=96, positions=256, tie_word_embeddings=False)
    model.save_pretrained(folder)
    return folder


def _recipe(folder, tmp_path, recent=6):
    return recipe_from_dict({
        "model": {"name_or_path": str(folder), "dtype": "float32"},
        "pod": {"sink_tokens": 2, "recent_window": recent},
        "data": {"train": "podkit:austen", "context_length": 64},
        "train": {"output_dir": str(tmp_path / "out")},
    }, check_environment=False)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits


def test_degenerate_pod_equals_dense(checkpoint, tmp_path):
    from transformers import LlamaForCausalLM

    recipe = _recipe(checkpoint, tmp_path)
    ids = torch.randint(0, 101, (3, 41))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0   # left padding
    mask[2, 30:] = 0  # right padding
    valid = mask.bool()
    stock = _logits(LlamaForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa"), ids, mask)
    dense = _logits(load_dense_reference(recipe, str(checkpoint)), ids, mask)
    torch.testing.assert_close(dense[valid], stock[valid], atol=2e-5, rtol=1e-5)

    own = [[layer, layer] for layer in range(LAYERS)]
    pod_own = _logits(load_model(recipe, str(checkpoint), anchor_layers=own), ids, mask)
    torch.testing.assert_close(pod_own[valid], dense[valid], atol=2e-5, rtol=1e-5)

    from train.models import pod_overrides, podkit_class

    wide = pod_overrides(recipe, SHARED)
    wide["pod_recent_window"] = ids.shape[1]
    pod_wide = _logits(podkit_class("llama").from_pretrained(checkpoint, **wide), ids, mask)
    torch.testing.assert_close(pod_wide[valid], dense[valid], atol=2e-5, rtol=1e-5)

    pod = _logits(load_model(recipe, str(checkpoint), anchor_layers=SHARED), ids, mask)
    assert torch.isfinite(pod[valid]).all()
    assert (pod[valid] - dense[valid]).abs().max() > 1e-2
