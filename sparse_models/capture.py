"""Capture a model's attention inputs and residual stream, for calibration and analysis.

Used by the POD exploration (inter-layer attention similarity), the TidalDecode re-selection
analysis and the Token Sparse drift analysis. Both functions run one no-grad forward with the
model's current prefill scheme and no cache.
"""

from __future__ import annotations

import torch

from .ragged import pack_new_tokens


@torch.no_grad()
def capture_attention_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                             layers=None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE queries and keys per layer.

    Args:
        model: a podkit ``*ForCausalLM`` (or its ``.model``).
        input_ids: [B, S]; attention_mask: [B, S] 0/1 (left or right padding) or None.
        layers: iterable of layer indices (None = all).
    Returns:
        {layer: (q [B, Hq, S', D], k [B, Hkv, S', D])} in podkit's packed layout: sequence b's tokens
        at slots [0, n_b) with n_b = attention_mask[b].sum() (S' = max n_b); slots >= n_b are zero.
    """
    base = getattr(model, "model", model)
    captured: dict = {}
    base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, capture=captured,
         capture_layers=None if layers is None else list(layers))
    packed = pack_new_tokens(attention_mask, input_ids.shape[0], input_ids.shape[1], None, 0, input_ids.device)
    valid = packed.valid()[:, None, :, None]
    return {layer: (q.masked_fill(~valid, 0.0), k.masked_fill(~valid, 0.0)) for layer, (q, k) in sorted(captured.items())}


@torch.no_grad()
def capture_residual_stream(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                            ) -> list[torch.Tensor]:
    """The residual stream before each layer and after the last one (before the final norm).

    Returns L + 1 tensors [B, S, H] in the caller's layout (zeros at padding): entry l is layer l's
    input, entry l + 1 its output, which is what Token Sparse's drift R_l compares (METHODS.md C.2).
    ``output_hidden_states=True`` gives the same except that its last entry is after the final norm,
    as in transformers.
    """
    base = getattr(model, "model", model)
    hidden_states = []

    def hook(module, args, output):
        hidden_states.append(args[0])

    handle = base.norm.register_forward_hook(hook)
    try:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True)
    finally:
        handle.remove()
    packed = pack_new_tokens(attention_mask, input_ids.shape[0], input_ids.shape[1], None, 0, input_ids.device)
    return list(out.hidden_states[:-1]) + [packed.unpack(hidden_states[-1])]
