# podkit developer targets. Every target sets up its own virtualenv (VENV, default .venv).
VENV ?= .venv
PY := $(VENV)/bin/python
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/.torch_extensions
export DS_ACCELERATOR ?= cpu
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test test-gpu demo bench eval lint clean

install:
	@scripts/setup_env.sh $(VENV) >/dev/null

# The CI test command (CPU: Triton kernels run under TRITON_INTERPRET=1, set by tests/conftest.py).
test: install
	$(PY) -m pytest -q tests

# On a CUDA machine: the same kernel tests in bf16 plus the GPU-only tests.
test-gpu:
	python3 -m pytest -q -m gpu tests

# The main job on the embedded default: POD adaptation of SmolLM2-135M on public-domain text (CPU).
demo: install
	$(PY) train/pod.py recipes/smollm2_135m.yaml

# Kernel benchmarks (meaningful on a GPU; see BENCHMARKS.md).
bench: install
	$(PY) -m eval.bench kernels

# Reduced fidelity sweep on the embedded default (minutes on CPU).
eval: install
	$(PY) -m eval.fidelity --reduced --out outputs/fidelity_reduced

lint: install
	$(VENV)/bin/ruff check kernels sparse_models train eval tests

clean:
	rm -rf outputs build *.egg-info .pytest_cache
