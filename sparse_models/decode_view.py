"""The model path's :class:`~sparse_models.schemes.base.DecodeView`: one layer of a
:class:`~sparse_models.cache.SparseKVCache` during one decode step of ``model.forward`` / ``generate()``.

The engine has the same view over its static cache (``sparse_models/engine/decode_layers.py``), so a
scheme's decode function (``schemes/<method>.py``) runs unchanged in both paths. Here every read is a
``kernels`` op over the layer's K/V in the slot = position layout; on POD's shared-key cache the
keys a non-POD role reads are the effective ones (own keys at proximal slots, the anchor's elsewhere:
``SparseKVCache.effective_keys``).
"""

from __future__ import annotations

import torch

import kernels

from .cache import SparseKVCache
from .plan import LayerPlan
from .schemes.base import fused_selection
from .schemes.registry import get_scheme


class CacheDecodeView:
    """One layer of the dynamic cache in one decode step (the current token already appended).

    Args:
        row: the layer's plan; cache: the SparseKVCache; lens [B]: lengths after this token;
        config: the SparseAttentionConfig; state: the forward's ForwardState (POD gates, queries).
    """

    def __init__(self, row: LayerPlan, cache: SparseKVCache, lens: torch.Tensor, config, state):
        self.layer = row.layer
        self.row = row
        self.cache = cache
        self.lens = lens
        self.config = config
        self.state = state
        self.num_kv_heads = cache.num_kv_heads
        self._keys: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor:
        """[B, Hkv, N, D]: the keys a non-POD role reads (effective keys on POD's cache)."""
        if self._keys is None:
            self._keys = self.cache.effective_keys(self.layer, self.lens) if self.row.pod_keys \
                else self.cache.layer_keys(self.layer)
        return self._keys

    @property
    def values(self) -> torch.Tensor:
        return self.cache.layer_values(self.layer)

    @property
    def capacity(self) -> int:
        """Cache slots this step reads (the view's width: the longest sequence rounded up to 64)."""
        return self.cache.view_slots(self.layer)

    def full(self, q: torch.Tensor) -> torch.Tensor:
        """Exact attention over the cache; a scheme's ``model_view["full"]`` if it has one."""
        own = get_scheme(self.config.decode_scheme).model_view.get("full")
        return own(self, q) if own is not None else self.full_over_keys(q)

    def full_over_keys(self, q: torch.Tensor) -> torch.Tensor:
        """:meth:`full` over one key per slot (:attr:`keys`)."""
        return kernels.decode_attention(q, self.keys, self.values, self.lens)

    def pod(self, q: torch.Tensor) -> torch.Tensor:
        return self._scheme_op("pod")(self, q)

    def _scheme_op(self, name: str):
        """The decode scheme's own implementation of view operation ``name`` over this cache (``Scheme.model_view``)."""
        scheme = get_scheme(self.config.decode_scheme)
        if name not in scheme.model_view:
            raise RuntimeError(f"decode_scheme={scheme.name!r} reads view.{name}() but defines no model_view[{name!r}] "
                               f"(sparse_models/schemes/base.py Scheme.model_view)")
        return scheme.model_view[name]

    def select(self, q: torch.Tensor, budget: int, selection: str = "query_head",
               recent: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention + the selected slots (out [B, Hq, D], indices [B, Hs, budget]); see DecodeView.select.
        A decode scheme with its own ``model_view["select"]`` (POD + TidalDecode under score sharing) runs that."""
        own = get_scheme(self.config.decode_scheme).model_view.get("select")
        out, idx = own(self, q, budget, selection, recent) if own is not None \
            else self.select_over_keys(q, budget, selection, recent)
        self.cache.selected_indices[self.layer] = idx  # the last step's selection, for inspection
        return out, idx

    def select_over_keys(self, q: torch.Tensor, budget: int, selection: str = "query_head",
                         recent: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`select` over one key per slot (:attr:`keys`)."""
        if fused_selection(selection, recent):
            out, idx = kernels.selection_decode_attention(q, self.keys, self.values, self.lens, budget,
                                                          per_kv_group=selection == "kv_group")
        else:  # the logits [B, Hq, N] of the same read, then the torch selection (kernels/reference.py)
            out, scores = kernels.decode_attention(q, self.keys, self.values, self.lens, return_scores=True)
            idx = kernels.select_topk_positions(scores, self.lens, budget, group_size=q.shape[1] // self.num_kv_heads,
                                                mode=selection, recent=recent)
        return out, idx

    def sparse(self, q: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Attention over the slots ``indices`` [B, Hs, K]; a scheme's ``model_view["sparse"]`` if it has one."""
        own = get_scheme(self.config.decode_scheme).model_view.get("sparse")
        return own(self, q, indices) if own is not None else self.sparse_over_keys(q, indices)

    def sparse_over_keys(self, q: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """:meth:`sparse` over one key per slot (:attr:`keys`)."""
        return kernels.sparse_decode_attention(q, self.keys, self.values, indices)

    def buffer(self, name: str) -> torch.Tensor:
        return self.cache.state_buffer(self.layer, name)
