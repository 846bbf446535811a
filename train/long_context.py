"""Activation memory that stops growing with the sequence: tiled MLP and checkpoint offload to CPU.

Both are DeepSpeed's components of Arctic Long Sequence Training (ALST, arXiv 2506.13996: tiled MLP
compute, activation checkpoint offload to CPU), switched on by the recipe
(``train.tiled_mlp``, ``train.tiled_mlp_shards``, ``train.activation_offload``):

* **Tiled MLP** (``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``): each decoder layer's MLP
  runs on ``shards`` slices of the sequence, without autograd in the forward, and recomputes one slice
  at a time in the backward. The [B, S, intermediate] activations (gate, up, their product: 3.5x the
  hidden size each for Llama-3-8B) then exist for one slice at a time. Shards: ``train.tiled_mlp_shards``,
  or by default ALST's rule ``ceil(S_local / hidden_size)`` (slices of about ``hidden_size`` tokens,
  so the MLP's peak no longer depends on S). Costs one extra MLP forward per layer.
* **Checkpoint offload** (``deepspeed.runtime.activation_checkpointing.offload_activations.
  CheckpointHiddenStatesOffload``): with gradient checkpointing the only activation kept per layer is
  the layer's input hidden state [B, S_local, hidden] (32 layers x 0.5 GiB at 64K tokens of an 8B
  model); the offload copies each one to pinned CPU memory on a side stream in the forward and back
  before its layer's recomputation. It is a ``saved_tensors_hooks`` context that offloads only the
  tensors marked for it: podkit's decoder loop marks the checkpointed layer input
  (``sparse_models/modeling_common.py``, ``checkpoint_offload``). On CPU-only machines DeepSpeed's
  engine offloads nothing (there is no device memory to free); the tests force it on for CPU tensors.

Both are exact: outputs and gradients equal the untiled / non-offloaded run up to float reassociation
(tests/train/test_long_context.py).
"""

from __future__ import annotations

import math
import types

import torch


def _decoders(model) -> list:
    from sparse_models.modeling_common import PodkitModelMixin

    decoders = [m for m in model.modules() if isinstance(m, PodkitModelMixin)]
    if not decoders:
        raise TypeError(f"{type(model).__name__} holds no podkit decoder: tiled MLP and checkpoint offload need a "
                        f"podkit model class (sparse_models)")
    return decoders


def _untiled_mlp(module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own class forward (the instance attribute ``forward`` is the tiled one)."""
    return type(module).forward(module, x)


def tiled_mlp_shards(x: torch.Tensor, hidden_size: int, num_shards: int | None) -> int:
    """Slices for ``x`` [B, S, hidden]: ``num_shards``, or ``ceil(S / hidden_size)`` (ALST's rule). In the
    automatic case every rank takes the largest count (ZeRO-3 gathers the weights once per slice, so all
    ranks must call the MLP's projections the same number of times)."""
    if num_shards is not None:
        return num_shards
    shards = max(math.ceil(x.shape[-2] / hidden_size), 1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        count = torch.tensor(shards, device=x.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        shards = int(count.item())
    return shards


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = tiled_mlp_shards(x, self.podkit_hidden_size, self.podkit_mlp_shards)
    if shards == 1:
        return _untiled_mlp(self, x)
    params = [p for p in self.parameters() if p.requires_grad]
    return TiledMLP.apply(_untiled_mlp, self, x, shards, params)


def enable_tiled_mlp(model, num_shards: int | None = None) -> int:
    """Make every podkit decoder layer's MLP in ``model`` (plain, peft- or DeepSpeed-wrapped) a tiled MLP.

    ``num_shards``: slices of the sequence, or None for ``ceil(S_local / hidden_size)``. Returns the
    number of MLPs tiled. Undo with :func:`disable_tiled_mlp`. Weights and state dict are unchanged.
    """
    if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, int)
                                   or num_shards < 1):
        raise ValueError(f"train.tiled_mlp_shards={num_shards!r}: expected an integer >= 1, or null for "
                         f"ceil(tokens per rank / hidden_size)")
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # noqa: F401
    except ImportError as error:
        raise ImportError(f"train.tiled_mlp uses DeepSpeed's TiledMLP (deepspeed.runtime.sequence_parallel."
                          f"ulysses_sp); importing it failed: {error}") from error
    count = 0
    for decoder in _decoders(model):
        for layer in decoder.layers:
            mlp = layer.mlp
            mlp.podkit_hidden_size = decoder.config.hidden_size
            mlp.podkit_mlp_shards = num_shards
            mlp.forward = types.MethodType(_tiled_forward, mlp)
            count += 1
    return count


def disable_tiled_mlp(model) -> None:
    """Restore the plain MLP forward everywhere :func:`enable_tiled_mlp` tiled it."""
    for decoder in _decoders(model):
        for layer in decoder.layers:
            for name in ("forward", "podkit_hidden_size", "podkit_mlp_shards"):
                layer.mlp.__dict__.pop(name, None)


class CheckpointOffload:
    """DeepSpeed's checkpoint-input offload for podkit's decoder loop.

    ``with offload:`` around a training step's forward *and* backward (the offloaded tensors come back
    in the backward; leaving the context drops them). Inside, the decoder marks each checkpointed layer
    input (``mark`` / ``unmark``), and DeepSpeed's pack hook moves the marked ones to CPU.
    ``stats``: DeepSpeed's counters of the last step (offloaded_tensors, offloaded_bytes, ...).
    """

    def __init__(self, **engine_options):
        try:
            from deepspeed.runtime.activation_checkpointing.offload_activations import (
                get_checkpoint_hidden_states_offloading_ctx_manager,
            )
        except ImportError as error:
            raise ImportError(f"train.activation_offload uses DeepSpeed's CheckpointHiddenStatesOffload "
                              f"(deepspeed.runtime.activation_checkpointing.offload_activations); importing it "
                              f"failed: {error}") from error
        self.manager = get_checkpoint_hidden_states_offloading_ctx_manager(**engine_options)

    def mark(self, tensor: torch.Tensor) -> None:
        self.manager.mark(tensor)

    def unmark(self, tensor: torch.Tensor) -> None:
        """Drop a mark the pack hook did not consume (no grad, or outside the context): ids get reused."""
        self.manager._consume_mark(tensor)

    @property
    def stats(self):
        return self.manager.stats

    def __enter__(self):
        self.manager.__enter__()
        return self

    def __exit__(self, *exc):
        return self.manager.__exit__(*exc)


def attach_checkpoint_offload(model, offload: CheckpointOffload | None) -> None:
    """Point every podkit decoder in ``model`` at ``offload`` (None detaches)."""
    for decoder in _decoders(model):
        decoder.checkpoint_offload = offload
