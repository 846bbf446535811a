"""podkit's attention ops: one public function per op, dispatched by device.

CUDA tensors go to the Triton kernels (``kernels/triton_<op>.py``; the prefix keeps a submodule
import from rebinding the package attribute that holds the public op of the same name), everything else to the plain-PyTorch
reference (``kernels/reference.py``), which is also the spec the kernels are tested against. Set
``PODKIT_FORCE_REFERENCE=1`` to run the reference on CUDA too (debugging, A/B comparisons).
Shapes and conventions: ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib
import os

import torch

from . import reference
from ._value_checks import (  # noqa: F401  (re-exported, listed in __all__)
    DECODE_LINEAR_MAX_ROWS,  # the largest batch decode_linear takes
    skipping_value_checks,  # a timed benchmark's scoped PODKIT_SKIP_VALUE_CHECKS=1
    value_checks_skipped,
)

__all__ = [
    "decode_attention",
    "selection_decode_attention",
    "select_topk_positions",
    "sparse_decode_attention",
    "prefill_attention",
    "sparse_prefill_attention",
    "token_sparse_scores",
    "pod_prefill_attention",
    "pod_decode_attention",
    "pod_sparse_decode_attention",
    "quest_page_scores",
    "quest_select_pages",
    "quest_page_minmax",
    "append_kv",
    "decode_linear",
    "quantize_kv",
    "dequantize_kv",
    "DECODE_LINEAR_MAX_ROWS",
    "skipping_value_checks",
    "value_checks_skipped",
    "reference",
]

# op name -> (module under kernels/, function name) of the Triton implementation
_TRITON_IMPLEMENTATIONS = {
    "decode_attention": ("triton_decode_attention", "decode_attention_triton"),
    "selection_decode_attention": ("triton_decode_attention", "selection_decode_attention_triton"),
    "sparse_decode_attention": ("triton_sparse_decode_attention", "sparse_decode_attention_triton"),
    "pod_decode_attention": ("triton_pod_decode_attention", "pod_decode_attention_triton"),
    "pod_sparse_decode_attention": ("triton_pod_sparse_decode_attention", "pod_sparse_decode_attention_triton"),
    "quest_page_scores": ("triton_quest_pages", "quest_page_scores_triton"),
    "quest_select_pages": ("triton_quest_pages", "quest_select_pages_triton"),
    "prefill_attention": ("triton_prefill_attention", "prefill_attention_triton"),
    "sparse_prefill_attention": ("triton_sparse_prefill_attention", "sparse_prefill_attention_triton"),
    "token_sparse_scores": ("triton_token_sparse_scores", "token_sparse_scores_triton"),
    "pod_prefill_attention": ("triton_pod_prefill_attention", "pod_prefill_attention_triton"),
    "append_kv": ("triton_cache_append", "append_kv_triton"),
    "decode_linear": ("triton_decode_linear", "decode_linear_triton"),
    "quantize_kv": ("triton_fp8_quantize", "quantize_kv_triton"),
}


# Triton ops with a backward (an autograd.Function, or a differentiable fallback inside the launcher). The
# others are forward-only kernels: their outputs carry no grad_fn, so under autograd they would cut the graph.
_DIFFERENTIABLE_TRITON_OPS = frozenset({"prefill_attention", "pod_prefill_attention"})


def use_triton(tensor) -> bool:
    """Whether ops on ``tensor`` run the Triton kernel (CUDA and not forced to the reference)."""
    return bool(getattr(tensor, "is_cuda", False)) and os.environ.get("PODKIT_FORCE_REFERENCE", "0") != "1"


def triton_implementation(op: str):
    """The Triton launcher of ``op`` (imported lazily: CPU users never import Triton code)."""
    module_name, function_name = _TRITON_IMPLEMENTATIONS[op]
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, function_name)


def _dispatch(op: str):
    reference_fn = getattr(reference, op)

    def op_fn(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if use_triton(first):
            if op not in _DIFFERENTIABLE_TRITON_OPS and torch.is_grad_enabled() and any(
                    isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
                raise RuntimeError(f"kernels.{op}: the Triton kernel is forward only, and an input requires grad "
                                   f"with grad mode on (its gradient would silently be lost); run it under "
                                   f"torch.no_grad(), or set PODKIT_FORCE_REFERENCE=1 to get the differentiable "
                                   f"PyTorch reference")
            return triton_implementation(op)(*args, **kwargs)
        return reference_fn(*args, **kwargs)

    op_fn.__name__ = op
    op_fn.__qualname__ = op
    op_fn.__doc__ = f"Dispatching wrapper; see kernels.reference.{op} for the contract.\n\n" + (reference_fn.__doc__ or "")
    return op_fn


decode_attention = _dispatch("decode_attention")
selection_decode_attention = _dispatch("selection_decode_attention")
sparse_decode_attention = _dispatch("sparse_decode_attention")
pod_decode_attention = _dispatch("pod_decode_attention")
pod_sparse_decode_attention = _dispatch("pod_sparse_decode_attention")
quest_page_scores = _dispatch("quest_page_scores")
quest_select_pages = _dispatch("quest_select_pages")
prefill_attention = _dispatch("prefill_attention")
sparse_prefill_attention = _dispatch("sparse_prefill_attention")
token_sparse_scores = _dispatch("token_sparse_scores")
pod_prefill_attention = _dispatch("pod_prefill_attention")
append_kv = _dispatch("append_kv")
decode_linear = _dispatch("decode_linear")
quantize_kv = _dispatch("quantize_kv")  # FP8 KV cache format: kernels/fp8_kv.py

# Selection and page min/max are cheap torch ops on every device.
select_topk_positions = reference.select_topk_positions
quest_page_minmax = reference.quest_page_minmax
dequantize_kv = reference.dequantize_kv
