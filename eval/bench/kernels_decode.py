"""Benchmark of podkit's Triton decode kernels against torch, with the memory-bandwidth floor.

    python -m eval.bench.kernels_decode --out decode.json [--contexts 8192 32768 131072]
        [--batches 1 8] [--rows decode selection sparse pod quest] [--check] [--tune] [--topk-variants]
        [--kv-cache-dtypes bfloat16 fp8_e4m3]

Pure torch + triton (runs on the GPU image: no deepspeed / lm-eval / datasets). Shape: Llama-3-8B
attention (32 query heads, 8 KV heads, D=128, bf16), every sequence full (seq_lens = context).
Each row times, in the same run, podkit's kernel, torch's closest composition and the floor
(bytes that must move / copy bandwidth measured here), with `triton.testing.do_bench` medians
(L2 flushed between repetitions). Rows:

- decode: torch SDPA (enable_gqa=True) vs decode_attention_triton.
- selection (budget 2048): naive torch (SDPA for the output + a GQA matmul for the logits +
  topk + sort) vs selection_decode_attention_triton, per head and per KV group, with the split
  top-k (default: first radix pass fused into the attention, kernels/_decode_topk_split.py) and
  the legacy top-k (kernels/_decode_topk.py); ratios to podkit full decode (target, BENCHMARKS.md
  status table: graph_over_podkit_full <= 1.25) and the fraction of rows whose index lists agree.
- sparse decode, k in {256, 2048, 4096}: torch gather + SDPA vs sparse_decode_attention_triton,
  lists per query head (Hs=Hq) and per KV group (Hs=Hkv).
- pod decode (sink 4, recent 2048): vs podkit full decode at equal context; with gate_tau 0.7 and
  the exact gate (reads everything); `pod_skip` rows: gate_tau 0.7 with a pre-evaluated gate
  (gate_estimate) that skips a given fraction of whole GQA groups (the reads a skip saves) or of
  single heads at random (a group reads while any of its heads does), with the skipped fractions,
  the time, and the time predicted by proportion.
- pod_sparse (POD + TidalDecode, budget 2048, sink 4, recent 2048): pod_sparse_decode_attention
  vs TidalDecode's sparse decode alone (target: <= 1.1x) and the engine's torch gather,
  lists per KV group and per query head; with the exact-gate tau and with half the groups skipped.
- quest (page 16, budget 2048): page scores + page selection + sparse decode over the pages.

`bw_util` (FlashInfer's metric): bytes the op must read / graph latency / the copy bandwidth
measured here (1.0 = at the copy floor). Bytes: K and V rows read (KV cache, or the listed /
selected / non-skipped rows), page metadata for Quest; score buffers and partials not counted.

`--kv-cache-dtypes fp8_e4m3` adds the `fp8_*` rows (without `bfloat16` in the list, only them: e.g.
`--contexts 131072 --batches 1 4 --kv-cache-dtypes fp8_e4m3` is the 128K FP8 set alone): each FP8 variant of a
decode kernel (kernels/fp8_kv.py: e4m3 K/V, one fp32 scale per token and KV head, dequantised in registers) on the
bf16 inputs quantised, against the same kernel on the bf16 inputs, both as CUDA-graph replays: fp8_decode,
fp8_selection_{head,group}, fp8_sparse_{head,group} (k in {256, 2048, 4096}), fp8_pod_decode,
fp8_pod_sparse_{group,head} and fp8_quest (page scores on bf16 pages that bound the dequantised keys + selection +
FP8 sparse decode), as `--rows` selects their families. Columns: graph_bf16_us, graph_fp8_us, fp8_over_bf16,
bytes_bf16 / bytes_fp8 (a K + V row per token and KV head read: 4 * D bytes in bf16, 2 * (D + 4) in FP8, plus
index lists and page metadata) and their floors and bw_utils.

Eager timings include Python and launch overheads, which dominate the small rows (podkit sparse decode at
k=256 is two Triton launches against a floor of about a microsecond); `graph_*` columns time one CUDA-graph replay
(L2 flushed before each), as the engine runs decode.

Data-dependent input checks (one host sync each) are switched off for the timings
(PODKIT_SKIP_VALUE_CHECKS=1), as under CUDA-graph capture; `checks_cost_us` reports their cost.
`--check` also compares every op in bf16 against kernels/reference.py (fp32 math) and an fp64
reference, and records the errors in the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F

from kernels import reference as R
from kernels import skipping_value_checks
from kernels.fp8_kv import KV_CACHE_DTYPES, bytes_per_token, quantize_kv, round_outward
from kernels.reference import quest_page_minmax

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
SELECTION_BUDGET = 2048  # TidalDecode's budget in the paper's efficiency runs (arXiv 2410.05076) and the targets


def _bench(fn, rep=100):
    import triton.testing  # lazy: Triton (CUDA benchmarks)
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3  # us


_FLUSH = {}


def _bench_graph(fn, iters=50):
    """Median device time (us) of one CUDA-graph replay of `fn`, L2 flushed before each replay.

    This is how the engine runs decode (CUDA-graph capture, the gpt-fast pattern): Python and
    launch overheads vanish, which eager timings of small problems are dominated by."""
    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flush = _FLUSH[dev]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return float(torch.tensor(times).median())


def copy_bandwidth(device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    us = _bench(lambda: dst.copy_(src), rep=50)
    src = dst = None
    return 2 * 2 * n / (us * 1e-6)


def _inputs(B, N, device, gen):
    q = torch.randn(B, HQ, D, device=device, dtype=DTYPE, generator=gen)
    k = torch.randn(B, HKV, N, D, device=device, dtype=DTYPE, generator=gen)
    v = torch.randn(B, HKV, N, D, device=device, dtype=DTYPE, generator=gen)
    seq_lens = torch.full((B,), N, device=device, dtype=torch.int32)
    return q, k, v, seq_lens


def _random_lists(B, H, N, K, device, gen):
    """[B,H,K] distinct random slots per list (ascending), int32."""
    keys = torch.rand(B, H, N, device=device, generator=gen)
    idx = keys.topk(K, dim=-1).indices
    return idx.sort(dim=-1).values.to(torch.int32)


def torch_sparse(q, k, v, idx):
    """torch gather + SDPA over listed slots (Hs = Hq or Hkv); what a user would write."""
    B, Hq, Dh = q.shape
    Hkv, Hs, K = k.shape[1], idx.shape[1], idx.shape[2]
    if Hs == Hkv:
        gi = idx.long()[..., None].expand(B, Hkv, K, Dh)
        ks, vs = torch.gather(k, 2, gi), torch.gather(v, 2, gi)
    else:
        gi = idx.long().view(B, Hkv, (Hq // Hkv) * K)[..., None].expand(-1, -1, -1, Dh)
        ks = torch.gather(k, 2, gi).view(B, Hq, K, Dh)
        vs = torch.gather(v, 2, gi).view(B, Hq, K, Dh)
    return F.scaled_dot_product_attention(q[:, :, None], ks, vs, enable_gqa=True)[:, :, 0]


def torch_selection(q, k, v, budget, per_kv_group):
    """SDPA output + logits via a GQA matmul + topk(budget-1) + current slot + sort."""
    B, Hq, Dh = q.shape
    N = k.shape[2]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    logits = torch.matmul(q.view(B, HKV, Hq // HKV, Dh), k.transpose(-1, -2)).float() * Dh ** -0.5
    logits[..., N - 1] = float("-inf")
    if per_kv_group:
        scores = torch.softmax(logits, -1).sum(2)
    else:
        scores = logits.view(B, Hq, N)
    idx = scores.topk(budget - 1, dim=-1, sorted=False).indices
    cur = torch.full((*idx.shape[:2], 1), N - 1, device=q.device, dtype=idx.dtype)
    return out, torch.cat([idx, cur], -1).sort(-1).values


def _row(rows, op, ctx, batch, **cols):
    row = dict(op=op, context=ctx, batch=batch, **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in cols.items()})
    rows.append(row)
    print(json.dumps(row), flush=True)


ROW_FAMILIES = ("decode", "selection", "sparse", "pod", "pod_sparse", "quest")
SKIP_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def run_bench(contexts, batches, device, bw, tune=False, topk_variants=False, families=ROW_FAMILIES,
              skip_fractions=SKIP_FRACTIONS, kv_cache_dtypes=("bfloat16",)):
    """Rows for every context x batch; `families` picks which ops (in bf16 the decode row always runs: the
    others' ratios refer to it) and `kv_cache_dtypes` which caches: "bfloat16" the rows below, "fp8_e4m3" the
    `fp8_*` rows (each times its bf16 op too, for the ratio, so they need no bf16 rows)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    rows = []
    for N in contexts:
        for B in batches:
            q, k, v, seq_lens = _inputs(B, N, device, gen)
            if "bfloat16" in kv_cache_dtypes:
                _bf16_rows(rows, q, k, v, seq_lens, bw, gen, tune, topk_variants, families, skip_fractions)
            if "fp8_e4m3" in kv_cache_dtypes:
                _fp8_rows(rows, q, k, v, seq_lens, bw, gen, families)
            q = k = v = None  # free the inputs before the next size
            torch.cuda.empty_cache()
    return rows


def _bf16_rows(rows, q, k, v, seq_lens, bw, gen, tune, topk_variants, families, skip_fractions):
    """The bf16 rows of one context x batch: decode, then the families asked for."""
    DA = importlib.import_module("kernels.triton_decode_attention")
    # lazy: Triton kernel modules (they import triton, slowly)
    from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton
    B, N, device = q.shape[0], k.shape[2], q.device
    kv_bytes = 2 * B * HKV * N * D * 2
    floor = kv_bytes / bw * 1e6
    sdpa = _bench(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
    full = _bench(lambda: DA.decode_attention_triton(q, k, v, seq_lens))
    full_scores = _bench(lambda: DA.decode_attention_triton(q, k, v, seq_lens, return_scores=True))
    sdpa_g = _bench_graph(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
    full_g = _bench_graph(lambda: DA.decode_attention_triton(q, k, v, seq_lens))
    _row(rows, "decode", N, B, floor_us=floor, sdpa_us=sdpa, podkit_us=full,
         podkit_scores_us=full_scores, podkit_over_sdpa=full / sdpa, podkit_over_floor=full / floor,
         graph_sdpa_us=sdpa_g, graph_podkit_us=full_g, graph_podkit_over_sdpa=full_g / sdpa_g,
         bw_util=floor / full_g, sdpa_bw_util=floor / sdpa_g)
    if tune:
        for bn, nw, ns in [(32, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 8, 3), (128, 4, 2)]:
            t = _bench(lambda: DA._launch_decode(q, k, v, seq_lens, D ** -0.5, None, False,
                                                 block_n=bn, num_warps=nw, num_stages=ns))
            _row(rows, "decode_tune", N, B, block_n=bn, num_warps=nw, num_stages=ns, podkit_us=t,
                 over_sdpa=t / sdpa)
    budget = SELECTION_BUDGET
    for per_group in (False, True) if "selection" in families else ():
        naive = _bench(lambda: torch_selection(q, k, v, budget, per_group))
        graphs = {}
        for impl in DA.TOPK_IMPLS:
            sel_fn = lambda impl=impl: DA.selection_decode_attention_triton(  # noqa: E731
                q, k, v, seq_lens, budget, per_kv_group=per_group, topk_impl=impl)
            graphs[impl] = (_bench(sel_fn), _bench_graph(sel_fn), sel_fn()[1])
        (sel, sel_g, idx), (old_e, old_g, idx_old) = graphs["split"], graphs["legacy"]
        agree = (idx == idx_old).all(-1).float().mean().item()
        _row(rows, "selection_group" if per_group else "selection_head", N, B, budget=budget,
             floor_us=floor, torch_us=naive, podkit_us=sel, podkit_full_us=full,
             over_podkit_full=sel / full, torch_over_podkit=naive / sel,
             graph_podkit_us=sel_g, graph_over_podkit_full=sel_g / full_g, bw_util=floor / sel_g,
             legacy_us=old_e, graph_legacy_us=old_g, graph_legacy_over_podkit_full=old_g / full_g,
             legacy_over_split=old_g / sel_g, rows_agreeing_with_legacy=agree)
    if topk_variants:
        # lazy: Triton kernel modules (they import triton, slowly)
        from kernels import _decode_topk as TK
        _, sc = DA.decode_attention_triton(q, k, v, seq_lens, return_scores=True)
        sc[torch.arange(B), :, seq_lens.long() - 1] = float("-inf")
        # lazy: Triton kernel modules (they import triton, slowly)
        from kernels import _decode_topk_split as TSP
        variants = {"torch": lambda: TK.topk_slots_torch(sc, seq_lens, budget),
                    "split": lambda: TSP.split_topk_slots(sc, seq_lens, budget)}
        for bits in (2, 4, 8):
            variants[f"radix{bits}"] = (lambda bits=bits: TK.topk_slots_with_current(sc, seq_lens, budget, _bits=bits))
        ref_sel = variants["torch"]()
        for name, fn in variants.items():
            _row(rows, "topk_variant", N, B, impl=name, rows_=B * HQ, graph_us=_bench_graph(fn),
                 rows_agreeing_with_torch=(fn() == ref_sel).all(-1).float().mean().item())
    for K in (256, 2048, 4096) if "sparse" in families else ():
        for Hs, name in ((HQ, "sparse_head"), (HKV, "sparse_group")):
            idx = _random_lists(B, Hs, N, K, device, gen)
            sp_floor = (2 * B * Hs * K * D * 2 + idx.numel() * 4) / bw * 1e6
            ts = _bench(lambda: torch_sparse(q, k, v, idx))
            ps = _bench(lambda: sparse_decode_attention_triton(q, k, v, idx))
            ts_g = _bench_graph(lambda: torch_sparse(q, k, v, idx))
            ps_g = _bench_graph(lambda: sparse_decode_attention_triton(q, k, v, idx))
            _row(rows, name, N, B, k=K, floor_us=sp_floor, torch_us=ts, podkit_us=ps,
                 torch_over_podkit=ts / ps, podkit_over_floor=ps / sp_floor,
                 graph_torch_us=ts_g, graph_podkit_us=ps_g, graph_torch_over_podkit=ts_g / ps_g,
                 bw_util=sp_floor / ps_g)
    if "pod" in families:
        _pod_rows(rows, q, k, v, seq_lens, full, full_g, bw, gen, skip_fractions=skip_fractions)
    if "pod_sparse" in families:
        _pod_sparse_rows(rows, q, k, v, seq_lens, bw, gen)
    if "quest" in families:
        _quest_rows(rows, q, k, v, seq_lens, full, bw)


def kv_row_bytes(kv_cache_dtype: str) -> int:
    """Bytes of one (token, KV head) row of K and V together that a kernel must read: 2 * D * 2 in bf16,
    2 * (D + 4) in FP8 (1 byte per element + the fp32 scale of the K row and of the V row, kernels/fp8_kv.py)."""
    return bytes_per_token(D, kv_cache_dtype, DTYPE)


def _fp8_pair(rows, op, N, B, bf16_fn, fp8_fn, rows_read, bw, extra_bytes=0, **cols):
    """One `fp8_*` row: CUDA-graph replays of the bf16 op and of its FP8 variant, each one's floor from the bytes
    it must read (``rows_read`` (token, KV head) rows of K + V, plus ``extra_bytes``: index lists, page metadata),
    both bw_utils and fp8 / bf16. A failing op is recorded in its row, not fatal to the run."""
    bytes_bf16 = rows_read * kv_row_bytes("bfloat16") + extra_bytes
    bytes_fp8 = rows_read * kv_row_bytes("fp8_e4m3") + extra_bytes
    try:
        t16, t8 = _bench_graph(bf16_fn), _bench_graph(fp8_fn)
    except Exception as err:  # noqa: BLE001 - record and go on to the next op
        _row(rows, op, N, B, kv_cache_dtype="fp8_e4m3", error=f"{type(err).__name__}: {str(err)[:300]}", **cols)
        return
    _row(rows, op, N, B, kv_cache_dtype="fp8_e4m3", **cols, bytes_bf16=bytes_bf16, bytes_fp8=bytes_fp8,
         floor_us=bytes_fp8 / bw * 1e6, bf16_floor_us=bytes_bf16 / bw * 1e6, graph_bf16_us=t16, graph_fp8_us=t8,
         fp8_over_bf16=t8 / t16, bw_util=bytes_fp8 / bw * 1e6 / t8, bf16_bw_util=bytes_bf16 / bw * 1e6 / t16)


def _fp8_rows(rows, q, k, v, seq_lens, bw, gen, families, sink=4, recent=2048):
    """The FP8 variant of every decode kernel against its bf16 self at one context x batch: full decode always,
    then the families asked for. K / V (and POD's ring) are the bf16 inputs quantised (kernels/fp8_kv.py)."""
    DA = importlib.import_module("kernels.triton_decode_attention")
    # lazy: Triton kernel modules (they import triton, slowly)
    from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton
    B, N = q.shape[0], k.shape[2]
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    s8 = dict(k_scale=ks, v_scale=vs)
    _fp8_pair(rows, "fp8_decode", N, B, lambda: DA.decode_attention_triton(q, k, v, seq_lens),
              lambda: DA.decode_attention_triton(q, k8, v8, seq_lens, **s8), B * HKV * N, bw)
    for per_group in (False, True) if "selection" in families else ():
        sel = DA.selection_decode_attention_triton
        _fp8_pair(rows, "fp8_selection_group" if per_group else "fp8_selection_head", N, B,
                  lambda: sel(q, k, v, seq_lens, SELECTION_BUDGET, per_kv_group=per_group),
                  lambda: sel(q, k8, v8, seq_lens, SELECTION_BUDGET, per_kv_group=per_group, **s8),
                  B * HKV * N, bw, budget=SELECTION_BUDGET)
    for K in (256, 2048, 4096) if "sparse" in families else ():
        for Hs, name in ((HQ, "fp8_sparse_head"), (HKV, "fp8_sparse_group")):
            idx = _random_lists(B, Hs, N, min(K, N), q.device, gen)
            _fp8_pair(rows, name, N, B, lambda: sparse_decode_attention_triton(q, k, v, idx),
                      lambda: sparse_decode_attention_triton(q, k8, v8, idx, **s8), B * Hs * idx.shape[-1], bw,
                      extra_bytes=idx.numel() * 4, k=K)
    k_local = torch.randn(B, HKV, sink + recent, D, device=q.device, dtype=DTYPE, generator=gen)
    kl8, kls = quantize_kv(k_local)
    pod = dict(sink=sink, recent=recent)
    pod8 = dict(k_local_scale=kls, k_anchor_scale=ks, v_scale=vs, **pod)
    if "pod" in families:
        # lazy: Triton kernel modules (they import triton, slowly)
        from kernels.triton_pod_decode_attention import pod_decode_attention_triton as pod_fn
        # distant positions read anchor K + V, proximal ones ring K + V: every position one row
        _fp8_pair(rows, "fp8_pod_decode", N, B, lambda: pod_fn(q, k_local, k, v, seq_lens, **pod),
                  lambda: pod_fn(q, kl8, k8, v8, seq_lens, **pod8), B * HKV * N, bw, sink=sink, recent=recent)
    if "pod_sparse" in families:
        _fp8_pod_sparse_rows(rows, q, (k_local, k, v), (kl8, k8, v8), seq_lens, pod, pod8, bw, gen)
    if "quest" in families:
        _fp8_quest_row(rows, q, (k, v), (k8, v8, ks, vs), seq_lens, bw)


def _fp8_pod_sparse_rows(rows, q, bf16, fp8, seq_lens, pod, pod8, bw, gen):
    """POD + TidalDecode over the selection's lists (per KV group and per query head), bf16 vs FP8."""
    # lazy: Triton kernel modules (they import triton, slowly)
    from kernels.triton_pod_sparse_decode_attention import pod_sparse_decode_attention_triton as fn
    B, N = q.shape[0], bf16[1].shape[2]
    budget = min(SELECTION_BUDGET, N)
    for Hs, name in ((HKV, "fp8_pod_sparse_group"), (HQ, "fp8_pod_sparse_head")):
        idx = _random_lists(B, Hs, N, budget, q.device, gen)
        idx[..., -1] = N - 1  # the current slot is always selected
        idx = idx.sort(-1).values
        _fp8_pair(rows, name, N, B, lambda: fn(q, *bf16, idx, seq_lens, **pod),
                  lambda: fn(q, *fp8, idx, seq_lens, **pod8), B * Hs * budget, bw, extra_bytes=idx.numel() * 4,
                  budget=budget, sink=pod["sink"], recent=pod["recent"])


def _fp8_quest_row(rows, q, bf16, fp8, seq_lens, bw, page_size=16, budget=2048):
    """Quest, page scores + page selection + sparse decode over the pages, bf16 vs FP8. FP8 pages bound the
    dequantised keys, rounded outward to bf16 (kernels/fp8_kv.py), so the score and selection kernels are the
    same in both; only the sparse decode reads FP8."""
    # lazy: Triton kernel modules (they import triton, slowly)
    from kernels.triton_quest_pages import quest_page_scores_triton, quest_select_pages_triton
    from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton
    (k, v), (k8, v8, ks, vs) = bf16, fp8
    B, N = q.shape[0], k.shape[2]
    pages = [tuple(t.to(DTYPE) for t in quest_page_minmax(k, seq_lens, page_size)),
             round_outward(*quest_page_minmax(k8, seq_lens, page_size, k_scale=ks), DTYPE)]

    def pipeline(pmax, pmin, keys, values, **scales):
        scores = quest_page_scores_triton(q, pmax, pmin, seq_lens, page_size)
        idx = quest_select_pages_triton(scores, seq_lens, page_size, budget)
        return sparse_decode_attention_triton(q, keys, values, idx, **scales)

    rows_read = B * HKV * min(budget // page_size, pages[0][0].shape[2]) * page_size
    _fp8_pair(rows, "fp8_quest", N, B, lambda: pipeline(*pages[0], k, v),
              lambda: pipeline(*pages[1], k8, v8, k_scale=ks, v_scale=vs), rows_read, bw,
              extra_bytes=2 * pages[0][0].numel() * 2, page_size=page_size, budget=budget)


def _pod_rows(rows, q, k, v, seq_lens, full, full_g, bw, gen, sink=4, recent=2048, tau=0.7,
              skip_fractions=SKIP_FRACTIONS):
    """POD decode without and with compute skipping (k doubles as the anchor keys)."""
    # lazy: Triton kernel modules (they import triton, slowly)
    from kernels.triton_pod_decode_attention import pod_decode_attention_triton
    B, N = q.shape[0], k.shape[2]
    device = q.device
    k_local = torch.randn(B, HKV, sink + recent, D, device=device, dtype=DTYPE, generator=gen)
    kw = dict(sink=sink, recent=recent)
    pod_fn = lambda: pod_decode_attention_triton(q, k_local, k, v, seq_lens, **kw)  # noqa: E731
    pod, pod_g = _bench(pod_fn), _bench_graph(pod_fn)
    pod_tau = _bench(lambda: pod_decode_attention_triton(q, k_local, k, v, seq_lens, gate_tau=tau, return_gate=True,
                                                         **kw))
    pod_tau_g = _bench_graph(lambda: pod_decode_attention_triton(q, k_local, k, v, seq_lens, gate_tau=tau, **kw))
    _, exact_skip = pod_decode_attention_triton(q, k_local, k, v, seq_lens, gate_tau=tau, return_skip=True, **kw)
    pod_w8_g = _bench_graph(lambda: pod_decode_attention_triton(q, k_local, k, v, seq_lens, _num_warps=8, **kw))
    # an anchor layer whose gate a later layer's estimate reads (engine, pod.gate_estimate="anchor"): exact
    # attention over its own keys through the POD kernel (k_local=None), against the plain decode kernel
    own_anchor_g = _bench_graph(lambda: pod_decode_attention_triton(q, None, k, v, seq_lens, return_gate=True, **kw))
    # bytes: anchor keys + values of distant positions, own (ring) keys + values of proximal ones
    distant = max(N - sink - recent, 0)
    dist_bytes = 2 * B * HKV * distant * D * 2
    prox_bytes = 2 * B * HKV * min(sink + recent, N) * D * 2
    pod_bytes = dist_bytes + prox_bytes
    _row(rows, "pod_decode", N, B, sink=sink, recent=recent, floor_us=pod_bytes / bw * 1e6, podkit_us=pod,
         podkit_tau_us=pod_tau, podkit_full_us=full, over_podkit_full=pod / full,
         graph_podkit_us=pod_g, graph_over_podkit_full=pod_g / full_g, bw_util=pod_bytes / bw * 1e6 / pod_g,
         graph_tau_exact_us=pod_tau_g, tau_exact_skipped_heads=exact_skip.float().mean().item(),
         graph_8_warps_us=pod_w8_g, graph_own_anchor_gate_us=own_anchor_g, own_anchor_gate_over_full=own_anchor_g / full_g)
    G = HQ // HKV
    for pattern in ("groups", "heads"):
        for frac in skip_fractions:
            if pattern == "groups":
                # whole GQA groups clear tau: the first round(frac * B * Hkv) (sequence, KV head) pairs
                n_skip = round(frac * B * HKV)
                grp = (torch.arange(B * HKV, device=device) < n_skip).view(B, HKV)
                est = torch.where(grp, 0.9, 0.1).repeat_interleave(G, dim=1).float()
            else:
                est = (torch.rand(B, HQ, device=device, generator=gen) < frac).float() * 0.8 + 0.1
            fn = lambda est=est: pod_decode_attention_triton(q, k_local, k, v, seq_lens, gate_tau=tau,  # noqa: E731
                                                             gate_estimate=est, **kw)
            t_g = _bench_graph(fn)
            _, skip = pod_decode_attention_triton(q, k_local, k, v, seq_lens, gate_tau=tau, gate_estimate=est,
                                                  return_skip=True, **kw)
            group_skip = skip.view(B, HKV, G).all(-1).float().mean().item()
            read = dist_bytes * (1 - group_skip) + prox_bytes
            _row(rows, "pod_skip", N, B, pattern=pattern, tau=tau, skipped_heads=skip.float().mean().item(),
                 skipped_groups=group_skip, graph_podkit_us=t_g, graph_no_skip_us=pod_g,
                 over_no_skip=t_g / pod_g, predicted_over_no_skip=read / pod_bytes,
                 bw_util=read / bw * 1e6 / t_g)


def torch_pod_sparse(q, k_local, k_anchor, v, idx, seq_lens, sink, recent):
    """The engine's torch gather for POD + TidalDecode (sparse_models/engine/decode_layers.py,
    _pod_sparse_run): per selected position the ring key if proximal, else the anchor key."""
    B, Hq, Dh = q.shape
    G = Hq // v.shape[1]
    if idx.shape[1] != Hq:
        idx = idx.repeat_interleave(G, dim=1)
    valid = idx >= 0
    j = idx.clamp(min=0).long()
    p = (seq_lens.long() - 1)[:, None, None]
    proximal = (j < sink) | (p - j < recent)
    b = torch.arange(B, device=q.device)[:, None, None]
    kvh = (torch.arange(Hq, device=q.device) // G)[None, :, None]
    ring = torch.where(j < sink, j, sink + j % recent)
    kk = torch.where(proximal[..., None], k_local[b, kvh, ring], k_anchor[b, kvh, j])
    logits = torch.einsum("bhd,bhkd->bhk", q.float(), kk.float()) * Dh ** -0.5
    probs = torch.softmax(logits.masked_fill(~valid, float("-inf")), -1)
    return torch.einsum("bhk,bhkd->bhd", probs, v[b, kvh, j].float()).to(q.dtype)


def _pod_sparse_rows(rows, q, k, v, seq_lens, bw, gen, sink=4, recent=2048, tau=0.7):
    """POD + TidalDecode sparse layer: pod_sparse_decode_attention over the selection's
    lists vs TidalDecode alone (sparse_decode_attention, target ratio <= 1.1) and the engine's torch
    gather; with gate_estimate skipping half of the GQA groups. Lists: the top-budget slots of random
    scores with the current slot, so about recent / N of each list is proximal."""
    # lazy: Triton kernel modules (they import triton, slowly)
    from kernels.triton_pod_sparse_decode_attention import pod_sparse_decode_attention_triton
    from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton
    B, N = q.shape[0], k.shape[2]
    budget = min(SELECTION_BUDGET, N)
    k_local = torch.randn(B, HKV, sink + recent, D, device=q.device, dtype=DTYPE, generator=gen)
    G = HQ // HKV
    for Hs, name in ((HKV, "pod_sparse_group"), (HQ, "pod_sparse_head")):
        idx = _random_lists(B, Hs, N, budget, q.device, gen)
        idx[..., -1] = N - 1  # the current slot is always selected
        idx = idx.sort(-1).values
        kw = dict(sink=sink, recent=recent)
        fused = lambda: pod_sparse_decode_attention_triton(q, k_local, k, v, idx, seq_lens, **kw)  # noqa: E731
        t_pod = _bench_graph(fused)
        t_tidal = _bench_graph(lambda: sparse_decode_attention_triton(q, k, v, idx))
        t_torch = _bench_graph(lambda: torch_pod_sparse(q, k_local, k, v, idx, seq_lens, sink, recent))
        t_tau = _bench_graph(lambda: pod_sparse_decode_attention_triton(q, k_local, k, v, idx, seq_lens,
                                                                        gate_tau=tau, **kw))
        grp = (torch.arange(B * HKV, device=q.device) % 2 == 0).view(B, HKV)
        est = torch.where(grp, 0.9, 0.1).repeat_interleave(G, dim=1).float()
        t_skip = _bench_graph(lambda: pod_sparse_decode_attention_triton(q, k_local, k, v, idx, seq_lens,
                                                                         gate_tau=tau, gate_estimate=est, **kw))
        other_warps = 4 if Hs == HKV else 8  # the launch width not chosen by default (see the kernel's notes)
        t_other = _bench_graph(lambda: pod_sparse_decode_attention_triton(q, k_local, k, v, idx, seq_lens,
                                                                          _num_warps=other_warps, **kw))
        list_bytes = 2 * B * Hs * budget * D * 2 + idx.numel() * 4
        _row(rows, name, N, B, budget=budget, sink=sink, recent=recent, graph_podkit_us=t_pod,
             graph_tidal_alone_us=t_tidal, over_tidal_alone=t_pod / t_tidal, graph_torch_us=t_torch,
             torch_over_podkit=t_torch / t_pod, graph_tau_exact_us=t_tau, graph_skip_half_groups_us=t_skip,
             other_num_warps=other_warps, graph_other_num_warps_us=t_other,
             bw_util=list_bytes / bw * 1e6 / t_pod)


def _quest_rows(rows, q, k, v, seq_lens, full, bw):
    """Quest: page scores + page selection + sparse decode over the selected pages."""
    # lazy: Triton kernel modules (they import triton, slowly)
    from kernels.triton_quest_pages import quest_page_scores_triton, quest_select_pages_triton
    from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton
    B, N = q.shape[0], k.shape[2]
    ps_, qbudget = 16, 2048
    pmax, pmin = quest_page_minmax(k, seq_lens, ps_)
    pmax, pmin = pmax.to(DTYPE), pmin.to(DTYPE)
    t_scores = _bench(lambda: quest_page_scores_triton(q, pmax, pmin, seq_lens, ps_))
    scores = quest_page_scores_triton(q, pmax, pmin, seq_lens, ps_)
    t_select = _bench(lambda: quest_select_pages_triton(scores, seq_lens, ps_, qbudget))
    qidx = quest_select_pages_triton(scores, seq_lens, ps_, qbudget)
    t_attn = _bench(lambda: sparse_decode_attention_triton(q, k, v, qidx))
    meta_floor = 2 * pmax.numel() * 2 / bw * 1e6
    attn_bytes = 2 * B * HKV * qbudget * D * 2
    _row(rows, "quest", N, B, page_size=ps_, budget=qbudget, scores_us=t_scores,
         scores_floor_us=meta_floor, select_us=t_select, attn_us=t_attn,
         total_us=t_scores + t_select + t_attn, podkit_full_us=full,
         bw_util=(attn_bytes + 2 * pmax.numel() * 2) / bw * 1e6 / (t_scores + t_select + t_attn))


def checks_cost(device):
    DA = importlib.import_module("kernels.triton_decode_attention")
    q, k, v, seq_lens = _inputs(1, 8192, device, None)
    os.environ["PODKIT_SKIP_VALUE_CHECKS"] = "0"
    on = _bench(lambda: DA.decode_attention_triton(q, k, v, seq_lens))
    os.environ["PODKIT_SKIP_VALUE_CHECKS"] = "1"
    off = _bench(lambda: DA.decode_attention_triton(q, k, v, seq_lens))
    return on - off


def run_checks(device):
    """bf16 errors of each op against the fp32-math reference and an fp64 reference."""
    # lazy: Triton kernel modules (they import triton, slowly)
    from kernels.triton_decode_attention import decode_attention_triton, selection_decode_attention_triton
    from kernels.triton_pod_decode_attention import pod_decode_attention_triton
    from kernels.triton_quest_pages import quest_page_scores_triton
    from kernels.triton_sparse_decode_attention import sparse_decode_attention_triton

    torch.manual_seed(1)
    out = {}
    B, N = 3, 5000
    q, k, v, _ = _inputs(B, N, device, None)
    seq_lens = torch.tensor([5000, 1777, 64], device=device, dtype=torch.int32)
    qd, kd, vd = q.double(), k.double(), v.double()

    def err(a, ref64):
        return (a.double() - ref64).abs().max().item()

    ref64 = R.decode_attention(qd, kd, vd, seq_lens)
    o = decode_attention_triton(q, k, v, seq_lens)
    out["decode"] = dict(kernel=err(o, ref64), torch_bf16=err(R.decode_attention(q, k, v, seq_lens), ref64))
    o, idx = selection_decode_attention_triton(q, k, v, seq_lens, 256)
    _, idx_ref = R.selection_decode_attention(q, k, v, seq_lens, 256)
    out["selection_head"] = dict(kernel=err(o, ref64), index_agreement=(idx == idx_ref).float().mean().item())
    o, idx = selection_decode_attention_triton(q, k, v, seq_lens, 256, per_kv_group=True)
    _, idx_ref = R.selection_decode_attention(q, k, v, seq_lens, 256, per_kv_group=True)
    out["selection_group"] = dict(kernel=err(o, ref64), index_agreement=(idx == idx_ref).float().mean().item())
    for per_group in (False, True):
        _, idx = selection_decode_attention_triton(q, k, v, seq_lens, 2048, per_kv_group=per_group, topk_impl="split")
        _, idx_old = selection_decode_attention_triton(q, k, v, seq_lens, 2048, per_kv_group=per_group,
                                                       topk_impl="legacy")
        out[f"selection_split_vs_legacy_{'group' if per_group else 'head'}"] = dict(
            rows_equal=(idx == idx_old).all(-1).float().mean().item())
    for Hs in (HQ, HKV):
        idx = _random_lists(B, Hs, 1700, 300, device, None).long()
        idx[2, :, 100:] = -1
        ref = R.sparse_decode_attention(qd, kd, vd, idx)
        o = sparse_decode_attention_triton(q, k, v, idx)
        out[f"sparse_hs{Hs}"] = dict(kernel=err(o, ref), torch_bf16=err(R.sparse_decode_attention(q, k, v, idx), ref))
    sink, recent = 4, 300
    k_local = torch.randn(B, HKV, sink + recent, D, device=device, dtype=DTYPE)
    ref, g64 = R.pod_decode_attention(qd, k_local.double(), kd, vd, seq_lens, sink=sink, recent=recent, return_gate=True)
    o, g = pod_decode_attention_triton(q, k_local, k, v, seq_lens, sink=sink, recent=recent, return_gate=True)
    r32 = R.pod_decode_attention(q, k_local, k, v, seq_lens, sink=sink, recent=recent)
    out["pod"] = dict(kernel=err(o, ref), torch_bf16=err(r32, ref), gate=err(g, g64))
    est = torch.rand(B, HQ, device=device)
    est[0, :HQ // HKV] = 0.9  # one whole group skips
    kw = dict(sink=sink, recent=recent, gate_tau=0.7, gate_estimate=est)
    ref = R.pod_decode_attention(qd, k_local.double(), kd, vd, seq_lens, **kw)
    o = pod_decode_attention_triton(q, k_local, k, v, seq_lens, **kw)
    out["pod_skip_estimate"] = dict(kernel=err(o, ref), torch_bf16=err(R.pod_decode_attention(q, k_local, k, v, seq_lens,
                                                                                              **kw), ref))
    pmax, pmin = R.quest_page_minmax(k, seq_lens, 16)
    s = quest_page_scores_triton(q, pmax.to(DTYPE), pmin.to(DTYPE), seq_lens, 16)
    sr = R.quest_page_scores(q, pmax.to(DTYPE), pmin.to(DTYPE), seq_lens, 16)
    fin = torch.isfinite(sr)
    out["quest_scores"] = dict(kernel=(s[fin] - sr[fin]).abs().max().item(),
                               inf_pattern_equal=bool(torch.equal(torch.isinf(s), torch.isinf(sr))))
    for name, val in out.items():
        print("check", name, json.dumps(val), flush=True)
    return out


@skipping_value_checks(force=True)
def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m eval.bench kernels-decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--check", action="store_true", help="also check bf16 accuracy against the reference")
    ap.add_argument("--tune", action="store_true", help="also time decode launch-config variants")
    ap.add_argument("--topk-variants", action="store_true", help="also time the selection top-k variants alone")
    ap.add_argument("--rows", nargs="+", choices=ROW_FAMILIES, default=list(ROW_FAMILIES),
                    help="which op families to time (decode always runs: the ratios refer to it)")
    ap.add_argument("--kv-cache-dtypes", nargs="+", choices=KV_CACHE_DTYPES, default=["bfloat16"],
                    help="bfloat16: the rows above; fp8_e4m3: the fp8_* rows (each FP8 kernel against its bf16 "
                         "self: graph us, fp8_over_bf16, bw_util from the FP8 bytes); default bfloat16 only")
    ap.add_argument("--skip-fractions", type=float, nargs="+", default=list(SKIP_FRACTIONS), metavar="F",
                    help="pod_skip rows: fractions of whole GQA groups (and of single heads) whose gate estimate "
                         "clears tau, e.g. the fractions `python -m eval.pod_gate_skip` measured on real text")
    args = ap.parse_args(argv)
    bad = [f for f in args.skip_fractions if not 0.0 <= f <= 1.0]
    if bad:
        ap.error(f"--skip-fractions {bad[0]} is outside [0, 1] (a fraction of groups or heads)")
    if not torch.cuda.is_available():
        print("kernels_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    import triton  # lazy: Triton (CUDA benchmarks)
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                  shape=dict(Hq=HQ, Hkv=HKV, D=D, dtype=str(DTYPE)))
    if args.check:
        result["checks"] = run_checks(device)
    bw = copy_bandwidth(device)
    result["copy_bandwidth_TBps"] = round(bw / 1e12, 3)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    result["checks_cost_us"] = round(checks_cost(device), 2)
    os.environ["PODKIT_SKIP_VALUE_CHECKS"] = "1"
    result["rows"] = run_bench(args.contexts, args.batches, device, bw, tune=args.tune, topk_variants=args.topk_variants,
                               families=tuple(args.rows), skip_fractions=tuple(args.skip_fractions),
                               kv_cache_dtypes=tuple(args.kv_cache_dtypes))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
