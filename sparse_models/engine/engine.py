"""The fast generation engine: static caches, CUDA-graph decode, every podkit scheme.

    engine = GenerationEngine(model, max_batch_size=4, max_seq_len=8192, decode_scheme="tidal", tidal_budget=2048)
    result = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=64, stop_token_ids=[2])
    result.tokens  # one list of new token ids per prompt

The engine reuses the model's weights and modules (``model_parts``), builds the per-layer plan from the
model's ``SparseAttentionConfig`` (``config.sparse_attention``) with load-time-style overrides, owns a
``StaticCache`` sized for ``max_batch_size`` x ``max_seq_len``, prefills with the chosen prefill scheme
and decodes with the chosen decode scheme, one CUDA graph per batch size on CUDA (eager elsewhere).
TidalDecode's KV-cache correction (arXiv 2410.05076 §3.3; ``tidal.correction_period`` = T) runs every T
decode steps: the last T tokens are recomputed with exact attention (one chunked prefill) and their K/V
overwritten.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

import kernels

from ..cache_layout import cache_layout
from ..config import ConfigError, SparseAttentionConfig
from ..kv_bytes import KVBytes
from ..modeling_common import resolve_calibration_files
from ..plan import build_plan, model_family
from ..schemes.registry import scheme_names, warn_config_notices
from .cuda_graph import GraphedStep
from .decode_step import DecodeStep
from .errors import EngineError
from .model_parts import extract_model_parts
from .prefill import check_prefill_roles, forward_chunk
from .sampling import SamplingConfig, sample_next
from .static_cache import StaticCache


@dataclass
class GenerationResult:
    """Output of :meth:`GenerationEngine.generate`.

    tokens: new token ids per prompt (a stop token, when hit, is included and ends the row).
    finish_reasons: "stop" or "length" per prompt.
    timings: wall clock, synchronised: ``prefill_s``, ``decode_s``, ``decode_steps``, ``ms_per_step`` (all
        steps); ``first_step_ms`` (the first decode step alone: it holds the CUDA-graph capture of a new
        batch size and the first torch.compile run), ``warmup_in_first_step`` (whether it did), and
        ``steady_ms_per_step`` (steps 2..N: the steady-state cost per token; None below 2 steps). A first
        ``generate`` also compiles the Triton kernels inside its prefill: run :meth:`GenerationEngine.warmup`
        first to keep that out of ``prefill_s``.
    stats: scheme statistics (e.g. Token Sparse kept fractions per layer); ``truncated_prompts``:
        ``{prompt index: original length}`` when ``truncate_prompts`` cut a prompt.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_lens: list[int]
    timings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


def _resolve_config(model, sparse_config, overrides) -> SparseAttentionConfig:
    if sparse_config is None:
        stored = getattr(model.config, "sparse_attention", None)
        if isinstance(stored, SparseAttentionConfig):
            sparse_config = stored
        elif isinstance(stored, dict):
            sparse_config = SparseAttentionConfig.from_dict(stored)
        else:
            sparse_config = SparseAttentionConfig()
    for key, allowed in (("decode_scheme", scheme_names("decode")), ("prefill_scheme", scheme_names("prefill"))):
        if key in overrides and overrides[key] not in allowed:
            raise EngineError(f"{key}={overrides[key]!r} is not a known scheme: expected one of {', '.join(allowed)}")
    try:
        config = sparse_config.with_overrides(**overrides) if overrides else sparse_config
        # a pod_blocks_file given here (generate --set) is read as the model's from_pretrained reads one
        return resolve_calibration_files(config, getattr(model, "name_or_path", None) or None)
    except ConfigError as err:
        raise EngineError(str(err)) from err


def fit_to_positions(prompts: list[list[int]], max_new_tokens: int, max_positions: int | None,
                     truncate: bool = False) -> tuple[list[list[int]], dict[int, int]]:
    """Check prompt + new tokens against the model's ``max_position_embeddings``, before any work.

    Beyond it, RoPE positions were never trained and the output is garbage (such a prompt runs for
    minutes and prints nonsense). ``truncate``: keep the
    last ``max_positions - max_new_tokens`` tokens of a longer prompt (the end usually holds the
    question) instead of raising. Returns (prompts, {index: original length} of the truncated ones).
    """
    if not max_positions:
        return prompts, {}
    room = max_positions - max_new_tokens
    if room < 1:
        raise EngineError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt within the model's "
                          f"max_position_embeddings={max_positions}: lower max_new_tokens")
    fitted, truncated = [], {}
    for i, prompt in enumerate(prompts):
        if len(prompt) > room:
            if not truncate:
                raise EngineError(f"prompt {i} has {len(prompt)} tokens + max_new_tokens={max_new_tokens} = "
                                  f"{len(prompt) + max_new_tokens} > the model's max_position_embeddings="
                                  f"{max_positions} (positions it was never trained on give garbage): shorten "
                                  f"the prompt, lower max_new_tokens, or truncate it to its last {room} tokens "
                                  f"(truncate_prompts=True; CLI: --truncate-prompt)")
            truncated[i] = len(prompt)
            prompt = prompt[len(prompt) - room:]
        fitted.append(prompt)
    return fitted, truncated


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DECODE_KERNELS = ("auto", "standard", "fused")


class GenerationEngine:
    """Static-cache generation for a Llama-family model with podkit's schemes.

    Args:
        model: PodkitLlamaForCausalLM (or any transformers Llama/Mistral/Qwen2 CausalLM), eval mode.
        sparse_config: the schemes; default: the model's ``config.sparse_attention`` (else dense).
        max_batch_size: sequences per generate() call.
        max_seq_len: cache slots per sequence (prompt + new tokens); default the model's
            ``max_position_embeddings``.
        use_cuda_graphs: capture the decode step (default: True on CUDA). Asked for on a machine
            without CUDA, it warns and runs eagerly.
        token_sparse_keep_ratio: replace Token Sparse's dynamic coverage by a fixed kept fraction.
        compile_layers: torch.compile the non-attention parts of the decode step (norms, projections,
            RoPE, MLP fused by Inductor; ``compiled_layers``). Default: off (first step compiles, ~tens of s).
        decode_kernels: ``"standard"`` (one cuBLAS ``F.linear`` per projection, indexed cache writes), ``"fused"``
            (q/k/v in one launch, gate/up in one with the SiLU gating fused, ``grouped_projections``; keys and values
            appended in one launch, ``kernels.append_kv``; batches of at most 64) or ``"auto"`` (default): fused on
            CUDA with ``max_batch_size <= 64``, standard otherwise. On an H200 the fused step is faster per token than
            the standard one for every scheme (BENCHMARKS.md "Where the dense decode step's time goes"). The choice
            made is ``engine.decode_kernels``.
        **overrides: flat scheme overrides (``decode_scheme="tidal", tidal_budget=2048``).
    """

    def __init__(self, model, *, sparse_config: SparseAttentionConfig | None = None, max_batch_size: int = 1,
                 max_seq_len: int | None = None, use_cuda_graphs: bool | None = None,
                 token_sparse_keep_ratio: float | None = None, compile_layers: bool = False,
                 decode_kernels: str = "auto", **overrides):
        self.model = model
        self.parts = extract_model_parts(model)
        self.config = _resolve_config(model, sparse_config, overrides)
        if token_sparse_keep_ratio is not None and not 0 < token_sparse_keep_ratio <= 1:
            raise EngineError(f"token_sparse_keep_ratio={token_sparse_keep_ratio!r} is invalid: expected a number "
                              f"in (0, 1]")
        self.token_sparse_keep_ratio = token_sparse_keep_ratio
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise EngineError(f"max_batch_size={max_batch_size!r} is invalid: expected an integer >= 1")
        if decode_kernels not in DECODE_KERNELS:
            raise EngineError(f"decode_kernels={decode_kernels!r} is invalid: expected one of {DECODE_KERNELS}")
        if decode_kernels == "fused" and max_batch_size > kernels.DECODE_LINEAR_MAX_ROWS:
            raise EngineError(f"decode_kernels='fused' runs decode batches of at most "
                              f"{kernels.DECODE_LINEAR_MAX_ROWS} rows; "
                              f"max_batch_size={max_batch_size}: use decode_kernels='standard'")
        device = self.parts.device
        requested_kernels = decode_kernels
        if decode_kernels == "auto":
            fits = max_batch_size <= kernels.DECODE_LINEAR_MAX_ROWS
            decode_kernels = "fused" if device.type == "cuda" and fits else "standard"
        self.decode_kernels = decode_kernels
        fused = decode_kernels == "fused"
        capacity = max_seq_len or getattr(model.config, "max_position_embeddings", None)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise EngineError(f"max_seq_len={max_seq_len!r} is invalid: expected an integer >= 2 (cache slots per "
                              f"sequence: prompt + new tokens)")
        window = getattr(model.config, "sliding_window", None)
        if getattr(model.config, "use_sliding_window", True) is not False and window and capacity > window:
            raise EngineError(f"max_seq_len={capacity} exceeds this model's sliding_window={window}: the engine "
                              f"implements full-attention layers only; use max_seq_len <= {window}")
        if use_cuda_graphs is None:
            use_cuda_graphs = device.type == "cuda"
        elif use_cuda_graphs and device.type != "cuda":
            warnings.warn(f"CUDA graphs were requested but the model is on {device} (CUDA graphs need a CUDA GPU); "
                          f"running the decode step eagerly", RuntimeWarning, stacklevel=2)
            use_cuda_graphs = False
        self.use_cuda_graphs = use_cuda_graphs
        # a budget beyond the context (the decode functions then read every slot exactly: covers_cache), POD without a
        # block map (the identity map: dense): each said once, as the model says them
        warn_config_notices(self.config, getattr(model.config, "max_position_embeddings", None))
        parts = self.parts
        try:
            self.plan = build_plan(self.config, parts.num_layers, parts.num_kv_heads, model_family(model.config))
        except ConfigError as err:
            raise EngineError(str(err)) from err
        check_prefill_roles(self.plan, self.config.prefill_scheme)
        self.cache = StaticCache(self.plan, parts.num_kv_heads, parts.head_dim, max_batch_size, capacity,
                                 dtype=parts.dtype, device=device, layout=cache_layout(self.config, self.plan, parts.head_dim),
                                 fused_append=fused)
        compiled = None
        if compile_layers or fused:
            from .compiled_layers import CompiledLayers

            compiled = CompiledLayers.build(parts, "grouped" if fused else "torch", compile=compile_layers)
            if compiled is None and (compile_layers or requested_kernels == "fused"):
                warnings.warn(f"compile_layers={compile_layers}, decode_kernels={decode_kernels!r}: this "
                              f"model's layers are not Llama-style (RMSNorm + SiLU MLP); running them eagerly with "
                              f"one F.linear per projection", RuntimeWarning, stacklevel=2)
        self.decode_step = DecodeStep(parts, self.plan, self.cache, self.config, compiled=compiled)
        self._input_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._graphs: dict[int, GraphedStep] = {}
        self._graph_pool = None
        self._compiled_ran = False

    # ------------------------------------------------------------------------------------------

    @property
    def max_batch_size(self) -> int:
        return self.cache.max_batch

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def kv_bytes(self) -> KVBytes:
        """The static cache's allocated KV bytes against a dense cache (``sparse_models/kv_bytes.py``)."""
        return self.cache.kv_bytes()

    @property
    def max_positions(self) -> int | None:
        """The model's ``max_position_embeddings`` (None when its config has none)."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def warmup(self, prompts, decode_steps: int = 2) -> float:
        """Compile kernels and capture CUDA graphs on ``prompts`` (the ones about to be generated, so that
        the same kernel shapes compile) with ``decode_steps`` decode steps; returns the seconds it took.

        The first call of each Triton kernel shape compiles it (or loads it from Triton's on-disk cache),
        the first decode step of a batch size captures its CUDA graph, and ``compile_layers`` compiles on
        its first call: timings of a later :meth:`generate` then measure the steady state. TidalDecode's
        KV correction (every T steps) is not warmed up. Truncation is applied as in ``generate``."""
        device = self.cache.device
        _synchronize(device)
        start = time.perf_counter()
        self.generate(prompts, max_new_tokens=decode_steps + 1, truncate_prompts=True, _announce=False)
        _synchronize(device)
        return time.perf_counter() - start

    def _check_prompts(self, prompts, max_new_tokens: int, truncate: bool = False,
                       announce: bool = True) -> tuple[list[list[int]], dict[int, int]]:
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() != 2:
                raise EngineError(f"prompts tensor has shape {tuple(prompts.shape)}: expected [batch, length] "
                                  f"(or a list of token-id lists for ragged prompts)")
            prompts = prompts.tolist()
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise EngineError(f"prompts={prompts!r} is invalid: expected a non-empty list of token-id lists")
        if isinstance(prompts[0], int):
            prompts = [prompts]
        if len(prompts) > self.max_batch_size:
            raise EngineError(f"got {len(prompts)} prompts but max_batch_size={self.max_batch_size}: build the "
                              f"engine with a larger max_batch_size")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EngineError(f"max_new_tokens={max_new_tokens!r} is invalid: expected an integer >= 1")
        out = []
        for i, p in enumerate(prompts):
            p = list(p)
            if not p:
                raise EngineError(f"prompt {i} is empty: every prompt needs at least one token")
            if any(not isinstance(t, int) or not 0 <= t < self.parts.vocab_size for t in p):
                raise EngineError(f"prompt {i} holds ids outside [0, {self.parts.vocab_size}) (vocab_size)")
            out.append(p)
        out, truncated = fit_to_positions(out, max_new_tokens, self.max_positions, truncate)
        if truncated and announce:
            warnings.warn("; ".join(f"prompt {i} truncated from {n} to its last {len(out[i])} tokens (the model's "
                                    f"max_position_embeddings={self.max_positions} - max_new_tokens={max_new_tokens})"
                                    for i, n in truncated.items()), RuntimeWarning, stacklevel=3)
        for i, p in enumerate(out):
            if len(p) + max_new_tokens > self.capacity:
                raise EngineError(f"prompt {i} has {len(p)} tokens + max_new_tokens={max_new_tokens} = "
                                  f"{len(p) + max_new_tokens} > the cache capacity max_seq_len={self.capacity}: "
                                  f"shorten the prompt, lower max_new_tokens or build the engine with a larger "
                                  f"max_seq_len")
        return out, truncated

    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], stats: dict | None = None) -> torch.Tensor:
        """Prefill right-padded prompts into the cache; returns the last-token logits [B, V] fp32."""
        device = self.cache.device
        batch = len(prompts)
        width = max(len(p) for p in prompts)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        offsets = torch.zeros_like(lens)
        logits = forward_chunk(self.parts, self.plan, self.cache, self.config, tokens, offsets, lens,
                               token_sparse_keep_ratio=self.token_sparse_keep_ratio, stats=stats)
        self.cache.positions[:batch] = lens
        return logits

    def step(self, batch: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for the first ``batch`` sequences: feed ``tokens`` [batch] (default: what
        the input buffer holds) at slots ``cache.positions``, advance positions, return logits [B, V].
        The returned tensor is a static buffer under CUDA graphs: read it before the next step."""
        ids = self._input_ids[:batch]
        if tokens is not None:
            ids.copy_(tokens)
        positions = self.cache.positions[:batch]
        if self.use_cuda_graphs:
            graph = self._graphs.get(batch)
            if graph is None:
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                graph = self._graphs[batch] = GraphedStep(self.decode_step, ids, positions, pool=self._graph_pool)
            logits = graph.replay()
        else:
            logits = self.decode_step(ids, positions)
        positions += 1
        return logits

    def correct_kv(self, batch: int, history: torch.Tensor) -> None:
        """TidalDecode KV-cache correction: recompute the K/V of the last T tokens with exact attention.

        history: [batch, T] the ids fed at the last T decode steps (slots positions - T .. positions - 1).
        One chunked prefill in exact causal attention over the clean prefix + the chunk, overwriting
        those slots in every layer. (``pod+tidal`` rejects a correction period in the plan: POD's ring
        no longer holds the proximal keys those tokens saw.)
        """
        positions = self.cache.positions[:batch]
        forward_chunk(self.parts, self.plan, self.cache, self.config, history, positions - history.shape[1],
                      positions.clone(), mode="full")

    @torch.no_grad()
    def generate(self, prompts, *, max_new_tokens: int, sampling: SamplingConfig | None = None,
                 stop_token_ids: Sequence[int] = (), on_tokens: Callable[[int, list], None] | None = None,
                 truncate_prompts: bool = False, _announce: bool = True) -> GenerationResult:
        """Generate up to ``max_new_tokens`` per prompt.

        Args:
            prompts: list of token-id lists (ragged lengths allowed) or a [B, S] tensor.
            sampling: greedy by default.
            stop_token_ids: a row ends after emitting one of these (it is included).
            on_tokens: streaming callback ``on_tokens(step, new)``; ``new[b]`` is the token row b emitted
                at this step, or None once the row has finished.
            truncate_prompts: a prompt that would run past the model's ``max_position_embeddings`` keeps
                its last tokens (announced with a RuntimeWarning) instead of raising :class:`EngineError`.
        """
        prompts, truncated = self._check_prompts(prompts, max_new_tokens, truncate_prompts, _announce)
        sampling = sampling or SamplingConfig()
        device = self.cache.device
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(sampling.seed)
        batch = len(prompts)
        stop = set(int(t) for t in stop_token_ids)
        watch = bool(stop) or on_tokens is not None
        period = self.cache.layout.correction_period
        generated = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
        history = torch.zeros(batch, period or 1, dtype=torch.long, device=device)
        done = [False] * batch
        lengths = [max_new_tokens] * batch
        stats: dict = {"truncated_prompts": truncated} if truncated else {}
        # the first decode step captures a graph for a new batch size / runs torch.compile the first time
        warmup_in_first_step = (self.use_cuda_graphs and batch not in self._graphs) or (
            self.decode_step.compiled is not None and not self._compiled_ran)
        first_step_end = None

        _synchronize(device)
        t0 = time.perf_counter()
        logits = self.prefill(prompts, stats=stats)
        token = sample_next(logits, sampling, generator)
        _synchronize(device)
        t1 = time.perf_counter()
        steps = 0
        for i in range(max_new_tokens):
            generated[:, i] = token
            if watch:
                values = token.tolist()
                new = []
                for b, t in enumerate(values):
                    if done[b]:
                        new.append(None)
                        continue
                    new.append(t)
                    if t in stop:
                        done[b] = True
                        lengths[b] = i + 1
                if on_tokens is not None:
                    on_tokens(i, new)
                if all(done):
                    break
            if i == max_new_tokens - 1:
                break
            if period:
                history[:, steps % period] = token
            logits = self.step(batch, token)
            steps += 1
            if steps == 1:
                _synchronize(device)
                first_step_end = time.perf_counter()
                self._compiled_ran = True
            if period and steps % period == 0:
                self.correct_kv(batch, history.clone())
            token = sample_next(logits, sampling, generator)
        _synchronize(device)
        t2 = time.perf_counter()
        rows = generated.tolist()
        tokens = [rows[b][:lengths[b]] for b in range(batch)]
        reasons = ["stop" if done[b] else "length" for b in range(batch)]
        timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps,
                   "ms_per_step": 1000 * (t2 - t1) / steps if steps else None,
                   "first_step_ms": 1000 * (first_step_end - t1) if steps else None,
                   "warmup_in_first_step": bool(steps and warmup_in_first_step),
                   "steady_ms_per_step": 1000 * (t2 - first_step_end) / (steps - 1) if steps > 1 else None}
        return GenerationResult(tokens, reasons, [len(p) for p in prompts], timings, stats)
