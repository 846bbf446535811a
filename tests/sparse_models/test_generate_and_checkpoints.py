"""generate() for every scheme (batch 2, left padding) against the oracle's greedy continuation;
beam search; save_pretrained -> from_pretrained keeps the schemes and load-time overrides win."""

import json

import pytest
import torch
from sm_oracle import Oracle
from sm_tiny import left_padded, random_prompts, tiny_model
from test_schemes_vs_oracle import SCHEMES
from transformers import AutoModelForCausalLM

from sparse_models import PodkitLlamaForCausalLM, SparseAttentionConfig, SparseKVCache
from tests.tiny_models import tiny_model as factory_model
from tests.tiny_models import twin_config

NEW_TOKENS = 4


@torch.no_grad()
def oracle_greedy(model, sparse, prompt):
    oracle = Oracle(model, sparse)
    oracle._gates = {}
    logits = oracle.prefill(prompt)[-1]
    tokens = []
    for i in range(NEW_TOKENS):
        token = int(logits.argmax())
        tokens.append(token)
        if i + 1 < NEW_TOKENS:
            if oracle._correction_due(i):
                oracle._correct(prompt, tokens[:-1])
            logits = oracle.decode(token)[0]
    return tokens


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_generate_matches_oracle_greedy(scheme):
    sparse = SparseAttentionConfig.from_dict(SCHEMES[scheme](2))
    model = tiny_model(4, 4, sparse, seed=11)
    prompts = random_prompts([12, 8])
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    got = out[:, ids.shape[1]:].tolist()
    want = [oracle_greedy(model, sparse, p) for p in prompts]
    assert got == want, f"{scheme}: generate {got} vs oracle {want}"


@pytest.mark.parametrize("scheme", ["dense", "tidal", "pod", "quest"])
def test_right_padded_batch_generates_what_each_prompt_alone_does(scheme):
    """issue 33: README's ``model.generate(**tokenizer(prompts, padding=True))`` with a right-padding tokenizer: the
    short row used to continue from a padding column (zero logits -> token 0, then garbage)."""
    sparse = SparseAttentionConfig.from_dict(SCHEMES[scheme](2))
    model = tiny_model(4, 4, sparse, seed=11)
    prompts = random_prompts([12, 5, 8], seed=3)
    alone = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
             for p in prompts]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, :len(p)], mask[b, :len(p)] = torch.tensor(p), 1
    for kwargs in ({"input_ids": ids}, {"inputs": ids}):  # keyword (the README's **tokenizer(...)) and positional
        out = model.generate(**kwargs, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
        assert out.shape == (len(prompts), width + NEW_TOKENS)
        assert out[:, width:].tolist() == alone, scheme
    left_ids, left_mask = left_padded(prompts)
    assert torch.equal(out[:, :width], left_ids)  # the prompts come back left-aligned, same width


def test_generate_with_beams_and_user_cache():
    model = tiny_model(3, 3, {"decode_scheme": "tidal", "tidal": {"budget": 4, "full_layers": [0]}}, seed=2)
    prompts = random_prompts([9, 6])
    ids, mask = left_padded(prompts)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
    assert beams.shape == (2, ids.shape[1] + 3)
    cache = model.new_cache()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         **{"past_key_values": cache})
    assert isinstance(cache, SparseKVCache) and cache.seq_lens.tolist() == [9 + 2, 6 + 2]
    assert out.shape[1] == ids.shape[1] + 3


def test_dense_beam_search_matches_transformers():
    model = tiny_model(3, 3, None, seed=4)
    ref = factory_model(seed=None, config=twin_config(model.config, podkit=False))
    ref.load_state_dict(model.state_dict())
    ids, mask = left_padded(random_prompts([9, 6]))
    kw = dict(attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_save_load_keeps_schemes_and_overrides_win(tmp_path):
    sparse = {"decode_scheme": "tidal", "tidal": {"budget": 7, "full_layers": [0], "selection_layers": [1]},
              "prefill_scheme": "token_sparse", "token_sparse": {"coverage": 0.01, "sparse_layers": [2]}}
    model = tiny_model(3, 4, sparse, seed=5)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "podkit_llama"
    assert saved["sparse_attention"]["tidal"]["budget"] == 7
    again = PodkitLlamaForCausalLM.from_pretrained(tmp_path)
    assert again.sparse_config == model.sparse_config
    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(auto, PodkitLlamaForCausalLM) and auto.sparse_config.tidal.budget == 7
    over = PodkitLlamaForCausalLM.from_pretrained(tmp_path, decode_scheme="quest", tidal_budget=9, quest_budget=32)
    assert over.sparse_config.decode_scheme == "quest"
    assert over.sparse_config.tidal.budget == 9 and over.sparse_config.quest.budget == 32
    assert over.sparse_config.token_sparse.sparse_layers == [2]  # untouched fields survive
    assert [p.decode for p in over.plan] == ["dense", "dense", "quest", "quest"]
    for a, b in zip(model.state_dict().values(), over.state_dict().values()):
        assert torch.equal(a, b)


def test_plain_llama_checkpoint_loads_with_schemes(tmp_path):
    plain = factory_model(3, 3, seed=None, podkit=False, vocab=61, intermediate=64, positions=None)
    plain.save_pretrained(tmp_path)
    model = PodkitLlamaForCausalLM.from_pretrained(tmp_path, decode_scheme="tidal", tidal_budget=256)
    assert model.sparse_config.decode_scheme == "tidal" and model.sparse_config.tidal.budget == 256
    ids = torch.randint(0, 61, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=2e-5, rtol=1e-5)


def test_blocks_file_is_resolved_relative_to_checkpoint(tmp_path):
    model = tiny_model(3, 4, None, seed=6)
    model.save_pretrained(tmp_path)
    anchors = [[0, 0], [0, 1], [2, 1], [2, 3]]
    (tmp_path / "pod_blocks.json").write_text(json.dumps({"anchor_layers": anchors}))
    loaded = PodkitLlamaForCausalLM.from_pretrained(tmp_path, decode_scheme="pod", pod_blocks_file="pod_blocks.json")
    assert [list(p.anchors) for p in loaded.plan] == anchors
    assert [p.decode for p in loaded.plan] == ["pod-anchor", "pod-shared", "pod-shared", "pod-shared"]


def test_token_sparse_calibration_file(tmp_path):
    model = tiny_model(3, 4, None, seed=6)
    model.save_pretrained(tmp_path)
    (tmp_path / "drift.json").write_text(json.dumps({"sparse_layers": [1, 3]}))
    loaded = PodkitLlamaForCausalLM.from_pretrained(tmp_path, prefill_scheme="token_sparse",
                                                    token_sparse_calibration_file="drift.json")
    assert [p.prefill for p in loaded.plan] == ["dense", "token-sparse", "dense", "token-sparse"]
    with pytest.raises(Exception, match="no such file"):
        loaded.set_sparse_attention(token_sparse_calibration_file=str(tmp_path / "missing.json"),
                                    token_sparse_sparse_layers=None)
