"""CPU thread counts for the pipeline (train/pipeline.py on a machine without CUDA).

torch starts one OpenMP thread per core in every process. With several processes (DeepSpeed on CPU)
or other work on the machine, the threads outnumber the free cores and OpenMP's spinning barriers
wait on preempted threads: on a loaded 2-core machine the explore stage of ``make demo`` took many times as long
as on an idle one, and with ``OMP_NUM_THREADS=1`` about as long as idle. So, unless the user set
``OMP_NUM_THREADS``: each process gets ``free cores // local processes`` threads (at least 1), where the
free cores are the usable cores minus those the 1-minute load average shows busy with other work, and ``OMP_NUM_THREADS`` is exported
so that child processes (``datasets`` workers) follow.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_thread_count(cores: int, processes: int = 1, load: float = 0.0) -> int:
    """Threads per process: the cores not busy with other work, shared by ``processes`` processes of
    this run on the host; at least 1. ``load``: the 1-minute load average, which counts this process
    itself as up to one busy core."""
    busy = round(max(load - 1.0, 0.0))
    return max(1, min(cores, cores - busy) // max(processes, 1))


def configure_cpu_threads(processes: int = 1, *, environ=None, cores: int | None = None, load: float | None = None,
                          log=print) -> int:
    """Apply the thread count (``torch.set_num_threads`` + ``OMP_NUM_THREADS``); returns it.

    An ``OMP_NUM_THREADS`` already set wins (it is applied to torch as is). ``environ``/``cores``/``load``
    default to the process's environment, its CPU affinity and ``os.getloadavg()``.
    """
    import torch

    environ = os.environ if environ is None else environ
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        threads = int(given)
        reason = "OMP_NUM_THREADS"
    else:
        cores = usable_cores() if cores is None else cores
        if load is None:
            try:
                load = os.getloadavg()[0]
            except OSError:
                load = 0.0
        threads = cpu_thread_count(cores, processes, load)
        environ["OMP_NUM_THREADS"] = str(threads)
        reason = (f"{cores} core(s), load {load:.1f}, {processes} process(es); set OMP_NUM_THREADS to choose")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    log(f"[podkit] CPU: {threads} torch thread(s) per process ({reason})")
    return threads
