#!/usr/bin/env bash
# Run on a CPU dev machine with PyPI: gather what the GPU image lacks into the repository's ignored folders, for a
# device call to carry (`carry: [".whl", ".cache"]`) and scripts/device_setup.sh to install there.
#   .whl/   wheels for CPython 3.12 / manylinux x86_64: datasets + its pure-Python needs the image lacks, gguf,
#           pydantic (+ core) for DeepSpeed, hjson, and DeepSpeed's sdist (built there without build isolation)
#   .cache/podkit/texts   the public-domain texts the tests and recipes read (fetched here with apt-get download)
# Versions follow constraints-cpu.txt where it pins them. Usage: scripts/device_bundle.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
pin() { grep -i "^$1==" constraints-cpu.txt | head -1 || true; }
mkdir -p .whl
for folder in .whl .cache; do  # both must stay out of git (they travel only when carried)
  git check-ignore -q "$folder/x" || { echo "error: $folder is not ignored by git (add /$folder/ to .gitignore)" >&2; exit 2; }
done
wheel_args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
# pydantic-core's version must be the one the chosen pydantic requires: take both from this venv
pydantic=$("$PY" -c "import pydantic; print(pydantic.VERSION)")
pydantic_core=$("$PY" -c "import pydantic_core; print(pydantic_core.__version__)")
python3 -m pip download -q "${wheel_args[@]}" "$(pin datasets)" dill multiprocess "$(pin gguf)" hjson \
  "pydantic==$pydantic" "pydantic-core==$pydantic_core" annotated-types typing-inspection
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl "$(pin deepspeed)"
PODKIT_CACHE="$PWD/.cache/podkit" "$PY" - <<'PYEOF'
from train.corpus.texts import load_text
for name in ("northanger_abbey", "emma", "mansfield_park"):
    print(f"{name}: {len(load_text(name)):,} characters")
PYEOF
du -sh .whl .cache
