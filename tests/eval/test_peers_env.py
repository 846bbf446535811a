"""scripts/peers_env.sh, the peers' environment for the RULER leaderboard: the offline install the GPU machine
uses (its python3 is itself a virtualenv, whose torch a nested venv must still see) and the wheels it downloads
for that machine (CPython 3.12 on x86-64 Linux, whatever machine downloads them)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "peers_env.sh"


def _wheel(folder: Path, name: str, version: str, source: str) -> Path:
    """A minimal pure-Python wheel of package ``name`` whose ``__init__`` is ``source``."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": source,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: podkit-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def _has_pip() -> bool:
    """Whether this interpreter has pip, asked in a child: ``find_spec("pip")`` in this process would make
    setuptools' distutils shim step aside for good (its meta-path finder's ``spec_for_pip``), and Inductor's
    CPU compile in a later test then fails on the stdlib distutils it finds."""
    return subprocess.run([sys.executable, "-c", "import pip"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_pip(), reason="needs pip in this interpreter")
def test_offline_venv_sees_the_interpreters_packages_and_its_wheels_shadow_them(tmp_path):
    """Made from this interpreter (a virtualenv here, like the GPU image's python3): the new venv finds this
    interpreter's torch, and a carried wheel of a package this interpreter also has wins (there: the carried
    transformers 5.2 over the image's 5.17)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "tqdm", "0.0.1", "__version__ = 'carried'\n")
    venv = tmp_path / "peers"
    check = ("import importlib.util, tqdm; assert tqdm.__version__ == 'carried', tqdm.__file__; "
             "assert importlib.util.find_spec('torch') is not None, 'torch not visible'; print('CHECKED')")
    env = {**os.environ, "PYTHON": sys.executable, "PEERS_CHECK": check}
    done = subprocess.run(["bash", str(SCRIPT), "--offline", str(wheels), str(venv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "CHECKED" in done.stdout and done.stdout.strip().endswith(str(venv))
    assert not (venv / "bin" / "pip").exists()  # no pip of its own: the interpreter's pip installed the wheels
    # a second run over the same venv (a rerun on a warm machine) reinstalls in place
    done = subprocess.run(["bash", str(SCRIPT), "--offline", str(wheels), str(venv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "CHECKED" in done.stdout, done.stderr[-2000:]


def test_download_asks_for_the_gpu_machines_wheels(tmp_path):
    """pip download is told the target (CPython 3.12, manylinux x86-64, binary wheels only) instead of taking this
    machine's interpreter and platform."""
    log = tmp_path / "pip_args"
    fake = tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > {log}\n")
    fake.chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    done = subprocess.run(["bash", str(SCRIPT), "--download", str(wheels)], cwd=REPO,
                          env={**os.environ, "PYTHON": str(fake)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = log.read_text().split("\n")
    assert args[:3] == ["-m", "pip", "download"]
    assert "--only-binary=:all:" in args and "--no-deps" in args
    assert args[args.index("--python-version") + 1] == "3.12" and args[args.index("--implementation") + 1] == "cp"
    assert "manylinux_2_17_x86_64" in args
    assert {"kvpress==0.5.5", "transformers==5.2.0", "tokenizers==0.22.2"} <= set(args)


def test_leaderboard_gpu_script_parses_and_stops_without_a_model(tmp_path):
    """scripts/leaderboard_gpu.sh: valid bash, and with no model it stops at once with a message (no work started)."""
    script = REPO / "scripts" / "leaderboard_gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = dict(os.environ, B=str(tmp_path / "board"), OUT=str(tmp_path / "out"), PY="false")
    (tmp_path / "board").mkdir()
    done = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "install the GGUF first" in done.stdout
