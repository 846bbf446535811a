"""Model-level evaluation procedures that put each scheme in the phase where it acts.

Decode schemes (TidalDecode, Quest, StreamingLLM, POD decode) only change the attention of tokens
processed one at a time after a prefill; prefill schemes (Token Sparse, POD prefill) only change the
prefill. A plain "forward the prompt, generate the answer" run would therefore hide most of a decode
scheme's effect (the first answer token comes from prefill logits). The procedures here:

* **Retrieval** (:func:`retrieval_generate`): prefill the *context* (haystack + needle) with the
  prefill scheme, then feed the *question* token by token through the decode path ("simulated
  decoding", as Quest's LongBench evaluation does), then generate the answer greedily, also through
  the decode path. Every query that has to find the needle is a decode query.
* **Perplexity** (:func:`window_perplexity`): for a window of L tokens, prefill the first
  ``L - decode_tokens`` tokens (prefill scheme), then feed the remaining tokens one at a time through
  the decode path (teacher forcing). Two numbers come out of the same run:
  ``prefill`` = NLL of tokens 1 .. P-1 from the prefill logits (what a prefill scheme changes), and
  ``decode`` = NLL of the last ``decode_tokens - 1`` tokens, each predicted by a decode step whose
  query attended under the decode scheme to a cache built by the prefill scheme (what a decode scheme
  changes, and what a prefill scheme leaves behind in the KV cache). Every setting, dense included,
  is scored on the same tokens, so the numbers compare directly. Decode steps are one token each:
  this is the only faithful way to apply a decode scheme to a scored token (a multi-token chunk is a
  prefill-like "chunk" phase with exact attention), and it costs one model step per scored token.

Only torch and the model are used (no lm-eval / datasets / deepspeed): runs on the GPU image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sparse_models.calibration.pod_similarity import read_blocks_json


def _step(model, ids: torch.Tensor, cache) -> tuple[torch.Tensor, Any]:
    """One forward of ``ids[1,S]`` on ``cache``: (logits ``[1,S,V]``, the cache to pass next).

    The phase follows from the cache: empty -> prefill, one token after a past -> decode.
    podkit models take ``cache=``; plain transformers models get ``past_key_values=``, the name both
    5.17 and 5.24 accept (5.24 renamed it ``cache`` and warns on the old name).
    """
    if hasattr(model, "new_cache"):
        out = model(input_ids=ids, cache=cache, use_cache=True)
    else:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    returned = getattr(out, "past_key_values", None)
    if returned is None:
        returned = getattr(out, "cache", None)
    return out.logits, (returned if returned is not None else cache)


def new_cache(model):
    """A fresh cache for the model's current schemes (podkit models), or None (transformers builds one)."""
    return model.new_cache() if hasattr(model, "new_cache") else None


def token_sparse_sparsity(model) -> float | None:
    """Mean dropped-token fraction of the last prefill if Token Sparse ran, else None."""
    stats = getattr(model, "token_sparse_stats", None)
    if stats is None or not getattr(stats, "layers", None):
        return None
    return float(stats.mean_token_sparsity)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    context_tokens: int
    question_tokens: int
    token_sparsity: float | None


@torch.no_grad()
def retrieval_generate(model, tokenizer, context: str, question: str, *, max_new_tokens: int = 8,
                       question_in_decode: bool = True, stop_at_newline: bool = True) -> Generation:
    """Greedy answer to ``context + question``; the question goes through the decode path (see module doc)."""
    device = next(model.parameters()).device
    context_ids = tokenizer(context, return_tensors="pt")["input_ids"].to(device)
    question_ids = tokenizer(question, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    cache = new_cache(model)
    if question_in_decode:
        logits, cache = _step(model, context_ids, cache)
        sparsity = token_sparse_sparsity(model)
        for position in range(question_ids.shape[1]):
            logits, cache = _step(model, question_ids[:, position:position + 1], cache)
    else:
        logits, cache = _step(model, torch.cat([context_ids, question_ids], dim=1), cache)
        sparsity = token_sparse_sparsity(model)
    generated: list[int] = []
    eos = tokenizer.eos_token_id
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        if eos is not None and token == eos:
            break
        generated.append(token)
        if stop_at_newline and "\n" in tokenizer.decode([token]) and len(generated) > 1:
            break
        logits, cache = _step(model, torch.tensor([[token]], device=device), cache)
    return Generation(tokenizer.decode(generated), generated, context_ids.shape[1], question_ids.shape[1], sparsity)


@dataclass
class WindowNLL:
    """Summed negative log-likelihoods (nats) and token counts of one window, by phase."""

    prefill_nll: float
    prefill_tokens: int
    decode_nll: float
    decode_tokens: int
    token_sparsity: float | None

    @property
    def prefill_ppl(self) -> float:
        return math.exp(self.prefill_nll / self.prefill_tokens) if self.prefill_tokens else float("nan")

    @property
    def decode_ppl(self) -> float:
        return math.exp(self.decode_nll / self.decode_tokens) if self.decode_tokens else float("nan")


def _target_nll(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> float:
    """Sum over positions of -log softmax(logits[i])[targets[i]]; ``logits[N,V]``, chunked to bound memory."""
    total = 0.0
    for start in range(0, logits.shape[0], chunk):
        part = logits[start:start + chunk].float()
        total += float((torch.logsumexp(part, -1) - part.gather(-1, targets[start:start + chunk, None])[:, 0]).sum())
    return total


@torch.no_grad()
def window_perplexity(model, ids: list[int] | torch.Tensor, *, decode_tokens: int) -> WindowNLL:
    """Prefill ``ids[:P]`` then teacher-force ``ids[P:]`` one decode step at a time (``P = L - decode_tokens``)."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).reshape(1, -1)
    length = ids.shape[1]
    if not 0 <= decode_tokens < length - 1:
        raise ValueError(f"decode_tokens={decode_tokens} is invalid for a window of {length} tokens: "
                         f"expected 0 <= decode_tokens < {length - 1}")
    prefill_len = length - decode_tokens
    cache = new_cache(model)
    logits, cache = _step(model, ids[:, :prefill_len], cache)
    sparsity = token_sparse_sparsity(model)
    prefill_nll = _target_nll(logits[0, :-1], ids[0, 1:prefill_len])
    del logits
    decode_nll = 0.0
    for position in range(prefill_len, length - 1):
        step_logits, cache = _step(model, ids[:, position:position + 1], cache)
        decode_nll += _target_nll(step_logits[0, -1:], ids[0, position + 1:position + 2])
    return WindowNLL(prefill_nll, prefill_len - 1, decode_nll, max(decode_tokens - 1, 0), sparsity)


def apply_overrides(model, base_config: Any, overrides: dict[str, Any]) -> None:
    """Switch a loaded podkit model to ``base_config`` + ``overrides`` in place (no reload).

    ``pod_blocks_file`` is resolved here into ``pod_anchor_layers`` (from_pretrained would do it at
    load time; switching in place does not).
    """
    overrides = dict(overrides)
    blocks_file = overrides.pop("pod_blocks_file", None)
    if blocks_file is not None:
        overrides["pod_anchor_layers"] = read_blocks_json(blocks_file)["anchor_layers"]
    model.set_sparse_attention(base_config, **overrides)
