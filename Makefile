# podkit developer targets. Every target sets up its own virtualenv (VENV, default .venv).
VENV ?= .venv
PY := $(VENV)/bin/python
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/.torch_extensions
export DS_ACCELERATOR ?= cpu
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test test-gpu test-gpu-parallel demo bench eval leaderboard peers lint clean

install:
	@scripts/setup_env.sh $(VENV) >/dev/null

# The CI test command (CPU: Triton kernels run under TRITON_INTERPRET=1, set by tests/conftest.py).
# Two pytest-xdist workers, one test file each at a time (module fixtures are built once): the suite is mostly
# single-threaded work (the interpreter, subprocess imports), so two workers use a 2-core CI machine's second core.
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# On a CUDA machine: the same kernel tests in bf16 plus the GPU-only tests.
test-gpu:
	python3 -m pytest -q -m gpu tests

# The same suite as concurrent pytest processes (about 210 s on 2 x H200; one GPU works too, the 2-GPU tests skip; logs in outputs/test_gpu).
test-gpu-parallel:
	scripts/test_gpu_parallel.sh python3

# The main job on the embedded default: POD adaptation of SmolLM2-135M on public-domain text (CPU).
demo: install
	$(PY) train/pod.py recipes/smollm2_135m.yaml

# Kernel benchmarks (meaningful on a GPU; see BENCHMARKS.md).
bench: install
	$(PY) -m eval.bench kernels

# Reduced fidelity sweep on the embedded default (minutes on CPU).
eval: install
	$(PY) -m eval.fidelity --reduced --out outputs/fidelity_reduced

# kvpress's environment for the leaderboard's peer rows (kvpress pins transformers < 5.3: never in $(VENV)).
PEERS_VENV ?= .venv-peers
peers:
	@scripts/peers_env.sh $(PEERS_VENV) >/dev/null

# RULER leaderboard smoke run on CPU (eval/harness/leaderboard.py; the full sweep is a GPU run, see BENCHMARKS.md).
leaderboard: install peers
	$(PY) -m eval.leaderboard --lengths 2048 --samples 1 --tasks niah_single_1 vt cwe qa_1 \
		--settings dense tidal@1/8 --max-new-tokens 24 --no-calibrate --out outputs/leaderboard_smoke \
		--peers --peers-venv $(PEERS_VENV) --peer-presses KVzip SnapKV --peer-ratios 0.875

lint: install
	$(VENV)/bin/ruff check kernels sparse_models train eval tests

clean:
	rm -rf outputs build *.egg-info .pytest_cache
