"""End-to-end benchmark of podkit's generation engine: decode latency, prefill time, KV memory.

    python -m eval.bench e2e --out outputs/bench/e2e.json            # the full H200 run (< 10 min)
    python -m eval.bench e2e --plot-only outputs/bench/e2e.json      # PNG from a JSON (needs matplotlib)
    python -m eval.bench e2e --tiny --out /tmp/e2e.json              # CPU smoke test of the code path
    python -m eval.bench e2e --sections memory --check-fit --kv-cache-dtypes bfloat16 fp8_e4m3  # KV memory, both

Model: a random-init Llama-3-8B shape (32 layers, hidden 4096, 32 query / 8 KV heads, D 128, FFN 14336,
vocab 128256) in bf16 on one GPU; random weights do not change the time of a step. Rows:

* decode ms/token (one decode step of the whole batch; median of CUDA-event timings of single steps)
  at (context, batch) in ``--rows`` (default 32Kx1, 128Kx1, 32Kx8, 128Kx4) for: transformers as users
  run it (``generate()``, sdpa, DynamicCache; only ``--hf-rows``), podkit dense, TidalDecode (budget
  2048, full layers 0-1, selection at 2 and 13), POD (a layer-uniform block map with 71.9% non-anchor
  units: 9 anchor layers of 32) and POD + TidalDecode; and the floor = (weight bytes + KV bytes a
  dense step reads) / copy bandwidth measured in this run. The engine's cache is filled with random
  K/V (no prefill needed: the step reads the same bytes whatever they hold). The decode step runs as
  users get it from the engine on CUDA: one CUDA graph per batch size, with the norms / projections /
  RoPE / MLP compiled by torch.compile (``--no-compile`` for plain eager modules inside the graph).
* prefill seconds at ``--prefill-contexts`` (default 32K, 128K), batch 1: dense, Token Sparse at fixed
  keep ratios 0.5 / 0.25 (second half of the layers sparse, the paper's fallback) and 0.5 with every
  layer but the first two sparse, POD. Only the attention of sparse layers shrinks (Token Sparse does
  not compress the MLPs), so the speedup is bounded by the attention share of the prefill FLOPs.
* KV bytes per sequence and per token at ``--memory-contexts`` (default 32K, 128K; really allocated by the
  engine's static cache, FP8 scales included) and the largest batch whose KV fits in 120 GB minus the weights,
  for dense and POD (``--check-fit`` allocates it).

``--variants BASE:key=value[:key=value...]`` adds rows of a scheme's variant beside it (eval.calibrate's picks, for
example ``tidal:tidal_selection=all_union`` or ``token_sparse@0.5:token_sparse_window=256``): BASE is a decode scheme
of ``--schemes``' kind (a decode row) or a prefill case name (a prefill row); the row is named by the spec itself, and
its overrides are validated like every flat override before the model is built.

``--kv-cache-dtypes`` (default ``bfloat16``; ``bfloat16 fp8_e4m3`` for both) picks the engine's KV storage
(kernels/fp8_kv.py: e4m3 data + one fp32 scale per token and KV head, ``2 * (D + 4)`` bytes per token and KV
head for K + V against ``4 * D`` in bf16). Every memory and decode row runs once per dtype; an FP8 decode cell is
``<scheme>/fp8_e4m3`` beside the bf16 ``<scheme>``, with ``over_bfloat16`` (its ms / the bf16 cell's ms), and each
decode row gets the FP8 floor ``floor_fp8_e4m3_ms`` next to ``floor_ms``; FP8 memory rows carry their bytes and
largest batch over bf16. The default stays bf16 so the full run above still fits one 10-minute call; run the FP8
rows as separate calls (``--sections memory`` / ``--sections decode --rows ...``). The memory rows are also drawn
as ``<out>_memory.png`` (eval/bench/memory_plot.py: KV per sequence and largest batch, per dtype).

Targets (BENCHMARKS.md's status table, "Engine"; "Targets that changed" says which replaced which) are evaluated
in ``targets``: dense within 1.2x of the floor at every row; TidalDecode
>= 1.8x dense at the longest context x 1 and >= 2.5x at x 4 (>= 2.5x at x 1 with one KV head per query head, the
LLaMA-2-7B shape of the TidalDecode paper); POD + TidalDecode within 1.1x of TidalDecode and POD within 1.05x of
dense at every row; every scheme >= 8x transformers at the shortest context x 1. The JSON is rewritten after every row, so a run cut
short by the 10-minute limit still leaves its measurements; OOM in a row is recorded, not fatal.
Runs on the GPU image (torch + transformers + triton only); the PNG needs matplotlib (else use
``--plot-only`` on a machine that has it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from eval.bench.kernels_decode import copy_bandwidth
from eval.bench.memory_plot import plot_kv_memory
from kernels import skipping_value_checks
from kernels.fp8_kv import KV_CACHE_DTYPES, bytes_per_token
from sparse_models.config import SparseAttentionConfig, is_override_key, parse_override_value, unknown_option_error
from sparse_models.engine import GenerationEngine
from sparse_models.schemes.registry import get_scheme, scheme_names
from sparse_models.validation import ConfigError

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=139264,
                 tie_word_embeddings=False)
# TidalDecode's own end-to-end comparison (Yang et al. 2024, Section 4.3): LLaMA-2-7B, 32 query = 32 KV heads
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0, max_position_embeddings=139264,
                 tie_word_embeddings=False)
SHAPES = {"llama3-8b": ("Llama-3-8B shape", LLAMA3_8B), "llama2-7b": ("LLaMA-2-7B shape", LLAMA2_7B)}
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
GIB = 1 << 30


def pod_anchor_layers(num_layers: int, num_kv_heads: int, anchor_layers: int | None = None) -> list[list[int]]:
    """A layer-uniform POD block map: ``anchor_layers`` blocks of consecutive layers, sizes as even as
    possible (Llama-3-8B: 9 blocks -> 23 of 32 layers non-anchor = 71.9% of (layer, KV head) units)."""
    blocks = anchor_layers or max(1, math.floor(num_layers * 0.28))
    sizes = [num_layers // blocks + (1 if i < num_layers % blocks else 0) for i in range(blocks)]
    rows, start = [], 0
    for size in sizes:
        rows += [[start] * num_kv_heads for _ in range(size)]
        start += size
    return rows


def scheme_overrides(name: str, num_layers: int, num_kv_heads: int, budget: int, tiny: bool) -> dict:
    """Flat overrides of a benchmark row: ``podkit-dense`` or a registered decode scheme, with this
    model shape's POD blocks and TidalDecode layers for the config sections it reads, and ``budget``
    in its scheme's meaning (``sparse_models.schemes.registry``)."""
    if name == "podkit-dense":
        return {"decode_scheme": "dense"}
    shape_settings = {
        "pod": dict(pod_anchor_layers=pod_anchor_layers(num_layers, num_kv_heads, 2 if tiny else 9),
                    pod_sink_tokens=4 if tiny else 16, pod_recent_window=28 if tiny else 4080),
        "tidal": dict(tidal_full_layers=[0, 1], tidal_selection_layers=[2] if tiny else [2, 13]),
    }
    scheme = get_scheme(name, "decode")
    overrides = {"decode_scheme": name}
    for section in scheme.sections:
        overrides |= shape_settings.get(section, {})
    if scheme.budget is not None:
        overrides |= scheme.budget.overrides(name, budget)
    return overrides


def build_model(shape: dict, device: str, dtype: torch.dtype):
    config = LlamaConfig(**shape, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: all but the embedding table (it reads B rows of it)."""
    emb = model.get_input_embeddings().weight
    return weight_bytes(model) - emb.numel() * emb.element_size()


def dense_kv_bytes(shape: dict, context: int, batch: int, elt: int) -> int:
    d = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * batch * shape["num_key_value_heads"] * context * d * elt


def dense_kv_bytes_per_token(shape: dict, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """K + V bytes one token takes in a dense cache, all layers and KV heads: L * Hkv * 2 * (D + 4) in FP8
    (fp32 scales, kernels/fp8_kv.py), L * Hkv * 2 * D * itemsize in the model's dtype."""
    d = shape["hidden_size"] // shape["num_attention_heads"]
    per_head = bytes_per_token(d, kv_cache_dtype, model_dtype)
    return shape["num_hidden_layers"] * shape["num_key_value_heads"] * per_head


def cell_name(scheme: str, kv_cache_dtype: str) -> str:
    """The decode row's key of a scheme's cell: the scheme's name in bf16 (the keys older JSONs and the targets
    use), ``<scheme>/<dtype>`` otherwise."""
    return scheme if kv_cache_dtype == "bfloat16" else f"{scheme}/{kv_cache_dtype}"


def memory_key(name: str, kv_cache_dtype: str, context: int) -> str:
    """``dense@32768``, ``pod/fp8_e4m3@131072``: one memory row per cache, dtype and context."""
    return f"{cell_name(name, kv_cache_dtype)}@{context}"


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------

def time_engine_decode(model, context: int, batch: int, overrides: dict, steps: int, use_graphs: bool,
                       compile_layers: bool = False) -> dict:
    """ms per decode step of the engine with a full random cache of ``context`` tokens per sequence."""
    device = next(model.parameters()).device
    engine = GenerationEngine(model, max_batch_size=batch, max_seq_len=context + steps + 8,
                              use_cuda_graphs=use_graphs, compile_layers=compile_layers, **overrides)
    try:
        lens = torch.full((batch,), context, dtype=torch.long, device=device)
        engine.cache.fill_random(lens)
        token = torch.zeros(batch, dtype=torch.long, device=device)
        synchronize(device)
        t0 = time.perf_counter()
        logits = engine.step(batch, token)  # graph capture (Triton compiles) + first step
        synchronize(device)
        capture_s = time.perf_counter() - t0
        for _ in range(2):
            logits = engine.step(batch, logits.argmax(-1))
        times = []
        for _ in range(steps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                logits = engine.step(batch, logits.argmax(-1))
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                logits = engine.step(batch, logits.argmax(-1))
                times.append(1000 * (time.perf_counter() - t))
        kv = engine.kv_bytes()
        times.sort()
        return {"ms_per_token": times[len(times) // 2], "ms_min": times[0], "ms_max": times[-1], "steps": steps,
                "capture_s": round(capture_s, 3), "graphs": engine.use_cuda_graphs, "compiled": compile_layers,
                "decode_kernels": engine.decode_kernels,
                "kv_bytes_allocated": kv.total, "kv_ratio_to_dense": kv.ratio_to_dense}
    finally:
        del engine
        free_memory()


def time_transformers_decode(model, context: int, batch: int, steps: int) -> dict:
    """ms per token of transformers' generate() continuing from a random DynamicCache of ``context``
    tokens (sdpa, greedy): (time of generate(n2) - time of generate(n1)) / (n2 - n1)."""
    device = next(model.parameters()).device
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, cfg.num_key_value_heads, context, d, device=device, dtype=dtype)
        cache.update(k, torch.randn_like(k), layer)
    del k

    def run(new_tokens: int) -> float:
        length = cache.get_seq_length()
        ids = torch.zeros(batch, length + 1, dtype=torch.long, device=device)
        synchronize(device)
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        synchronize(device)
        return time.perf_counter() - t

    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    try:
        run(2)  # warm-up
        short, long_ = 2, 2 + steps
        t_short, t_long = run(short), run(long_)
        return {"ms_per_token": 1000 * (t_long - t_short) / (long_ - short), "method": "generate() difference",
                "steps": steps}
    finally:
        cache = None  # drop the 17+ GB DynamicCache before the next row
        free_memory()


# ----------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------

def time_prefill(model, context: int, overrides: dict, keep_ratio: float | None, repeats: int,
                 warmup: bool = True) -> dict:
    device = next(model.parameters()).device
    engine = GenerationEngine(model, max_batch_size=1, max_seq_len=context + 1, use_cuda_graphs=False,
                              token_sparse_keep_ratio=keep_ratio, **overrides)
    try:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
        times = []
        stats: dict = {}
        for _ in range(repeats + int(warmup)):  # a warm-up run compiles the Triton kernels
            synchronize(device)
            t = time.perf_counter()
            engine.prefill([prompt], stats=stats)
            synchronize(device)
            times.append(time.perf_counter() - t)
        timed = times[1:] if warmup else times
        row = {"seconds": min(timed), "runs_s": [round(t, 4) for t in times], "warmup_run": warmup}
        if "token_sparse" in stats:
            row["mean_token_sparsity"] = stats["token_sparse"].mean_token_sparsity
        return row
    finally:
        del engine
        free_memory()


# ----------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------

def kv_per_sequence(model, context: int, overrides: dict):
    """The engine's ``KVBytes`` for one sequence of ``context`` slots (sparse_models/kv_bytes.py)."""
    engine = GenerationEngine(model, max_batch_size=1, max_seq_len=context, use_cuda_graphs=False, **overrides)
    try:
        return engine.kv_bytes()
    finally:
        del engine
        free_memory()


def check_fit(model, context: int, batch: int, overrides: dict) -> bool:
    try:
        engine = GenerationEngine(model, max_batch_size=batch, max_seq_len=context, use_cuda_graphs=False, **overrides)
        del engine
        return True
    except Exception as err:  # noqa: BLE001 - OOM is the answer we are looking for
        if is_oom(err):
            return False
        raise
    finally:
        free_memory()


# ----------------------------------------------------------------------------------------------

def parse_rows(items: list[str]) -> list[tuple[int, int]]:
    rows = []
    for item in items:
        try:
            context, batch = item.lower().split("x")
            rows.append((int(context), int(batch)))
        except ValueError:
            raise SystemExit(f"--rows {item!r} is invalid: expected CONTEXTxBATCH, e.g. 32768x1") from None
    return rows


def memory_fields(key: str, row: dict) -> tuple[str, str, int]:
    """(cache name, KV dtype, context) of a memory row; rows of older JSONs (keys ``dense`` / ``pod``, bf16 at one
    context) carry neither name nor dtype."""
    name = key.split("@")[0].split("/")[0]
    return name, row.get("kv_cache_dtype", "bfloat16"), row["context"]


def bf16_memory_at_shortest(memory: dict) -> dict:
    """Cache name -> its bf16 memory row at the shortest context measured (the POD memory targets' rows: 32K)."""
    rows = [(memory_fields(key, row), row) for key, row in memory.items()]
    bf16 = [(fields, row) for fields, row in rows if fields[1] == "bfloat16"]
    shortest = min((fields[2] for fields, _ in bf16), default=None)
    return {fields[0]: row for fields, row in bf16 if fields[2] == shortest}


def evaluate_targets(result: dict) -> dict:
    decode = result.get("decode", {})
    targets = {}

    def ms(scheme, ctx, b):
        row = decode.get(f"{ctx}x{b}", {}).get(scheme)
        return row.get("ms_per_token") if isinstance(row, dict) else None

    for key, row in decode.items():
        dense = row.get("podkit-dense", {}).get("ms_per_token")
        floor = row.get("floor_ms")
        if dense and floor:
            targets[f"dense_over_floor@{key} (<= 1.2)"] = round(dense / floor, 3)
        for scheme, base, goal in (("pod+tidal", "tidal", 1.1), ("pod", "podkit-dense", 1.05)):
            t, t_base = (row.get(name, {}).get("ms_per_token") for name in (scheme, base))
            if t and t_base:
                targets[f"{scheme}_over_{base}@{key} (<= {goal})"] = round(t / t_base, 3)
    ctx_long = max((int(k.split("x")[0]) for k in decode), default=None)
    shape = result.get("shape", {})
    no_gqa = shape.get("num_key_value_heads") == shape.get("num_attention_heads")
    for b, goal in ((1, 2.5 if no_gqa else 1.8), (4, 2.5)):
        dense, tidal = ms("podkit-dense", ctx_long, b), ms("tidal", ctx_long, b)
        if dense and tidal:
            targets[f"tidal_speedup@{ctx_long}x{b} (>= {goal})"] = round(dense / tidal, 3)
    ctx_short = min((int(k.split("x")[0]) for k in decode), default=None)
    hf = ms("transformers", ctx_short, 1)
    if hf:
        for scheme in ("podkit-dense", "tidal", "pod", "pod+tidal"):
            t = ms(scheme, ctx_short, 1)
            if t:
                targets[f"{scheme}_speedup_vs_transformers@{ctx_short}x1 (>= 8)"] = round(hf / t, 2)
    mem = bf16_memory_at_shortest(result.get("memory", {}))
    if "dense" in mem and "pod" in mem:
        targets["pod_kv_bytes_over_dense (<= 0.70)"] = round(mem["pod"]["kv_bytes_per_seq"]
                                                             / mem["dense"]["kv_bytes_per_seq"], 4)
        if mem["dense"].get("max_batch"):
            targets["pod_max_batch_over_dense (>= 1.3)"] = round(mem["pod"]["max_batch"] / mem["dense"]["max_batch"], 3)
    prefill = result.get("prefill", {})
    long_ctx = max((int(k) for k in prefill), default=None)
    if long_ctx:
        row = prefill[str(long_ctx)]
        if row.get("dense", {}).get("seconds") and row.get("token_sparse@0.5", {}).get("seconds"):
            targets[f"token_sparse@0.5_prefill_speedup@{long_ctx} (>= 1.5)"] = round(
                row["dense"]["seconds"] / row["token_sparse@0.5"]["seconds"], 3)
    return targets


def memory_lines(memory: dict) -> list[str]:
    """The memory table: per cache, KV dtype and context, bytes per token (FP8 scales included), GiB per sequence,
    the largest batch in the budget, its ratio to bf16 and whether --check-fit allocated it."""
    if not memory:
        return []
    lines = ["| cache | KV dtype | context | KV bytes / token | KV GiB / sequence | largest batch | batch / bf16 "
             "| allocates |", "|---|---|---|---|---|---|---|---|"]
    for key, row in memory.items():
        name, dtype, context = memory_fields(key, row)
        per_token = row.get("kv_bytes_per_token", row["kv_bytes_per_seq"] / context)
        lines.append(f"| {name} | {dtype} | {context} | {per_token:,.0f} | {row['kv_gib_per_seq']} | "
                     f"{row['max_batch']} | {row.get('max_batch_over_bfloat16', '-')} | "
                     f"{row.get('max_batch_allocates', '-')} |")
    return lines + [""]


def ratio_lines(decode: dict) -> list[str]:
    """fp8 ms / bf16 ms per decode row and scheme (the cells' ``over_bfloat16``); none without FP8 cells."""
    ratios = {key: {name.split("/")[0]: cell["over_bfloat16"] for name, cell in row.items()
                    if isinstance(cell, dict) and "over_bfloat16" in cell} for key, row in decode.items()}
    schemes = list(dict.fromkeys(s for row in ratios.values() for s in row))
    if not schemes:
        return []
    lines = ["| fp8_e4m3 / bfloat16 ms | " + " | ".join(schemes) + " |", "|---|" + "---|" * len(schemes)]
    for key, row in ratios.items():
        lines.append(f"| {key} | " + " | ".join(f"{row[s]:.3f}" if s in row else "-" for s in schemes) + " |")
    return lines + [""]


def markdown_table(result: dict) -> str:
    """The tables BENCHMARKS.md takes: decode ms/token, prefill s, memory, targets."""
    lines = [f"`{result.get('command', '')}` — {result.get('date', '')}, {result.get('device', '')}, "
             f"torch {result.get('torch', '')}, transformers {result.get('transformers', '')}, {result.get('model', '')} "
             f"({result.get('dtype', '')}); copy bandwidth {result.get('copy_bandwidth_TBps')} TB/s", ""]
    decode = result.get("decode", {})
    schemes = []
    for row in decode.values():
        for name, cell in row.items():
            if isinstance(cell, dict) and name not in schemes:
                schemes.append(name)
    if decode:
        lines += ["| context x batch | floor ms | " + " | ".join(schemes) + " |",
                  "|---|---|" + "---|" * len(schemes)]
        for key, row in decode.items():
            cells = []
            for name in schemes:
                cell = row.get(name, {})
                cells.append(f"{cell['ms_per_token']:.2f}" if cell.get("ms_per_token") else
                             ("error" if "error" in cell else "-"))
            floor = f"{row['floor_ms']:.2f}" if row.get("floor_ms") else "-"
            if row.get("floor_fp8_e4m3_ms"):  # the FP8 cache's floor beside the bf16 one
                floor += f" / {row['floor_fp8_e4m3_ms']:.2f} fp8"
            lines.append(f"| {key} | {floor} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += ratio_lines(decode)
    prefill = {ctx: row for ctx, row in result.get("prefill", {}).items() if row}
    names = list(dict.fromkeys(n for row in prefill.values() for n in row))
    if prefill:
        lines += ["| prefill context | " + " | ".join(f"{n} s" for n in names) + " |", "|---|" + "---|" * len(names)]
        for ctx, row in prefill.items():
            lines.append(f"| {ctx} | " + " | ".join(f"{row[n]['seconds']:.3f}" if row.get(n, {}).get("seconds")
                                                     else "error" for n in names) + " |")
        lines.append("")
    lines += memory_lines(result.get("memory", {}))
    targets = result.get("targets", {})
    if targets:
        lines += ["| target | measured |", "|---|---|"] + [f"| {k} | {v} |" for k, v in targets.items()]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> str | None:
    try:  # matplotlib is optional (the H200 image has none): --plot-only redraws elsewhere
        import matplotlib  # lazy: matplotlib is optional (plots only)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)
    except ImportError:
        return "matplotlib is not installed: rerun with --plot-only JSON where it is"
    decode = result.get("decode", {})
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for key, row in decode.items():
        ctx, batch = (int(x) for x in key.split("x"))
        for scheme, cell in row.items():
            if isinstance(cell, dict) and cell.get("ms_per_token"):
                series.setdefault((scheme, batch), []).append((ctx, cell["ms_per_token"]))
        if row.get("floor_ms"):
            series.setdefault(("floor (dense)", batch), []).append((ctx, row["floor_ms"]))
        if row.get("floor_fp8_e4m3_ms"):
            series.setdefault(("floor (dense fp8_e4m3)", batch), []).append((ctx, row["floor_fp8_e4m3_ms"]))
    batches = sorted({b for _, b in series})
    if not batches:  # a memory-only run: its rows are drawn by plot_kv_memory
        return None
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for (scheme, b), points in sorted(series.items()):
            if b != batch:
                continue
            points.sort()
            style = "--" if scheme.startswith("floor") else (":" if "/fp8" in scheme else "-")
            ax.plot([p[0] / 1024 for p in points], [p[1] for p in points], style, marker="o", label=scheme)
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("decode ms / token (step)")
        ax.set_yscale("log")
        ax.set_title(f"batch {batch}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"podkit engine, {result.get('model', '')}, {result.get('device', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.bench e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/bench/e2e.json")
    ap.add_argument("--png", default=None, help="default: the JSON path with .png")
    ap.add_argument("--plot-only", default=None, metavar="JSON", help="only draw the PNG of an existing JSON")
    ap.add_argument("--rows", nargs="+", default=["32768x1", "131072x1", "32768x8", "131072x4"])
    ap.add_argument("--hf-rows", nargs="*", default=["32768x1", "131072x1"],
                    help="rows where transformers' generate() is also timed (it is slow and memory hungry)")
    ap.add_argument("--schemes", nargs="+", default=["podkit-dense", "tidal", "pod", "pod+tidal"],
                    help="podkit-dense or registered decode schemes ("
                         + ", ".join(n for n in scheme_names("decode") if n != "dense") + ")")
    ap.add_argument("--variants", nargs="+", default=[], metavar="BASE:KEY=VALUE",
                    help="extra rows: a decode scheme or prefill case with flat overrides, e.g. "
                         "tidal:tidal_selection=all_union token_sparse@0.5:token_sparse_window=256")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per row")
    ap.add_argument("--hf-steps", type=int, default=6)
    ap.add_argument("--prefill-contexts", nargs="*", type=int, default=[32768, 131072])
    ap.add_argument("--prefill-repeats", type=int, default=1)
    ap.add_argument("--memory-contexts", "--memory-context", dest="memory_contexts", type=int, nargs="+",
                    default=[32768, 131072], help="contexts of the memory rows (KV bytes, largest batch)")
    ap.add_argument("--memory-budget-gb", type=float, default=120.0)
    ap.add_argument("--check-fit", action="store_true", help="allocate the largest batch to prove it fits")
    ap.add_argument("--kv-cache-dtypes", nargs="+", choices=KV_CACHE_DTYPES, default=["bfloat16"],
                    help="KV cache storage of every memory and decode row (kernels/fp8_kv.py); default bfloat16 "
                         "only, 'bfloat16 fp8_e4m3' for both and the fp8 / bf16 ratios")
    ap.add_argument("--num-layers", type=int, default=None, help="fewer layers (quick checks; not the benchmark)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                    help="random-init model shape; llama2-7b (no GQA) is TidalDecode's own e2e setting")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and contexts: exercises the code on CPU")
    ap.add_argument("--sections", nargs="+", default=["memory", "decode", "prefill"],
                    choices=["memory", "decode", "prefill"], help="what to measure (split a run across calls)")
    ap.add_argument("--time-budget-s", type=float, default=540.0,
                    help="skip the remaining rows once this much wall time has passed (the device's per-call "
                         "limit is 600 s); skipped rows are listed in the JSON")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode (for comparison)")
    ap.add_argument("--decode-kernels", choices=["auto", "standard", "fused"], default="auto",
                    help="the engine's decode step: auto (fused on CUDA for batches <= 64), standard (cuBLAS projections + "
                         "indexed cache writes), or fused (grouped matrix-vector launches + one-launch KV "
                         "append)")
    ap.add_argument("--no-compile", action="store_true",
                    help="do not torch.compile the non-attention parts of the decode step (engine compile_layers)")
    return ap


class Run:
    """One run's result dict, saved to ``out`` after every measurement, and its wall-time budget."""

    def __init__(self, result: dict, out: Path, time_budget_s: float):
        self.result, self.out, self.time_budget_s = result, out, time_budget_s
        self.started = time.perf_counter()
        result["skipped"] = []

    def save(self) -> None:
        self.result["targets"] = evaluate_targets(self.result)
        self.out.write_text(json.dumps(self.result, indent=2))

    def out_of_time(self, what: str) -> bool:
        if time.perf_counter() - self.started > self.time_budget_s:
            self.result["skipped"].append(what)
            print(f"skipped {what}: --time-budget-s {self.time_budget_s} spent", flush=True)
            return True
        return False


def apply_tiny(args: argparse.Namespace) -> None:
    """``--tiny``: the CPU smoke test's rows, contexts, budget and steps."""
    args.rows = ["256x1", "512x2"]
    args.hf_rows = ["256x1"]
    args.prefill_contexts = [384]
    args.memory_contexts = [512, 1024]
    args.budget = 32
    args.steps = min(args.steps, 4)


MEMORY_CACHES = (("dense", "podkit-dense"), ("pod", "pod"))  # memory row name -> scheme_overrides' name


def memory_row(model, args: argparse.Namespace, shape: dict, wbytes: int, device: str, scheme: str, context: int,
               kv_cache_dtype: str) -> dict:
    """One cache's KV bytes per sequence and per token at ``context`` (the engine's own ``kv_bytes``: FP8 data and
    scales), the largest batch whose KV fits in the budget minus the weights and, with ``--check-fit`` on CUDA,
    whether that batch really allocates."""
    overrides = scheme_overrides(scheme, shape["num_hidden_layers"], shape["num_key_value_heads"], args.budget,
                                 args.tiny) | {"kv_cache_dtype": kv_cache_dtype}
    kv = kv_per_sequence(model, context, overrides)
    budget = args.memory_budget_gb * 1e9 - wbytes
    row = {"scheme": scheme, "kv_cache_dtype": kv_cache_dtype, "context": context, "kv_bytes_per_seq": kv.total,
           "kv_bytes_per_token": round(kv.total / context, 2), "kv_gib_per_seq": round(kv.total / GIB, 3),
           "max_batch": int(budget // kv.total),
           "budget_note": f"{args.memory_budget_gb} GB minus the weights ({wbytes / 1e9:.2f} GB)"}
    if args.check_fit and device == "cuda":
        row["max_batch_allocates"] = check_fit(model, context, row["max_batch"], overrides)
    return row


def add_bf16_ratios(memory: dict, name: str, context: int, row: dict) -> None:
    """An FP8 row's bytes and largest batch over the bf16 row of the same cache and context (when measured)."""
    base = memory.get(memory_key(name, "bfloat16", context))
    if row["kv_cache_dtype"] == "bfloat16" or not base:
        return
    row["kv_bytes_over_bfloat16"] = round(row["kv_bytes_per_seq"] / base["kv_bytes_per_seq"], 4)
    if base["max_batch"]:
        row["max_batch_over_bfloat16"] = round(row["max_batch"] / base["max_batch"], 3)


def measure_memory(run: Run, model, args: argparse.Namespace, shape: dict, wbytes: int, device: str) -> None:
    """KV bytes per sequence and token and the largest batch that fits, dense and POD, per context and KV dtype
    (cheap and independent of timing)."""
    result = run.result
    for context in args.memory_contexts:
        for name, scheme in MEMORY_CACHES:
            for dtype in args.kv_cache_dtypes:
                key = memory_key(name, dtype, context)
                try:
                    row = memory_row(model, args, shape, wbytes, device, scheme, context, dtype)
                    add_bf16_ratios(result["memory"], name, context, row)
                    result["memory"][key] = row
                    print(f"memory {key}: {row['kv_bytes_per_token']:.0f} B/token, {row['kv_gib_per_seq']} GiB/seq, "
                          f"max batch {row['max_batch']}" + (f" (allocates: {row['max_batch_allocates']})"
                                                             if "max_batch_allocates" in row else ""), flush=True)
                except Exception as err:  # noqa: BLE001
                    result["errors"].append(f"memory {key}: {type(err).__name__}: {err}")
                    free_memory()
                run.save()


def parse_variant(spec: str) -> tuple[str, dict]:
    """``BASE:key=value[:key=value...]`` -> (BASE, flat overrides); values as on the command line
    (``sparse_models.config.parse_override_value``). A malformed spec or an unknown key raises ConfigError."""
    base, *pairs = spec.split(":")
    if not base or not pairs:
        raise ConfigError(f"--variants {spec!r}: expected BASE:key=value[:key=value...] (e.g. "
                          f"tidal:tidal_selection=all_union)")
    extra = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--variants {spec!r}: {pair!r} is not key=value")
        if not is_override_key(key):
            raise unknown_option_error(key, text)
        extra[key] = parse_override_value(text)
    return base, extra


def resolve_variants(args: argparse.Namespace, shape: dict, cases: dict) -> tuple[dict, dict]:
    """The ``--variants`` rows: (decode name -> overrides, prefill name -> (overrides, keep ratio)), each
    validated by building its SparseAttentionConfig, so that a bad variant fails before any model is built."""
    decode_bases = {"podkit-dense", *scheme_names("decode")}
    decode, prefill = {}, {}
    for spec in args.variants:
        base, extra = parse_variant(spec)
        # a base that names both a prefill case and a decode scheme (pod) gets a row in both sections
        if base in cases:
            overrides, ratio = cases[base]
            prefill[spec] = (overrides | extra, ratio)
            SparseAttentionConfig().with_overrides(**prefill[spec][0])
        if base in decode_bases:
            decode[spec] = scheme_overrides(base, shape["num_hidden_layers"], shape["num_key_value_heads"],
                                            args.budget, args.tiny) | extra
            # each decode cell sets kv_cache_dtype to its column's (decode_cell), so the variant is checked with
            # every --kv-cache-dtypes value: kv_cache_recent_keys is valid beside fp8_e4m3 only
            for kv_cache_dtype in args.kv_cache_dtypes:
                try:
                    SparseAttentionConfig().with_overrides(**(decode[spec] | {"kv_cache_dtype": kv_cache_dtype}))
                except ConfigError as err:
                    raise ConfigError(f"--variants {spec!r} with --kv-cache-dtypes {kv_cache_dtype}: {err}") from None
        if base not in cases and base not in decode_bases:
            raise ConfigError(f"--variants {spec!r}: base {base!r} is neither a decode scheme ("
                              f"{', '.join(sorted(decode_bases))}) nor a prefill case ({', '.join(cases)})")
    return decode, prefill


def decode_cell(model, args: argparse.Namespace, shape: dict, context: int, batch: int, scheme: str,
                kv_cache_dtype: str, device: str, errors: list) -> dict:
    """One scheme's (or ``--variants`` row's) engine decode at (context, batch) with this KV dtype; a torch.compile
    failure is retried eagerly (recorded in ``errors``) so that it does not cost the row."""
    base = args.decode_variants[scheme] if scheme in args.decode_variants else scheme_overrides(
        scheme, shape["num_hidden_layers"], shape["num_key_value_heads"], args.budget, args.tiny)
    overrides = base | {"decode_kernels": args.decode_kernels, "kv_cache_dtype": kv_cache_dtype}
    compile_layers = not args.no_compile and device == "cuda"
    try:
        return time_engine_decode(model, context, batch, overrides, args.steps,
                                  use_graphs=not args.no_graphs and device == "cuda", compile_layers=compile_layers)
    except Exception as err:  # noqa: BLE001 - a compile failure must not cost the row
        if not compile_layers or is_oom(err):
            raise
        errors.append(f"decode {context}x{batch} {cell_name(scheme, kv_cache_dtype)} with compile_layers: "
                      f"{type(err).__name__}: {str(err)[:300]}; retried without")
        free_memory()
        return time_engine_decode(model, context, batch, overrides, args.steps,
                                  use_graphs=not args.no_graphs, compile_layers=False)


def add_floors(row: dict, shape: dict, context: int, batch: int, model_dtype: torch.dtype, bw, wread: int,
               kv_cache_dtypes: list[str]) -> None:
    """The dense step's floor per KV dtype: (weights read + dense KV bytes) / copy bandwidth; ``floor_ms`` is the
    bf16 one (older JSONs' key), ``floor_fp8_e4m3_ms`` the FP8 one (data + scales)."""
    if not bw:
        return
    for dtype in kv_cache_dtypes:
        kv = dense_kv_bytes_per_token(shape, dtype, model_dtype) * context * batch
        suffix = "" if dtype == "bfloat16" else f"_{dtype}"
        row[f"floor{suffix}_ms"] = 1000 * (wread + kv) / bw
        row[f"floor{suffix}_bytes"] = wread + kv


def measure_decode(run: Run, model, args: argparse.Namespace, shape: dict, model_dtype: torch.dtype, bw, wread: int,
                   device: str) -> None:
    """Per row (context x batch): each scheme's engine decode in each KV dtype (FP8 cells with their ratio to
    bf16), the bandwidth floors, and transformers' generate()."""
    result = run.result
    for context, batch in parse_rows(args.rows):
        key = f"{context}x{batch}"
        if run.out_of_time(f"decode {key}"):
            continue
        row = result["decode"].setdefault(key, {})
        add_floors(row, shape, context, batch, model_dtype, bw, wread, args.kv_cache_dtypes)
        for scheme in [*args.schemes, *args.decode_variants]:
            for dtype in args.kv_cache_dtypes:
                name = cell_name(scheme, dtype)
                if dtype != args.kv_cache_dtypes[0] and run.out_of_time(f"decode {key} {name}"):
                    continue
                try:
                    row[name] = decode_cell(model, args, shape, context, batch, scheme, dtype, device, result["errors"])
                    base = row.get(scheme, {}).get("ms_per_token")
                    if name != scheme and base:
                        row[name]["over_bfloat16"] = round(row[name]["ms_per_token"] / base, 4)
                    if scheme in args.decode_variants:  # a variant against its scheme's row, same dtype
                        plain = row.get(cell_name(scheme.split(":")[0], dtype), {}).get("ms_per_token")
                        if plain:
                            row[name]["over_base"] = round(row[name]["ms_per_token"] / plain, 4)
                    print(f"decode {key} {name}: {row[name]['ms_per_token']:.3f} ms/token "
                          f"(floor {row.get('floor_ms', float('nan')):.3f})", flush=True)
                except Exception as err:  # noqa: BLE001 - record and go on
                    row[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                    print(f"decode {key} {name}: {row[name]['error']}", flush=True)
                    free_memory()
                run.save()
        if key in args.hf_rows and not run.out_of_time(f"decode {key} transformers"):
            measure_transformers(run, model, args, row, key, context, batch)


def measure_transformers(run: Run, model, args: argparse.Namespace, row: dict, key: str, context: int,
                         batch: int) -> None:
    """transformers' generate() at one decode row (bf16 DynamicCache: its own KV dtype, whatever the flag)."""
    try:
        row["transformers"] = time_transformers_decode(model, context, batch, args.hf_steps)
        print(f"decode {key} transformers: {row['transformers']['ms_per_token']:.2f} ms/token", flush=True)
    except Exception as err:  # noqa: BLE001
        row["transformers"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(f"decode {key} transformers: {row['transformers']['error']}", flush=True)
        free_memory()
    run.save()


def prefill_cases(shape: dict, args: argparse.Namespace) -> dict:
    """name -> (overrides, Token Sparse keep ratio or None) of the prefill rows."""
    nl, nkv = shape["num_hidden_layers"], shape["num_key_value_heads"]
    sparse_layers = list(range(nl // 2, nl))
    return {
        "dense": (dict(prefill_scheme="dense"), None),
        "token_sparse@0.5": (dict(prefill_scheme="token_sparse", token_sparse_sparse_layers=sparse_layers,
                                  **({"token_sparse_min_tokens": 16, "token_sparse_window": 16} if args.tiny else {})),
                             0.5),
        "token_sparse@0.25": (dict(prefill_scheme="token_sparse", token_sparse_sparse_layers=sparse_layers,
                                   **({"token_sparse_min_tokens": 16, "token_sparse_window": 16} if args.tiny else {})),
                              0.25),
        # every layer but the first two sparse (the paper's fallback above is the second half only)
        "token_sparse@0.5(layers 2+)": (dict(prefill_scheme="token_sparse", token_sparse_sparse_layers=list(range(2, nl)),
                                             **({"token_sparse_min_tokens": 16, "token_sparse_window": 16}
                                                if args.tiny else {})), 0.5),
        "pod": (dict(prefill_scheme="pod", **{k: v for k, v in scheme_overrides("pod", nl, nkv, args.budget,
                                                                                   args.tiny).items()}), None),
    }


def measure_prefill(run: Run, model, args: argparse.Namespace, cases: dict) -> None:
    """Each prefill case's time at each prefill context."""
    for context in args.prefill_contexts:
        row = run.result["prefill"].setdefault(str(context), {})
        for name, (overrides, ratio) in cases.items():
            if run.out_of_time(f"prefill {context} {name}"):
                continue
            try:
                # kernels compiled at the first (shortest) context serve the longer ones: no warm-up there
                warm = context == args.prefill_contexts[0]
                row[name] = time_prefill(model, context, overrides, ratio, args.prefill_repeats, warmup=warm)
                print(f"prefill {context} {name}: {row[name]['seconds']:.3f} s", flush=True)
            except Exception as err:  # noqa: BLE001
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                print(f"prefill {context} {name}: {row[name]['error']}", flush=True)
                free_memory()
            run.save()


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed flags, KV dtypes de-duplicated and bf16 first (an FP8 cell's ratio needs its bf16 cell measured
    before it). A dtype outside KV_CACHE_DTYPES is argparse's one error naming the flag, the value and the choices,
    before any model is built."""
    args = build_parser().parse_args(argv)
    args.kv_cache_dtypes = sorted(set(args.kv_cache_dtypes), key=KV_CACHE_DTYPES.index)
    args.decode_variants = {}  # --variants' decode rows, resolved by main once the shape is known
    return args


def draw(result: dict, png: Path) -> str | None:
    """The decode PNG and, when there are memory rows, ``<png stem>_memory.png``; an error line or None."""
    err = plot(result, png)
    print(err or f"wrote {png}")
    if not err and result.get("memory"):
        memory_png = png.with_name(png.stem + "_memory.png")
        print(f"wrote {plot_kv_memory(result, memory_png)}")
    return err


@skipping_value_checks
def main(argv=None) -> int:
    args = parse_args(argv)

    if args.plot_only:
        result = json.loads(Path(args.plot_only).read_text())
        err = draw(result, Path(args.png or Path(args.plot_only).with_suffix(".png")))
        print(markdown_table(result))
        return 1 if err else 0

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("eval.bench e2e measures the H200 engine: no CUDA GPU here (use --tiny for a CPU smoke test)")
    shape_name, full_shape = SHAPES[args.shape]
    shape = dict(TINY if args.tiny else full_shape)
    if args.num_layers:
        shape["num_hidden_layers"] = args.num_layers
    if args.tiny:
        apply_tiny(args)
    cases = prefill_cases(shape, args)
    try:
        args.decode_variants, prefill_variants = resolve_variants(args, shape, cases)
    except ConfigError as err:
        print(f"eval.bench e2e: {err}", file=sys.stderr)
        return 2
    cases |= prefill_variants
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = Path(args.png or out.with_suffix(".png"))

    # PODKIT_SKIP_VALUE_CHECKS=1 for the whole run (skipping_value_checks): no host syncs inside timed steps
    result = {"benchmark": "e2e", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "python -m eval.bench e2e " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "model": "random-init " + ("tiny Llama" if args.tiny else shape_name),
              "shape": shape, "dtype": str(dtype).replace("torch.", ""), "budget": args.budget,
              "pod_anchor_layers": pod_anchor_layers(shape["num_hidden_layers"], shape["num_key_value_heads"],
                                                     2 if args.tiny else 9),
              "decode_kernels": args.decode_kernels, "kv_cache_dtypes": args.kv_cache_dtypes,
              "variants": args.variants, "decode": {}, "prefill": {}, "memory": {}, "errors": []}
    result["transformers"] = transformers.__version__

    run = Run(result, out, args.time_budget_s)

    print(f"building {result['model']} on {device}...", flush=True)
    model = build_model(shape, device, dtype)
    wbytes, wread = weight_bytes(model), decode_weight_bytes(model)
    result["weight_bytes"] = wbytes
    if device == "cuda":
        bw = copy_bandwidth(torch.device(device))
    else:
        bw = None
    result["copy_bandwidth_TBps"] = round(bw / 1e12, 3) if bw else None
    print(f"weights {wbytes / GIB:.2f} GiB, copy bandwidth {result['copy_bandwidth_TBps']} TB/s", flush=True)
    run.save()

    # memory first: cheap and independent of timing
    if "memory" in args.sections:
        measure_memory(run, model, args, shape, wbytes, device)
    if "decode" in args.sections:
        measure_decode(run, model, args, shape, dtype, bw, wread, device)
    if "prefill" in args.sections:
        measure_prefill(run, model, args, cases)

    run.save()
    draw(result, png)
    table = markdown_table(result)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
