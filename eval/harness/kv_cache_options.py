"""The KV cache options of the eval CLIs (``eval.leaderboard``, ``eval.quality``): ``--kv-cache-dtype`` and
``--kv-cache-recent-keys``, applied as load-time overrides of every row (kernels/fp8_kv.py: the layout, and
"Recent keys")."""

from __future__ import annotations

import argparse

from kernels.fp8_kv import KV_CACHE_DTYPES


def add_kv_cache_arguments(parser: argparse.ArgumentParser, rows: str = "every row's") -> None:
    parser.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                        help=f"{rows} KV cache dtype (default: the model's config; a separate --out per dtype)")
    parser.add_argument("--kv-cache-recent-keys", type=int, default=None, metavar="W",
                        help="with --kv-cache-dtype fp8_e4m3: the newest W positions' keys also kept in the model's "
                             "dtype and read from there (default: the model's config)")


def check_kv_cache_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One parser error, before any model loads, for a recent-key window that the cache cannot take."""
    recent = args.kv_cache_recent_keys
    if recent is None:
        return
    if recent < 0:
        parser.error(f"--kv-cache-recent-keys {recent} is invalid: expected an integer >= 0")
    if recent and args.kv_cache_dtype != "fp8_e4m3":
        parser.error(f"--kv-cache-recent-keys {recent} needs --kv-cache-dtype fp8_e4m3 (got "
                     f"{args.kv_cache_dtype or 'the model config'!s}): it keeps an FP8 cache's newest keys in the "
                     "model's dtype")


def cache_override(args: argparse.Namespace) -> dict[str, object]:
    """The given options as flat load-time overrides (none given: the checkpoint's own config decides)."""
    out: dict[str, object] = {}
    if args.kv_cache_dtype:
        out["kv_cache_dtype"] = args.kv_cache_dtype
    if args.kv_cache_recent_keys is not None:
        out["kv_cache_recent_keys"] = args.kv_cache_recent_keys
    return out
