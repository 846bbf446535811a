"""Tiny random podkit models and helpers shared by the sparse_models tests."""

from __future__ import annotations

import torch

from sparse_models import PodkitLlamaConfig, PodkitLlamaForCausalLM, SparseAttentionConfig

# (query heads, KV heads, hidden): GQA groups 1, 3, 4
GQA_SHAPES = {1: (4, 4, 64), 3: (6, 2, 48), 4: (8, 2, 64)}
VOCAB = 61


def tiny_config(group: int = 3, layers: int = 4, **extra) -> PodkitLlamaConfig:
    hq, hkv, hidden = GQA_SHAPES[group]
    return PodkitLlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=hq, num_key_value_heads=hkv, max_position_embeddings=512,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra)


def tiny_model(group: int = 3, layers: int = 4, sparse: SparseAttentionConfig | dict | None = None,
               seed: int = 0) -> PodkitLlamaForCausalLM:
    torch.manual_seed(seed)
    model = PodkitLlamaForCausalLM(tiny_config(group, layers)).eval()
    with torch.no_grad():  # larger weights than the default init: sharper, less uniform attention
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0, 0.35)
    if sparse is not None:
        model.set_sparse_attention(sparse if isinstance(sparse, SparseAttentionConfig)
                                   else SparseAttentionConfig.from_dict(sparse))
    return model


def pod_anchor_map(layers: int, kv_heads: int) -> list[list[int]]:
    """Head-wise blocks: even heads [0, 0, 2, 2, ...], odd heads [0, 1, 1, 3, 3, ...]."""
    rows = []
    for layer in range(layers):
        row = []
        for h in range(kv_heads):
            if h % 2 == 0:
                row.append(layer - layer % 2)
            else:
                row.append(0 if layer == 0 else layer - (layer + 1) % 2)
        rows.append(row)
    return rows


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask


def random_prompts(lengths, seed=None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def run_model(model, prompts, continuations):
    """Prefill (left-padded batch) then teacher-forced decode. Returns (prompt logits per row [n_b, V],
    list over steps of [B, V])."""
    ids, mask = left_padded(prompts)
    cache = model.new_cache()
    out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
    width = ids.shape[1]
    prompt_logits = [out.logits[b, width - len(p):] for b, p in enumerate(prompts)]
    steps = []
    for t in range(len(continuations[0])):
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
        tok = torch.tensor([[c[t]] for c in continuations])
        out = model(tok, attention_mask=mask, cache=cache, use_cache=True)
        steps.append(out.logits[:, -1])
    return prompt_logits, steps, cache
