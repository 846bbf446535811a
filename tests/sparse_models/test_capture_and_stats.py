"""capture_attention_inputs, hidden states, ragged layouts and Token Sparse statistics."""

import torch
from sm_tiny import left_padded, random_prompts, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sparse_models import SparseAttentionConfig, capture_attention_inputs, capture_residual_stream


def _manual_qk(model, tokens, layer):
    """q, k of one unpadded sequence, computed directly from the modules (dense model)."""
    base = model.model
    h = base.embed_tokens(torch.tensor([tokens]))
    pos = torch.arange(len(tokens))[None]
    cos, sin = base.rotary_emb(h, pos)
    for i in range(layer + 1):
        lay = base.layers[i]
        x = lay.input_layernorm(h)
        a = lay.self_attn
        d = a.head_dim
        q = a.q_proj(x).view(1, len(tokens), -1, d).transpose(1, 2)
        k = a.k_proj(x).view(1, len(tokens), -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if i == layer:
            return q[0], k[0]
        h = model(torch.tensor([tokens]), use_cache=False, output_hidden_states=True).hidden_states[i + 1]


@torch.no_grad()
def test_capture_attention_inputs_matches_manual_projection():
    model = tiny_model(3, 3, seed=1)
    prompts = random_prompts([11, 7])
    ids, mask = left_padded(prompts)
    got = capture_attention_inputs(model, ids, mask, layers=[0, 2])
    assert sorted(got) == [0, 2]
    for layer in (0, 2):
        q, k = got[layer]
        assert q.shape == (2, 6, 11, 8) and k.shape == (2, 2, 11, 8)
        for b, p in enumerate(prompts):
            mq, mk = _manual_qk(model, p, layer)
            torch.testing.assert_close(q[b, :, : len(p)], mq, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k[b, :, : len(p)], mk, atol=1e-5, rtol=1e-5)
            assert (q[b, :, len(p):] == 0).all()


@torch.no_grad()
def test_hidden_states_and_residual_stream():
    model = tiny_model(4, 3, seed=2)
    prompts = random_prompts([9, 5])
    ids, mask = left_padded(prompts)
    out = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == 4
    stream = capture_residual_stream(model, ids, mask)
    assert len(stream) == 4
    for a, b in zip(out.hidden_states[:3], stream[:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(model.model.norm(stream[-1]) * mask[..., None], out.hidden_states[-1])
    single = model(ids[1:, 4:], output_hidden_states=True, use_cache=False).hidden_states
    for a, b in zip(out.hidden_states, single):
        torch.testing.assert_close(a[1, 4:], b[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_right_padding_equals_left_padding():
    model = tiny_model(3, 3, {"prefill_scheme": "token_sparse", "token_sparse": {
        "coverage": 0.3, "window": 3, "min_tokens": 2, "pool_kernel": 3, "sparse_layers": [1]}}, seed=3)
    prompts = random_prompts([12, 8])
    ids, mask = left_padded(prompts)
    right_ids = torch.zeros_like(ids)
    right_mask = torch.zeros_like(mask)
    for b, p in enumerate(prompts):
        right_ids[b, : len(p)] = torch.tensor(p)
        right_mask[b, : len(p)] = 1
    left = model(ids, attention_mask=mask, use_cache=False).logits
    right = model(right_ids, attention_mask=right_mask, use_cache=False).logits
    for b, p in enumerate(prompts):
        torch.testing.assert_close(left[b, 12 - len(p):], right[b, : len(p)])
        assert (right[b, len(p):] == 0).all()


@torch.no_grad()
def test_token_sparse_stats_report_achieved_sparsity():
    model = tiny_model(3, 4, {"prefill_scheme": "token_sparse", "token_sparse": {
        "coverage": 0.3, "window": 4, "min_tokens": 2, "pool_kernel": 3, "sparse_layers": [2, 3]}}, seed=4)
    ids, mask = left_padded(random_prompts([40, 5]))
    model(ids, attention_mask=mask, use_cache=False)
    stats = model.token_sparse_stats
    assert sorted(stats.layers) == [2, 3]
    rec = stats.layers[2]
    assert rec.seq_lens == [40, 5]
    assert rec.sparse == [True, False]  # 5 <= min_tokens + window: dense
    assert rec.kept[1] == 5 and 4 + 2 <= rec.kept[0] < 40
    assert rec.token_sparsity[1] == 0.0 and rec.token_sparsity[0] > 0
    assert 0 < stats.mean_token_sparsity < 1
    assert stats.to_dict()["layers"][3]["seq_lens"] == [40, 5]
    # decode leaves the stats of the prefill alone
    model.set_sparse_attention(SparseAttentionConfig.from_dict({"prefill_scheme": "dense"}))
    model(ids, attention_mask=mask, use_cache=False)
    assert model.token_sparse_stats is None
