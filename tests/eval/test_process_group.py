"""eval/bench/process_group.py: a benchmark job is one process group that always stops: on its time limit, or
``grace_s`` after its result file appears (a rank hung in teardown), the launcher and its children all go."""

import os
import sys
import time

from eval.bench.process_group import run_process_group

# a "launcher" that starts a long-lived "rank", records the rank's pid, then runs BODY
LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(rank.pid))
print("launched", flush=True)
{body}
"""


def _gone(pid: int) -> bool:
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().split()[2] == "Z":
                return True
        time.sleep(0.1)
    return False


def _run(tmp_path, body, **kw):
    pid_file = tmp_path / "rank.pid"
    job = run_process_group([sys.executable, "-c", LAUNCHER.format(body=body), str(pid_file)], cwd=tmp_path,
                            env=dict(os.environ), **kw)
    return job, int(pid_file.read_text())


def test_a_job_that_exits_returns_its_code_and_output(tmp_path):
    job, rank = _run(tmp_path, "rank.kill(); print('done'); sys.exit(3)", timeout_s=60)
    assert (job.returncode, job.timed_out, job.teardown_killed) == (3, False, False)
    assert "launched" in job.output and "done" in job.output


def test_the_time_limit_kills_the_launcher_and_its_ranks(tmp_path):
    start = time.monotonic()
    job, rank = _run(tmp_path, "time.sleep(120)", timeout_s=2, poll_s=0.2)
    assert job.timed_out and job.returncode is None and not job.teardown_killed
    assert time.monotonic() - start < 30 and _gone(rank) and "launched" in job.output


def test_a_result_then_a_hung_teardown_is_cut_after_the_grace(tmp_path):
    result = tmp_path / "row.json"
    body = f"open({str(result)!r}, 'w').write('{{}}'); time.sleep(120)"
    start = time.monotonic()
    job, rank = _run(tmp_path, body, timeout_s=600, result_file=result, grace_s=1, poll_s=0.2)
    assert job.teardown_killed and not job.timed_out and job.returncode is None
    assert time.monotonic() - start < 30 and _gone(rank)
