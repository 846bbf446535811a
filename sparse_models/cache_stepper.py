"""The generation engine's ``prefill`` / ``step`` interface over a podkit model's own forward and cache.

:func:`sparse_models.engine.answers.engine_answers` drives either. The engine (static cache, CUDA graphs) is the
fast path; this one runs eagerly through the model classes, so it covers every configuration the model path
implements, including those the engine refuses (POD's v1 score sharing: the distant logits need the anchor
layer's query of the same step). Rows are ragged: the prompts are right-padded and packed by the model
(sparse_models/ragged.py), and every step feeds one token per row.
"""

from __future__ import annotations

import torch


class ModelCacheStepper:
    """``prefill(prompts) -> logits [B, V]`` and ``step(batch, tokens [batch]) -> logits [batch, V]`` (fp32) of
    ``model`` (a podkit causal LM, its current schemes) over a fresh ``SparseKVCache``.

    ``max_batch_size`` rows of at most ``max_seq_len`` tokens each (``capacity``), as the engine's arguments.
    """

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} is invalid: expected an integer >= 1")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len!r} is invalid: expected an integer >= 1")
        self.model, self.max_batch_size, self.capacity = model, max_batch_size, max_seq_len
        self.device = next(model.parameters()).device
        self.cache = None
        self._batch = 0

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill ``prompts`` (token id lists, each >= 1 token) into a new cache; the last tokens' logits [B, V]."""
        lengths = [len(p) for p in prompts]
        if not prompts or len(prompts) > self.max_batch_size or min(lengths) < 1 or max(lengths) > self.capacity:
            raise ValueError(f"prefill: {len(prompts)} prompts of {min(lengths, default=0)}-{max(lengths, default=0)} "
                             f"tokens; this stepper holds 1-{self.max_batch_size} rows of 1-{self.capacity} tokens")
        batch, width = len(prompts), max(lengths)
        ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
            mask[b, :len(p)] = 1
        self.cache = self.model.new_cache(self.capacity)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), cache=self.cache,
                         use_cache=True, skip_lm_head=True)
        last = torch.tensor(lengths, device=self.device) - 1
        self._batch = batch
        return self._logits(out.hidden_states[0][torch.arange(batch, device=self.device), last])

    @torch.no_grad()
    def step(self, batch: int, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [batch] (one per row, every row of the prefill) and return their logits [batch, V]."""
        if self.cache is None:
            raise RuntimeError("step() before prefill(): there is no cache to decode from")
        if batch != self._batch or tokens.shape != (batch,):
            raise ValueError(f"step: batch={batch} with tokens of shape {tuple(tokens.shape)}; the prefill held "
                             f"{self._batch} rows and a step feeds one token per row")
        ones = torch.ones(batch, 1, dtype=torch.long, device=self.device)
        out = self.model(input_ids=tokens.to(self.device)[:, None], attention_mask=ones, cache=self.cache,
                         use_cache=True, skip_lm_head=True)
        return self._logits(out.hidden_states[0][:, -1])
