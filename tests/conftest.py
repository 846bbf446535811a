"""Test-wide setup.

- Triton kernels run on CPU through the interpreter: TRITON_INTERPRET must be set before any
  ``@triton.jit`` decorator runs, i.e. before the kernel modules are imported. On a GPU they run
  compiled, with autotuning off (``PODKIT_TRITON_AUTOTUNE=0``).
- No hub, ever: tests build tiny models locally or use the embedded default.
- podkit's top-level package ``kernels`` shadows Hugging Face's optional ``kernels`` package, which
  transformers probes; a test below checks transformers still reports it unavailable.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # GPU tests check correctness, not speed: one launch config per kernel instead of autotuning 7-11
    # candidates per key (each a compile), which made `make test-gpu` exceed 10 minutes on an H200.
    # tests/kernels/test_autotune_configs.py covers the candidate lists; the benchmarks autotune.
    os.environ.setdefault("PODKIT_TRITON_AUTOTUNE", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _downloads_back_on():
    """A run given a token cache turns the corpus downloads off for its process (train.corpus.network); a test that
    ran one in-process must not leave them off for the next."""
    yield
    from train.corpus.network import forbid_downloads

    forbid_downloads(None)


@pytest.fixture(autouse=True)
def _value_checks_not_leaked(request):
    """A benchmark run in-process (eval.bench e2e --tiny, ...) sets PODKIT_SKIP_VALUE_CHECKS only for its run
    (kernels.value_checks_skipped); a test that leaves it changed would silently switch the kernels' value checks
    off for every later test, so the leak fails the test that caused it, and is undone."""
    from kernels._value_checks import SKIP_VALUE_CHECKS_ENV

    before = os.environ.get(SKIP_VALUE_CHECKS_ENV)
    yield
    after = os.environ.get(SKIP_VALUE_CHECKS_ENV)
    if after != before:
        if before is None:
            os.environ.pop(SKIP_VALUE_CHECKS_ENV, None)
        else:
            os.environ[SKIP_VALUE_CHECKS_ENV] = before
        pytest.fail(f"{request.node.nodeid} left {SKIP_VALUE_CHECKS_ENV}={after!r} (was {before!r}); "
                    "use kernels.value_checks_skipped or monkeypatch.setenv")
