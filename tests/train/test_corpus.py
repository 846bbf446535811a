"""train.corpus: shards + manifest + reuse/rebuild, weighted mixing, memmap rows, held-out overlap, mixture specs."""

from __future__ import annotations

import gzip
import json
import pickle
import struct
import zlib

import numpy as np
import pytest

from train.corpus import documents, extract, registry
from train.corpus.mixture import MixedRows, MixError, mix_to_string, parse_mix, plan_rows
from train.corpus.overlap import ngram_hashes, overlap_count
from train.corpus.shards import ShardedTokens, ensure_shards, pack_folder, token_dtype, tokenizer_identity

WORDS = ("the sea whale ship captain harbour rope sail storm island river field house garden letter "
         "sister brother morning evening dinner ball walk carriage rain sun wind road town").split()


def _text(seed: int, words: int = 300) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words)) + ".\n"


def _tokenizer(vocab_size: int = 300, extra: str = ""):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_text(i) for i in range(20)] + [extra], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An empty podkit cache root; PODKIT_TEXT_CACHE / PODKIT_TOKEN_CACHE unset so the root decides."""
    monkeypatch.setenv("PODKIT_CACHE", str(tmp_path / "podkit"))
    monkeypatch.delenv("PODKIT_TEXT_CACHE", raising=False)
    monkeypatch.delenv("PODKIT_TOKEN_CACHE", raising=False)
    return tmp_path / "podkit"


BOILERPLATE = ("This boilerplate paragraph is printed on every page of the toy documentation, so held-out "
               "pages share it with training pages unless the training split drops it.\n")


INLINE = ("a sentence quoted inside a longer line on every page, which no line filter can see because each "
          "line starts differently, but whose tokens the held-out filter finds and cuts out.\n")


@pytest.fixture()
def fake_source(cache, monkeypatch):
    """Registry sources: 'toy', already materialised under the cache (12 documents, each with the same
    boilerplate line), and 'never' (fetching it fails the test); stand-ins for the embedded books."""
    source = registry.CorpusSource("toy", "deb", "toy-package", "text_files", ("*.txt",), "public domain", "toy")
    never = registry.CorpusSource("never", "deb", "never-package", "text_files", ("*.txt",), "public domain",
                                  "a source that is never fetched: building 'toy' must not need it")
    monkeypatch.setattr(registry, "SOURCES", {"toy": source, "never": never})
    monkeypatch.setattr(registry, "_fetch", lambda *a: pytest.fail(f"fetched {a[0].name}"))
    texts = cache / "texts"
    texts.mkdir(parents=True)
    for index, book in enumerate(("emma", *registry.OOD_BOOKS)):
        (texts / f"{book}.txt").write_text(_text(900 + index, 300))
    folder = registry.source_folder("toy")
    folder.mkdir(parents=True)
    docs = [{"id": f"doc{i:02d}", "text": _text(100 + i, 200 + 40 * i) + BOILERPLATE + f"Page {i}: {INLINE}"}
            for i in range(12)]
    (folder / "documents.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "source.json").write_text(json.dumps({"fingerprint": source.fingerprint(), "sha256": "0" * 64}))
    return docs


def _jsonl_source(tmp_path, texts):
    folder = tmp_path / "samples"
    folder.mkdir(exist_ok=True)
    (folder / "part.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(folder)


def test_shards_manifest_stream_and_reuse(cache, tmp_path):
    tokenizer = _tokenizer()
    texts = [_text(i, 150) for i in range(6)]
    source = _jsonl_source(tmp_path, texts)
    logs: list[str] = []
    shards = ensure_shards(source, tokenizer, shard_tokens=256, log=logs.append)
    expected = np.concatenate([tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                               for t in texts])
    manifest = shards.manifest
    assert shards.folder.is_relative_to(cache / "tokens")
    assert manifest["tokenizer"]["hash"] == tokenizer_identity(tokenizer)["hash"]
    assert manifest["dtype"] == "<u2" and manifest["documents"] == 6 and manifest["total_tokens"] == len(expected)
    assert [s["tokens"] for s in manifest["shards"][:-1]] == [256] * (len(manifest["shards"]) - 1)
    assert len(manifest["shards"]) == -(-len(expected) // 256) > 2
    np.testing.assert_array_equal(shards.read(0, shards.total_tokens), expected)
    np.testing.assert_array_equal(shards.read(250, 20), expected[250:270])  # across a shard boundary
    starts = shards.doc_starts()
    assert (expected[starts[1:] - 1] == tokenizer.eos_token_id).all() and starts[0] == 0
    assert len(logs) == 1

    again = ensure_shards(source, tokenizer, shard_tokens=256, log=logs.append)
    assert len(logs) == 1 and again.folder == shards.folder  # reused, nothing tokenised

    (tmp_path / "samples" / "part.jsonl").write_text(json.dumps({"text": texts[0]}) + "\n")
    changed = ensure_shards(source, tokenizer, shard_tokens=256, log=logs.append)
    assert "source changed" in logs[-1] and changed.manifest["documents"] == 1
    assert not list(shards.folder.parent.glob("*.tmp-*")) and not list(shards.folder.parent.glob("*.old-*"))


def test_shards_rebuilt_for_another_tokenizer(cache, tmp_path):
    source = _jsonl_source(tmp_path, [_text(i) for i in range(3)])
    first = ensure_shards(source, _tokenizer(300), log=lambda _: None)
    second = ensure_shards(source, _tokenizer(340), log=lambda _: None)
    assert first.manifest["tokenizer"]["hash"] != second.manifest["tokenizer"]["hash"]
    assert first.folder != second.folder and first.total_tokens != second.total_tokens
    assert token_dtype(50_000) == np.uint16 and token_dtype(128_256) == np.uint32


def test_plan_rows_exact_counts_and_deterministic():
    plan = plan_rows([50, 7, 1000], [3.0, 1.0, 6.0], 1000, seed=3)
    assert plan.counts == [300, 100, 600]
    assert np.bincount(plan.source, minlength=3).tolist() == plan.counts
    again = plan_rows([50, 7, 1000], [3.0, 1.0, 6.0], 1000, seed=3)
    np.testing.assert_array_equal(plan.source, again.source)
    np.testing.assert_array_equal(plan.row, again.row)
    assert not np.array_equal(plan.source, plan_rows([50, 7, 1000], [3.0, 1.0, 6.0], 1000, seed=4).source)
    small = plan.row[plan.source == 1]  # 100 rows from a source of 7: every row used 14-15 times
    assert set(small.tolist()) == set(range(7)) and np.bincount(small).min() >= 14
    big = plan.row[plan.source == 2]  # 600 of 1000: no repeats
    assert len(set(big.tolist())) == 600
    assert plan_rows([5, 5], [1, 1], 3, seed=0).counts in ([2, 1], [1, 2])


def test_mixed_rows_read_memmapped_shards(cache, tmp_path):
    tokenizer = _tokenizer()
    a = ensure_shards(_jsonl_source(tmp_path / "a", [_text(i, 400) for i in range(4)]) if (tmp_path / "a").mkdir()
                      is None else None, tokenizer, shard_tokens=300, log=lambda _: None)
    b = ensure_shards(_jsonl_source(tmp_path / "b", [_text(50 + i, 400) for i in range(2)]) if (tmp_path / "b").mkdir()
                      is None else None, tokenizer, shard_tokens=300, log=lambda _: None)
    rows = MixedRows([a, b], [1.0, 3.0], 64, num_rows=40, seed=7)
    assert len(rows) == 40 and [s["rows"] for s in rows.summary()] == [10, 30]
    for k in range(len(rows)):
        item = rows[k]
        source = (a, b)[rows.plan.source[k]]
        start = int(rows.plan.row[k]) * 64
        np.testing.assert_array_equal(item["input_ids"].numpy(), source.read(start, 64))
        assert item["input_ids"].dtype.is_floating_point is False and item["input_ids"].shape == (64,)
        assert (item["labels"] == item["input_ids"]).all()
    blob = pickle.dumps(rows)  # DataLoader workers: the memmaps are not copied
    assert len(blob) < 20_000
    np.testing.assert_array_equal(pickle.loads(blob)[5]["input_ids"].numpy(), rows[5]["input_ids"].numpy())
    with pytest.raises(ValueError, match="fewer than context_length"):
        MixedRows([a], [1.0], 10**6)


def test_parse_mix_forms_and_errors():
    assert parse_mix("podkit:austen") == parse_mix(["podkit:austen"]) == parse_mix([{"source": "podkit:austen"}])
    mix = parse_mix("podkit:gcide=3, ./samples=0.5,podkit:austen")
    assert [(e.source, e.weight) for e in mix] == [("podkit:gcide", 3.0), ("./samples", 0.5), ("podkit:austen", 1.0)]
    assert parse_mix(mix_to_string(mix)) == mix
    assert parse_mix([{"source": "a", "weight": 2}, "b=1"])[0].weight == 2.0
    cases = {
        "a=-1": "data.train[0]: weight=-1.0 for 'a': expected a positive finite number",
        "a=1,a=2": "source 'a' is listed twice",
        "": "data.train is empty",
        "a=1,=2": "data.train[1]='=2': empty source",
        "a=1e400": "expected a positive finite number",
    }
    for value, message in cases.items():
        with pytest.raises(MixError) as error:
            parse_mix(value)
        assert message in str(error.value), (value, str(error.value))
    with pytest.raises(MixError, match=r"data.train\[0\]: unknown key\(s\) 'wieght'; allowed: source, weight"):
        parse_mix([{"source": "a", "wieght": 2}])
    with pytest.raises(MixError, match=r"data.train\[1\].weight='x': expected a positive number"):
        parse_mix([{"source": "a"}, {"source": "b", "weight": "x"}])
    with pytest.raises(MixError, match=r"data.train=3: expected a source string"):
        parse_mix(3)


def test_recipe_accepts_mixtures_and_reports_bad_ones(tmp_path):
    from train.recipe import RecipeError, recipe_from_dict

    base = {"model": {"name_or_path": "podkit:smollm2-135m"}, "pod": {"recent_window": 100},
            "data": {"train": [{"source": "podkit:austen", "weight": 2}, "podkit:shakespeare"], "context_length": 256},
            "train": {"output_dir": str(tmp_path / "out")}}
    recipe = recipe_from_dict(base)
    assert [e.weight for e in parse_mix(recipe.data.train)] == [2.0, 1.0]
    override = recipe_from_dict(base, ["data.train=podkit:austen=1,podkit:heldout-ood=0.5"])
    assert override.data.train == "podkit:austen=1,podkit:heldout-ood=0.5"
    with pytest.raises(RecipeError) as error:
        recipe_from_dict(base, ["data.train=podkit:austen=0,podkit:nope=1"])
    text = str(error.value)
    assert "data.train[0]: weight=0.0 for 'podkit:austen': expected a positive finite number" in text
    with pytest.raises(RecipeError) as error:
        recipe_from_dict(base, ["data.train=podkit:austen=1,podkit:nope=1"])
    assert "data.train[1]='podkit:nope': unknown embedded corpus" in str(error.value)


def test_heldout_split_never_reaches_training_shards(fake_source):
    tokenizer = _tokenizer(extra=" ".join(d["text"] for d in fake_source))
    held = {doc_id for doc_id, _ in registry.split_documents("toy", "heldout")}
    trained = {doc_id for doc_id, _ in registry.split_documents("toy", "train")}
    assert held and trained and not held & trained and len(held | trained) == 12
    train = ensure_shards("podkit:toy", tokenizer, log=lambda _: None)
    heldout = ensure_shards("podkit:heldout/toy", tokenizer, log=lambda _: None)
    assert overlap_count(train, heldout.read(0, heldout.total_tokens), n=32) == 0
    trained_text = tokenizer.decode(train.read(0, train.total_tokens))
    assert BOILERPLATE.strip() not in trained_text and INLINE[20:80] not in trained_text
    assert train.manifest["heldout_filter"]["removed_tokens"] > 0
    ood = ensure_shards("podkit:heldout-ood", tokenizer, log=lambda _: None)
    assert overlap_count(train, ood.read(0, ood.total_tokens), n=32) == 0
    # the check can fail: training text against itself overlaps everywhere
    assert overlap_count(train, train.read(0, 2000), n=32) >= 2000 - 31
    assert documents.source_fingerprint("podkit:toy") is not None


def test_in_sorted_matches_isin():
    from train.corpus.overlap import in_sorted

    rng = np.random.default_rng(0)
    table = np.unique(rng.integers(0, 1000, 300).astype(np.uint64))
    values = rng.integers(0, 1100, 500).astype(np.uint64)
    np.testing.assert_array_equal(in_sorted(values, table), np.isin(values, table))
    assert not in_sorted(values, table[:0]).any()


def test_ngram_hashes_match_windows():
    tokens = np.array([5, 1, 2, 3, 5, 1, 2, 9])
    hashes = ngram_hashes(tokens, 3)
    assert len(hashes) == 6 and hashes[0] == hashes[4] and len(set(hashes.tolist())) == 5
    assert len(ngram_hashes(tokens[:2], 3)) == 0


def test_pack_copies_only_needed_tokens_and_is_used_elsewhere(cache, tmp_path, fake_source, monkeypatch):
    tokenizer = _tokenizer()
    full = ensure_shards("podkit:toy", tokenizer, shard_tokens=128, log=lambda _: None)
    packed_cache = tmp_path / "packed"
    folder = pack_folder(full, 300, packed_cache)
    packed = ShardedTokens(folder)
    assert packed.total_tokens == 300 and [s["tokens"] for s in packed.manifest["shards"]] == [128, 128, 44]
    assert packed.manifest["packed_from"]["total_tokens"] == full.total_tokens
    np.testing.assert_array_equal(packed.read(0, 300), full.read(0, 300))
    # another machine: no texts there, only the packed tokens -> used as they are, nothing fetched
    monkeypatch.setenv("PODKIT_CACHE", str(tmp_path / "empty"))
    assert documents.source_fingerprint("podkit:toy") is None
    again = ensure_shards("podkit:toy", tokenizer, cache=packed_cache, log=pytest.fail)
    assert again.total_tokens == 300


def test_extract_readers(tmp_path):
    dict_text = ("00-database-info\n    about\nApple\n    n 1: a fruit [syn: {apple}]\nPear\n    n 1: a fruit "
                 "[syn: {apple}]\nPlum\n    n 1: another fruit\n")
    (tmp_path / "d.dict.dz").write_bytes(gzip.compress(dict_text.encode()))
    docs = list(extract.dictd(tmp_path, ("*.dict.dz",)))
    assert len(docs) == 1 and "Apple" in docs[0][1] and "Pear" not in docs[0][1] and "00-database" not in docs[0][1]

    verses = ('<div type="book"/><title>Genesis</title><verse>In the beginning God created the heavens '
              'and the earth.<note>a footnote</note></verse> ') * 10
    block = zlib.compress(verses.encode())
    (tmp_path / "ot.bzz").write_bytes(block)
    (tmp_path / "ot.bzs").write_bytes(struct.pack("<III", 0, len(block), len(verses.encode())))
    (doc_id, text), = extract.sword_ztext(tmp_path, ("*.bzs",))
    assert doc_id == "ot.bzs#0000" and "In the beginning God created" in text and "footnote" not in text

    page = "<html><head><style>x{}</style></head><body><h1>Title</h1><p>One &amp; two</p><script>no</script></body>"
    assert extract.html_to_text(page) == "Title\n\nOne & two\n"


def test_heldout_windows_for_evaluation_come_from_shards(fake_source):
    from train.data import token_windows

    tokenizer = _tokenizer()
    windows = token_windows("podkit:heldout/toy", tokenizer, 32, 10**6)
    stream = ensure_shards("podkit:heldout/toy", tokenizer, log=pytest.fail)  # built by token_windows, reused
    assert windows.shape == (stream.total_tokens // 32, 32) and windows.dtype.is_floating_point is False
    np.testing.assert_array_equal(windows.flatten().numpy(), stream.read(0, windows.numel()))
    held_text = "".join(text for _, text in registry.split_documents("toy", "heldout"))
    assert tokenizer.decode(windows[0]) in held_text


def test_source_fetched_by_the_build_is_not_rebuilt_next_time(cache, fake_source, monkeypatch):
    """A registry source materialised during the first build records its fingerprint then."""
    folder = registry.source_folder("toy")
    saved = {p.name: p.read_bytes() for p in folder.iterdir()}
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()

    def fake_materialise(name, log=print):
        folder.mkdir(parents=True, exist_ok=True)
        for file, data in saved.items():
            (folder / file).write_bytes(data)
        return folder

    monkeypatch.setattr(registry, "materialise", fake_materialise)
    assert documents.source_fingerprint("podkit:toy") is None
    tokenizer = _tokenizer()
    first = ensure_shards("podkit:toy", tokenizer, log=lambda _: None)
    assert first.manifest["source"]["fingerprint"] == documents.source_fingerprint("podkit:toy") is not None
    ensure_shards("podkit:toy", tokenizer, log=pytest.fail)


def test_drop_shared_spans_cuts_documents_at_held_out_windows():
    from train.corpus.overlap import drop_shared_spans

    held = np.unique(ngram_hashes(np.array([7, 8, 9, 10]), 3))
    ids = np.array([1, 2, 7, 8, 9, 10, 3, 4, 8, 9, 10, 5])
    kept = drop_shared_spans(ids, held, n=3)
    assert [k.tolist() for k in kept] == [[1, 2], [3, 4], [5]]
    assert [k.tolist() for k in drop_shared_spans(ids, np.empty(0, np.uint64), n=3)] == [ids.tolist()]
    assert drop_shared_spans(np.array([7, 8, 9]), held, n=3) == []


def test_family_members_filter_each_others_held_out_text(fake_source, monkeypatch):
    """Two sources of one family: a line that only 'sibling's held-out documents hold leaves 'toy's training split."""
    toy = registry.SOURCES["toy"]
    sibling = registry.CorpusSource("sibling", "deb", "sibling-package", "text_files", ("*.txt",), "public domain",
                                    "sibling", family="docs")
    monkeypatch.setitem(registry.SOURCES, "toy", registry.CorpusSource(**{**toy.__dict__, "family": "docs"}))
    monkeypatch.setitem(registry.SOURCES, "sibling", sibling)
    quoted = "A line that the sibling documentation quotes from the toy documentation, word for word."
    folder = registry.source_folder("sibling")
    folder.mkdir(parents=True)
    docs = [{"id": f"s{i:02d}", "text": _text(500 + i, 100) + quoted + "\n"} for i in range(6)]
    (folder / "documents.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "source.json").write_text(json.dumps({"fingerprint": sibling.fingerprint(), "sha256": "1" * 64}))
    held = {doc_id for doc_id, _ in registry.split_documents("toy", "heldout")}
    toy_docs = folder.parent / "toy" / "documents.jsonl"
    records = [json.loads(line) for line in toy_docs.read_text().splitlines()]
    for record in records:  # the quoted line goes into toy's training documents only
        record["text"] += "" if record["id"] in held else quoted + "\n"
    toy_docs.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert registry.family_of("toy") == ("toy", "sibling")
    assert documents.heldout_sources("toy")[:2] == ("podkit:heldout/toy", "podkit:heldout/sibling")
    trained = "".join(documents.podkit_documents("toy"))
    assert quoted not in trained and "Page 3" in trained
    monkeypatch.setitem(registry.SOURCES, "toy", toy)  # without the family the quoted line stays
    assert quoted in "".join(documents.podkit_documents("toy"))


def test_row_aligned_rows_start_at_documents_and_keep_them_whole(cache, tmp_path):
    """podkit:recall-long's rows (MixedRows(aligned=)): each row starts at a document, so a document shorter than
    a row is never cut; documents too close to the end of the stream start no row; the unaligned source of the
    same mixture still reads every context_length tokens."""
    from train.corpus.mixture import document_rows

    tokenizer = _tokenizer()
    (tmp_path / "a").mkdir()
    texts = [_text(i, 30 + 17 * i) for i in range(11)] + [_text(99, 5)]  # the last one starts no row
    a = ensure_shards(_jsonl_source(tmp_path / "a", texts), tokenizer, shard_tokens=200, log=lambda _: None)
    starts = a.doc_starts()
    assert len(starts) == 12
    rows = MixedRows([a, a], [1.0, 1.0], 64, num_rows=60, seed=1, aligned=[True, False])
    wanted = document_rows(starts, a.total_tokens, 64)
    assert 0 < len(wanted) < 12 and (wanted + 64 <= a.total_tokens).all()
    assert [s["available_rows"] for s in rows.summary()] == [len(wanted), a.total_tokens // 64]
    ends = list(starts[1:]) + [a.total_tokens]
    for k in range(len(rows)):
        ids = rows[k]["input_ids"].numpy()
        row = int(rows.plan.row[k])
        if rows.plan.source[k] == 0:
            doc = int(np.searchsorted(starts, wanted[row]))
            np.testing.assert_array_equal(ids, a.read(int(starts[doc]), 64))
            whole = min(64, int(ends[doc] - starts[doc]))  # the document's own tokens lead the row, uncut
            np.testing.assert_array_equal(ids[:whole], a.read(int(starts[doc]), whole))
        else:
            np.testing.assert_array_equal(ids, a.read(row * 64, 64))
    assert len(pickle.dumps(rows)) < 20_000
    with pytest.raises(ValueError, match="aligned has 1 entries for 2 sources"):
        MixedRows([a, a], [1.0, 1.0], 64, aligned=[True])


def test_pack_of_a_row_aligned_source_keeps_the_rows_it_plans(cache, tmp_path, monkeypatch, capsys):
    """`python -m train.corpus pack` counts a row-aligned source's rows as the training does (documents, not
    stream tokens // L) and keeps its stream through the end of the last row it plans."""
    from train.corpus import __main__ as cli
    from train.corpus.mixture import document_rows

    tokenizer = _tokenizer()
    (tmp_path / "a").mkdir()
    source = _jsonl_source(tmp_path / "a", [_text(i, 40) for i in range(40)])
    full = ensure_shards(source, tokenizer, shard_tokens=200, log=lambda _: None)
    monkeypatch.setattr(cli, "load_tokenizer", lambda name: tokenizer)
    monkeypatch.setattr(documents, "row_aligned", lambda s: s == source)
    out = tmp_path / "packed"
    # --eval with no source: the held-out sets would materialise every real corpus (minutes on CI's 2 cores)
    assert cli.main(["pack", "--sources", source, "--max-tokens", str(10 * 32), "--context-length", "32",
                     "--margin", "1.0", "--eval", "--out", str(out)]) == 0
    report = json.loads((out / "pack.json").read_text())["items"][0]
    rows = document_rows(full.doc_starts(), full.total_tokens, 32)
    assert report["tokens"] == int(rows[10]) + 32 < full.total_tokens
    packed = ensure_shards(source, tokenizer, cache=out, log=pytest.fail)
    assert len(document_rows(packed.doc_starts(), packed.total_tokens, 32)) >= 10
