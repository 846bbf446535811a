"""``KVBytes``: the one report of the KV memory a cache really allocated, for the model's ``SparseKVCache``
(``sparse_models/cache.py``) and the engine's ``StaticCache`` (``sparse_models/engine/static_cache.py``) alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes held by ``tensors`` (None entries, e.g. a layer without that buffer, count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True)
class KVBytes:
    """KV memory actually allocated, against a dense cache of the same capacity (bytes).

    Attributes:
        keys: key buffers (POD: anchor units' full keys + the shared heads' sinks + ring); with
            ``kv_cache_dtype="fp8_e4m3"`` the float8 data and their fp32 scales (D + 4 bytes per token and KV head).
        values: value buffers (always every position of every KV head), FP8 data + scales likewise.
        metadata: scheme state besides K/V (Quest's page max / min).
        dense: a dense cache of the same batch, capacity and storage: keys stored exactly like values, 2 x ``values``.
    """

    keys: int
    values: int
    metadata: int
    dense: int

    @classmethod
    def of(cls, keys: Iterable[torch.Tensor | None], values: Iterable[torch.Tensor | None],
           metadata: Iterable[torch.Tensor | None] = ()) -> "KVBytes":
        """The report for these key, value and metadata buffers."""
        value_bytes = tensor_bytes(values)
        return cls(tensor_bytes(keys), value_bytes, tensor_bytes(metadata), 2 * value_bytes)

    @property
    def total(self) -> int:
        return self.keys + self.values + self.metadata

    @property
    def ratio_to_dense(self) -> float:
        """total / dense (POD: down to about 0.5 as distant keys dominate; Quest: above 1, its pages)."""
        return self.total / self.dense if self.dense else 1.0

    @property
    def saving(self) -> float:
        """1 - total / dense."""
        return 1.0 - self.ratio_to_dense
