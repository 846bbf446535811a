"""train/process_exit.py: a rank of a multi-process launch runs its atexit handlers, flushes, keeps its exit code and
skips interpreter finalization (where the SIGABRT of a finished rank came from); one process exits the ordinary way."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import atexit, sys
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from train.process_exit import exit_process
    out = Path({out!r})

    class FinalizedLate:  # a module global: its __del__ runs only in interpreter finalization
        def __del__(self):
            (out / "finalized").write_text("yes")

    keep = FinalizedLate()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    sys.stdout.write("buffered line, not flushed")
    exit_process({code})
""")


def _run(tmp_path, code, world_size):
    env = {"PATH": "/usr/bin:/bin"}
    if world_size is not None:
        env["WORLD_SIZE"] = str(world_size)
    script = CHILD.format(repo=str(REPO), out=str(tmp_path), code=code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("code", [0, 3])
def test_rank_of_a_launch_runs_atexit_flushes_and_skips_finalization(tmp_path, code):
    done = _run(tmp_path, code, world_size=2)
    assert done.returncode == code
    assert done.stdout == "buffered line, not flushed"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "finalized").exists()  # finalization skipped


@pytest.mark.parametrize("world_size", [None, 1, "not-a-number"])
def test_one_process_exits_the_ordinary_way(tmp_path, world_size):
    done = _run(tmp_path, 3, world_size=world_size)
    assert done.returncode == 3
    assert done.stdout == "buffered line, not flushed"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "finalized").read_text() == "yes"  # ordinary finalization
