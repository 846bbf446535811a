"""Helpers shared by the kernel tests: NaN-poisoned launcher buffers and measured tolerances."""

import functools
import zlib

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every float buffer a launcher allocates starts as NaN, so unwritten elements show up."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)


def case_seed(*parts) -> int:
    """A seed for one parametrised case that is the same in every process (``hash`` of a str is salted per
    process by PYTHONHASHSEED, so a failing draw would not reproduce)."""
    return zlib.crc32(repr(parts).encode())


def _assert_error_within(name, got, same_dtype_ref, exact, factor=4.0, floor=1e-6):
    """The kernel's error against an exact (fp64) answer stays within `factor` times the error of
    the same-dtype PyTorch reference, plus an absolute `floor` for answers the reference gets exact."""
    got_err = (got.double() - exact).abs().max().item()
    ref_err = (same_dtype_ref.double() - exact).abs().max().item()
    assert got_err <= factor * ref_err + floor, f"{name}: kernel error {got_err:.3e} vs reference error {ref_err:.3e}"


def error_check(floor=1e-6, factor=4.0):
    """An `assert_error_within(name, got, same_dtype_ref, exact)` with this file's floor and factor."""
    return functools.partial(_assert_error_within, factor=factor, floor=floor)
