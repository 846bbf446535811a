"""POD-adapted Llama / Mistral / Qwen2 for ``trust_remote_code=True`` users without podkit.

Self-contained: imports only ``torch`` and ``transformers``. podkit's export (``train/export.py``)
copies this file next to the weights and writes ``auto_map`` into ``config.json``::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True)

What it implements: POD, "Proximal tokens Over Distant tokens" (Ma et al., arXiv 2412.02252, v2 key
sharing). For a query at position i, a key position j <= i is *proximal* when ``j < sink`` or
``i - j < recent``; proximal logits use the layer's own key k_l[j], distant logits the key of the
block's anchor layer k_a[j] (per KV head, ``anchor_layers[layer][kv_head]``); one softmax over both
(= the log-sum-exp merge with the parameter-free gate g = sigmoid(lse_P - lse_D)), applied to the
layer's own values. A (layer, KV head) that is its own anchor is plain causal attention. With
``pod.sharing: scores`` (v1) the distant logits are the anchor layer's own, q_a[i] . k_a[j].

How: transformers' own modules (projections, RoPE incl. Llama-3.1 scaling, Qwen2 biases, MLP,
norms, ``DynamicCache``) with one attention function, :func:`pod_attention_forward`, registered in
``AttentionInterface``. It is one SDPA call per query chunk over the concatenated keys
``[k_own ; k_anchor]`` (values ``[v ; v]``) with the mask ``[causal & proximal ; causal & distant]``
for shared heads (``[causal ; none]`` for own-anchor heads), in fp32 math like podkit's reference. Score
sharing widens the head dimension instead of calling SDPA twice: queries ``[q, q_a]`` against keys
``[k_own, 0]`` and ``[0, k_anchor]`` give exactly ``q . k_own`` and ``q_a . k_anchor``.

Differences from podkit's classes (same logits; tests/train/test_standalone_export.py checks it):
  * keys of every layer stay in the ``DynamicCache``: the math is POD's, the KV memory saving is
    not (podkit's ``SparseKVCache`` drops non-anchor distant keys);
  * no FP8 KV cache (``kv_cache_dtype`` other than "bfloat16" is refused at load time);
  * no Triton kernels, no TidalDecode / Token Sparse / Quest / StreamingLLM schemes (the export's
    schemes are ``pod`` or ``dense``; anything else is refused at load time);
  * ``pod.gate_tau`` (decode compute skipping) is not applied: a warning says so, and decode
    outputs equal podkit's with ``gate_tau=None``;
  * padding: positions follow the 2-D ``attention_mask`` (left or right padding), as in podkit;
    logits at padded positions are whatever the math gives (podkit returns zeros there).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaForCausalLM
from transformers.models.mistral.modeling_mistral import MistralForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

try:  # transformers >= 5 configs are strict dataclasses: a new field needs the decorator
    from huggingface_hub.dataclasses import strict
except ImportError:  # pragma: no cover - older huggingface_hub
    def strict(cls):
        return cls

logger = logging.getLogger(__name__)

ATTENTION_NAME = "podkit_pod_standalone"
QUERY_CHUNK = 2048  # query rows per SDPA call: bounds the [Hq, chunk, 2N] boolean mask
SUPPORTED_SCHEMES = ("pod", "dense")


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------

def pod_settings(sparse_attention: dict | None, num_layers: int, num_kv_heads: int) -> dict:
    """Validated POD settings from a config's ``sparse_attention`` dict.

    Returns ``{"anchors": tuple[tuple[int, ...], ...] [layer][kv_head], "sources": set of layers whose keys
    a layer above borrows, "sink": int, "recent": int}``;
    dense (every layer its own anchor) unless both schemes are ``pod`` with an anchor map.
    """
    sa = dict(sparse_attention or {})
    pod = dict(sa.get("pod") or {})
    prefill, decode = sa.get("prefill_scheme", "dense"), sa.get("decode_scheme", "dense")
    for name, value in (("prefill_scheme", prefill), ("decode_scheme", decode)):
        if value not in SUPPORTED_SCHEMES:
            raise ValueError(f"sparse_attention.{name}={value!r} is not implemented by the standalone modeling file "
                             f"(expected one of {', '.join(SUPPORTED_SCHEMES)}); install podkit to use it")
    kv_cache_dtype = sa.get("kv_cache_dtype", "bfloat16")
    if kv_cache_dtype != "bfloat16":
        raise ValueError(f"sparse_attention.kv_cache_dtype={kv_cache_dtype!r} is not implemented by the standalone "
                         f"modeling file (expected 'bfloat16': its DynamicCache keeps K/V in the model's dtype); "
                         f"install podkit for the FP8 cache ('fp8_e4m3')")
    if prefill != decode:
        raise ValueError(f"sparse_attention.prefill_scheme={prefill!r} and decode_scheme={decode!r}: the standalone "
                         f"modeling file runs one scheme for both phases; install podkit for mixed schemes")
    sharing = pod.get("sharing", "keys")
    if sharing not in ("keys", "scores"):
        raise ValueError(f"sparse_attention.pod.sharing={sharing!r}: expected 'keys' (the paper's v2) or 'scores' "
                         f"(v1)")
    if pod.get("gate_tau") is not None:
        logger.warning("sparse_attention.pod.gate_tau=%s: the standalone modeling file does not skip distant "
                       "attention; outputs equal podkit's with gate_tau=None", pod["gate_tau"])
    own = tuple(tuple([layer] * num_kv_heads) for layer in range(num_layers))
    anchors = pod.get("anchor_layers") if prefill == "pod" else None
    if anchors is None:
        return {"anchors": own, "sources": set(), "sink": 0, "recent": 1, "sharing": "keys"}
    if len(anchors) != num_layers or any(len(row) != num_kv_heads for row in anchors):
        raise ValueError(f"sparse_attention.pod.anchor_layers: expected {num_layers} rows of {num_kv_heads} anchor "
                         f"layers (one per KV head), got {len(anchors)} rows")
    for layer, row in enumerate(anchors):
        for head, anchor in enumerate(row):
            previous = anchors[layer - 1][head] if layer > 0 else 0
            if anchor not in (layer, previous):
                raise ValueError(f"sparse_attention.pod.anchor_layers[{layer}][{head}]={anchor!r}: a block is "
                                 f"consecutive layers anchored at its lowest layer; expected {layer} or {previous}")
    sink, recent = pod.get("sink_tokens", 16), pod.get("recent_window", 4080)
    if not (isinstance(sink, int) and sink >= 0 and isinstance(recent, int) and recent >= 1):
        raise ValueError(f"sparse_attention.pod sink_tokens={sink!r}, recent_window={recent!r}: expected integers "
                         f">= 0 and >= 1")
    anchors = tuple(tuple(int(a) for a in row) for row in anchors)
    sources = {a for layer, row in enumerate(anchors) for a in row if a != layer}
    return {"anchors": anchors, "sources": sources, "sink": sink, "recent": recent, "sharing": sharing}


@strict
class PodkitLlamaConfig(LlamaConfig):
    """LlamaConfig + ``sparse_attention`` (podkit's scheme dict)."""

    model_type = "podkit_llama"
    sparse_attention: dict | None = None


@strict
class PodkitMistralConfig(MistralConfig):
    """MistralConfig + ``sparse_attention`` (podkit's scheme dict)."""

    model_type = "podkit_mistral"
    sparse_attention: dict | None = None


@strict
class PodkitQwen2Config(Qwen2Config):
    """Qwen2Config + ``sparse_attention`` (podkit's scheme dict)."""

    model_type = "podkit_qwen2"
    sparse_attention: dict | None = None


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

class ForwardState:
    """Per-forward side state shared by the attention modules of one model.

    key_positions [B, N] int64 (position of each cache slot, -1 at padding), key_valid [B, N] bool,
    keys {layer: k [B, Hkv, N, D]} (post-RoPE, cache included) for the anchor layers' use above them, and
    under score sharing queries {layer: q [B, Hq, S, D]} (this forward's tokens).
    """

    def __init__(self, settings: dict):
        self.settings = settings
        self.key_positions: torch.Tensor | None = None
        self.key_valid: torch.Tensor | None = None
        self.keys: dict[int, torch.Tensor] = {}
        self.queries: dict[int, torch.Tensor] = {}


def pod_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """POD attention for transformers' attention interface.

    query [B, Hq, S, D]; key, value [B, Hkv, N, D] (this layer's cache incl. the S new tokens, post-RoPE).
    Returns (out [B, S, Hq, D], None). ``attention_mask`` (transformers' 4-D mask) is not used: positions
    and padding come from the state the model's forward filled from the 2-D mask.
    """
    state: ForwardState = module._podkit_state
    layer = module.layer_idx
    batch, num_heads, s, head_dim = query.shape
    num_kv, n = key.shape[1], key.shape[2]
    group = num_heads // num_kv
    anchors = state.settings["anchors"][layer]
    sink, recent = state.settings["sink"], state.settings["recent"]
    if state.key_positions is None or state.key_positions.shape[1] != n:
        raise RuntimeError(f"layer {layer}: {n} cached keys but the model prepared positions for "
                           f"{None if state.key_positions is None else state.key_positions.shape[1]}; call the "
                           f"model's forward (not a submodule) with a 2-D attention_mask")
    share_scores = state.settings["sharing"] == "scores"
    if layer in state.settings["sources"]:  # a layer above borrows this layer's keys (and queries)
        state.keys[layer] = key
        if share_scores:
            state.queries[layer] = query
    scale = head_dim ** -0.5 if scaling is None else scaling
    shared = torch.tensor([a != layer for a in anchors], device=query.device).repeat_interleave(group)  # [Hq]
    ct = torch.float64 if query.dtype == torch.float64 else torch.float32
    k_own, v = key.to(ct).repeat_interleave(group, 1), value.to(ct).repeat_interleave(group, 1)
    q_anchor = None
    if bool(shared.any()):
        k_anchor = torch.stack([key[:, h] if a == layer else state.keys[a][:, h] for h, a in enumerate(anchors)], 1)
        k_anchor = k_anchor.to(ct).repeat_interleave(group, 1)
        if share_scores:  # [k_own, 0] and [0, k_anchor] against [q, q_a]: [B, Hq, 2N, 2D]
            q_anchor = torch.stack([query[:, h] if anchors[h // group] == layer else state.queries[anchors[h // group]][:, h]
                                    for h in range(num_heads)], 1).to(ct)
            zeros = torch.zeros_like(k_own)
            keys = torch.cat([torch.cat([k_own, zeros], -1), torch.cat([zeros, k_anchor], -1)], dim=2)
        else:
            keys = torch.cat([k_own, k_anchor], dim=2)  # [B, Hq, 2N, D]
        values = torch.cat([v, v], dim=2)
    else:
        keys, values = k_own, v
    kpos, kvalid = state.key_positions, state.key_valid                                 # [B, N]
    outputs = []
    for start in range(0, s, QUERY_CHUNK):
        stop = min(s, start + QUERY_CHUNK)
        qpos = kpos[:, n - s + start:n - s + stop]                                      # [B, c]
        causal = (kpos[:, None, :] <= qpos[:, :, None]) & kvalid[:, None, :] & (qpos[:, :, None] >= 0)  # [B, c, N]
        if keys.shape[2] == n:
            mask = causal[:, None]
        else:
            proximal = (kpos[:, None, :] < sink) | (qpos[:, :, None] - kpos[:, None, :] < recent)
            sh = shared[None, :, None, None]
            own_part = causal[:, None] & (~sh | proximal[:, None])
            distant_part = causal[:, None] & sh & ~proximal[:, None]
            mask = torch.cat([own_part, distant_part], dim=-1)                          # [B, Hq, c, 2N]
        q = query[:, :, start:stop].to(ct)
        if q_anchor is not None:
            q = torch.cat([q, q_anchor[:, :, start:stop]], dim=-1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        rows = mask.any(-1, keepdim=True)  # padding rows see no key: 0 instead of NaN
        outputs.append(torch.where(rows, out, torch.zeros((), dtype=ct, device=out.device)))
    out = torch.cat(outputs, dim=2).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, pod_attention_forward)


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------

class PodkitStandaloneMixin:
    """Installs the POD attention and fills the per-forward state from the 2-D attention mask."""

    def _podkit_setup(self, config) -> None:
        settings = pod_settings(config.sparse_attention, config.num_hidden_layers, config.num_key_value_heads)
        self._podkit_state = ForwardState(settings)
        for layer in self.model.layers:
            layer.self_attn._podkit_state = self._podkit_state
        self.config._attn_implementation = ATTENTION_NAME

    def generate(self, inputs=None, *args, **kwargs):
        """transformers' ``generate()``; a right-padded prompt batch is left-aligned first (generation continues
        each row from the last column, padding in a right-padded row), as podkit's classes do
        (sparse_models/ragged.py left_align). The returned prompts are then left-padded (same width)."""
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 0 \
                and kwargs.get("cache", kwargs.get("past_key_values")) is None:
            width = mask.shape[1]
            cols = torch.arange(width, device=mask.device)
            last = torch.where(mask != 0, cols[None, :], torch.full_like(cols[None, :], -1)).amax(-1)
            shift = torch.where(last >= 0, width - 1 - last, torch.zeros_like(last))
            if bool(shift.any()):
                source = (cols[None, :] - shift[:, None]) % width

                def roll(x):
                    idx = source.to(x.device).view(*source.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
                    return torch.gather(x, 1, idx)

                ids = kwargs.get("input_ids", inputs)
                if isinstance(ids, torch.Tensor) and ids.shape == mask.shape:
                    if "input_ids" in kwargs:
                        kwargs["input_ids"] = roll(ids)
                    else:
                        inputs = roll(ids)
                if isinstance(kwargs.get("inputs_embeds"), torch.Tensor):
                    kwargs["inputs_embeds"] = roll(kwargs["inputs_embeds"])
                kwargs["attention_mask"] = roll(mask)
        return super().generate(inputs, *args, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        if self.config._attn_implementation != ATTENTION_NAME:
            logger.warning("attn_implementation=%r replaced by %r: POD needs its own attention",
                           self.config._attn_implementation, ATTENTION_NAME)
            self.config._attn_implementation = ATTENTION_NAME
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ref = input_ids if input_ids is not None else inputs_embeds
        batch, s = ref.shape[0], ref.shape[1]
        past = int(cache.get_seq_length()) if cache is not None else 0
        n = past + s
        limit = getattr(self.config, "sliding_window", None) if getattr(self.config, "use_sliding_window", True) else None
        if limit is not None and n > limit:
            raise NotImplementedError(f"sequence length {n} exceeds sliding_window={limit}: POD here implements "
                                      f"full-attention layers only")
        if attention_mask is None:
            mask = torch.ones(batch, n, dtype=torch.bool, device=ref.device)
        else:
            if attention_mask.dim() != 2 or attention_mask.shape[1] < n:
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)}: expected a 2-D [batch, past + new] "
                                 f"0/1 mask covering {n} positions")
            mask = attention_mask[:, -n:].bool()
        positions = mask.long().cumsum(-1) - 1
        positions = positions.masked_fill(~mask, -1)
        state = self._podkit_state
        state.key_positions, state.key_valid, state.keys = positions, mask, {}
        if position_ids is None:  # RoPE at the real positions (left padding), as podkit does
            position_ids = positions[:, -s:].clamp_min(0)
        try:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, **kwargs)
        finally:
            state.keys = {}


class PodkitLlamaForCausalLM(PodkitStandaloneMixin, LlamaForCausalLM):
    config_class = PodkitLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self._podkit_setup(config)


class PodkitMistralForCausalLM(PodkitStandaloneMixin, MistralForCausalLM):
    config_class = PodkitMistralConfig

    def __init__(self, config):
        super().__init__(config)
        self._podkit_setup(config)


class PodkitQwen2ForCausalLM(PodkitStandaloneMixin, Qwen2ForCausalLM):
    config_class = PodkitQwen2Config

    def __init__(self, config):
        super().__init__(config)
        self._podkit_setup(config)


AUTO_MAP = {
    "podkit_llama": ("PodkitLlamaConfig", "PodkitLlamaForCausalLM"),
    "podkit_mistral": ("PodkitMistralConfig", "PodkitMistralForCausalLM"),
    "podkit_qwen2": ("PodkitQwen2Config", "PodkitQwen2ForCausalLM"),
}
