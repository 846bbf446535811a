"""One way to read the documents of any data source, and a fingerprint of what would be read.

Source strings (``data.train`` entries, ``data.eval``, ``python -m train.corpus`` arguments):

* ``podkit:austen`` -- the five Austen novels trained on (*Emma* is held out); ``podkit:<book>`` -- one
  book of ``train.corpus.texts`` (``emma``, ``moby_dick``, ``jargon``, ...);
* ``podkit:<corpus source>`` -- the training split of a ``train.corpus.registry`` source
  (``podkit:gcide``, ``podkit:shakespeare``, ...), without any line of its family's held-out
  documents, *Emma* or the out-of-domain books (:func:`heldout_lines`), and (in its token shards) without any
  span it shares with them (``train.corpus.shards``);
* ``podkit:recall`` -- synthetic recall documents (facts in real prose, then a quiz on them) built from
  the training splits of the prose sources (``train.corpus.recall``); ``podkit:recall-long`` -- the same with
  one ~3.5K-6.5K-token episode per document, each starting a training row (8K contexts);
* ``podkit:heldout/<corpus source>`` -- that source's held-out documents (``podkit:heldout/austen``
  is *Emma*);
* ``podkit:heldout-indomain`` -- *Emma* and every corpus source's held-out documents, cut into
  ``PIECE_CHARS`` pieces taken round-robin over the sources, so that the first windows of
  perplexity already cover every source;
* ``podkit:heldout-ood`` -- the out-of-domain books (``registry.OOD_BOOKS``: *Moby Dick*, the Jargon
  File), never part of any podkit training source, pieces round-robin likewise;
* a local file or folder (``.txt``: one document per file; ``.jsonl`` / ``.json`` / ``.parquet``:
  ``text_field``) -- e.g. text sampled from a teacher model -- or a Hub dataset name, read through
  ``load_text_dataset``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from train.corpus import registry

PREFIX = "podkit:"
HELDOUT_PREFIX = "heldout/"
HELDOUT_SETS = ("heldout-indomain", "heldout-ood")
RECALL = "recall"
RECALL_LONG = "recall-long"
RECALL_NAMES = (RECALL, RECALL_LONG)   # train.corpus.recall.SHAPES' keys (tests/train/test_recall.py)
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PIECE_CHARS = 32_000  # ~8K tokens: one piece fills an 8K-context window
AUSTEN_HELDOUT = "emma"
# 2: lines of a corpus source's training split that occur in held-out text are dropped; 3: and token spans
# shared with it (train.corpus.overlap.drop_shared_spans); 5: held-out text = the family's held-out documents
# (registry.family_of) + Emma + OOD books
SPLIT_VERSION = 5
_HELDOUT_LINES: dict[tuple, frozenset[str]] = {}


def book_names() -> tuple[str, ...]:
    from train.corpus.texts import TEXT_NAMES  # the embedded books (fetched from Debian by train.corpus.texts)

    return tuple(TEXT_NAMES)


def podkit_names() -> tuple[str, ...]:
    """Every name accepted after ``podkit:``."""
    return (("austen",) + RECALL_NAMES + book_names() + tuple(registry.SOURCES) + HELDOUT_SETS
            + tuple(HELDOUT_PREFIX + n for n in ("austen",) + tuple(registry.SOURCES)))


def _austen_training_books() -> list[str]:
    from train.corpus.texts import TEXT_SOURCES

    return [n for n in book_names() if TEXT_SOURCES[n].package == "r-cran-janeaustenr" and n != AUSTEN_HELDOUT]


def _book(name: str) -> str:
    from train.corpus.texts import load_text

    return load_text(name)


def _pieces(named_texts: list[tuple[str, list[str]]]) -> Iterator[str]:
    """Round-robin over sources of PIECE_CHARS pieces (cut at a line break where possible)."""
    queues = []
    for _, texts in named_texts:
        pieces = []
        for text in texts:
            start = 0
            while start < len(text):
                end = min(len(text), start + PIECE_CHARS)
                cut = text.rfind("\n", start + PIECE_CHARS // 2, end) if end < len(text) else -1
                end = cut + 1 if cut > 0 else end
                pieces.append(text[start:end])
                start = end
        queues.append(pieces)
    for index in range(max((len(q) for q in queues), default=0)):
        for queue in queues:
            if index < len(queue):
                yield queue[index]


def heldout_lines(name: str) -> frozenset[str]:
    """Every non-blank line (stripped) of the held-out text that corpus source ``name`` must not train on:
    the held-out documents of its family (``registry.family_of``: itself, or e.g. every Python
    documentation source), *Emma* and the out-of-domain books. Documentation repeats boilerplate
    across pages (rustdoc's trait-impl lists, Haddock instance tables, page footers), so a document-level
    split alone leaves held-out lines in training pages: ``check-overlap`` found 1.5M shared 32-token
    windows between rust-std-docs' training split and the held-out set before this filter. Other sources'
    held-out documents are not read, so that building one source never fetches all of them (measured:
    cross-family overlap is 0; inside a family, pandas-docs shared 83 windows with statsmodels' held-out
    pages and rust-std-docs 25 with the Rust books' before families were filtered together)."""
    from train.corpus.texts import cache_dir

    family = registry.family_of(name)
    key = (str(cache_dir()), tuple(registry.SOURCES[n].fingerprint() for n in family), registry.OOD_BOOKS)
    if key not in _HELDOUT_LINES:
        texts = [_book(AUSTEN_HELDOUT)] + [_book(b) for b in registry.OOD_BOOKS]
        texts += [text for member in family for _, text in registry.split_documents(member, "heldout")]
        _HELDOUT_LINES[key] = frozenset(line.strip() for text in texts for line in text.split("\n") if line.strip())
    return _HELDOUT_LINES[key]


def heldout_sources(name: str) -> tuple[str, ...]:
    """The held-out sources whose token spans corpus source ``name``'s training shards drop."""
    family = tuple(f"{PREFIX}{HELDOUT_PREFIX}{member}" for member in registry.family_of(name))
    return family + (f"{PREFIX}{HELDOUT_PREFIX}austen", f"{PREFIX}heldout-ood")


def without_lines(text: str, blocked: frozenset[str]) -> str:
    """``text`` without its non-blank lines that are in ``blocked`` (blank lines kept: paragraphs stay)."""
    return "\n".join(line for line in text.split("\n") if not line.strip() or line.strip() not in blocked)


def filtered_by_heldout(source: str) -> bool:
    """Whether ``source`` is a corpus source's training split, whose shards drop held-out token spans."""
    return source.startswith(PREFIX) and source[len(PREFIX):] in registry.SOURCES


def row_aligned(source: str) -> bool:
    """Whether ``source``'s documents each start a training row (``train.corpus.mixture.MixedRows``) instead of
    being cut at every ``context_length`` tokens of its stream: podkit:recall-long, whose episodes must stay whole."""
    from train.corpus.recall import SHAPES

    name = source[len(PREFIX):] if source.startswith(PREFIX) else None
    return name in SHAPES and SHAPES[name].row_aligned


def podkit_documents(name: str) -> Iterator[str]:
    """Texts of ``podkit:<name>`` (see the module docstring)."""
    if name == "austen":
        yield from (_book(n) for n in _austen_training_books())
    elif name in registry.SOURCES:
        blocked = heldout_lines(name)
        for _, text in registry.split_documents(name, "train"):
            text = without_lines(text, blocked)
            if text.strip():
                yield text
    elif name in RECALL_NAMES:
        from train.corpus.recall import PROSE_SOURCES, SHAPES, recall_documents

        yield from recall_documents({source: podkit_documents(source) for source in PROSE_SOURCES},
                                    shape=SHAPES[name])
    elif name == "heldout/austen":
        yield _book(AUSTEN_HELDOUT)
    elif name.startswith(HELDOUT_PREFIX) and name[len(HELDOUT_PREFIX):] in registry.SOURCES:
        yield from (text for _, text in registry.split_documents(name[len(HELDOUT_PREFIX):], "heldout"))
    elif name == "heldout-indomain":
        groups = [("austen", [_book(AUSTEN_HELDOUT)])]
        groups += [(s, [t for _, t in registry.split_documents(s, "heldout")]) for s in registry.SOURCES]
        yield from _pieces(groups)
    elif name == "heldout-ood":
        yield from _pieces([(b, [_book(b)]) for b in registry.OOD_BOOKS])
    elif name in book_names():
        yield _book(name)
    else:
        raise ValueError(f"source=podkit:{name!r} is not an embedded corpus: expected podkit:<one of "
                         f"{', '.join(podkit_names())}>")


def iter_documents(source: str, *, config: str | None = None, split: str = "train",
                   text_field: str = "text") -> Iterator[str]:
    """The documents of any source string, as texts, in a fixed order."""
    if source.startswith(PREFIX):
        yield from podkit_documents(source[len(PREFIX):])
        return
    dataset = load_text_dataset(source, config=config, split=split, text_field=text_field)
    for start in range(0, len(dataset), 1000):
        yield from dataset[start:start + 1000]["text"]


def load_text_dataset(source: str, *, config: str | None = None, split: str = "train", text_field: str = "text"):
    """A ``datasets.Dataset`` with one column ``text`` (one row per document)."""
    import datasets

    from train.inputs import looks_like_local_path, resolve_input_path

    if source.startswith(PREFIX):
        return datasets.Dataset.from_dict({"text": list(podkit_documents(source[len(PREFIX):]))})
    if looks_like_local_path(source):
        path = resolve_input_path(source)
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS) if path.is_dir() else [path]
        suffixes = {p.suffix for p in files}
        if not files or len(suffixes) != 1 or next(iter(suffixes)) not in LOCAL_BUILDERS:
            raise ValueError(f"source={source!r}: expected one .txt/.jsonl/.json/.parquet file or a folder of one "
                             f"of those kinds, found {sorted(suffixes) or 'no data files'}")
        builder = LOCAL_BUILDERS[next(iter(suffixes))]
        kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
        dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)
    else:
        dataset = datasets.load_dataset(source, config, split=split)
    if text_field not in dataset.column_names:
        raise ValueError(f"data.text_field={text_field!r} is not a column of {source!r}: columns are "
                         f"{', '.join(dataset.column_names)}")
    if text_field != "text":
        dataset = dataset.rename_column(text_field, "text")
    return dataset.select_columns(["text"])


def source_fingerprint(source: str, *, config: str | None = None, split: str = "train",
                       text_field: str = "text") -> str | None:
    """A short hash that changes when the source's documents would change; None when the source cannot
    be inspected here (a local path that is absent: a packed shard folder is then trusted as it is)."""
    if source.startswith(PREFIX):
        name = source[len(PREFIX):]
        if name.startswith(HELDOUT_PREFIX):
            parts = [name] + [_text_fingerprint(name[len(HELDOUT_PREFIX):])]
        elif name == "heldout-indomain":
            parts = [name, PIECE_CHARS, _text_fingerprint(AUSTEN_HELDOUT)] + [_text_fingerprint(s) for s in registry.SOURCES]
        elif name == "heldout-ood":
            parts = [name, PIECE_CHARS] + [_text_fingerprint(b) for b in registry.OOD_BOOKS]
        elif name == "austen":
            parts = [name] + [_text_fingerprint(b) for b in _austen_training_books()]
        elif name in RECALL_NAMES:  # built from the prose sources' training splits
            from dataclasses import astuple

            from train.corpus.recall import DOCUMENTS, PROSE_SOURCES, RECALL_VERSION, SHAPES

            # podkit:recall's parts are what they were before it had a shape: its packed shards stay valid
            shape = [] if name == RECALL else list(astuple(SHAPES[name]))
            parts = [name, RECALL_VERSION, DOCUMENTS] + shape + [source_fingerprint(PREFIX + s) for s in PROSE_SOURCES]
        elif name in registry.SOURCES:  # its training split is filtered by every held-out text
            parts = ["train", SPLIT_VERSION, _text_fingerprint(AUSTEN_HELDOUT)]
            parts += [_text_fingerprint(n) for n in registry.family_of(name)]
            parts += [_text_fingerprint(b) for b in registry.OOD_BOOKS]
        else:
            parts = ["train", _text_fingerprint(name)]
        if None in parts:
            return None  # some text is not on this machine: trust existing shards (a packed folder)
        spec = parts
    else:
        from train.inputs import looks_like_local_path, resolve_input_path

        if looks_like_local_path(source):
            path = resolve_input_path(source)
            if not path.exists():
                return None
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            spec = [[str(p.relative_to(path) if path.is_dir() else p.name), p.stat().st_size, p.stat().st_mtime_ns]
                    for p in files] + [text_field]
        else:
            spec = [source, config, split, text_field]
    return hashlib.sha256(json.dumps(spec, default=str).encode()).hexdigest()[:16]


def required_texts(source: str) -> list[tuple[str, str]] | None:
    """The texts building ``source``'s documents reads, as ``("corpus", registry name)`` / ``("book", text name)``
    (the same ones :func:`source_fingerprint` hashes); None for a source that is not ``podkit:`` (a local path or
    a Hub dataset)."""
    if not source.startswith(PREFIX):
        return None
    name = source[len(PREFIX):]

    def of(member: str) -> list[tuple[str, str]]:
        if member == "austen":
            return [("book", AUSTEN_HELDOUT)]
        return [("corpus", member)] if member in registry.SOURCES else [("book", member)]

    if name.startswith(HELDOUT_PREFIX):
        needed = of(name[len(HELDOUT_PREFIX):])
    elif name == "heldout-indomain":
        needed = of("austen") + [("corpus", s) for s in registry.SOURCES]
    elif name == "heldout-ood":
        needed = [("book", b) for b in registry.OOD_BOOKS]
    elif name == "austen":
        needed = [("book", b) for b in _austen_training_books()]
    elif name in RECALL_NAMES:
        from train.corpus.recall import PROSE_SOURCES

        needed = [text for s in PROSE_SOURCES for text in required_texts(PREFIX + s)]
    elif name in registry.SOURCES:
        needed = of("austen") + [("corpus", n) for n in registry.family_of(name)]
        needed += [("book", b) for b in registry.OOD_BOOKS]
    else:
        needed = of(name)
    return list(dict.fromkeys(needed))


def text_present(kind: str, name: str) -> bool:
    """Whether a text of :func:`required_texts` is on this machine (current reader), so reading it fetches nothing."""
    if kind == "corpus":
        return _text_fingerprint(name) not in (None, "stale")
    from train.corpus.texts import cache_dir

    return (cache_dir() / f"{name}.txt").is_file()


def _text_fingerprint(name: str) -> str | None:
    """Content hash of a registry source (its source.json) or an embedded book (its cached .txt);
    None when it has not been fetched on this machine."""
    if name == "austen":
        name = AUSTEN_HELDOUT
    if name in registry.SOURCES:
        meta = registry.source_folder(name) / "source.json"
        if not meta.is_file():
            return None
        info = json.loads(meta.read_text())
        if info.get("fingerprint") != registry.SOURCES[name].fingerprint():
            return "stale"  # fetched by an older reader: never matches, so shards are rebuilt
        return registry.SOURCES[name].fingerprint() + info["sha256"][:16]
    from train.corpus.texts import cache_dir

    path = cache_dir() / f"{name}.txt"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


def source_slug(source: str, *, config: str | None = None, split: str = "train") -> str:
    """A folder name for a source: readable prefix + hash of the exact string (and config/split)."""
    key = json.dumps([source, config, split] if (config or split != "train") else source)
    readable = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(source.rstrip("/")).name or source)
    readable = readable.replace("podkit-", "")[:40].strip("-.") or "source"
    return f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
