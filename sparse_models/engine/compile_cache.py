"""On-disk caches of compiled kernels under podkit's cache root, so that a second run starts fast.

Triton compiles each kernel specialisation once per process unless its cache directory holds it, and
torch.compile (Inductor) keeps FX-graph and generated-kernel caches under a temporary folder by default
(``/tmp/torchinductor_<user>``, which containers and reboots wipe). The generation CLI points both at
``$PODKIT_CACHE/compile/{triton,inductor}`` (default ``~/.cache/podkit``, sparse_models/smollm2.py) and
switches Inductor's FX-graph cache on. Variables the user set are left alone. Must run before the first
kernel compiles (Triton reads ``TRITON_CACHE_DIR`` when it compiles; Inductor fixes its folder on first
use).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def _torch_default(variable: str) -> str | None:
    """The value torch itself writes into the environment: importing ``torch._dynamo`` (transformers and
    podkit do) calls Inductor's ``cache_dir()``, which sets ``TORCHINDUCTOR_CACHE_DIR`` to its temporary
    default. That value is torch's, not the user's, so it does not count as set (found on an H200: the
    second run recompiled every Inductor graph)."""
    if variable != "TORCHINDUCTOR_CACHE_DIR":
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def enable_persistent_compile_caches(root: str | os.PathLike | None = None, environ=None) -> dict[str, str]:
    """Set the cache folders (unless already set) and return the variables in effect.

    ``root``: default ``sparse_models.paths.cache_root() / "compile"``; ``environ``: default ``os.environ``.
    """
    if environ is None:
        environ = os.environ
    if root is None:
        from ..paths import cache_root

        root = cache_root() / "compile"
    root = Path(root).expanduser()
    for variable, folder in (("TRITON_CACHE_DIR", root / "triton"), ("TORCHINDUCTOR_CACHE_DIR", root / "inductor")):
        if not environ.get(variable) or environ[variable] == _torch_default(variable):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue  # an unwritable cache root: keep the libraries' defaults
            environ[variable] = str(folder)
    environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    return {variable: environ[variable] for variable in (*CACHE_VARIABLES, "TORCHINDUCTOR_FX_GRAPH_CACHE")
            if variable in environ}
