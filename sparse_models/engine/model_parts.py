"""The pieces of a Llama-family CausalLM that the engine runs, found by transformers' parameter names.

The engine owns the attention computation, the caches and the decode loop (gpt-fast style); it reuses
the model's own modules for everything else: the embedding, per layer the q/k/v/o projections (with
Qwen2's biases), the two RMSNorms and the MLP, the final norm, the lm_head and the rotary embedding
(llama3 / linear / yarn rope scaling included, since its ``inv_freq`` already carries the scaling).

Works with ``PodkitLlamaForCausalLM`` and with plain ``transformers`` ``LlamaForCausalLM`` /
``MistralForCausalLM`` / ``Qwen2ForCausalLM``: they share these names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import EngineError


@dataclass
class LayerModules:
    """One decoder layer's modules (owned by the model; the engine only calls them)."""

    input_layernorm: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module


@dataclass
class ModelParts:
    """Modules and shapes of a Llama-family CausalLM.

    Attributes:
        num_layers, num_heads (Hq), num_kv_heads (Hkv), head_dim (D), hidden_size, vocab_size.
        scale: softmax scale of the attention (the module's ``scaling``, else D ** -0.5).
        dtype / device: of the embedding weights (the engine's activation dtype).
    """

    embed_tokens: nn.Module
    layers: list[LayerModules]
    norm: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    scale: float
    dtype: torch.dtype
    device: torch.device
    config: object

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _require(obj, name: str, where: str):
    value = getattr(obj, name, None)
    if value is None:
        raise EngineError(f"model has no `{where}.{name}`: the engine runs Llama-family CausalLMs "
                          f"(PodkitLlamaForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")
    return value


def extract_model_parts(model: nn.Module) -> ModelParts:
    """Find the modules the engine needs in ``model`` (a CausalLM with ``.model`` and ``.lm_head``)."""
    inner = _require(model, "model", type(model).__name__)
    config = _require(model, "config", type(model).__name__)
    layers = []
    for i, layer in enumerate(_require(inner, "layers", "model")):
        attn = _require(layer, "self_attn", f"model.layers.{i}")
        layers.append(LayerModules(
            input_layernorm=_require(layer, "input_layernorm", f"model.layers.{i}"),
            q_proj=_require(attn, "q_proj", f"model.layers.{i}.self_attn"),
            k_proj=_require(attn, "k_proj", f"model.layers.{i}.self_attn"),
            v_proj=_require(attn, "v_proj", f"model.layers.{i}.self_attn"),
            o_proj=_require(attn, "o_proj", f"model.layers.{i}.self_attn"),
            post_attention_layernorm=_require(layer, "post_attention_layernorm", f"model.layers.{i}"),
            mlp=_require(layer, "mlp", f"model.layers.{i}"),
        ))
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    first_attn = inner.layers[0].self_attn
    scale = float(getattr(first_attn, "scaling", head_dim ** -0.5))
    embed = _require(inner, "embed_tokens", "model")
    weight = embed.weight
    return ModelParts(
        embed_tokens=embed, layers=layers, norm=_require(inner, "norm", "model"),
        lm_head=_require(model, "lm_head", type(model).__name__), rotary_emb=_require(inner, "rotary_emb", "model"),
        num_layers=len(layers), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        hidden_size=config.hidden_size, vocab_size=config.vocab_size, scale=scale,
        dtype=weight.dtype, device=weight.device, config=config,
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] with cos/sin [B, S, D] (transformers' rotate-half convention)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def rope_tables(parts: ModelParts, hidden: torch.Tensor, position_ids: torch.Tensor):
    """cos, sin [B, S, D] for position_ids [B, S]: computed once per forward, shared by every layer."""
    return parts.rotary_emb(hidden, position_ids)


def weighted_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm from its weight and epsilon (the compiled decode functions take tensors, not modules): normalise
    in fp32, cast back, multiply by the weight, as transformers' LlamaRMSNorm does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm with fewer kernels (one launch step matters at decode: 2 norms x L layers).

    Same math as transformers' LlamaRMSNorm / Qwen2RMSNorm / MistralRMSNorm: normalise in fp32, cast
    back, multiply by the weight. Other norm modules are called as they are.
    """
    eps = getattr(norm, "variance_epsilon", None)
    weight = getattr(norm, "weight", None)
    if eps is None or weight is None or type(norm).__name__ not in ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"):
        return norm(x)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def project_qkv(parts: ModelParts, layer: LayerModules, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Pre-attention half of a decoder layer (after the input norm).

    Args:
        x: [B, S, hidden] normalised hidden states; cos, sin: [B, S, D] (``rope_tables``).
    Returns:
        q [B, Hq, S, D], k [B, Hkv, S, D] (both post-RoPE), v [B, Hkv, S, D].
    """
    batch, s, _ = x.shape
    d = parts.head_dim
    q = layer.q_proj(x).view(batch, s, parts.num_heads, d).transpose(1, 2)
    k = layer.k_proj(x).view(batch, s, parts.num_kv_heads, d).transpose(1, 2)
    v = layer.v_proj(x).view(batch, s, parts.num_kv_heads, d).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def finish_layer(layer: LayerModules, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Post-attention half: o_proj, residual, MLP. attn_out [B, S, Hq * D] -> hidden [B, S, hidden]."""
    hidden = residual + layer.o_proj(attn_out)
    return hidden + layer.mlp(rms_norm(layer.post_attention_layernorm, hidden))
