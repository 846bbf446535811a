"""Helpers for the sequence-parallel tests: a tiny POD model, and an in-process all-to-all for P "ranks"
run as threads (DeepSpeed's own layout functions + an exchange of chunks, as ``all_to_all_single`` does)."""

from __future__ import annotations

import threading

import torch

VOCAB = 97


def tiny_pod_model(heads: int, kv_heads: int, *, layers: int = 4, head_dim: int = 8, sink: int = 3, recent: int = 9,
                   block: int = 2, seed: int = 0, scheme: str = "pod", sharing: str = "keys"):
    """A random PodkitLlamaForCausalLM (fp32). POD: layers in blocks of ``block`` consecutive layers for every KV
    head, except that KV head 0 of each non-anchor layer stays its own anchor (mixed own/shared heads)."""
    from tests.tiny_models import ROPE_DEFAULT, tiny_model

    model = tiny_model(layers=layers, seed=seed, eval=False, vocab=VOCAB, heads=heads, kv_heads=kv_heads,
                       hidden=heads * head_dim, intermediate=48, head_dim=head_dim, positions=4096,
                       tie_word_embeddings=False, rope=ROPE_DEFAULT)
    if scheme == "pod":
        anchors = [[layer if (h == 0 and layer % block) else (layer // block) * block for h in range(kv_heads)]
                   for layer in range(layers)]
        model.set_sparse_attention(prefill_scheme="pod", decode_scheme="pod", pod_anchor_layers=anchors,
                                   pod_sink_tokens=sink, pod_recent_window=recent, pod_sharing=sharing)
    model.config.use_cache = False
    return model.float()


class ThreadAllToAll:
    """``all_to_all_single`` among ``size`` threads of one process, with DeepSpeed's pre/post layout functions
    (``deepspeed.sequence.layer``), so that the threads run exactly what ``_SeqAllToAll`` runs per rank."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size

    def for_rank(self, rank: int):
        return lambda x, scatter_dim, gather_dim: self._exchange(rank, x, scatter_dim, gather_dim)

    def _exchange(self, rank, x, scatter_dim, gather_dim):
        from deepspeed.sequence.layer import _generate_layout_params, post_all2all, pre_all2all_fun

        perm, shape, post_perm, post_shape = _generate_layout_params(scatter_dim, 0, self.size, x)
        self.slots[rank] = pre_all2all_fun(perm, shape, x)
        self.barrier.wait()
        # all_to_all_single: dim 0 is cut into `size` chunks; chunk j goes to rank j, in source-rank order
        received = torch.cat([self.slots[src].chunk(self.size, 0)[rank] for src in range(self.size)], 0)
        self.barrier.wait()  # every rank has read before anyone writes the next exchange
        return post_all2all(post_perm, post_shape)(received)


def run_ranks(exchange: ThreadAllToAll, fn) -> list:
    """Run ``fn(rank)`` for every rank of ``exchange`` in its own thread; results in rank order. The first
    error is re-raised (the barrier is aborted so the other threads fail fast instead of waiting)."""
    results, errors = [None] * exchange.size, []

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)
            exchange.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(exchange.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results
