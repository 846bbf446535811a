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


def unexplained_local_imports(root: Path = REPO, package: str = "eval") -> list[str]:
    """``import`` / ``from ... import`` inside a function body of ``root/package`` without a comment containing
    "lazy" on its line(s) or the line above (issue 30: imports are hoisted to module level unless there is a reason,
    an optional or heavy dependency, said in that comment). A comment above a run of consecutive imports covers the
    run: ``# lazy: Triton kernel modules`` over three ``from kernels.triton_... import``."""
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()

        def says_lazy(node: ast.stmt) -> bool:
            return any("lazy" in line for line in lines[node.lineno - 1:node.end_lineno])

        def above_says_lazy(node: ast.stmt) -> bool:
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            return above.startswith("#") and "lazy" in above

        def visit(node: ast.AST, in_function: bool) -> None:
            inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for field in ("body", "orelse", "finalbody", "handlers"):
                statements = getattr(node, field, None)
                if not inside or not isinstance(statements, list):
                    continue
                run_explained = False  # the run of adjacent imports this one is in has a "lazy" comment above
                previous_import = None
                for statement in statements:
                    if isinstance(statement, (ast.Import, ast.ImportFrom)):
                        if previous_import is None or statement.lineno != previous_import.end_lineno + 1:
                            run_explained = above_says_lazy(statement)
                        if not (run_explained or says_lazy(statement) or above_says_lazy(statement)):
                            problems.append(f"{rel}:{statement.lineno}: {lines[statement.lineno - 1].strip()}")
                        previous_import = statement
                    else:
                        previous_import = None
            for child in ast.iter_child_nodes(node):
                visit(child, inside)

        visit(ast.parse("\n".join(lines)), False)
    return problems


def test_function_level_imports_say_why_they_are_lazy():
    problems = unexplained_local_imports()
    assert not problems, ("function-level imports with no '# lazy: <reason>' comment on the line or the line above; "
                          "hoist them to module level or say why not:\n" + "\n".join(problems))


def test_the_lazy_import_check_catches_an_unexplained_one(tmp_path):
    (tmp_path / "eval" / "sub").mkdir(parents=True)
    (tmp_path / "eval" / "sub" / "mod.py").write_text(
        "import json\n\n\n"
        "def plot():\n"
        "    import matplotlib  # lazy: matplotlib is optional (plots only)\n\n"
        "    # lazy: lm-eval is the optional eval extra\n"
        "    from lm_eval import utils\n"
        "    from lm_eval import api\n"
        "    x = 1\n"
        "    import copy\n"
        "    if x:\n"
        "        from eval.models import load_model\n"
        "    try:\n"
        "        pass\n"
        "    except ImportError:\n"
        "        import re\n"
        "    return json, matplotlib, utils, api, copy, load_model, re\n\n\n"
        "class A:\n"
        "    import os  # a class body is not a function\n\n"
        "    def m(self):\n"
        "        import re  # not why\n"
        "        f = lambda: __import__('os')\n"
        "        return f\n")
    assert unexplained_local_imports(tmp_path) == ["eval/sub/mod.py:11: import copy",
                                                   "eval/sub/mod.py:13: from eval.models import load_model",
                                                   "eval/sub/mod.py:17: import re",
                                                   "eval/sub/mod.py:25: import re  # not why"]


MAIN_LINES = 100


def long_mains(root: Path = REPO, package: str = "eval", limit: int = MAIN_LINES) -> list[str]:
    """Entry points of ``root/package`` longer than ``limit`` lines: a function named ``main`` / ``_main`` and a
    module's ``if __name__ == "__main__":`` block (ARCHITECTURE.md, "eval": argument parsing, each measurement and
    the report are named helpers)."""
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("main", "_main"):
                name = node.name
            elif (isinstance(node, ast.If) and node in tree.body and "__name__" in ast.unparse(node.test)
                  and "__main__" in ast.unparse(node.test)):
                name = "__main__ block"
            else:
                continue
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                problems.append(f"{rel}:{node.lineno}: {name} is {length} lines")
    return problems


def test_mains_stay_under_100_lines():
    problems = long_mains()
    assert not problems, f"entry points over {MAIN_LINES} lines; split them into named helpers:\n" + "\n".join(problems)


def test_the_main_length_check_catches_a_long_one(tmp_path):
    (tmp_path / "eval" / "bench").mkdir(parents=True)
    def body(lines: int) -> str:
        return "".join(f"    x{i} = {i}\n" for i in range(lines))

    (tmp_path / "eval" / "bench" / "long.py").write_text(f"def main():\n{body(100)}\n\ndef helper():\n{body(200)}")
    (tmp_path / "eval" / "short.py").write_text(f"def main():\n{body(99)}\n\nif __name__ == '__main__':\n{body(100)}")
    assert long_mains(tmp_path) == ["eval/bench/long.py:1: main is 101 lines",
                                    "eval/short.py:103: __main__ block is 101 lines"]


PRIVATE_KERNEL_PREFIXES = ("_", "triton_", "gluon_")  # the launchers and device code behind kernels' public ops


def private_kernel_imports(root: Path = REPO, package: str = "eval") -> list[str]:
    """Imports of a private kernel module (``kernels._*``, ``kernels.triton_*``, ``kernels.gluon_*``) outside
    ``eval/bench``: only the benchmarks time variants under test; the rest of eval calls the public ops."""
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[1:2] == ("bench",):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names] \
                    if node.module == "kernels" else [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "kernels" and len(parts) > 1 and parts[1].startswith(PRIVATE_KERNEL_PREFIXES):
                    problems.append(f"{rel.as_posix()}:{node.lineno}: {name}")
    return problems


def test_only_the_benchmarks_reach_private_kernel_modules():
    problems = private_kernel_imports()
    assert not problems, "private kernel modules imported outside eval/bench (use kernels' public ops):\n" + \
        "\n".join(problems)


def test_the_private_kernel_check_catches_one(tmp_path):
    for room in ("bench", "harness"):
        (tmp_path / "eval" / room).mkdir(parents=True)
        (tmp_path / "eval" / room / "mod.py").write_text(
            "import kernels\nfrom kernels.reference import decode_attention\nfrom kernels import _decode_topk\n"
            "def f():\n    from kernels.triton_quest_pages import quest_page_scores_triton\n")
    assert private_kernel_imports(tmp_path) == ["eval/harness/mod.py:3: kernels._decode_topk",
                                                "eval/harness/mod.py:5: kernels.triton_quest_pages"]
