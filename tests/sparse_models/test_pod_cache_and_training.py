"""POD: the cache really drops non-anchor distant keys (kv_bytes), and POD training is
differentiable with non-reentrant gradient checkpointing, gradients reaching the anchor layers."""

import pytest
import torch
from sm_tiny import left_padded, random_prompts, tiny_model

from sparse_models import SparseAttentionConfig


def test_kv_bytes_matches_block_map():
    anchors = [[0, 0], [0, 1], [0, 1], [3, 1]]  # non-anchor units: (1,0) (2,0) (2,1) (3,1)
    sink, recent = 2, 5
    sparse = SparseAttentionConfig.from_dict({"decode_scheme": "pod", "pod": {
        "sink_tokens": sink, "recent_window": recent, "anchor_layers": anchors}})
    model = tiny_model(3, 4, sparse)  # 2 KV heads, head_dim 8
    ids, mask = left_padded(random_prompts([30, 17]))
    cache = model.new_cache(capacity=64)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    b, n, d, elt = 2, 64, 8, 4
    shared_units = sum(1 for layer, row in enumerate(anchors) for a in row if a != layer)
    own_units = 4 * 2 - shared_units
    got = cache.kv_bytes()
    assert got.values == 4 * 2 * b * n * d * elt
    assert got.keys == own_units * b * n * d * elt + shared_units * b * (sink + recent) * d * elt
    assert got.dense == 2 * got.values
    assert abs(got.saving - shared_units * (n - sink - recent) / (2 * 4 * 2 * n)) < 1e-12
    dense_cache = tiny_model(3, 4, None).new_cache(capacity=64)
    with torch.no_grad():
        tiny_model(3, 4, None)(ids, attention_mask=mask, cache=dense_cache)
    assert dense_cache.kv_bytes().saving == 0.0 and dense_cache.kv_bytes().total == got.dense


def _pod_training_model(sharing="keys"):
    sparse = {"prefill_scheme": "pod", "pod": {"sink_tokens": 1, "recent_window": 3, "sharing": sharing,
                                                "anchor_layers": [[0, 0], [0, 1], [0, 1], [3, 1]]}}
    model = tiny_model(3, 4, sparse, seed=9)
    model.train()
    return model


def _loss_and_grads(model, ids, mask, labels):
    model.zero_grad()
    loss = model(ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("sharing", ["keys", "scores"])
def test_pod_training_gradients_with_checkpointing(sharing):
    ids, mask = left_padded(random_prompts([14, 10]))
    labels = ids.masked_fill(mask == 0, -100)
    model = _pod_training_model(sharing)
    loss, grads = _loss_and_grads(model, ids, mask, labels)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert model.model.gradient_checkpointing
    loss_ckpt, grads_ckpt = _loss_and_grads(model, ids, mask, labels)
    torch.testing.assert_close(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ckpt[name], atol=1e-6, rtol=1e-5, msg=name)
    # layer 0 is the anchor of layers 1-2 (head 0): its keys get gradient from their distant attention
    k0 = grads["model.layers.0.self_attn.k_proj.weight"]
    assert k0.abs().sum() > 0


def test_lora_on_pod_model_trains_adapters_only():
    peft = __import__("pytest").importorskip("peft")
    model = _pod_training_model()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    ids, mask = left_padded(random_prompts([12, 9]))
    loss = lora(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False).loss
    loss.backward()
    trained = [n for n, p in lora.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert trained and all("lora_" in n for n in trained)


SCHEMES_WITH_CHUNKS = {
    "dense": {},
    "pod_keys": {"prefill_scheme": "pod", "decode_scheme": "pod",
                 "pod": {"sink_tokens": 2, "recent_window": 3, "anchor_layers": [[0, 0], [0, 1], [0, 1], [3, 1]]}},
    "pod_scores": {"prefill_scheme": "pod", "decode_scheme": "pod",
                   "pod": {"sink_tokens": 2, "recent_window": 3, "sharing": "scores",
                           "anchor_layers": [[0, 0], [0, 1], [0, 1], [3, 1]]}},
    "quest": {"decode_scheme": "quest", "quest": {"page_size": 4, "budget": 8, "dense_layers": [0]}},
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES_WITH_CHUNKS))
@torch.no_grad()
def test_chunked_prefill_equals_one_shot(scheme):
    """A prompt fed in two chunks through the cache gives the one-shot prefill's logits (exact attention
    over the cache: dense, or POD's when the cache is POD-shaped), and the same next decode step."""
    model = tiny_model(3, 4, SCHEMES_WITH_CHUNKS[scheme], seed=12)
    prompts = random_prompts([15, 11])
    ids, mask = left_padded(prompts)
    one = model(ids, attention_mask=mask, cache=(c1 := model.new_cache()))
    c2 = model.new_cache()
    first = model(ids[:, :8], attention_mask=mask[:, :8], cache=c2)
    second = model(ids[:, 8:], attention_mask=mask, cache=c2)
    chunked = torch.cat([first.logits, second.logits], dim=1)
    valid = mask.bool()
    torch.testing.assert_close(chunked[valid], one.logits[valid], atol=2e-5, rtol=1e-5)
    step = torch.tensor([[3], [5]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    a = model(step, attention_mask=mask2, cache=c1).logits
    b = model(step, attention_mask=mask2, cache=c2).logits
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
