"""Layers import only downward: kernels -> sparse_models -> train -> eval, and modules form no circle.

An AST walk over every module of the four layers: an import of a higher layer (at module level or
inside a function, ``import x`` or ``from x import y``) fails, naming the file, the line and the
import. Relative imports stay inside their package, so they cannot climb. A second walk builds the
module import graph (function-level imports included; package ``__init__`` re-exports and
``if TYPE_CHECKING:`` imports left out) and fails on any circle, e.g. ``train.data`` <-> ``train.corpus.documents``;
a third walk counts the type-only imports too, so not even annotations form a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "sparse_models", "train", "eval")


def _imported_top_levels(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def upward_imports(root: Path = ROOT) -> list[str]:
    problems = []
    for rank, layer in enumerate(LAYERS):
        above = set(LAYERS[rank + 1:])
        for path in sorted((root / layer).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for line, module in _imported_top_levels(tree):
                if module.split(".")[0] in above:
                    problems.append(f"{path.relative_to(root)}:{line}: {layer} imports {module}")
    return problems


def _module_names(root: Path) -> dict[str, Path]:
    modules = {}
    for layer in LAYERS:
        for path in (root / layer).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _runtime_nodes(tree: ast.AST, type_only: bool = False):
    """Every node except the bodies of ``if TYPE_CHECKING:`` (type-only imports never run); ``type_only``: those
    too."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph(root: Path = ROOT, type_only: bool = False) -> dict[str, set[str]]:
    """module -> the modules of the four layers it imports (packages' ``__init__`` left out; ``type_only``: the
    ``if TYPE_CHECKING:`` imports counted too)."""
    modules = _module_names(root)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}

    def owner(dotted: str) -> str:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name in packages:
            continue
        package = name.rpartition(".")[0]
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8")), type_only):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:  # ``from pkg import module`` names a module, else an attribute
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else owner(base))
        graph[name] = {t for t in targets if t and t != name and t not in packages}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _layers(root: Path) -> None:
    for layer in LAYERS:
        (root / layer).mkdir()


@pytest.mark.parametrize("type_only", [False, True], ids=["runtime", "type_only"])
def test_no_import_circles(type_only):
    """type_only: not even for annotations (the model cache and POD's scheme once imported each other under
    TYPE_CHECKING, a sign the layout belonged to neither: it is sparse_models/ring.py and cache_layout.py now)."""
    circles = import_circles(import_graph(type_only=type_only))
    assert not circles, ("modules that import each other (directly or through others"
                         + (", type-only imports counted" if type_only else "") + "):\n"
                         + "\n".join(" <-> ".join(c) for c in circles))


def test_the_type_only_check_catches_a_type_only_circle(tmp_path):
    _layers(tmp_path)
    (tmp_path / "sparse_models" / "cache.py").write_text("from sparse_models.schemes import pod\n")
    (tmp_path / "sparse_models" / "schemes").mkdir()
    (tmp_path / "sparse_models" / "schemes" / "pod.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cache import SparseKVCache\n")
    assert import_circles(import_graph(tmp_path)) == []
    assert import_circles(import_graph(tmp_path, type_only=True)) == [["sparse_models.cache",
                                                                       "sparse_models.schemes.pod"]]


def test_the_circle_check_catches_a_lazy_circle(tmp_path):
    _layers(tmp_path)
    (tmp_path / "train" / "__init__.py").write_text("from train import data\n")
    (tmp_path / "train" / "data.py").write_text("from train.recipe import Recipe\n")
    (tmp_path / "train" / "recipe.py").write_text("def check():\n    from . import data\n")
    (tmp_path / "train" / "alone.py").write_text("import train\n")
    assert import_circles(import_graph(tmp_path)) == [["train.data", "train.recipe"]]


def test_no_upward_imports():
    problems = upward_imports()
    assert not problems, "upward imports (allowed: kernels -> sparse_models -> train -> eval):\n" + "\n".join(problems)


def test_the_walk_catches_an_upward_import(tmp_path):
    _layers(tmp_path)
    (tmp_path / "kernels" / "ok.py").write_text("import torch\nfrom . import reference\n")
    (tmp_path / "sparse_models" / "bad.py").write_text("def f():\n    from eval.models import load\n")
    (tmp_path / "train" / "bad.py").write_text("import eval.data.texts as texts\nimport sparse_models\n")
    assert upward_imports(tmp_path) == [
        "sparse_models/bad.py:2: sparse_models imports eval.models",
        "train/bad.py:1: train imports eval.data.texts",
    ]
