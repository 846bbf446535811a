"""Run a benchmark job (a launcher and the ranks it starts) as one process group that can always be stopped.

Two failures seen on an H200 (BENCHMARKS.md, "Where the long-context step's time went"): a job that
had written its result hung in its process-group teardown until the caller's time limit, and killing only the
launcher on that limit left a rank alive that held the GPU memory and the rendezvous port, so the next launch
failed with ``EADDRINUSE``. :func:`run_process_group` starts the command in its own session, kills the whole
group (launcher and ranks) on the time limit, and, once the job's result file exists, gives it ``grace_s``
seconds to exit before doing the same: the steps were timed; only the teardown is cut.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class JobOutcome:
    returncode: int | None  # None: the group was killed
    output: str  # stdout and stderr, interleaved
    timed_out: bool = False  # killed at timeout_s without a result file
    teardown_killed: bool = False  # the result file existed; killed after grace_s


def _kill_group(process: subprocess.Popen) -> str:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group already left
        pass
    output, _ = process.communicate()
    return output or ""


def run_process_group(command: list[str], *, cwd, env: dict, timeout_s: float, result_file: Path | None = None,
                      grace_s: float = 60.0, poll_s: float = 1.0) -> JobOutcome:
    """Run ``command`` in a new session; see the module docstring. ``result_file``: the file whose appearance
    means the job's work is done (None: only ``timeout_s`` applies)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                               env=env, start_new_session=True)
    start = time.monotonic()
    done_at = None
    while True:
        try:
            output, _ = process.communicate(timeout=poll_s)  # retrying after a timeout loses no output
            return JobOutcome(process.returncode, output or "")
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if done_at is None and result_file is not None and Path(result_file).is_file():
            done_at = now
        if done_at is not None and now - done_at > grace_s:
            return JobOutcome(None, _kill_group(process), teardown_killed=True)
        if done_at is None and now - start > timeout_s:
            return JobOutcome(None, _kill_group(process), timed_out=True)
