"""The gated forward: every shared (layer, KV head) unit mixes dense and POD attention by a scalar gate.

DuoAttention (Xiao et al. 2024, arXiv 2410.10819, §3.2) gives each attention head a gate ``alpha`` in [0, 1] and
runs ``alpha * full attention + (1 - alpha) * streaming attention``; the model stays frozen and only the gates
learn. Here the two branches are POD's (Ma et al. 2024, arXiv 2412.02252, §2.2; METHODS.md A.3): for a unit
``(l, h)`` whose block anchor is ``a != l``,

    o = alpha[l, h] * dense(q_l, k_l, v_l) + (1 - alpha[l, h]) * pod(q_l, k_l, k_a, v_l)

where ``pod`` uses the layer's own keys for proximal pairs (the first ``sink`` positions and the last ``recent``)
and the anchor layer's keys for distant pairs, merged by one softmax (``kernels.pod_prefill_attention``, the op
the POD model's prefill runs: sparse_models/schemes/pod.py ``pod_prefill``). Units that are their own anchor run
dense attention (POD attention with ``k_a = k_l`` is dense). Query head ``qh`` reads KV head ``qh // G`` and takes
that unit's gate. ``alpha = 1`` everywhere is the dense model, ``alpha = 0`` the POD model of the candidate map
(tests/train/test_unit_selection.py holds both equal to sparse_models' models).

Under v1's score sharing (``sharing="scores"``, METHODS.md A.3) the POD branch's distant logits are the anchor
layer's own, ``q_a . k_a``: query head ``qh`` takes the anchor layer's queries of the same head
(``kernels.pod_prefill_attention(..., q_distant=)``), and proximal pairs keep ``q_l . k_l``.

The decoder loop is walked here through the model's public modules (``embed_tokens``, ``rotary_emb``, each
layer's norms, q/k/v/o projections and MLP, the final ``norm``), so nothing in sparse_models changes; it covers
the Llama family (Llama, Mistral without a sliding window, Qwen2: projection biases live in the modules).

Shapes: ``B`` batch, ``S`` tokens, ``H`` hidden, ``L`` layers, ``Hq`` / ``Hkv`` heads, ``D`` head dim.
"""

from __future__ import annotations

import torch

import kernels
from sparse_models.anchors import assemble_anchor_keys, assemble_anchor_queries


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # the model family's own RoPE

    return apply_rotary_pos_emb(q, k, cos, sin)


class GatedPodForward:
    """``forward(ids[B,S], alpha[L,Hkv]) -> final hidden states [B,S,H]`` (after the final norm) of ``model``
    with POD attention of ``anchor_layers`` gated per unit by ``alpha`` (module docstring).

    ``model``: a (podkit or transformers) Llama-family causal LM; its weights are not modified and are expected
    frozen (``freeze``). ``anchor_layers[layer][kv_head]``: the candidate block map. Batches are unpadded
    (every row ``S`` tokens): the synthetic samples are generated at one length.
    """

    def __init__(self, model, anchor_layers: list[list[int]], *, sink: int, recent: int, sharing: str = "keys"):
        if sharing not in ("keys", "scores"):
            raise ValueError(f"sharing={sharing!r}: expected 'keys' (paper v2) or 'scores' (v1)")
        self.model, self.inner = model, model.model
        self.anchors = [list(row) for row in anchor_layers]
        self.sink, self.recent, self.sharing = sink, recent, sharing
        config = model.config
        self.num_layers, self.num_kv_heads = config.num_hidden_layers, config.num_key_value_heads
        if len(self.anchors) != self.num_layers or any(len(row) != self.num_kv_heads for row in self.anchors):
            raise ValueError(f"anchor map of {len(self.anchors)} x {len(self.anchors[0])} units: the model has "
                             f"{self.num_layers} layers x {self.num_kv_heads} KV heads")
        # layers whose keys a later layer reads for distant positions
        self.sources = {a for layer, row in enumerate(self.anchors) for a in row if a != layer}

    def shared_mask(self) -> torch.Tensor:
        """``[L, Hkv]`` bool: the units that read an anchor's keys (the ones with a gate)."""
        return torch.tensor([[a != layer for a in row] for layer, row in enumerate(self.anchors)])

    def freeze(self) -> None:
        for p in self.model.parameters():
            p.requires_grad_(False)

    def logits(self, ids: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """``[B,S,V]`` logits of the gated model (the tests compare them with sparse_models' models)."""
        return self.model.lm_head(self.forward(ids, alpha))

    def forward(self, ids: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        batch, seq = ids.shape
        hidden = self.inner.embed_tokens(ids)
        positions = torch.arange(seq, device=ids.device)[None].expand(batch, seq)
        cos, sin = self.inner.rotary_emb(hidden, positions)
        lens = torch.full((batch,), seq, dtype=torch.long, device=ids.device)
        zeros = torch.zeros_like(lens)
        keys: dict[int, torch.Tensor] = {}
        queries: dict[int, torch.Tensor] = {}  # anchor layers' queries, under score sharing
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            d = attn.head_dim
            q = attn.q_proj(x).view(batch, seq, -1, d).transpose(1, 2)   # [B,Hq,S,D]
            k = attn.k_proj(x).view(batch, seq, -1, d).transpose(1, 2)   # [B,Hkv,S,D]
            v = attn.v_proj(x).view(batch, seq, -1, d).transpose(1, 2)
            q, k = _rotary(q, k, cos, sin)
            scale = getattr(attn, "scaling", d ** -0.5)
            out = kernels.prefill_attention(q, k, v, zeros, lens, scale=scale)
            row = self.anchors[i]
            if any(a != i for a in row):
                # distant keys per KV head: the anchor layer's (own keys where the unit is its own anchor)
                k_anchor = assemble_anchor_keys(tuple(row), keys | {i: k})
                # score sharing: query head qh takes the queries of its KV head's anchor layer
                q_distant = assemble_anchor_queries(tuple(row), queries | {i: q}) if self.sharing == "scores" else None
                pod = kernels.pod_prefill_attention(q, k, k_anchor, v, lens, sink=self.sink, recent=self.recent,
                                                    scale=scale, q_distant=q_distant)
                group = q.shape[1] // self.num_kv_heads
                gate = alpha[i].to(out.dtype).repeat_interleave(group)[None, :, None, None]   # [1,Hq,1,1]
                shared = torch.tensor([a != i for a in row], device=ids.device).repeat_interleave(group)
                # own-anchor heads stay exactly dense whatever their (unused) alpha entry holds
                gate = torch.where(shared[None, :, None, None], gate, torch.ones_like(gate))
                out = gate * out + (1 - gate) * pod
            if i in self.sources:
                keys[i] = k
                if self.sharing == "scores":
                    queries[i] = q
            out = out.transpose(1, 2).reshape(batch, seq, -1)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.inner.norm(hidden)

    __call__ = forward
