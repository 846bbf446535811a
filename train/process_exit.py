"""How a rank of a multi-process launch leaves once its work is done.

A rank that returned normally could still exit with SIGABRT (-6, "terminate called without an active exception"):
in about one of 25 runs of ``tests/train/test_pipeline_sequence_parallel.py`` on a 2-core CPU, and in one of five
CI runs (two gloo ranks under ``deepspeed``), after it had trained, written its checkpoint and destroyed its process group
(train/pipeline.py, ``_shutdown_distributed``); the launcher then reports the whole job failed and kills the other
ranks. Both ways a CPython process that has finished its work can still abort in native code belong to interpreter
finalization, which comes after the ``atexit`` handlers: daemon threads that wake then are ended with
``pthread_exit``, whose forced unwinding through a ``noexcept`` C++ frame (a GIL re-acquire in a binding) calls
``std::terminate``; and the native libraries' static destructors run in no fixed order. Which of the two it was
here is not pinned down (it did not recur under ``PYTHONFAULTHANDLER=1`` in eleven runs).

So a rank of a multi-process launch runs the ``atexit`` handlers itself (logging's flush, experiment trackers'
``finish``), flushes its streams and ends with ``os._exit``, skipping finalization. A single-process run exits
the ordinary way.
"""

from __future__ import annotations

import atexit
import os
import sys


def in_multi_process_launch() -> bool:
    """True under a launcher that started several ranks (``WORLD_SIZE`` > 1: deepspeed, torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def exit_process(code: int | None) -> None:
    """End this process with ``code``: the ordinary ``sys.exit`` for one process; for a rank of a multi-process
    launch the ``atexit`` handlers, then flushed streams, then ``os._exit`` (module docstring). Never returns."""
    if not in_multi_process_launch():
        sys.exit(code)
    try:
        atexit._run_exitfuncs()  # what normal shutdown would run first; finalization is what gets skipped
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
                pass
        os._exit(0 if code is None else code if isinstance(code, int) else 1)
