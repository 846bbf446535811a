#!/usr/bin/env bash
# The peers' virtualenv for the RULER leaderboard (eval/peers_kvpress.py): NVIDIA kvpress, which pins
# transformers < 5.3, so it never shares podkit's environment (transformers >= 5.17).
# Usage:
#   scripts/peers_env.sh [VENV]                      online: CPU torch pinned in the same command (else pip
#                                                    resolves a multi-GB CUDA build), kvpress and its deps
#   scripts/peers_env.sh --download WHEELS           online: fill WHEELS with what a machine that already has
#                                                    torch (the GPU image) lacks, for an offline install there
#   scripts/peers_env.sh --offline WHEELS [VENV]     offline (the GPU): a venv over the system's torch
#                                                    (--system-site-packages) + the wheels in WHEELS
set -euo pipefail
cd "$(dirname "$0")/.."
KVPRESS="kvpress==0.5.5"
TRANSFORMERS="transformers==5.2.0"   # the newest release kvpress 0.5.5 admits (< 5.3)
PIP_FLAGS=(-q --disable-pip-version-check)
if [ "${1:-}" = "--download" ]; then
  WHEELS="${2:?usage: scripts/peers_env.sh --download WHEELS}"
  # What the GPU image (torch 2.11, transformers 5.17 and their deps) lacks for kvpress 0.5.5: kvpress,
  # the transformers it admits and the tokenizers that one admits, cachetools. kvpress also imports
  # datasets, fire and requests at package import, for two presses the leaderboard does not run (DuoAttention,
  # ExpectedAttentionStats); eval/peers_kvpress.py stands in for them where they are missing (pyarrow
  # alone would be 55 MB, over the device machine's 64 MiB carry).
  python3 -m pip download "${PIP_FLAGS[@]}" -d "$WHEELS" --no-deps "$KVPRESS" "$TRANSFORMERS" tokenizers==0.22.2 \
    cachetools==5.5.2 typer-slim shellingham
  du -sh "$WHEELS"
  exit 0
fi
if [ "${1:-}" = "--offline" ]; then
  WHEELS="${2:?usage: scripts/peers_env.sh --offline WHEELS [VENV]}"
  VENV="${3:-.venv-peers}"
  [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" --no-index --find-links "$WHEELS" --no-deps "$WHEELS"/*.whl
  "$VENV/bin/python" -c "import kvpress, transformers; print('kvpress', kvpress.__name__, 'transformers', transformers.__version__)"
  echo "$VENV"
  exit 0
fi
VENV="${1:-.venv-peers}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
STAMP="$VENV/.peers-installed"
if [ ! -f "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" torch==2.13.0 "$KVPRESS" "$TRANSFORMERS"
  touch "$STAMP"
fi
echo "$VENV"
