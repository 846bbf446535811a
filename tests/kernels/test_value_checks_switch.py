"""kernels.value_checks_skipped: the benchmarks' PODKIT_SKIP_VALUE_CHECKS=1 lasts for their run only."""

import os

import pytest
import torch

from kernels import skipping_value_checks, value_checks_skipped
from kernels._value_checks import SKIP_VALUE_CHECKS_ENV, value_checks_enabled


@pytest.mark.parametrize("before", [None, "0", "1"])
@pytest.mark.parametrize("force", [False, True])
def test_the_switch_is_restored_even_after_an_error(monkeypatch, before, force):
    if before is None:
        monkeypatch.delenv(SKIP_VALUE_CHECKS_ENV, raising=False)
    else:
        monkeypatch.setenv(SKIP_VALUE_CHECKS_ENV, before)
    t = torch.zeros(1)
    with pytest.raises(RuntimeError, match="boom"), value_checks_skipped(force=force):
        # a caller's explicit "0" (time the checks too) is kept unless forced
        assert value_checks_enabled(t) is (before == "0" and not force)
        raise RuntimeError("boom")
    assert os.environ.get(SKIP_VALUE_CHECKS_ENV) == before


def test_the_decorator_scopes_a_main(monkeypatch):
    monkeypatch.delenv(SKIP_VALUE_CHECKS_ENV, raising=False)

    @skipping_value_checks
    def main(argv=None):
        return os.environ.get(SKIP_VALUE_CHECKS_ENV), value_checks_enabled(torch.zeros(1))

    assert main() == ("1", False)
    assert SKIP_VALUE_CHECKS_ENV not in os.environ and value_checks_enabled(torch.zeros(1))
