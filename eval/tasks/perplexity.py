"""Long-text perplexity windows on a held-out public-domain book.

A window is ``length`` consecutive tokens of the book (the model's tokenizer). Windows do not overlap
and start after the first ``skip_fraction`` of the book (front matter, title pages), so a length's
windows are disjoint pieces of the same prose. The default book is
:data:`eval.data.texts.HELD_OUT_TEXT` (Emma), which POD training leaves out.
"""

from __future__ import annotations

from typing import Any

from eval.data.texts import HELD_OUT_TEXT, load_text
from eval.tasks.haystack import encode


def perplexity_windows(tokenizer: Any, length: int, num_windows: int, *, text: str | None = None,
                       skip_fraction: float = 0.05) -> list[list[int]]:
    """``num_windows`` non-overlapping windows of ``length`` token ids from the book ``text``."""

    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length={length!r} is invalid: expected an integer >= 2")
    if isinstance(num_windows, bool) or not isinstance(num_windows, int) or num_windows < 1:
        raise ValueError(f"num_windows={num_windows!r} is invalid: expected an integer >= 1")
    name = text or HELD_OUT_TEXT
    ids = encode(tokenizer, load_text(name))
    start = int(len(ids) * skip_fraction)
    available = (len(ids) - start) // length
    if available < num_windows:
        raise ValueError(f"num_windows={num_windows} at length={length} needs {num_windows * length} tokens after "
                         f"the skipped front matter, but text={name!r} has {len(ids) - start}")
    return [ids[start + i * length: start + (i + 1) * length] for i in range(num_windows)]
