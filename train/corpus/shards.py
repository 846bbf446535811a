"""Tokenise a source once into fixed-size, memory-mapped token shards; reuse them across runs.

Layout under the token cache (``sparse_models.paths.cache_dir("tokens")``: ``$PODKIT_CACHE/tokens``, or
``$PODKIT_TOKEN_CACHE``, or ``data.token_cache``)::

    <tokenizer hash>/<source slug>/manifest.json
                                  /shard_00000.bin ...   raw little-endian uint16 (uint32 if vocab > 65536),
                                                         SHARD_TOKENS tokens each except the last
                                  /doc_starts.npy        int64 [documents]: first token of each document

Documents are tokenised without special tokens and each is followed by EOS, so the shards are one
token stream with EOS separators. The manifest records the tokenizer identity (:func:`tokenizer_identity`:
class, name, vocab, EOS and the hash of what decides the token ids), the source (string, fingerprint) and
counts. A folder is built in a temporary sibling and renamed into place, the manifest written last, under a
file lock, so concurrent ranks build it once and a crash never leaves a half-written folder that looks valid.
A changed tokenizer lands in another ``<tokenizer hash>`` folder; a changed source (fingerprint) is rebuilt in
place. Folders written under the first identity (:func:`legacy_tokenizer_hash`: vocabulary, added tokens, one
probe text, EOS) are still read where that hash matches (:func:`find_shards`).

Travelling between machines: the hash covers only what decides the ids -- never the serialised
``tokenizer.json`` (transformers 5.17 and 5.24 write the same SmolLM2 tokenizer with another normalizer
entry, other BPE flags, another decoder). The ids did differ in one place: transformers 5.17's GGUF converter
gives SmolLM2 the BOS token as EOS (``<|im_start|>``, 1, not ``<|im_end|>``, 2), so its shards would carry
another separator; ``sparse_models.smollm2`` sets the special tokens from the model config, so both versions
build the same tokenizer and the same hash (``tests/train/test_token_identity.py``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
SHARD_TOKENS = 4 * 1024 * 1024
BATCH_CHARS = 2_000_000  # characters per tokenizer call (the fast tokenizer batches across its threads)


def token_cache_dir(override: str | os.PathLike | None = None) -> Path:
    from sparse_models.paths import cache_dir

    return Path(override).expanduser() if override else cache_dir("tokens")


PROBE_TEXT = "Podkit probe:  Hello, WORLD!\n\tIt's 1,234.5 -- naïve café, 東京, 🙂 </s><|endoftext|>  end"
# Texts whose ids show what a normalizer, a pre-tokenizer or the added tokens do, whatever their serialisation:
# leading / repeated spaces, line ends, digits, code, compatibility and decomposed characters, scripts, emoji,
# special-token strings.
PROBE_TEXTS = (
    PROBE_TEXT,
    " leading space", "  two leading spaces", "trailing space ", "\n\nnewlines\r\nand CRLF\r\n", "a\u3000b\u00a0c",
    "Hello world hello World HELLO WORLD", "digits 0 12 345 6789 12345678 3.14159 1e-9 2026-12-02",
    "def f(x):\n    return x ** 2  # comment\n\tif x != 0: pass\n", "https://example.com/a?b=c&d=e#f user@example.com",
    "\ufb01ne \u00bd \u216b \u2460 \u212b \u00c5 A\u030a \u00e9 e\u0301 \u00df \u0130 \u1e9e",
    "Ünïcödé façade — “quotes” ‘single’ … ¿qué? ¡sí!", "中文 日本語 한국어 العربية עברית русский ελληνικά हिन्दी",
    "emoji 🙂👍🏽 👨‍👩‍👧 zero\u200bwidth", "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<s></s><unk><pad>[CLS][SEP]",
    "a" * 40,
)
IDENTITY_VERSION = 2


def _merges(tokenizer) -> list[list[str]] | None:
    """A BPE backend's merges as ``[left, right]`` pairs in rank order (``tokenizer.json`` writes them as
    ``"left right"`` strings or as pairs, by the version of ``tokenizers``), None without a BPE backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    merges = json.loads(backend.to_str()).get("model", {}).get("merges")
    if merges is None:
        return None
    return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]


_IDENTITIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> (key, identity, legacy hash)


def _cached(tokenizer, which: int, compute):
    """``compute()``, remembered per tokenizer object while its length, EOS and probe encoding stay the same
    (the identity reads the whole vocabulary and merges: ~1 s for SmolLM2, asked for once per source)."""
    key = (len(tokenizer), tokenizer.eos_token_id, tuple(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]))
    try:
        entry = _IDENTITIES.get(tokenizer)
        if entry is None or entry[0] != key:
            entry = _IDENTITIES[tokenizer] = [key, None, None]
    except TypeError:  # not hashable or not weakly referenceable: computed every time
        return compute()
    if entry[which] is None:
        entry[which] = compute()
    return entry[which]


def tokenizer_identity(tokenizer) -> dict:
    """What decides a tokenizer's ids, hashed (plus readable fields): the vocabulary (token -> id), the added
    tokens (content -> id), the BPE merges in order, the ids of ``PROBE_TEXTS`` (what the normalizer,
    pre-tokenizer and added-token matching do) and the EOS id (the shards' document separator). Not the
    serialised definition, which transformers versions write differently for the same tokenizer (key order,
    ``"a b"`` or ``["a", "b"]`` merges, an empty normalizer written or left out, BPE flags that a byte-level
    vocabulary never exercises, the decoder): shards must travel between them (module docstring)."""
    return dict(_cached(tokenizer, 1, lambda: _identity(tokenizer)))


def _identity(tokenizer) -> dict:
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    decisive = {"version": IDENTITY_VERSION, "vocab": sorted(tokenizer.get_vocab().items()),
                "added": sorted(tokenizer.get_added_vocab().items()), "merges": _merges(tokenizer),
                "probe": [encode(text) for text in PROBE_TEXTS], "eos": tokenizer.eos_token_id}
    digest = hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()
    return {"class": type(tokenizer).__name__, "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "identity_version": IDENTITY_VERSION, "hash": digest}


def legacy_tokenizer_hash(tokenizer) -> str:
    """The hash of the first identity (podkit before ``IDENTITY_VERSION`` 2): vocabulary, one probe, EOS,
    added tokens. Folders written under it are still read (:func:`find_shards`)."""
    return _cached(tokenizer, 2, lambda: _legacy_hash(tokenizer))


def _legacy_hash(tokenizer) -> str:
    definition = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()),
                             "probe": tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]})
    special = json.dumps({"eos": tokenizer.eos_token_id, "added": sorted(tokenizer.get_added_vocab().items())})
    return hashlib.sha256((definition + special).encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class ShardedTokens:
    """Read access to one built shard folder: ``total_tokens``, ``read(start, length)``.

    Memory maps are opened on first read and dropped when pickled (DataLoader workers reopen them),
    so a dataset holding this object never copies the shards."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.manifest = json.loads((self.folder / "manifest.json").read_text())
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shard_sizes = [s["tokens"] for s in self.manifest["shards"]]
        self.offsets = np.cumsum([0] + self.shard_sizes)
        self.total_tokens = int(self.offsets[-1])
        self._maps: list[np.memmap] | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"] = None
        return state

    @property
    def source(self) -> str:
        return self.manifest["source"]["name"]

    def _shards(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [np.memmap(self.folder / s["file"], dtype=self.dtype, mode="r", shape=(s["tokens"],))
                          for s in self.manifest["shards"]]
        return self._maps

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream as int64 (may span shards)."""
        if start < 0 or start + length > self.total_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.total_tokens}) of {self.folder}")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        maps = self._shards()
        while done < length:
            local = start + done - int(self.offsets[shard])
            take = min(length - done, self.shard_sizes[shard] - local)
            out[done:done + take] = maps[shard][local:local + take]
            done += take
            shard += 1
        return out

    def doc_starts(self) -> np.ndarray:
        return np.load(self.folder / "doc_starts.npy")


def shard_folder(source: str, tokenizer_hash: str, *, cache: Path, config: str | None = None,
                 split: str = "train") -> Path:
    from train.corpus.documents import source_slug

    return cache / tokenizer_hash[:16] / source_slug(source, config=config, split=split)


def find_shards(source: str, tokenizer, *, cache: str | os.PathLike | None = None, config: str | None = None,
                split: str = "train", text_field: str = "text", identity: dict | None = None,
                fingerprint: str | None | bool = False) -> tuple[Path | None, str]:
    """``(folder, "")`` when ``source`` has usable shards for ``tokenizer`` under the token cache (its own
    identity's folder, else a folder written under the legacy hash), else ``(None, why)``. Reads only."""
    from train.corpus.documents import source_fingerprint

    identity = identity or tokenizer_identity(tokenizer)
    cache = token_cache_dir(cache)
    if fingerprint is False:
        fingerprint = source_fingerprint(source, config=config, split=split, text_field=text_field)
    folder = shard_folder(source, identity["hash"], cache=cache, config=config, split=split)
    problem = _stale(folder, identity["hash"], fingerprint)
    if problem is None:
        return folder, ""
    legacy = legacy_tokenizer_hash(tokenizer)
    old = shard_folder(source, legacy, cache=cache, config=config, split=split)
    if _stale(old, legacy, fingerprint) is None:
        return old, ""
    return None, problem


def hash_folders(cache: Path) -> dict[str, dict]:
    """The tokenizer-hash folders of a token cache: name -> {"sources": count, "tokenizer": one manifest's
    tokenizer fields (or {})}."""
    found: dict[str, dict] = {}
    if not cache.is_dir():
        return found
    for folder in sorted(p for p in cache.iterdir() if p.is_dir()):
        manifests = sorted(folder.glob("*/manifest.json"))
        if not manifests:
            continue
        try:
            tokenizer = json.loads(manifests[0].read_text()).get("tokenizer", {})
        except (OSError, json.JSONDecodeError):
            tokenizer = {}
        found[folder.name] = {"sources": len(manifests), "tokenizer": tokenizer}
    return found


def cache_label(override: str | os.PathLike | None = None) -> str:
    """How the user named the token cache, for messages: ``PODKIT_TOKEN_CACHE=...`` or ``token cache ...``."""
    if override is None and os.environ.get("PODKIT_TOKEN_CACHE"):
        return f"PODKIT_TOKEN_CACHE={os.environ['PODKIT_TOKEN_CACHE']}"
    return f"token cache {token_cache_dir(override)}"


def hash_folder_problem(cache: Path, label: str) -> str | None:
    """A message when ``cache`` is one tokenizer-hash folder (``DIR/<hash>``) instead of the cache (``DIR``):
    it holds source folders with manifests itself."""
    if not cache.is_dir():
        return None
    held = sorted(p.parent.name for p in cache.glob("*/manifest.json"))
    if not held:
        return None
    return (f"{label} is a tokenizer-hash folder (it holds the shard folders {', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''} itself); set it to its parent {cache.parent}")


def ensure_shards(source: str, tokenizer, *, cache: str | os.PathLike | None = None, config: str | None = None,
                  split: str = "train", text_field: str = "text", shard_tokens: int = SHARD_TOKENS,
                  log=print) -> ShardedTokens:
    """The shards of ``source`` for ``tokenizer``: reused when the manifest matches, else (re)built."""
    from train.corpus.documents import PREFIX, filtered_by_heldout, heldout_sources, iter_documents, source_fingerprint

    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id: the token stream needs a document separator")
    identity = tokenizer_identity(tokenizer)
    label = cache_label(cache)
    cache = token_cache_dir(cache)
    folder = shard_folder(source, identity["hash"], cache=cache, config=config, split=split)
    fingerprint = source_fingerprint(source, config=config, split=split, text_field=text_field)
    with _locked(folder.with_name(folder.name + ".lock")):
        found, problem = find_shards(source, tokenizer, cache=cache, config=config, split=split, identity=identity,
                                     fingerprint=fingerprint)
        if found is not None:
            if found != folder:
                log(f"[corpus] {source}: reading {found} (written under the legacy hash of this tokenizer)")
            return ShardedTokens(found)
        deep = hash_folder_problem(cache, label)
        if deep is not None:
            raise ValueError(deep)
        heldout = None
        if filtered_by_heldout(source):
            heldout = heldout_hashes(tokenizer, heldout_sources(source[len(PREFIX):]), cache=cache, log=log)
        log(f"[corpus] tokenising {source} into {folder} ({problem})")
        documents = iter_documents(source, config=config, split=split, text_field=text_field)
        # a source fetched by this very build has a fingerprint only afterwards: record that one
        _build(folder, documents, tokenizer, identity, {"name": source, "config": config, "split": split,
                                                        "text_field": text_field, "fingerprint": fingerprint},
               shard_tokens=shard_tokens, heldout=heldout,
               fingerprint_after=lambda: source_fingerprint(source, config=config, split=split, text_field=text_field))
    return ShardedTokens(folder)


def heldout_hashes(tokenizer, sources: tuple[str, ...], *, cache=None, log=print) -> np.ndarray:
    """Sorted unique FILTER_N-gram hashes of the token streams of the held-out ``sources``."""
    from train.corpus.overlap import FILTER_N, ngram_hashes

    streams = [ensure_shards(name, tokenizer, cache=cache, log=log) for name in sources]
    return np.unique(np.concatenate([ngram_hashes(s.read(0, s.total_tokens), FILTER_N) for s in streams]))


def _stale(folder: Path, tokenizer_hash: str, fingerprint: str | None) -> str | None:
    """Why ``folder`` cannot be reused (None: it can)."""
    path = folder / "manifest.json"
    if not path.is_file():
        return "no shards yet"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        return f"unreadable manifest: {error}"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"format {manifest.get('format_version')} != {FORMAT_VERSION}"
    if manifest["tokenizer"]["hash"] != tokenizer_hash:
        return "tokenizer changed"
    if fingerprint is not None and manifest["source"]["fingerprint"] != fingerprint:
        return "source changed"
    missing = [s["file"] for s in manifest["shards"] if not (folder / s["file"]).is_file()
               or (folder / s["file"]).stat().st_size != s["tokens"] * np.dtype(manifest["dtype"]).itemsize]
    return f"missing or truncated shards {missing[:3]}" if missing else None


def _batches(documents: Iterable[str]) -> Iterable[list[str]]:
    batch, size = [], 0
    for text in documents:
        if not text:
            continue
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _build(folder: Path, documents: Iterable[str], tokenizer, identity: dict, source: dict, *,
           shard_tokens: int, heldout: np.ndarray | None = None, fingerprint_after=None) -> None:
    from tqdm.auto import tqdm

    from train.corpus.overlap import FILTER_N, drop_shared_spans

    dtype = token_dtype(identity["vocab_size"])
    eos = identity["eos_token_id"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        buffer = np.empty(shard_tokens, dtype=dtype)
        fill, shards, doc_starts, total, removed = 0, [], [], 0, 0

        def flush(count: int) -> None:
            name = f"shard_{len(shards):05d}.bin"
            buffer[:count].tofile(tmp / name)
            shards.append({"file": name, "tokens": int(count)})

        progress = tqdm(desc=f"tokenise {source['name']}", unit="tok", unit_scale=True, mininterval=1.0)
        for batch in _batches(documents):
            encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
            segments = []
            for ids in encoded:
                ids = np.asarray(ids, dtype=dtype)
                if heldout is None:
                    segments.append(ids)
                    continue
                kept = drop_shared_spans(ids, heldout)  # held-out spans out; the cuts become document breaks
                removed += len(ids) - sum(len(k) for k in kept)
                segments.extend(kept)
            for ids in segments:
                doc_starts.append(total)
                ids = np.append(ids, np.asarray([eos], dtype=dtype))
                total += len(ids)
                progress.update(len(ids))
                while len(ids):
                    take = min(len(ids), shard_tokens - fill)
                    buffer[fill:fill + take] = ids[:take]
                    fill, ids = fill + take, ids[take:]
                    if fill == shard_tokens:
                        flush(fill)
                        fill = 0
        progress.close()
        if fill:
            flush(fill)
        if total == 0:
            raise ValueError(f"source {source['name']!r} holds no text: nothing to tokenise")
        np.save(tmp / "doc_starts.npy", np.asarray(doc_starts, dtype=np.int64))
        if source["fingerprint"] is None and fingerprint_after is not None:
            source = dict(source, fingerprint=fingerprint_after())
        manifest = {"format_version": FORMAT_VERSION, "tokenizer": identity, "source": source, "dtype": dtype.str,
                    "shard_tokens": shard_tokens, "total_tokens": total, "documents": len(doc_starts),
                    "separator": "eos after every document", "shards": shards,
                    "heldout_filter": None if heldout is None else {"n": FILTER_N, "removed_tokens": removed}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        old = folder.with_name(folder.name + f".old-{os.getpid()}")
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def pack_folder(shards: ShardedTokens, tokens: int, out_cache: Path) -> Path:
    """Copy the first ``tokens`` tokens of ``shards`` (all if fewer) into the same layout under
    ``out_cache`` (a token cache of its own): whole shards, the last one cut, listed in a manifest
    that also records the size of the folder it was cut from (``packed_from``)."""
    manifest = dict(shards.manifest)
    count = min(int(tokens), shards.total_tokens)
    target = out_cache / shards.folder.parent.name / shards.folder.name
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=_mkdir(target.parent)))
    keep, done = [], 0
    for shard in manifest["shards"]:
        if done >= count:
            break
        take = min(shard["tokens"], count - done)
        if take == shard["tokens"]:
            shutil.copyfile(shards.folder / shard["file"], tmp / shard["file"])
        else:
            shards.read(done, take).astype(shards.dtype).tofile(tmp / shard["file"])
        keep.append({"file": shard["file"], "tokens": int(take)})
        done += take
    starts = shards.doc_starts()
    np.save(tmp / "doc_starts.npy", starts[starts < count])
    manifest.update(shards=keep, total_tokens=count, documents=int((starts < count).sum()),
                    packed_from={"total_tokens": shards.total_tokens, "documents": shards.manifest["documents"]})
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
