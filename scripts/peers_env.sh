#!/usr/bin/env bash
# The peers' virtualenv for the RULER leaderboard (eval/harness/peers_kvpress.py): NVIDIA kvpress, which pins
# transformers < 5.3, so it never shares podkit's environment (transformers >= 5.17).
# Usage:
#   scripts/peers_env.sh [VENV]                      online: CPU torch pinned in the same command (else pip
#                                                    resolves a multi-GB CUDA build), kvpress and its deps
#   scripts/peers_env.sh --download WHEELS           online: fill WHEELS with what a machine that already has
#                                                    torch (the GPU image) lacks, for an offline install there:
#                                                    wheels for CPython $PEERS_PYTHON_VERSION (default 3.12) on
#                                                    x86-64 Linux, whatever this machine runs
#   scripts/peers_env.sh --offline WHEELS [VENV]     offline (the GPU): a venv over the interpreter's own packages
#                                                    (its torch) + the wheels in WHEELS, which shadow them
# $PYTHON (default python3) is the interpreter the venv is made from. Where it is itself a virtualenv (the GPU
# image's python3 is /opt/torch/.venv/bin/python3), --system-site-packages alone would see the base
# interpreter's packages, not that venv's torch: its site-packages are added to the new venv with a .pth
# file, after the venv's own (so the carried transformers 5.2 shadows the image's 5.17). The install uses
# $PYTHON's pip with --target, so the venv needs no pip (nor ensurepip) of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
KVPRESS="kvpress==0.5.5"
TRANSFORMERS="transformers==5.2.0"   # the newest release kvpress 0.5.5 admits (< 5.3)
PIP_FLAGS=(-q --disable-pip-version-check)
if [ "${1:-}" = "--download" ]; then
  WHEELS="${2:?usage: scripts/peers_env.sh --download WHEELS}"
  # What the GPU image (torch 2.11, transformers 5.17 and their deps) lacks for kvpress 0.5.5: kvpress,
  # the transformers it admits and the tokenizers that one admits, cachetools. kvpress also imports
  # datasets, fire and requests at package import, for two presses the leaderboard does not run (DuoAttention,
  # ExpectedAttentionStats); eval/harness/peers_kvpress.py stands in for them where they are missing (pyarrow
  # alone would be 55 MB, over the device machine's 64 MiB carry). Binary wheels for the device's
  # interpreter (tokenizers is compiled), not this machine's.
  PLATFORMS=()
  for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do PLATFORMS+=(--platform "$p"); done
  "$PYTHON" -m pip download "${PIP_FLAGS[@]}" -d "$WHEELS" --no-deps --only-binary=:all: \
    --python-version "${PEERS_PYTHON_VERSION:-3.12}" --implementation cp "${PLATFORMS[@]}" \
    "$KVPRESS" "$TRANSFORMERS" tokenizers==0.22.2 cachetools==5.5.2 typer-slim==0.24.0 shellingham==1.5.4
  du -sh "$WHEELS"
  exit 0
fi
if [ "${1:-}" = "--offline" ]; then
  WHEELS="${2:?usage: scripts/peers_env.sh --offline WHEELS [VENV]}"
  VENV="${3:-.venv-peers}"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
  SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # the creating interpreter's own site-packages (a venv's: torch), after the venv's
  "$PYTHON" -c "import site, sys; sys.prefix != sys.base_prefix and print('\n'.join(site.getsitepackages()))" \
    > "$SITE/_peers_parent.pth"
  "$PYTHON" -m pip install "${PIP_FLAGS[@]}" --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    "$WHEELS"/*.whl
  # kvpress through eval.peers_kvpress's import (stand-ins for datasets / fire where the image lacks them)
  CHECK="${PEERS_CHECK:-from eval.peers_kvpress import import_kvpress; import torch, transformers; import_kvpress(); \
print('kvpress ok: transformers', transformers.__version__, 'torch', torch.__version__, transformers.__file__)}"
  "$VENV/bin/python" -c "$CHECK"
  echo "$VENV"
  exit 0
fi
VENV="${1:-.venv-peers}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
STAMP="$VENV/.peers-installed"
if [ ! -f "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" torch==2.13.0 "$KVPRESS" "$TRANSFORMERS"
  touch "$STAMP"
fi
echo "$VENV"
