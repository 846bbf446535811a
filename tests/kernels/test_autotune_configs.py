"""Autotune candidates (kernels/_prefill_common.py): one config under the interpreter, the extra sm_90 candidates
only on a Hopper-class GPU (and not with PODKIT_HOPPER_CONFIGS=0), the first one only with PODKIT_TRITON_AUTOTUNE=0."""

import pytest
import torch
import triton

from kernels import _prefill_common as common
from kernels._prefill_pod_bwd import dkdv_configs, dq_configs

GPU = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}), triton.Config({"BLOCK_M": 128, "BLOCK_N": 64})]
HOPPER = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_stages=4)]
INTERPRETER = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})


@pytest.fixture
def compiled_on(monkeypatch):
    """``compiled_on(major)``: pretend to compile for a CUDA device of that compute capability."""
    def pretend(major: int):
        monkeypatch.setattr(common, "interpreter_active", lambda: False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))
    return pretend


def test_interpreter_gets_its_one_config():
    if not common.interpreter_active():
        pytest.skip("runs under TRITON_INTERPRET=1 (CPU)")
    assert common.pick_configs(GPU, INTERPRETER, hopper_configs=HOPPER) == [INTERPRETER]
    for configs in (common.forward_tile_configs(), dkdv_configs(), dq_configs()):
        assert [(c.kwargs, c.num_stages) for c in configs] == [({"BLOCK_M": 16, "BLOCK_N": 16}, 1)]


@pytest.mark.parametrize("major, hopper_env, autotune_env, expected", [
    (9, None, None, GPU + HOPPER),
    (10, None, None, GPU + HOPPER),
    (8, None, None, GPU),
    (9, "0", None, GPU),
    (9, None, "0", GPU[:1]),
])
def test_hopper_candidates_only_on_sm90(compiled_on, monkeypatch, major, hopper_env, autotune_env, expected):
    compiled_on(major)
    for name, value in (("PODKIT_HOPPER_CONFIGS", hopper_env), ("PODKIT_TRITON_AUTOTUNE", autotune_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert common.pick_configs(GPU, INTERPRETER, hopper_configs=HOPPER) == expected


def test_shipped_hopper_candidates_are_new_and_wgmma_shaped(compiled_on, monkeypatch):
    monkeypatch.delenv("PODKIT_HOPPER_CONFIGS", raising=False)
    monkeypatch.delenv("PODKIT_TRITON_AUTOTUNE", raising=False)
    for make in (common.forward_tile_configs, dkdv_configs, dq_configs):
        compiled_on(8)
        base = [(tuple(c.kwargs.items()), c.num_warps, c.num_stages) for c in make()]
        compiled_on(9)
        extra = [(tuple(c.kwargs.items()), c.num_warps, c.num_stages) for c in make()][len(base):]
        assert extra and not set(extra) & set(base), make.__name__
        # a warpgroup is 4 warps; wgmma tiles have M >= 64 (the larger of the two tile sides here)
        assert all(w % 4 == 0 and max(dict(kw).values()) >= 64 for kw, w, _ in extra), extra
