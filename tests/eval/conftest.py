"""Fixtures for eval tests: a tiny byte-level BPE tokenizer and a tiny random Llama saved with it.

Everything is built locally (no hub): the tokenizer is trained on the passkey filler, digits and a
few sentences, so that prompts tokenise to realistic lengths and decode back to text.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CORPUS = [
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ",
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. ",
    "What is the pass key? The pass key is 0123456789. Remember it. Question: Answer: secret of",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse.",
]


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory, tiny_tokenizer):
    """``make(name, layers, positions) -> folder``: a new folder holding a random plain Llama of ``layers`` layers
    (GQA 3, seed 0, the tiny tokenizer's vocabulary and special token ids, ``positions`` positions) and the
    tokenizer, as a checkpoint on disk is loaded."""
    from tests.tiny_models import tiny_model

    def make(name: str, layers: int, positions: int):
        model = tiny_model(3, layers, seed=0, podkit=False, eval=False, vocab=len(tiny_tokenizer), positions=positions,
                           bos_token_id=tiny_tokenizer.bos_token_id, eos_token_id=tiny_tokenizer.eos_token_id,
                           pad_token_id=tiny_tokenizer.pad_token_id)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tiny_tokenizer.save_pretrained(folder)
        return folder

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_folder):
    """A folder with a 2-layer random Llama (GQA 3, vocab of the tiny tokenizer) and its tokenizer."""
    return tiny_model_folder("tiny_llama", layers=2, positions=4096)


@pytest.fixture()
def fake_text_cache(tmp_path, monkeypatch):
    """A text cache holding small stand-ins for every book name, so tests never touch apt-get."""
    from eval.data.texts import TEXT_NAMES

    sentence = "It is a truth universally acknowledged, that a single man must be in want of a wife. "
    for index, name in enumerate(TEXT_NAMES):
        (tmp_path / f"{name}.txt").write_text(f"Chapter {index}. " + sentence * 400)
    monkeypatch.setenv("PODKIT_TEXT_CACHE", str(tmp_path))
    return tmp_path
