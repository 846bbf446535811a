"""The tokenizer identity that names token-shard folders travels between transformers versions (issue 33 section 3).

transformers 5.24 (here) and 5.17 (the H200 image) build SmolLM2's tokenizer from the GGUF with the same
vocabulary, added tokens, merges and encodings, but write another ``tokenizer.json`` (an empty normalizer
``Sequence``, ``trim_offsets: false``, BPE ``unk_token`` / ``fuse_unk`` / ``byte_fallback`` set, another decoder;
older ``tokenizers`` write merges as ``"a b"`` strings) and 5.17 names the BOS token as EOS with no pad token (its
``tokenizer_config.json``: ``eos_token: <|im_start|>``, ``eos_token_id: 1``, ``pad_token_id: null``). The files
below are those 5.17 wrote (compared on a real 5.17 install), rebuilt from the 5.24 files of the converted folder.
"""

from __future__ import annotations

import json
import shutil

import pytest

from train.corpus.shards import legacy_tokenizer_hash, tokenizer_identity

# What the 5.24 folder hashed to under the first identity (the issue's "3930e2a0a8692bc1..."); 5.17's files gave
# 6bd7ddb70f6b7d71 (their EOS). Old shard folders are found by this hash.
LEGACY_HASH = "3930e2a0a8692bc124b4eba0a74d3c5e536b38ad85dd81c781ea547a2b4bfb36"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tokenizer files of the embedded model's converted folder (5.24 here), copied."""
    from sparse_models.smollm2 import default_model_path

    source = default_model_path()
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copyfile(source / name, folder / name)
    return folder


def _load(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _copy(converted, tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(converted, folder)
    return folder


def _reversed_keys(value):
    if isinstance(value, dict):
        return {key: _reversed_keys(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_keys(item) for item in value]
    return value


def _as_517_wrote_it(folder, *, eos_fixed: bool) -> None:
    """Rewrite ``folder``'s files the way transformers 5.17's GGUF conversion wrote them (``eos_fixed``: with the
    special tokens ``sparse_models.smollm2.align_special_tokens`` gives it), merges in the legacy string form
    and every key in reverse order."""
    definition = json.loads((folder / "tokenizer.json").read_text())
    definition["normalizer"] = {"type": "Sequence", "normalizers": []}
    definition["pre_tokenizer"]["trim_offsets"] = False
    definition["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    model = definition["model"]
    model.update(unk_token="<|endoftext|>", fuse_unk=True, byte_fallback=True, continuing_subword_prefix=None,
                 end_of_word_suffix=None, merges=[" ".join(pair) for pair in model["merges"]])
    definition["added_tokens"] = definition["added_tokens"][::-1]
    (folder / "tokenizer.json").write_text(json.dumps(_reversed_keys(definition), ensure_ascii=False))
    settings = {"add_prefix_space": False, "backend": "tokenizers", "bos_token": "<|im_start|>", "bos_token_id": 1,
                "clean_up_tokenization_spaces": True, "eos_token": "<|im_start|>", "eos_token_id": 1, "legacy": False,
                "model_max_length": 1000000000000000019884624838656, "model_type": "gpt2", "pad_token_id": None,
                "tokenizer_class": "TokenizersBackend", "unk_token": "<|endoftext|>", "unk_token_id": 0}
    if eos_fixed:
        settings.update(eos_token="<|im_end|>", eos_token_id=2, pad_token="<|im_end|>", pad_token_id=2)
    (folder / "tokenizer_config.json").write_text(json.dumps(_reversed_keys(settings)))


def test_identity_is_the_same_under_other_serialisations(converted, tmp_path):
    here = _load(converted)
    identity = tokenizer_identity(here)
    assert identity["eos_token_id"] == 2 and identity["vocab_size"] == 49152
    assert legacy_tokenizer_hash(here) == LEGACY_HASH

    here.save_pretrained(tmp_path / "saved")  # saved and reloaded
    assert tokenizer_identity(_load(tmp_path / "saved"))["hash"] == identity["hash"]

    other = _copy(converted, tmp_path, "as_517")  # 5.17's serialisation, special tokens aligned
    _as_517_wrote_it(other, eos_fixed=True)
    assert json.loads((other / "tokenizer.json").read_text())["model"]["merges"][0] == "Ġ t"
    reloaded = _load(other)
    assert tokenizer_identity(reloaded)["hash"] == identity["hash"]
    assert legacy_tokenizer_hash(reloaded) == LEGACY_HASH  # so old folders are found there too


def test_517_eos_is_a_real_difference_that_the_folder_repair_removes(converted, tmp_path):
    from sparse_models.smollm2 import _repair_special_tokens

    identity = tokenizer_identity(_load(converted))
    folder = _copy(converted, tmp_path, "as_517_unfixed")
    _as_517_wrote_it(folder, eos_fixed=False)
    before = _load(folder)
    assert before.eos_token_id == 1 and before.pad_token_id is None
    assert tokenizer_identity(before)["hash"] != identity["hash"]  # another document separator in the shards

    _repair_special_tokens(folder)
    after = _load(folder)
    assert (after.eos_token, after.eos_token_id, after.pad_token_id) == ("<|im_end|>", 2, 2)
    assert tokenizer_identity(after)["hash"] == identity["hash"]
    stamp = (folder / "tokenizer_config.json").stat().st_mtime_ns
    _repair_special_tokens(folder)  # nothing left to repair: not rewritten
    assert (folder / "tokenizer_config.json").stat().st_mtime_ns == stamp


def test_align_special_tokens_follows_the_config(converted):
    from types import SimpleNamespace

    from sparse_models.smollm2 import align_special_tokens

    tokenizer = _load(converted)
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None  # as 5.17's converter left it
    align_special_tokens(tokenizer, SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=2, unk_token_id=0))
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token_id) == ("<|im_end|>", "<|im_end|>", 1)


def _edited(converted, tmp_path, name, edit):
    folder = _copy(converted, tmp_path, name)
    definition = json.loads((folder / "tokenizer.json").read_text())
    edit(definition)
    (folder / "tokenizer.json").write_text(json.dumps(definition, ensure_ascii=False))
    return tokenizer_identity(_load(folder))["hash"]


def test_a_different_tokenizer_gets_another_hash(converted, tmp_path):
    identity = tokenizer_identity(_load(converted))["hash"]

    def swap_ids(definition):  # two ordinary tokens trade ids
        vocab = definition["model"]["vocab"]
        vocab["the"], vocab["Ġthe"] = vocab["Ġthe"], vocab["the"]

    def swap_late_merges(definition):  # the probes never reach these ranks: only the merges show it
        merges = definition["model"]["merges"]
        merges[-1], merges[-2] = merges[-2], merges[-1]

    def add_token(definition):
        definition["added_tokens"].append({"id": 49152, "content": "<|podkit|>", "single_word": False, "lstrip": False,
                                           "rstrip": False, "normalized": False, "special": True})

    def lowercase(definition):  # a normalizer that changes what the ids are
        definition["normalizer"] = {"type": "Lowercase"}

    hashes = {name: _edited(converted, tmp_path, name, edit) for name, edit in
              [("swap_ids", swap_ids), ("swap_late_merges", swap_late_merges), ("add_token", add_token),
               ("lowercase", lowercase)]}
    assert identity not in hashes.values() and len(set(hashes.values())) == len(hashes), hashes

    from tokenizers import normalizers

    changed = _load(converted)  # changed in place after its identity was taken (the identity is remembered)
    assert tokenizer_identity(changed)["hash"] == identity
    changed.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert tokenizer_identity(changed)["hash"] == hashes["lowercase"]
