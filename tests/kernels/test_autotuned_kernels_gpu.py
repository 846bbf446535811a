"""The GPU tests run with one launch config per kernel (tests/conftest.py sets PODKIT_TRITON_AUTOTUNE=0 to keep
compile time down). Users and the benchmarks autotune over every candidate, sm_90 ones included
(kernels/_prefill_common.py), so the prefill kernels' bf16 GPU checks run once more here, autotuned, in a fresh
process (the candidate lists are fixed when the kernel modules are imported)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

AUTOTUNED_CHECKS = [
    "tests/kernels/test_prefill_attention.py::test_bf16_gpu[4]",
    "tests/kernels/test_prefill_attention.py::test_bf16_gradients_gpu[4]",
    "tests/kernels/test_pod_prefill_attention.py::test_bf16_gpu[4]",
    "tests/kernels/test_sparse_prefill_attention.py::test_bf16_gpu[4]",
]


@pytest.mark.gpu
def test_prefill_kernels_are_correct_with_every_autotune_candidate_enabled():
    env = dict(os.environ, PODKIT_TRITON_AUTOTUNE="1", PODKIT_POD_HOPPER_CONFIGS="1")  # the opt-in POD ones too
    env.pop("PODKIT_HOPPER_CONFIGS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AUTOTUNED_CHECKS],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"{len(AUTOTUNED_CHECKS)} passed" in done.stdout, done.stdout[-2000:]
