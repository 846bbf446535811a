"""``kv_bytes()`` has one type and one meaning in both paths: the model's ``SparseKVCache`` and the engine's static
cache return a :class:`~sparse_models.kv_bytes.KVBytes`, and for the same batch and capacity they count the same
bytes for every registered decode scheme, but for POD's ring, which the engine also keeps for the own heads of a
layer with shared heads (its kernels read the ring next to the key pool; ARCHITECTURE.md, "What is still
per-path")."""

from __future__ import annotations

import pytest
import torch
from test_engine import SCHEMES, _valid_anchor_map, podkit_model

from sparse_models import SparseAttentionConfig
from sparse_models.engine import GenerationEngine
from sparse_models.kv_bytes import KVBytes
from sparse_models.schemes.registry import get_scheme, scheme_names

BATCH, CAPACITY, KV_HEADS = 2, 64, 2


def test_every_decode_scheme_is_checked():
    assert set(scheme_names("decode")) <= set(SCHEMES)


@pytest.mark.parametrize("name", scheme_names("decode"))
def test_both_caches_count_the_same_bytes(name):
    overrides = dict(SCHEMES[name])
    uses_anchors = get_scheme(name).uses_anchors
    if uses_anchors:
        overrides["pod_anchor_layers"] = _valid_anchor_map(KV_HEADS)
    model = podkit_model(6, KV_HEADS, seed=1)
    model.set_sparse_attention(SparseAttentionConfig(), **overrides)
    cache = model.new_cache(CAPACITY)
    model(torch.tensor([[1, 2, 3, 4, 5]] * BATCH), cache=cache, use_cache=True)
    engine = GenerationEngine(model, max_batch_size=BATCH, max_seq_len=CAPACITY, **overrides)
    ours, theirs = cache.kv_bytes(), engine.kv_bytes()
    assert type(ours) is type(theirs) is KVBytes
    extra_ring = 0
    if uses_anchors:  # the engine's ring of the own heads in layers that also have shared heads
        config = model.sparse_config
        ring = config.pod.sink_tokens + config.pod.recent_window
        own_beside_shared = sum(row.count(layer) for layer, row in enumerate(config.pod.anchor_layers)
                                if any(a != layer for a in row))
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        extra_ring = own_beside_shared * BATCH * ring * head_dim * 4  # fp32
        assert extra_ring > 0
    assert theirs == KVBytes(ours.keys + extra_ring, ours.values, ours.metadata, ours.dense)
