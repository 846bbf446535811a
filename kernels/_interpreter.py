"""Triton CPU-interpreter detection and the one compatibility patch podkit's kernels need.

Tests run every kernel on CPU with ``TRITON_INTERPRET=1``. Under triton 3.6 with numpy >= 2.4 the
interpreter keeps kernel scalars (``tl.load(ptr)``, ``tl.program_id``) as shape-(1,) arrays and
converts them with ``int(array)``, which numpy rejects ("only 0-dimensional arrays can be
converted to Python scalars"), so ``for ... in range(start, end)`` with runtime bounds fails. The
kernels keep ``for`` loops (only those get software-pipelined by the GPU compiler), and this module
re-installs the interpreter's ``__index__`` so that it takes the single element explicitly.
Interpreter-only and idempotent; compiled Triton is unaffected.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_scalar_index() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - other triton layouts
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_podkit_scalar_index", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._podkit_scalar_index = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_scalar_index()
