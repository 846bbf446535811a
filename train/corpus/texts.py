"""Public-domain long texts, fetched by name from Debian's archive and cached as UTF-8 files.

This module sits in ``train/corpus`` (the lowest layer that needs it) so that train's corpus and
eval's tasks both import it downward. podkit needs real long prose (perplexity at 2K-8K tokens, real-text passkey haystacks, POD training
data) on machines with no model hub and no dataset hub, but with access to Debian's package archive.
Three Debian packages carry public-domain books:

* ``r-cran-janeaustenr``: Jane Austen's six novels, in R's lazy-load format
  (``data/Rdata.rdx`` = gzip of an R-serialised index {name: (offset, length)}; ``data/Rdata.rdb`` =
  records of a 4-byte big-endian uncompressed length followed by a zlib stream of an R-serialised
  character vector, one line per element);
* ``r-cran-tokenizers``: *Moby Dick* (dataset ``mobydick``, one string, Project Gutenberg header and
  licence included: stripped here);
* ``jargon-text``: the Jargon File 4.4.7 as plain text.

``load_text(name)`` returns the text; the first call runs ``apt-get download`` (no install, no root
needed) and ``dpkg -x`` in a temporary folder, decodes every text of that package with PyPI ``rdata``
and writes them to the cache (``texts/`` under podkit's cache root ``$PODKIT_CACHE``, default
``~/.cache/podkit``; ``$PODKIT_TEXT_CACHE`` still overrides it, deprecated). Later calls, and
machines with no network that received a copy of the cache folder, only read files.

    >>> from train.corpus.texts import load_text, TEXT_NAMES
    >>> emma = load_text("emma")
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TextSource:
    """Where a text lives: the Debian package, and how to read it out of the unpacked tree."""

    package: str
    kind: str          # "rdata" (R lazy-load database) or "gzip_text"
    member: str        # rdata: lazy-load database path without extension; gzip_text: file path
    variable: str = "" # rdata: the R object's name


_AUSTEN_DB = "usr/lib/R/site-library/janeaustenr/data/Rdata"
TEXT_SOURCES: dict[str, TextSource] = {
    "emma": TextSource("r-cran-janeaustenr", "rdata", _AUSTEN_DB, "emma"),
    "mansfield_park": TextSource("r-cran-janeaustenr", "rdata", _AUSTEN_DB, "mansfieldpark"),
    "northanger_abbey": TextSource("r-cran-janeaustenr", "rdata", _AUSTEN_DB, "northangerabbey"),
    "persuasion": TextSource("r-cran-janeaustenr", "rdata", _AUSTEN_DB, "persuasion"),
    "pride_and_prejudice": TextSource("r-cran-janeaustenr", "rdata", _AUSTEN_DB, "prideprejudice"),
    "sense_and_sensibility": TextSource("r-cran-janeaustenr", "rdata", _AUSTEN_DB, "sensesensibility"),
    "moby_dick": TextSource("r-cran-tokenizers", "rdata", "usr/lib/R/site-library/tokenizers/data/Rdata", "mobydick"),
    "jargon": TextSource("jargon-text", "gzip_text", "usr/share/doc/jargon-text/jargon.txt.gz"),
}
TEXT_NAMES: tuple[str, ...] = tuple(TEXT_SOURCES)

# The book podkit's evaluations score perplexity on. POD training data should leave it out
# (train/ uses the other Austen novels), so that "held-out" means held out.
HELD_OUT_TEXT = "emma"


def cache_dir() -> Path:
    """The folder holding ``<name>.txt`` files: ``sparse_models.paths.cache_dir("texts")``
    (``$PODKIT_CACHE/texts``, or ``$PODKIT_TEXT_CACHE`` where that deprecated variable is set)."""
    from sparse_models.paths import cache_dir as podkit_cache_dir

    return podkit_cache_dir("texts")


def load_text(name: str) -> str:
    """The full text of the book ``name`` (one of ``TEXT_NAMES``), fetched and cached on first use."""
    if name not in TEXT_SOURCES:
        raise ValueError(f"name={name!r} is not a known text: expected one of {', '.join(TEXT_NAMES)}")
    path = cache_dir() / f"{name}.txt"
    if not path.exists():
        _fetch_package(TEXT_SOURCES[name].package)
    return path.read_text(encoding="utf-8")


def _fetch_package(package: str) -> None:
    """Download and unpack ``package``, then cache every text it carries."""
    from train.corpus.network import check_download

    books = ", ".join(name for name, source in TEXT_SOURCES.items() if source.package == package)
    check_download(f"apt-get download {package}", f"the text of {books}")
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"cannot fetch Debian package {package!r}: {tool!r} is not on PATH. Copy the text "
                               f"cache ({cache_dir()}) from a machine that has it, or point PODKIT_CACHE at a copy.")
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="podkit_texts_") as tmp:
        done = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
        debs = sorted(Path(tmp).glob(f"{package}_*.deb"))
        if done.returncode != 0 or not debs:
            raise RuntimeError(f"apt-get download {package} failed (rc={done.returncode}): {done.stderr.strip()[-500:]}"
                               " -- run `apt-get update` once if the package lists are empty")
        root = Path(tmp) / "root"
        subprocess.run(["dpkg", "-x", str(debs[0]), str(root)], check=True, capture_output=True)
        for name, source in TEXT_SOURCES.items():
            if source.package == package:
                _atomic_write(out / f"{name}.txt", _read_source(root, source))


def _read_source(root: Path, source: TextSource) -> str:
    if source.kind == "gzip_text":
        return _normalise(gzip.decompress((root / source.member).read_bytes()).decode("utf-8"))
    lines = read_r_lazyload(root / source.member, source.variable)
    text = _normalise("\n".join(lines))
    return strip_gutenberg_boilerplate(text)


def read_r_lazyload(database: Path, variable: str) -> list[str]:
    """The character vector ``variable`` stored in the R lazy-load database ``database``(.rdx/.rdb)."""
    import warnings

    import rdata  # PyPI rdata parses R's serialisation format (XDR)

    def parse(raw: bytes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rdata warns "Unknown file type: assumed RDS" for bare streams
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(gzip.decompress(database.with_suffix(".rdx").read_bytes()))
    variables = {str(k): v for k, v in index["variables"].items()}
    if variable not in variables:
        raise KeyError(f"variable={variable!r} is not in {database}: it holds {', '.join(sorted(variables))}")
    offset, length = (int(x) for x in variables[variable])
    with open(database.with_suffix(".rdb"), "rb") as handle:
        handle.seek(offset)
        record = handle.read(length)
    expected = int.from_bytes(record[:4], "big")
    raw = zlib.decompress(record[4:])
    if len(raw) != expected:
        raise ValueError(f"{database}.rdb record {variable!r}: inflated to {len(raw)} bytes, header says {expected}")
    return [str(line) for line in parse(raw)]


def _normalise(text: str) -> str:
    return text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")


_PG_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.MULTILINE)
_PG_END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg", re.MULTILINE)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Drop a Project Gutenberg header and licence footer if present (Moby Dick carries them)."""
    start = _PG_START.search(text)
    if start:
        text = text[start.end():]
    end = _PG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main() -> None:
    """``python -m train.corpus.texts [NAME ...]`` (or ``python -m eval.data.texts``): fetch (if needed) and print sizes."""
    import sys

    for name in sys.argv[1:] or TEXT_NAMES:
        text = load_text(name)
        print(f"{name:24s} {len(text):>9,d} chars  {cache_dir() / (name + '.txt')}")


if __name__ == "__main__":
    main()
