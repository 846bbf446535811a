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


@pytest.mark.parametrize("pod_env, hopper_env, expected_extra", [
    (None, None, False),   # default: the POD kernels autotune over the base candidates only
    ("1", None, True),     # opt-in
    ("1", "0", False),     # PODKIT_HOPPER_CONFIGS=0 turns every family's sm_90 candidates off
])
def test_pod_kernels_take_their_sm90_candidates_only_when_asked(compiled_on, monkeypatch, pod_env, hopper_env,
                                                                expected_extra):
    from kernels._prefill_pod_fwd import forward_configs as pod_forward_configs

    monkeypatch.delenv("PODKIT_TRITON_AUTOTUNE", raising=False)
    for name, value in ((common.POD_HOPPER_CONFIGS_ENV, pod_env), ("PODKIT_HOPPER_CONFIGS", hopper_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    compiled_on(9)
    base, hopper = common.forward_tile_candidates()
    assert len(pod_forward_configs()) == len(base) + (len(hopper) if expected_extra else 0)
    assert (len(dq_configs()) > 5) == expected_extra and (len(dkdv_configs()) > 7) == expected_extra
    # the dense / sparse forward kernels keep theirs by default
    assert len(common.forward_tile_configs()) == len(base) + (0 if hopper_env == "0" else len(hopper))


def test_shipped_hopper_candidates_are_new_and_wgmma_shaped(compiled_on, monkeypatch):
    monkeypatch.delenv("PODKIT_HOPPER_CONFIGS", raising=False)
    monkeypatch.delenv("PODKIT_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setenv(common.POD_HOPPER_CONFIGS_ENV, "1")
    for make in (common.forward_tile_configs, dkdv_configs, dq_configs):
        compiled_on(8)
        base = [(tuple(c.kwargs.items()), c.num_warps, c.num_stages) for c in make()]
        compiled_on(9)
        extra = [(tuple(c.kwargs.items()), c.num_warps, c.num_stages) for c in make()][len(base):]
        assert extra and not set(extra) & set(base), make.__name__
        # a warpgroup is 4 warps; wgmma tiles have M >= 64 (the larger of the two tile sides here)
        assert all(w % 4 == 0 and max(dict(kw).values()) >= 64 for kw, w, _ in extra), extra


@pytest.mark.parametrize("dtype, expected", [
    (torch.float32, GPU[:1]),       # exact IEEE dot: the first candidate only (compile time)
    (torch.bfloat16, GPU + HOPPER),
    (torch.float16, GPU + HOPPER),
])
def test_float32_inputs_compile_the_first_candidate_only(dtype, expected):
    named = {"LEN": 7, "IDX": torch.zeros(3, dtype=torch.int32), "Q": torch.zeros(2, 4, dtype=dtype),
             "K": torch.zeros(2, 4, dtype=torch.bfloat16)}
    assert common.float32_first_candidate(GPU + HOPPER, named) == expected


def test_float32_pruning_without_a_floating_tensor_keeps_every_candidate():
    assert common.float32_first_candidate(GPU, {"N": 4, "IDX": torch.zeros(2, dtype=torch.int64)}) == GPU


def test_every_autotuned_kernel_prunes_float32_inputs():
    """A new autotuned kernel without the pruning would compile every candidate's IEEE dot for a float32 model."""
    import importlib
    import pkgutil

    from triton.runtime.autotuner import Autotuner

    import kernels

    tuned = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        tuned.update({f"{info.name}.{name}": obj for name, obj in vars(module).items() if isinstance(obj, Autotuner)})
    assert len(tuned) >= 6, sorted(tuned)
    unpruned = sorted(name for name, obj in tuned.items() if obj.early_config_prune is not common.float32_first_candidate)
    assert not unpruned, f"autotuned kernels without prune_configs_by=FLOAT32_FIRST_CANDIDATE: {unpruned}"
