"""eval's three rooms (ARCHITECTURE.md, "eval"): the product in eval/harness/, the one-off studies in eval/studies/,
the benchmarks in eval/bench/, and eval's shared modules (models, schemes, runner, tasks, data) beside them.

Imports go one way: a room imports the shared modules, studies and benchmarks may import the product, and nothing
imports a study or a benchmark from another room; the shared modules import no room. The old module names
(``python -m eval.fidelity``, ``import eval.fidelity``) stay as thin modules that are the moved module itself.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EVAL = REPO / "eval"
ROOMS = ("harness", "studies", "bench")
SHARED = ("models", "schemes", "runner", "tasks", "data")
MAY_IMPORT = {"harness": {"harness"}, "studies": {"harness", "studies"}, "bench": {"harness", "bench"}, None: set()}
MOVED = {"harness": ("lm_eval", "lm_eval_model", "quality", "fidelity", "leaderboard", "leaderboard_records",
                     "peers_kvpress", "plots", "calibrate", "chain"),
         "studies": ("needle_heads", "needle_token_sparse", "retrieval_units", "pod_gate_skip", "learning_curves")}
ENTRY_POINTS = ("lm_eval", "quality", "fidelity", "leaderboard", "peers_kvpress", "calibrate", "chain",
                "needle_heads", "needle_token_sparse", "retrieval_units", "pod_gate_skip", "learning_curves")


def _room(parts: tuple[str, ...]) -> str | None:
    """The room of ``eval.<parts>``: harness / studies / bench, or None for a shared module."""
    return parts[0] if parts and parts[0] in ROOMS else None


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "eval" and name.count(".") >= 1:
                yield node.lineno, tuple(name.split(".")[1:])


def test_rooms_import_one_way():
    old_names = {m for mods in MOVED.values() for m in mods}
    wrong = []
    for path in sorted(EVAL.rglob("*.py")):
        rel = path.relative_to(EVAL).with_suffix("").parts
        if len(rel) == 1 and rel[0] in old_names:
            continue  # an old name: the thin module that is its moved module
        here = _room(rel)
        for line, target in _imports(path):
            there = _room(target)
            if there is None:
                if target[0] in old_names:
                    wrong.append(f"{path.relative_to(REPO)}:{line}: imports the old name eval.{'.'.join(target)}")
                continue
            if there not in MAY_IMPORT[here]:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {here or 'shared'} imports eval.{'.'.join(target)}")
    assert not wrong, "\n".join(wrong)


def test_the_rooms_hold_what_the_architecture_says():
    for room, mods in MOVED.items():
        for mod in mods:
            assert (EVAL / room / f"{mod}.py").is_file(), (room, mod)
    for mod in SHARED:
        assert (EVAL / f"{mod}.py").is_file() or (EVAL / mod).is_dir(), mod
    assert not (EVAL / "results").exists(), "result records live in benchmarks/results/, outside the package"


@pytest.mark.parametrize("room,mod", [(room, mod) for room, mods in MOVED.items() for mod in mods])
def test_an_old_name_is_the_moved_module(room, mod):
    assert importlib.import_module(f"eval.{mod}") is importlib.import_module(f"eval.{room}.{mod}")


def test_the_old_commands_still_run():
    code = ("import runpy, sys\n"
            "for name in sys.argv[1:]:\n"
            "    sys.argv = [name, '--help']\n"
            "    try:\n"
            "        runpy.run_module('eval.' + name, run_name='__main__', alter_sys=True)\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), (name, e.code)\n"
            "    else:\n"
            "        raise AssertionError(name + ' --help did not exit')\n"
            "print('ok')\n")
    light = [m for m in ENTRY_POINTS if m not in ("lm_eval", "peers_kvpress")]  # lm-eval's / kvpress's own CLIs
    done = subprocess.run([sys.executable, "-c", code, *light], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
