"""Readers that turn files of an unpacked Debian / PyPI package into plain-text documents.

Each reader takes the unpacked package root and yields ``(doc_id, text)`` pairs in a stable order
(sorted paths), so a source's documents -- and therefore its held-out split and its token shards --
are the same on every machine. Formats:

* ``text_files``: plain text (optionally ``.gz``), one document per file;
* ``html_files``: HTML pages, one document per page, text only (stdlib ``html.parser``: the GPU image
  has no BeautifulSoup);
* ``dictd``: a dictd database (``.dict.dz`` is gzip-compatible dictzip), cut into documents of
  about ``DICT_DOC_CHARS`` characters at entry boundaries (a whole dictionary is one stream of
  entries, but one document of 40 MB would make a single-document held-out split impossible);
* ``sword_ztext``: a SWORD compressed Bible module (``ot/nt.bzs`` block index of ``<u32 offset,
  u32 size, u32 unpacked size>``, ``.bzz`` zlib blocks of OSIS XML), one document per block (a book).
"""

from __future__ import annotations

import gzip
import html
import re
import struct
import zlib
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

DICT_DOC_CHARS = 200_000
_BLOCK_TAGS = {"p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "pre", "blockquote",
               "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "title", "hr"}
_SKIP_TAGS = {"script", "style", "head", "nav", "noscript", "svg"}


def normalise(text: str) -> str:
    """Unix newlines, no BOM, no trailing spaces, at most one blank line in a row."""
    text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t\u00a0]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _read(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz" or path.name.endswith(".dz"):
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


def _files(root: Path, patterns: tuple[str, ...], exclude: tuple[str, ...] = ()) -> list[Path]:
    found = {p for pattern in patterns for p in root.glob(pattern) if p.is_file()}
    found = {p for p in found if not any(re.search(x, str(p.relative_to(root))) for x in exclude)}
    return sorted(found, key=lambda p: str(p.relative_to(root)))


def text_files(root: Path, patterns: tuple[str, ...], exclude: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    for path in _files(root, patterns, exclude):
        yield str(path.relative_to(root)), normalise(_read(path))


class _TextOfHtml(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP_TAGS:
            self.skip += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in _SKIP_TAGS:
            self.skip = max(0, self.skip - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_to_text(page: str) -> str:
    """Visible text of an HTML page: block elements become line breaks, runs of spaces collapse
    (``pre`` blocks lose their indentation; acceptable for language-model text)."""
    parser = _TextOfHtml()
    parser.feed(page)
    parser.close()
    lines = (re.sub(r"[ \t\u00a0]+", " ", line).strip() for line in "".join(parser.parts).split("\n"))
    return normalise("\n".join(lines))


def html_files(root: Path, patterns: tuple[str, ...], exclude: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    for path in _files(root, patterns, exclude):
        yield str(path.relative_to(root)), html_to_text(_read(path))


def dictd(root: Path, patterns: tuple[str, ...], exclude: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """Entries of a dictd ``.dict(.dz)`` body, grouped into ~DICT_DOC_CHARS documents. An entry starts
    at a line with no indentation (its headword); its definition lines are indented. Entries whose
    definition repeats an earlier one (WordNet lists a synset under each of its words) are kept once,
    and the ``00-database-*`` header entries are dropped."""
    for path in _files(root, patterns, exclude):
        text = normalise(_read(path))
        seen: set[int] = set()
        chunk: list[str] = []
        size = part = 0
        for entry in re.split(r"\n(?=\S)", text):
            entry = entry.strip("\n")
            head, _, body = entry.partition("\n")
            if not body.strip() or head.startswith(("00-database", "00database")):
                continue
            key = hash(body.strip())
            if key in seen:
                continue
            seen.add(key)
            chunk.append(entry)
            size += len(entry) + 1
            if size >= DICT_DOC_CHARS:
                yield f"{path.relative_to(root)}#{part:04d}", normalise("\n".join(chunk))
                chunk, size, part = [], 0, part + 1
        if chunk:
            yield f"{path.relative_to(root)}#{part:04d}", normalise("\n".join(chunk))


_OSIS_NOTE = re.compile(r"<note\b.*?</note>", re.DOTALL)
_OSIS_BREAK = re.compile(r"<(?:div|p|l|lg|title|chapter|lb)\b[^>]*>|</(?:title|p|l)>")
_TAG = re.compile(r"<[^>]+>")


def osis_to_text(block: str) -> str:
    """Plain text of an OSIS fragment: footnotes dropped, paragraphs / titles / chapters on new lines."""
    block = _OSIS_NOTE.sub("", block)
    block = _OSIS_BREAK.sub("\n", block)
    block = html.unescape(_TAG.sub("", block))
    lines = (re.sub(r"[ \t]+", " ", line).strip() for line in block.split("\n"))
    return normalise("\n".join(line for line in lines if line))


def sword_ztext(root: Path, patterns: tuple[str, ...], exclude: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    for index_path in _files(root, patterns, exclude):  # patterns match the .bzs block indexes
        blocks = index_path.read_bytes()
        data = index_path.with_suffix(".bzz").read_bytes()
        for number in range(len(blocks) // 12):
            offset, size, unpacked = struct.unpack_from("<III", blocks, number * 12)
            if size == 0:
                continue
            raw = zlib.decompress(data[offset:offset + size])
            if len(raw) != unpacked:
                raise ValueError(f"{index_path} block {number}: inflated to {len(raw)} bytes, index says {unpacked}")
            text = osis_to_text(raw.decode("utf-8", errors="replace"))
            if len(text) > 200:  # skip importer milestones and empty blocks
                yield f"{index_path.relative_to(root)}#{number:04d}", text


READERS = {"text_files": text_files, "html_files": html_files, "dictd": dictd, "sword_ztext": sword_ztext}
