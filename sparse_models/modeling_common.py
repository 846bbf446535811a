"""podkit's decoder loop (gpt-fast style) shared by the Llama, Mistral and Qwen2 model classes.

``PodkitModelMixin`` replaces the transformers base model's ``forward``: it keeps transformers'
modules (embeddings, decoder layers' projections/MLP/RMSNorm, rotary embedding incl. Llama-3.1 rope
scaling, Qwen2's q/k/v biases) and parameter names, and owns only the attention computation, the
cache, the ragged-batch layout and the loop. ``PodkitCausalLMMixin`` adds the LM head, loss,
``generate()`` integration (a :class:`SparseKVCache` is injected) and ``from_pretrained`` with
scheme overrides.

Layout: the caller's (left- or right-) padded batch is packed so that sequence b holds its tokens at
slots [0, seq_len_b) with position id = slot (ARCHITECTURE.md); results go back to the caller's
layout on exit. ``position_ids`` passed by callers are ignored for that reason (they are implied).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .anchors import assemble_anchor_keys, assemble_anchor_queries, validate_anchor_layers
from .attention import ForwardState, layer_attention
from .cache import SparseKVCache
from .cache_layout import cache_layout
from .config import ConfigError, SparseAttentionConfig, is_override_key, looks_like_override
from .model_files import check_model_folder
from .plan import build_plan, model_family
from .ragged import left_align, pack_new_tokens
from .schemes.registry import get_scheme, warn_config_notices

# transformers 5.24 renamed the outputs' / generate's `past_key_values` to `cache`
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def sliding_window_limit(config) -> int | None:
    """The model's sliding attention window, if it has one podkit would have to honour."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


class PodkitModelMixin:
    """The decoder loop. Mixed in front of a transformers ``*Model`` (LlamaModel, MistralModel, Qwen2Model)."""

    def _podkit_init(self, config) -> None:
        self.gradient_checkpointing = False
        self.token_sparse_stats = None  # the last prefill's Scheme.prefill_stats() report (Token Sparse's)
        # Ulysses sequence parallelism (sparse_models.sequence_parallel.UlyssesAttention) or None; set by
        # train/ for SP training: each rank then holds a slice of every sequence.
        self.sequence_parallel = None
        # Offload of the checkpointed layer inputs to CPU, or None: an object with mark(tensor) / unmark(tensor)
        # (train/long_context.py, DeepSpeed's CheckpointHiddenStatesOffload, whose pack hook moves the tensors
        # marked here). Set by train/ for long-context training with gradient checkpointing.
        self.checkpoint_offload = None
        self.set_sparse_attention(SparseAttentionConfig.from_dict(config.sparse_attention))

    # ------------------------------------------------------------------ configuration
    def set_sparse_attention(self, sparse_config: SparseAttentionConfig) -> None:
        """Switch schemes (validated against this model's shape); stored in ``config.sparse_attention``."""
        cfg = self.config
        sparse_config = resolve_calibration_files(sparse_config)
        plan = build_plan(sparse_config, cfg.num_hidden_layers, cfg.num_key_value_heads, model_family(cfg))
        self.sparse_config = sparse_config
        self.plan = plan
        cfg.sparse_attention = sparse_config.to_dict()
        warn_config_notices(sparse_config, getattr(cfg, "max_position_embeddings", None))  # huge budget, no POD map

    def new_cache(self, capacity: int = 0) -> SparseKVCache:
        """An empty cache shaped for the current plan (``capacity`` slots preallocated)."""
        sc = self.sparse_config
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return SparseKVCache(self.plan, cfg.num_key_value_heads, head_dim, layout=cache_layout(sc, self.plan, head_dim),
                             capacity=capacity or 0)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None, output_attentions=None,
                return_dict=None, capture=None, capture_layers=None, **kwargs):
        """Run the decoder. Shapes: input_ids [B, S] or inputs_embeds [B, S, H]; attention_mask [B, past + S].

        Returns a ``BaseModelOutputWithPast`` (last_hidden_state [B, S, H] in the caller's layout, zeros
        at padding; the cache; hidden_states: L + 1 entries, the last one after the final norm, as in
        transformers). ``capture``: a dict that receives layer -> (q [B, Hq, S', D], k [B, Hkv, S', D])
        post-RoPE in the packed layout (see ``sparse_models.capture``).
        """
        if output_attentions:
            raise ValueError("output_attentions=True is not supported by podkit models (attention is never "
                             "materialised); use sparse_models.capture_attention_inputs to get q and k")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, SparseKVCache):
            raise TypeError(f"cache is a {type(cache).__name__}; podkit models need a SparseKVCache "
                            f"(model.new_cache(), or let generate() create it)")
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training
        if use_cache and cache is None:
            cache = self.new_cache()
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, s = embeds.shape[:2]
        device = embeds.device
        has_past = cache is not None and cache.seq_lens is not None and cache.columns_seen > 0
        packed = pack_new_tokens(attention_mask, batch, s, cache.seq_lens if has_past else None,
                                 cache.columns_seen if cache is not None else 0, device)
        old_lens = cache.seq_lens.clone() if has_past else torch.zeros(batch, dtype=torch.long, device=device)
        num_new = packed.num_new
        if not has_past or not bool((old_lens > 0).any()):
            phase = "prefill"
        elif packed.width == 1 and bool((num_new == 1).all()) and bool((old_lens > 0).all()):
            phase = "decode"
        else:
            phase = "chunk"
        limit = sliding_window_limit(self.config)
        if limit is not None and int((old_lens + num_new).max()) > limit:
            raise NotImplementedError(f"sequence length {int((old_lens + num_new).max())} exceeds this model's "
                                      f"sliding_window={limit}: podkit implements full-attention layers only")
        if phase == "decode" and cache.correction_period is not None \
                and cache.steps_since_correction >= cache.correction_period:
            self._tidal_correction(cache)
            old_lens = cache.seq_lens.clone()
        hidden = packed.pack(embeds)
        state = self._run_layers(hidden, phase, old_lens, num_new, cache, output_hidden_states, capture,
                                 capture_layers)
        hidden, all_hidden = state.pop("hidden"), state.pop("all_hidden")
        if cache is not None:
            cache.seq_lens = old_lens + num_new
            cache.columns_seen = (attention_mask.shape[1] if attention_mask is not None and attention_mask.shape[1] > s
                                  else cache.columns_seen + s)
            if phase == "decode" and cache.correction_period is not None:
                if input_ids is None:
                    raise ValueError("TidalDecode KV correction re-runs decoded tokens: decode with input_ids")
                cache.record_decoded(input_ids[:, -1])
        if phase == "prefill":
            self.token_sparse_stats = state["stats"]
        last = packed.unpack(hidden)
        hidden_states = tuple(packed.unpack(h) for h in all_hidden) + (last,) if output_hidden_states else None
        return BaseModelOutputWithPast(last_hidden_state=last, hidden_states=hidden_states, **{CACHE_FIELD: cache})

    def _run_layers(self, hidden, phase, old_lens, num_new, cache, output_hidden_states=False, capture=None,
                    capture_layers=None) -> dict:
        batch, width = hidden.shape[:2]
        new_lens = old_lens + num_new
        if cache is not None:
            cache.reserve(batch, int(old_lens.max()) + width, hidden.dtype, hidden.device)
            cache.set_view_limit(int(new_lens.max()))
        positions = old_lens[:, None] + torch.arange(width, device=hidden.device)[None, :]
        if self.sequence_parallel is not None:  # RoPE at global positions; attention sees the whole sequence
            positions, num_new, new_lens = self.sequence_parallel.global_positions_and_lengths(
                phase, cache, positions, num_new)
        cos, sin = self.rotary_emb(hidden, positions)
        make_stats = get_scheme(self.sparse_config.prefill_scheme).prefill_stats
        stats = make_stats() if phase == "prefill" and make_stats is not None else None
        state = ForwardState(phase, old_lens, num_new, new_lens, cache, self.sparse_config, self.plan, stats=stats,
                             capture=capture, capture_layers=set(capture_layers) if capture_layers is not None else None)
        anchor_key_roles = get_scheme(self.sparse_config.prefill_scheme).anchor_key_roles
        pod_prefill = phase == "prefill" and any(p.prefill in anchor_key_roles for p in self.plan)
        anchor_sources = {a for p in self.plan if p.prefill in anchor_key_roles for a in p.anchors if a != p.layer} \
            if pod_prefill else set()
        keys_by_layer: dict[int, torch.Tensor] = {}
        queries_by_layer: dict[int, torch.Tensor] = {}
        share_scores = self.sparse_config.pod.sharing == "scores"
        all_hidden = []
        use_checkpoint = self.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        for i in range(self.config.num_hidden_layers):
            if output_hidden_states:
                all_hidden.append(hidden)
            p = self.plan[i]
            k_partial, q_partial, own = None, None, None
            if pod_prefill and p.prefill in anchor_key_roles:
                # own-anchor heads are filled with the layer's own keys (and queries) inside the layer
                k_partial = assemble_anchor_keys(p.anchors, _with_placeholder(keys_by_layer, i))
                own = torch.tensor([a == i for a in p.anchors], device=hidden.device)
                if share_scores:
                    q_partial = assemble_anchor_queries(p.anchors, _with_placeholder(queries_by_layer, i))
            args = (i, hidden, cos, sin, k_partial, q_partial, own, state)
            if use_checkpoint:
                offload, layer_input = self.checkpoint_offload, hidden
                if offload is not None:  # the checkpoint saves its inputs: this one goes to CPU
                    offload.mark(layer_input)
                try:
                    hidden, k, q = checkpoint(self._layer_forward, *args, use_reentrant=False)
                finally:
                    if offload is not None:
                        offload.unmark(layer_input)
            else:
                hidden, k, q = self._layer_forward(*args)
            if i in anchor_sources:
                keys_by_layer[i] = k
                if share_scores:
                    queries_by_layer[i] = q
        hidden = self.norm(hidden)
        return {"hidden": hidden, "all_hidden": all_hidden, "stats": stats}

    def _layer_forward(self, i, hidden, cos, sin, k_partial, q_partial, own, state):
        """One decoder layer: hidden [B, S, H] -> (hidden [B, S, H], post-RoPE keys [B, Hkv, S, D], queries
        [B, Hq, S, D]). ``k_partial`` / ``q_partial``: anchor keys / queries (POD prefill), with
        placeholders at the heads that are their own anchor (``own``)."""
        layer = self.layers[i]
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        batch, s = x.shape[:2]
        d = attn.head_dim
        q = attn.q_proj(x).view(batch, s, -1, d).transpose(1, 2)
        k = attn.k_proj(x).view(batch, s, -1, d).transpose(1, 2)
        v = attn.v_proj(x).view(batch, s, -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_anchor = None if k_partial is None else torch.where(own[None, :, None, None], k, k_partial)
        q_anchor = None
        if q_partial is not None:
            own_q = own.repeat_interleave(q.shape[1] // own.shape[0])
            q_anchor = torch.where(own_q[None, :, None, None], q, q_partial)
        if self.sequence_parallel is None:
            out = layer_attention(i, q, k, v, state, k_anchor, q_anchor)
        else:  # all-to-all to head shards of the whole sequence and back around the same attention
            out = self.sequence_parallel.attention(layer_attention, i, q, k, v, state, k_anchor, q_anchor)
        out = out.transpose(1, 2).reshape(batch, s, -1)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, k, q

    def _tidal_correction(self, cache: SparseKVCache) -> None:
        """TidalDecode KV-cache correction (paper §3.3): re-run the last T sparse-decoded tokens with full
        attention over the cache and overwrite their K/V in every layer."""
        tokens = cache.decoded_tokens  # [B, T]
        steps = tokens.shape[1]
        start = cache.seq_lens - steps
        with torch.no_grad():
            embeds = self.embed_tokens(tokens)
            num_new = torch.full_like(start, steps)
            self._run_layers(embeds, "chunk", start, num_new, cache)
        cache.steps_since_correction = 0
        cache.decoded_tokens = None


def _with_placeholder(keys_by_layer, layer):
    """keys_by_layer plus zeros for ``layer`` itself (its own heads are substituted inside the layer)."""
    if layer in keys_by_layer:
        return keys_by_layer
    ref = next(iter(keys_by_layer.values())) if keys_by_layer else None
    if ref is None:
        raise RuntimeError(f"layer {layer} shares keys but no anchor layer below it produced keys")
    return {**keys_by_layer, layer: torch.zeros_like(ref)}


class PodkitCausalLMMixin:
    """LM head, loss, generate() integration and from_pretrained overrides. Mixed in front of ``*ForCausalLM``."""

    @property
    def plan(self):
        return self.model.plan

    @property
    def sparse_config(self) -> SparseAttentionConfig:
        return self.model.sparse_config

    @property
    def token_sparse_stats(self):
        """Achieved Token Sparse sparsity of the last prefill, a TokenSparseStats (the prefill scheme's
        ``Scheme.prefill_stats`` report; None if its prefill scheme reports nothing)."""
        return self.model.token_sparse_stats

    def set_sparse_attention(self, sparse_config: SparseAttentionConfig | dict | None = None, **overrides) -> None:
        """Switch schemes in place: a full config and/or flat overrides (``decode_scheme="tidal"``)."""
        if sparse_config is None:
            sparse_config = self.model.sparse_config
        elif isinstance(sparse_config, dict):
            sparse_config = SparseAttentionConfig.from_dict(sparse_config)
        if overrides:
            sparse_config = sparse_config.with_overrides(**overrides)
        self.model.set_sparse_attention(sparse_config)

    def new_cache(self, capacity: int = 0) -> SparseKVCache:
        return self.model.new_cache(capacity)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, output_hidden_states=None,
                output_attentions=None, return_dict=None, **kwargs):
        """Logits [B, S, V] in the caller's layout (zeros at padding); loss with ``labels`` (-100 ignored).

        ``skip_lm_head=True``: no logits; ``hidden_states`` is ``(final hidden [B, S, H],)`` instead."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                         capture=kwargs.pop("capture", None), capture_layers=kwargs.pop("capture_layers", None))
        hidden = out.last_hidden_state
        if kwargs.pop("skip_lm_head", False):
            # Training losses that chunk the LM head themselves (train/losses.py) take the final hidden
            # states [B, S, H] and never materialise [B, S, V] logits here.
            return CausalLMOutputWithPast(logits=None, hidden_states=(hidden,),
                                          **{CACHE_FIELD: getattr(out, CACHE_FIELD)})
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      **{k: v for k, v in kwargs.items() if k == "num_items_in_batch"})
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{CACHE_FIELD: getattr(out, CACHE_FIELD)})

    def generate(self, inputs=None, *args, **kwargs):
        """transformers' ``generate()``; a right-padded prompt batch (a tokenizer with ``padding_side="right"``)
        is left-aligned first, since generation continues every row from the last column (which holds padding
        in a right-padded row). The returned sequences then show those prompts left-padded (same width)."""
        mask = kwargs.get("attention_mask")
        past = kwargs.get(CACHE_FIELD, kwargs.get("past_key_values"))
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and past is None:
            ids = kwargs.get("input_ids", inputs)
            if ids is not None and not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape == mask.shape):
                ids = None  # not token ids of the mask's shape (an encoder input, or already handled): leave as is
            embeds = kwargs.get("inputs_embeds")
            mask, ids, embeds = left_align(mask, ids, embeds)
            kwargs["attention_mask"] = mask
            if embeds is not None:
                kwargs["inputs_embeds"] = embeds
            if ids is not None:
                if "input_ids" in kwargs:
                    kwargs["input_ids"] = ids
                else:
                    inputs = ids
        return super().generate(inputs, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Give generate() a SparseKVCache (transformers would build a DynamicCache)."""
        existing = model_kwargs.get(CACHE_FIELD)
        if existing is not None:
            if not isinstance(existing, SparseKVCache):
                raise TypeError(f"{CACHE_FIELD} is a {type(existing).__name__}; podkit models need a SparseKVCache")
            existing._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        params = list(inspect.signature(super()._prepare_cache_for_generation).parameters)
        bound = dict(zip(params[2:], args))
        bound.update(kwargs)
        capacity = bound.get("max_cache_length") or 0
        model_kwargs[CACHE_FIELD] = self.new_cache(int(capacity))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, sparse_attention=None, **kwargs):
        """Load a podkit or plain transformers checkpoint; scheme overrides win over the saved config.

        ``sparse_attention``: a SparseAttentionConfig or dict replacing the saved one; flat overrides
        such as ``decode_scheme="tidal", tidal_budget=256`` are applied on top.
        """
        # Keys shaped like an override but unknown (``tidal_budgt``) go to validation too, which names the close
        # matches, instead of reaching transformers (which would fail with a TypeError from __init__).
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if is_override_key(k) or looks_like_override(k)}
        if overrides:
            SparseAttentionConfig().with_overrides(**overrides)  # fail on bad values before loading weights
        if Path(str(pretrained_model_name_or_path)).is_dir():  # an incomplete export or truncated weights: named
            check_model_folder(pretrained_model_name_or_path)
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        base = model.model.sparse_config
        if sparse_attention is not None:
            base = (sparse_attention if isinstance(sparse_attention, SparseAttentionConfig)
                    else SparseAttentionConfig.from_dict(sparse_attention))
        if overrides:
            base = base.with_overrides(**overrides)
        base = resolve_calibration_files(base, pretrained_model_name_or_path)
        model.model.set_sparse_attention(base)
        return loaded


def _resolve_path(name: str, field: str, checkpoint_dir) -> Path:
    path = Path(name)
    if not path.is_absolute() and checkpoint_dir is not None and (Path(str(checkpoint_dir)) / path).is_file():
        path = Path(str(checkpoint_dir)) / path
    if not path.is_file():
        raise ConfigError(f"{field}={name!r} is invalid: no such file ({path})")
    return path


def resolve_calibration_files(sparse_config: SparseAttentionConfig, checkpoint_dir=None) -> SparseAttentionConfig:
    """Fill list fields from the calibration files a config points to (absolute paths, paths relative to
    the checkpoint folder, or to the working directory). Explicit lists win over files.

    - ``pod.blocks_file``: JSON with ``anchor_layers`` ([layer][kv_head] -> anchor layer), as written by
      ``sparse_models.calibration.pod_similarity``.
    - ``token_sparse.calibration_file``: JSON with ``sparse_layers``, as written by
      ``sparse_models.calibration.token_sparse_drift``.
    """
    pod, ts = sparse_config.pod, sparse_config.token_sparse
    if pod.blocks_file is not None and pod.anchor_layers is None:
        data = json.loads(_resolve_path(pod.blocks_file, "pod.blocks_file", checkpoint_dir).read_text())
        anchors = data.get("anchor_layers") if isinstance(data, dict) else None
        if anchors is None:
            raise ConfigError(f"pod.blocks_file={pod.blocks_file!r} is invalid: expected a JSON object with an "
                              f"'anchor_layers' list ([layer][kv_head] -> anchor layer)")
        validate_anchor_layers(anchors)
        sparse_config = dataclasses.replace(sparse_config, pod=dataclasses.replace(pod, anchor_layers=anchors))
    if ts.calibration_file is not None and ts.sparse_layers is None:
        data = json.loads(_resolve_path(ts.calibration_file, "token_sparse.calibration_file", checkpoint_dir).read_text())
        layers = data.get("sparse_layers") if isinstance(data, dict) else None
        if not isinstance(layers, list) or not all(isinstance(x, int) and x >= 0 for x in layers):
            raise ConfigError(f"token_sparse.calibration_file={ts.calibration_file!r} is invalid: expected a JSON "
                              f"object with a 'sparse_layers' list of layer indices")
        sparse_config = dataclasses.replace(sparse_config, token_sparse=dataclasses.replace(ts, sparse_layers=layers))
    return sparse_config
