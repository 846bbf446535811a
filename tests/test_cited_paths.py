"""Comments, docstrings and the top-level notes cite files that exist in the repository.

A citation is a path whose first component is a top-level folder of the repository
(``sparse_models/engine/static_cache.py``) or a bare ``NAME.md`` note (``METHODS.md A.4``). Paths
resolve against the repository root, the citing file's folder, or the folder of its top-level
package (so ``engine/decode_step.py`` inside ``sparse_models/`` counts). Notes outside the
repository (``../shared``, ``methods.md``) are what this test exists to catch.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("kernels", "sparse_models", "train", "eval", "tests", "benchmarks", "scripts")


def _top_level_folders() -> tuple[str, ...]:
    """The repository's own top-level folders: those git tracks files in (a run's ``outputs/`` or a virtualenv
    beside them are not the repository); every non-hidden folder where git is unavailable."""
    import subprocess

    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return tuple(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
    return tuple(sorted({line.split("/", 1)[0] for line in tracked.splitlines() if "/" in line
                         and not line.startswith(".")}))


TOP = _top_level_folders()
_EXT = r"(?:py|md|yaml|yml|json|toml|cfg|sh|txt)"
# A repository path: top-level folder / ... / file.ext (or folder/, or a template prefix such as
# ``kernels/triton_<op>.py``), or a note: an upper-case ``NAME.md`` or any ``name.md`` followed by a
# section (``environment.md §3``, ``methods.md A.4``). Lower-case names without a section are output
# files the code writes (``fidelity.md``), not citations.
PATH_RE = re.compile(
    r"(?<![\w./-])((?:%s)/[\w./-]*?(?:\.%s\b|/|(?=[<{*]))|[A-Z][A-Z_]*\.md\b|[\w-]+\.md(?= ?(?:§|[A-G]\.\d)))"
    % ("|".join(re.escape(t) for t in TOP + ("shared",)), _EXT)
)


def _comment_and_docstring_text(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    out: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((getattr(node, "lineno", 1), doc))
    return out


def _exists(cited: str, citing: Path) -> bool:
    bases = [ROOT, citing.parent]
    rel = citing.relative_to(ROOT)
    if len(rel.parts) > 1:
        bases.append(ROOT / rel.parts[0])
    if cited.endswith(("/", "_")) or not Path(cited).suffix:  # a folder or a template's prefix
        return any(any(base.glob(cited.rstrip("/") + "*")) for base in bases)
    return any((base / cited).exists() for base in bases)


def _citations():
    files = [p for d in CODE_DIRS if (ROOT / d).is_dir() for p in sorted((ROOT / d).rglob("*.py"))]
    for path in files:
        if path == Path(__file__).resolve():
            continue  # its own docstring and examples name missing notes on purpose
        for line, text in _comment_and_docstring_text(path):
            for m in PATH_RE.finditer(text):
                yield path, line, m.group(1)
    for path in sorted(ROOT.glob("*.md")) + sorted((ROOT / "recipes").rglob("*.yaml")):
        for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if path.suffix == ".yaml" and not text.lstrip().startswith("#"):
                continue
            for m in PATH_RE.finditer(text):
                yield path, line, m.group(1)


def test_every_cited_path_exists():
    missing = [
        f"{path.relative_to(ROOT)}:{line}: {cited}" for path, line, cited in _citations() if not _exists(cited, path)
    ]
    assert not missing, "comments/docs cite files that are not in the repository:\n" + "\n".join(missing)


def test_the_checker_catches_a_missing_note(tmp_path):
    # The regex must see the citations this test was written for.
    text = "see methods.md A.4, environment.md §3, ../shared/reference/x.md, kernels/nope.py; writes fidelity.md"
    found = [m.group(1) for m in PATH_RE.finditer(text)]
    assert found == ["methods.md", "environment.md", "kernels/nope.py"], found
    assert not _exists("methods.md", ROOT / "kernels" / "reference.py")
    assert _exists("METHODS.md", ROOT / "kernels" / "reference.py")
    assert _exists("engine/decode_step.py", ROOT / "sparse_models" / "attention.py")
