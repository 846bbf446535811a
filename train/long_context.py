"""Activation memory that stops growing with the sequence: tiled MLP and checkpoint offload to CPU.

Both are DeepSpeed's components of Arctic Long Sequence Training (ALST, arXiv 2506.13996: tiled MLP
compute, activation checkpoint offload to CPU), switched on by the recipe
(``train.tiled_mlp``, ``train.tiled_mlp_shards``, ``train.activation_offload``):

* **Tiled MLP** (``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``): each decoder layer's MLP
  runs on ``shards`` slices of the sequence, without autograd in the forward, and recomputes one slice
  at a time in the backward. The [B, S, intermediate] activations (gate, up, their product: 3.5x the
  hidden size each for Llama-3-8B) then exist for one slice at a time. Shards: ``train.tiled_mlp_shards``,
  or by default ``ceil(tokens per rank / (4 * hidden_size))`` (slices of about 4 x ``hidden_size``
  tokens, so the MLP's peak no longer depends on S). Costs one extra MLP forward per layer, and every
  slice costs time of its own under ZeRO-3: ALST's rule of ``hidden_size``-token slices (8 at 32K for
  Llama-3-8B) made the 32-layer LoRA step on one H200 much slower than 2 slices for little less peak
  memory (BENCHMARKS.md, "Where the long-context step's time went").
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


def default_mlp_shards(tokens_per_rank: int, hidden_size: int) -> int:
    """``ceil(tokens per rank / (4 * hidden_size))`` slices, i.e. slices of about ``4 * hidden_size`` tokens.

    ALST (arXiv 2506.13996) slices at ``hidden_size`` tokens. Four times that keeps the slice's MLP activations
    small (Llama-3-8B: 16K tokens x 14336 x 3 bf16 tensors = 1.3 GiB) with a quarter of the slices, which is
    what costs the time (module docstring)."""
    return max(math.ceil(tokens_per_rank / (4 * hidden_size)), 1)


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    if self.podkit_mlp_shards == 1:
        return _untiled_mlp(self, x)
    params = [p for p in self.parameters() if p.requires_grad]
    return TiledMLP.apply(_untiled_mlp, self, x, self.podkit_mlp_shards, params)


def enable_tiled_mlp(model, tokens_per_rank: int, num_shards: int | None = None) -> int:
    """Make every podkit decoder layer's MLP in ``model`` (plain, peft- or DeepSpeed-wrapped) a tiled MLP.

    ``num_shards``: slices of the sequence, or None for :func:`default_mlp_shards` of ``tokens_per_rank``
    (the training row length / the sequence-parallel size). The count is fixed here, not per call: under
    ZeRO-3 every rank must call the MLP's projections equally often (each call gathers the weights), and a
    per-call rule would need a collective per layer to agree. Returns the count. Weights and state dict are
    unchanged; undo with :func:`disable_tiled_mlp`.
    """
    if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, int)
                                   or num_shards < 1):
        raise ValueError(f"train.tiled_mlp_shards={num_shards!r}: expected an integer >= 1, or null for "
                         f"ceil(tokens per rank / (4 * hidden_size))")
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # noqa: F401
    except ImportError as error:
        raise ImportError(f"train.tiled_mlp uses DeepSpeed's TiledMLP (deepspeed.runtime.sequence_parallel."
                          f"ulysses_sp); importing it failed: {error}") from error
    decoders = _decoders(model)
    shards = num_shards or default_mlp_shards(tokens_per_rank, decoders[0].config.hidden_size)
    for decoder in decoders:
        for layer in decoder.layers:
            mlp = layer.mlp
            mlp.podkit_mlp_shards = shards
            mlp.forward = types.MethodType(_tiled_forward, mlp)
    return shards


def disable_tiled_mlp(model) -> None:
    """Restore the plain MLP forward everywhere :func:`enable_tiled_mlp` tiled it."""
    for decoder in _decoders(model):
        for layer in decoder.layers:
            for name in ("forward", "podkit_mlp_shards"):
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
