"""The kernels ops the engine calls, resolved per call through kernels' public dispatch helpers.

Why not ``kernels.decode_attention`` directly: several Triton modules share their op's name
(``kernels/decode_attention.py`` defines ``decode_attention_triton``), and the first lazy import of such
a module rebinds the package attribute ``kernels.decode_attention`` from the dispatching function to
the submodule (Python sets ``package.submodule`` on import), after which ``kernels.decode_attention(...)``
raises "'module' object is not callable" on CUDA. Resolving through ``kernels.use_triton`` /
``kernels.triton_implementation`` / ``kernels.reference`` is immune to that and dispatches the same way.
"""

from __future__ import annotations

import kernels
from kernels import reference


def _op(name: str):
    reference_fn = getattr(reference, name)

    def call(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if kernels.use_triton(first):
            return kernels.triton_implementation(name)(*args, **kwargs)
        return reference_fn(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = reference_fn.__doc__
    return call


decode_attention = _op("decode_attention")
selection_decode_attention = _op("selection_decode_attention")
sparse_decode_attention = _op("sparse_decode_attention")
pod_decode_attention = _op("pod_decode_attention")
quest_page_scores = _op("quest_page_scores")
quest_select_pages = _op("quest_select_pages")
prefill_attention = _op("prefill_attention")
sparse_prefill_attention = _op("sparse_prefill_attention")
token_sparse_scores = _op("token_sparse_scores")
pod_prefill_attention = _op("pod_prefill_attention")
# plain torch on every device
select_topk_positions = reference.select_topk_positions
quest_page_minmax = reference.quest_page_minmax
