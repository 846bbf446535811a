"""Ulysses sharding / unsharding math in one process: P "ranks" are threads exchanging through DeepSpeed's own
all-to-all layout functions (tests/train/sp_helpers.py). Checks the exchange itself, POD attention over head
shards, and the whole model (global RoPE positions, POD anchor keys, GQA) forward and backward against the
unsharded model. The real multi-process path (DeepSpeed's _SeqAllToAll over gloo) is
test_sequence_parallel_dist.py."""

import copy

import pytest
import torch

pytest.importorskip("deepspeed", reason="the layout functions under test are DeepSpeed's (deepspeed.sequence.layer)")

from sp_helpers import VOCAB, ThreadAllToAll, run_ranks, tiny_pod_model  # noqa: E402

import kernels  # noqa: E402
from sparse_models.sequence_parallel import UlyssesAttention  # noqa: E402


def _seeded(*key) -> torch.Generator:
    import zlib

    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("size,heads", [(2, 2), (2, 6), (4, 4), (4, 8), (3, 9)])
def test_exchange_round_trip(size, heads):
    g = _seeded("round", size, heads)
    batch, s_loc, dim = 2, 5, 3
    x = torch.randn(batch, heads, size * s_loc, dim, generator=g)
    exchange = ThreadAllToAll(size)

    def rank_fn(rank):
        sp = UlyssesAttention(group=None, size=size, rank=rank, exchange=exchange.for_rank(rank))
        shard = x[:, :, rank * s_loc:(rank + 1) * s_loc]
        by_heads = sp.heads_from_sequence(shard)
        return shard, by_heads, sp.sequence_from_heads(by_heads)

    per_head = heads // size
    for rank, (shard, by_heads, back) in enumerate(run_ranks(exchange, rank_fn)):
        assert torch.equal(by_heads, x[:, rank * per_head:(rank + 1) * per_head]), rank  # all tokens, own heads
        assert torch.equal(back, shard), rank


@pytest.mark.parametrize("size,group,kv_heads", [(2, 1, 2), (2, 3, 2), (2, 4, 4), (2, 8, 2), (4, 3, 4)])
def test_pod_attention_over_head_shards_equals_full(size, group, kv_heads):
    g = _seeded("pod", size, group, kv_heads)
    batch, s_loc, dim, sink, recent = 2, 11, 8, 3, 7
    s = size * s_loc
    q = torch.randn(batch, group * kv_heads, s, dim, generator=g, requires_grad=True)
    k, k_anchor, v = (torch.randn(batch, kv_heads, s, dim, generator=g, requires_grad=True) for _ in range(3))
    lens = torch.full((batch,), s)
    full = kernels.pod_prefill_attention(q, k, k_anchor, v, lens, sink=sink, recent=recent)
    weight = torch.randn(full.shape, generator=g)
    grads_full = torch.autograd.grad((full * weight).sum(), (q, k, k_anchor, v))

    exchange = ThreadAllToAll(size)

    def attention_fn(layer, q_, k_, v_, state, ka_, qa_):
        assert state == "global state" and qa_ is None and q_.shape[2] == s
        return kernels.pod_prefill_attention(q_, k_, ka_, v_, lens, sink=sink, recent=recent)

    def rank_fn(rank):
        sp = UlyssesAttention(group=None, size=size, rank=rank, exchange=exchange.for_rank(rank))
        cut = slice(rank * s_loc, (rank + 1) * s_loc)
        return sp.attention(attention_fn, 0, q[:, :, cut], k[:, :, cut], v[:, :, cut], "global state",
                            k_anchor[:, :, cut])

    outs = run_ranks(exchange, rank_fn)
    sharded = torch.cat(outs, dim=2)
    torch.testing.assert_close(sharded, full, rtol=1e-5, atol=1e-6)
    grads_sp = torch.autograd.grad((sharded * weight).sum(), (q, k, k_anchor, v))  # through the exchanges
    for name, a, b in zip(("q", "k", "k_anchor", "v"), grads_sp, grads_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def _shift_labels(ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)


@pytest.mark.parametrize("heads,kv_heads,size,scheme", [(4, 4, 2, "pod"), (6, 2, 2, "pod"), (8, 2, 2, "pod"),
                                                         (16, 2, 2, "pod"), (8, 4, 4, "pod"), (6, 2, 2, "dense"),
                                                         (6, 2, 2, "pod-scores")])
def test_model_sequence_parallel_equals_unsharded(heads, kv_heads, size, scheme):
    """Logits, loss and parameter gradients of P sequence-parallel replicas (summed, as the SP all-reduce of
    gradients does) equal the one-process model; positions beyond one slice exercise global RoPE, and the
    window (sink 3 + recent 9) is shorter than the sequence, so anchor keys are used."""
    sharing = "scores" if scheme == "pod-scores" else "keys"
    full = tiny_pod_model(heads, kv_heads, scheme="dense" if scheme == "dense" else "pod", sharing=sharing).train()
    batch, s_loc = 2, 7
    s = size * s_loc
    ids = torch.randint(0, VOCAB, (batch, s), generator=_seeded("ids", heads, kv_heads, size, scheme))
    labels = _shift_labels(ids)
    tokens = int((labels != -100).sum())

    out = full(input_ids=ids, labels=ids)
    out.loss.backward()
    grads_full = {n: p.grad.clone() for n, p in full.named_parameters()}

    replicas = [copy.deepcopy(full) for _ in range(size)]
    exchange = ThreadAllToAll(size)
    for rank, replica in enumerate(replicas):
        replica.zero_grad(set_to_none=True)
        replica.model.sequence_parallel = UlyssesAttention(group=None, size=size, rank=rank,
                                                           exchange=exchange.for_rank(rank))

    def rank_fn(rank):
        cut = slice(rank * s_loc, (rank + 1) * s_loc)
        logits = replicas[rank](input_ids=ids[:, cut]).logits
        slice_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, cut].reshape(-1),
                                                      ignore_index=-100, reduction="sum")
        return logits, slice_sum

    results = run_ranks(exchange, rank_fn)
    logits = torch.cat([r[0] for r in results], dim=1)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    loss = sum(r[1] for r in results) / tokens
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=1e-6)
    loss.backward()  # the graph crosses the replicas through the exchanged tensors
    for name, reference in grads_full.items():
        summed = sum(dict(r.named_parameters())[name].grad for r in replicas)
        torch.testing.assert_close(summed, reference, rtol=1e-4, atol=1e-6, msg=name)


def test_sequence_parallel_rejects_what_it_does_not_cover():
    model = tiny_pod_model(6, 3)  # 3 KV heads cannot be split over 2 ranks
    model.model.sequence_parallel = UlyssesAttention(group=None, size=2, rank=0, exchange=lambda *a: 1 / 0)
    ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(ValueError, match="KV head count divisible by the sequence-parallel size 2"):
        model(input_ids=ids)

    model = tiny_pod_model(4, 2)
    model.model.sequence_parallel = UlyssesAttention(group=None, size=2, rank=1, exchange=lambda *a: 1 / 0)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="attention_mask: sequence parallelism needs unpadded rows"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="training-style forwards only"):
        model.eval()(input_ids=ids, use_cache=True)
    with pytest.raises(ValueError, match="rank=2"):
        UlyssesAttention(group=None, size=2, rank=2)


def test_collate_with_position_ids():
    from train.sequence_parallel import collate_with_position_ids

    rows = [{"input_ids": list(range(5, 13)), "labels": list(range(5, 13))} for _ in range(3)]
    batch = collate_with_position_ids(rows)
    assert batch["input_ids"].shape == batch["position_ids"].shape == (3, 8)
    assert torch.equal(batch["position_ids"][2], torch.arange(8))
