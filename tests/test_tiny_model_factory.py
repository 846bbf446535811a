"""tests/tiny_models.py is the test tree's one factory for tiny models (issue 30, item 5): no other test file
constructs a Llama / Mistral / Qwen2 config itself, and the factory's shapes, seeds and classes are what it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.tiny_models import GQA_SHAPES, SHARP_QK_STD, tiny_config, tiny_model, twin_config

TESTS = Path(__file__).resolve().parent
FACTORY = TESTS / "tiny_models.py"
# a config class called directly: LlamaConfig(...), PodkitLlamaConfig(**...), ... (not .from_pretrained)
DIRECT = re.compile(r"\b(?:Podkit)?(?:Llama|Mistral|Qwen2)Config\(")


def test_no_test_file_builds_a_config_but_the_factory():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path in (FACTORY, Path(__file__).resolve()):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DIRECT.search(line):
                offenders.append(f"{path.relative_to(TESTS.parent)}:{number}: {line.strip()}")
    assert not offenders, ("build tiny configs / models with tests/tiny_models.py (odd fields go through its "
                           "**extra):\n" + "\n".join(offenders))


def test_the_guard_sees_direct_constructions():
    for line in ("LlamaConfig(vocab_size=8)", "x = PodkitLlamaConfig(**common)", "MistralConfig(", "Qwen2Config("):
        assert DIRECT.search(line), line
    for line in ("LlamaConfig.from_pretrained(base)", "TokenSparseConfig(coverage=0.2)", "SparseAttentionConfig()"):
        assert not DIRECT.search(line), line


@pytest.mark.parametrize("podkit", [True, False])
@pytest.mark.parametrize("group", sorted(GQA_SHAPES))
def test_gqa_groups_give_their_head_counts(group, podkit):
    config = tiny_config(group, layers=2, podkit=podkit)
    heads, kv_heads, hidden = GQA_SHAPES[group]
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (heads, kv_heads, hidden)
    assert config.num_attention_heads // config.num_key_value_heads == group
    assert config.intermediate_size == 2 * hidden and config.num_hidden_layers == 2
    assert config.max_position_embeddings == 512 and config.vocab_size == 61
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_both_classes_and_every_family():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    from sparse_models import PODKIT_CLASSES, PodkitLlamaConfig, PodkitLlamaForCausalLM

    podkit, plain = tiny_model(layers=1), tiny_model(layers=1, podkit=False)
    assert type(podkit) is PodkitLlamaForCausalLM and type(podkit.config) is PodkitLlamaConfig
    assert type(plain) is LlamaForCausalLM and type(plain.config) is LlamaConfig
    assert not podkit.training and tiny_model(layers=1, eval=False).training
    for family, cls in (("mistral", MistralForCausalLM), ("qwen2", Qwen2ForCausalLM)):
        assert type(tiny_model(layers=1, family=family, podkit=False)) is cls
        assert type(tiny_model(layers=1, family=family)) is PODKIT_CLASSES[family]
    with pytest.raises(ValueError, match="family"):
        tiny_config(family="gpt2")


def test_explicit_sizes_and_extra_fields_pass_through():
    config = tiny_config(layers=3, vocab=97, heads=4, kv_heads=1, hidden=32, intermediate=40, positions=None,
                         head_dim=8, tie_word_embeddings=False, eos_token_id=None)
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (4, 1, 32)
    assert config.intermediate_size == 40 and config.vocab_size == 97 and config.head_dim == 8
    assert config.max_position_embeddings == 2048  # the class default
    assert config.tie_word_embeddings is False and config.eos_token_id is None
    with pytest.raises(TypeError):  # a field given twice is an error, not a silent override
        tiny_config(vocab_size=10)


def test_seed_reproducibility():
    a, b, c = tiny_model(layers=1, seed=3), tiny_model(layers=1, seed=3), tiny_model(layers=1, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))
    torch.manual_seed(3)
    d = tiny_model(layers=1, seed=None)  # the caller's RNG state
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), d.state_dict().values()))


def test_weight_options_and_sm_tiny_delegates():
    from tests.sparse_models.sm_tiny import tiny_model as sm_tiny_model

    base, sharp = tiny_model(layers=1, seed=5), tiny_model(layers=1, seed=5, qk_std=SHARP_QK_STD)
    for name, p in sharp.named_parameters():
        same = torch.equal(p, base.get_parameter(name))
        assert same != name.endswith(("q_proj.weight", "k_proj.weight")), name
    scaled = tiny_model(layers=1, seed=5, scale=3.0)
    assert all(torch.equal(p, 3.0 * base.get_parameter(n)) for n, p in scaled.named_parameters())
    ours = sm_tiny_model(3, 1, {"decode_scheme": "streaming"}, seed=5)
    assert ours.sparse_config.decode_scheme == "streaming"
    assert all(torch.equal(x, y) for x, y in zip(ours.state_dict().values(), sharp.state_dict().values()))


def test_twin_config_gives_the_same_model_in_the_other_class():
    podkit = tiny_model(layers=2, seed=6)
    plain = tiny_model(seed=None, config=twin_config(podkit.config, podkit=False))
    plain.load_state_dict(podkit.state_dict())
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(podkit(ids).logits, plain(ids).logits, atol=2e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="config given"):
        tiny_model(config=podkit.config, vocab=7)
