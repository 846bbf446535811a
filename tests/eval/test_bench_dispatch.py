"""``python -m eval.bench`` dispatches to the right module with the right arguments."""

import sys
import types

import pytest

from eval.bench import __main__ as bench


@pytest.fixture()
def fake_modules(monkeypatch):
    calls = []
    for command, name in bench.MODULES.items():
        module = types.ModuleType(name)
        module.main = lambda argv, command=command: calls.append((command, list(argv))) or 0
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_kernels_runs_decode_and_prefill(fake_modules, tmp_path):
    assert bench.main(["kernels", "--out-dir", str(tmp_path)]) == 0
    assert fake_modules == [("kernels-decode", ["--out", str(tmp_path / "kernels_decode.json")]),
                            ("kernels-prefill", ["--out", str(tmp_path / "kernels_prefill.json")])]


@pytest.mark.parametrize("command", ["train", "e2e", "kernels-decode"])
def test_pass_through(fake_modules, command):
    assert bench.main([command, "--x", "1"]) == 0
    assert fake_modules == [(command, ["--x", "1"])]


def test_unknown_command_prints_usage(capsys):
    assert bench.main(["nope"]) == 2
    assert "kernels" in capsys.readouterr().out


def test_missing_module_is_named(monkeypatch):
    monkeypatch.setitem(bench.MODULES, "e2e", "eval.bench.does_not_exist")
    with pytest.raises(SystemExit, match="does_not_exist does not exist"):
        bench.main(["e2e"])
