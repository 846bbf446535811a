"""``kv_cache_recent_keys`` (issue 32): an FP8 cache that keeps the newest W positions' keys in the model's dtype.

The model cache's readers must return, for every layer and KV head, the key of each position exactly as written
when the position is among the newest W of its row, and the FP8 round trip of it otherwise: for plain layers, POD's
anchors and rings (``anchor_keys``, ``local_key_view``, ``effective_keys``), over ragged rows and decode steps that
wrap the ring. Quest's page bounds must hold for both versions of a recent key."""

from __future__ import annotations

import zlib

import pytest
import torch
from sm_tiny import random_prompts as sm_prompts
from sm_tiny import run_model, tiny_model
from test_engine import podkit_model, random_prompts, reference_generate, scheme_overrides
from test_engine_limits_and_timing import compile_cache_env, tiny_checkpoint  # noqa: F401  (fixtures)

from kernels.fp8_kv import dequantize_kv, quantize_kv
from sparse_models import SparseAttentionConfig
from sparse_models.cache import SparseKVCache
from sparse_models.cache_layout import cache_layout
from sparse_models.config import ConfigError, override_keys
from sparse_models.engine import GenerationEngine
from sparse_models.plan import build_plan

FP8 = dict(kv_cache_dtype="fp8_e4m3")
LAYERS, HKV, D = 4, 2, 16


def test_field_validated_with_one_clear_error():
    config = SparseAttentionConfig()
    assert config.kv_cache_recent_keys == 0 and "kv_cache_recent_keys" in override_keys()
    assert config.with_overrides(**FP8, kv_cache_recent_keys=64).kv_cache_recent_keys == 64
    round_trip = SparseAttentionConfig.from_dict(SparseAttentionConfig(**FP8, kv_cache_recent_keys=8).to_dict())
    assert round_trip.kv_cache_recent_keys == 8
    for bad in (-1, 1.5, True, "64"):
        with pytest.raises(ConfigError, match=r"kv_cache_recent_keys=.* is invalid: expected an int >= 0"):
            SparseAttentionConfig(**FP8, kv_cache_recent_keys=bad)
    with pytest.raises(ConfigError, match=r"kv_cache_recent_keys=64 is invalid: expected 0 with "
                                          r"kv_cache_dtype='bfloat16'"):
        config.with_overrides(kv_cache_recent_keys=64)
    with pytest.raises(ConfigError, match=r"did you mean kv_cache_recent_keys"):
        config.with_overrides(kv_cache_recent_key=64)


RECENT_SCHEMES = ["dense", "tidal", "tidal-correction", "tidal-all-union", "tidal-group-union-recent", "quest",
                  "streaming", "pod", "pod-gate-skip-anchor", "pod+tidal", "pod+tidal-all-union", "pod-prefill+pod",
                  "pod-scores"]


@pytest.mark.parametrize("scheme", RECENT_SCHEMES)
def test_engine_equals_generate_with_recent_keys(scheme):
    """The engine's static cache and decode ops (rings passed to every kernel) give the tokens of the model classes'
    cache (whose readers overlay the ring), with a window of 5 that the 14-23-token prompts wrap."""
    model = podkit_model(6, 2, seed=zlib.crc32(f"recent-{scheme}".encode()) % 1000)
    prompts = random_prompts([23, 14, 19], seed=len(scheme))
    overrides = {**scheme_overrides(scheme, 2), **FP8, "kv_cache_recent_keys": 5}
    expected = reference_generate(model, prompts, overrides)
    for kind in ("standard", "fused"):
        engine = GenerationEngine(model, sparse_config=SparseAttentionConfig(), max_batch_size=3, max_seq_len=40,
                                  decode_kernels=kind, **overrides)
        assert engine.cache.recent_keys[0].shape == (3, 2, 5, 16)
        assert engine.generate(prompts, max_new_tokens=7).tokens == expected, kind


def _cache(scheme: str, window: int) -> SparseKVCache:
    config = SparseAttentionConfig().with_overrides(**scheme_overrides(scheme, HKV), **FP8,
                                                    kv_cache_recent_keys=window)
    plan = build_plan(config, LAYERS, HKV)
    return SparseKVCache(plan, HKV, D, layout=cache_layout(config, plan, D))


def _written(scheme: str, window: int, prompt_lens, steps: int, seed: int):
    """A cache after a ragged prefill of ``prompt_lens`` tokens (padding columns after each row's tokens) and
    ``steps`` decode tokens per row, fed random keys and values. Returns (cache, keys [B, Hkv, T, D] per layer by
    position, as written, lens after the last step)."""
    g = torch.Generator().manual_seed(seed)
    cache = _cache(scheme, window)
    batch, width = len(prompt_lens), max(prompt_lens)
    total = width + steps
    keys = [torch.randn(batch, HKV, total, D, generator=g) * 3 for _ in range(LAYERS)]
    rows = torch.arange(batch)
    cache.reserve(batch, total, torch.float32, "cpu")
    lens = torch.tensor(prompt_lens)
    cache.set_view_limit(int(lens.max()))
    zero = torch.zeros(batch, dtype=torch.long)
    for layer in range(LAYERS):  # the prefill: row b's columns >= lens[b] are padding
        cache.write(layer, keys[layer][:, :, :width], torch.randn(batch, HKV, width, D, generator=g), zero, lens)
    cache.seq_lens = lens
    cache._rebuild_key_state(range(LAYERS))
    one = torch.ones(batch, dtype=torch.long)
    for i in range(steps):
        start = lens + i
        cache.set_view_limit(int(start.max()) + 1)
        for layer in range(LAYERS):
            k = keys[layer][rows, :, start][:, :, None]
            cache.write(layer, k, torch.randn(k.shape, generator=g), start, one)
            cache.update_key_state(layer, start, start + 1)
        cache.seq_lens = start + 1
    return cache, keys, lens + steps


def _expected(keys: torch.Tensor, lens: torch.Tensor, window: int) -> torch.Tensor:
    """keys [B, H, T, D] as an FP8 cache with ``window`` recent keys reads them."""
    data, scale = quantize_kv(keys)
    read = dequantize_kv(data, scale)
    position = torch.arange(keys.shape[2])[None, :]
    recent = (position >= (lens[:, None] - window)) & (position < lens[:, None])
    return torch.where(recent[:, None, :, None], keys, read)


@pytest.mark.parametrize("window", [0, 3, 8, 64])
def test_dense_layers_read_recent_keys_exactly_and_older_keys_in_fp8(window):
    cache, keys, lens = _written("dense", window, [9, 5, 12], steps=7, seed=window)
    for layer in range(LAYERS):
        got = cache.layer_keys(layer)
        want = _expected(keys[layer], lens, window)
        for b, n in enumerate(lens.tolist()):
            torch.testing.assert_close(got[b, :, :n], want[b, :, :n], atol=0, rtol=0)


@pytest.mark.parametrize("scheme", ["pod", "pod+tidal"])
@pytest.mark.parametrize("window", [0, 4, 64])
def test_pod_anchor_and_ring_keys_follow_the_same_rule(scheme, window):
    """POD's shared heads: distant keys are the anchor layer's (recent or FP8 by the anchor's ring), proximal keys
    the layer's own ring (recent slots in the model's dtype)."""
    cache, keys, lens = _written(scheme, window, [14, 6], steps=9, seed=10 + window)
    plan = cache.plan
    for layer in range(LAYERS):
        anchors = plan[layer].anchors
        want_anchor = torch.stack([_expected(keys[a], lens, window)[:, h] for h, a in enumerate(anchors)], dim=1)
        own = _expected(keys[layer], lens, window)
        effective = cache.effective_keys(layer, lens)
        local = cache.local_key_view(layer, lens)
        anchor = cache.anchor_keys(layer)
        for b, n in enumerate(lens.tolist()):
            torch.testing.assert_close(anchor[b, :, :n], want_anchor[b, :, :n], atol=0, rtol=0)
            for h in range(HKV):
                proximal = [j for j in range(n) if j < cache.sink or n - 1 - j < cache.recent]
                distant = [j for j in range(n) if j not in proximal]
                torch.testing.assert_close(effective[b, h, proximal], own[b, h, proximal], atol=0, rtol=0)
                torch.testing.assert_close(effective[b, h, distant], want_anchor[b, h, distant], atol=0, rtol=0)
                # the ring view: slot t < sink holds position t, ring slot sink + j % recent position j
                for j in proximal:
                    slot = j if j < cache.sink else cache.sink + j % cache.recent
                    torch.testing.assert_close(local[b, h, slot], own[b, h, j], atol=0, rtol=0)


def test_quest_pages_bound_both_versions_of_every_recent_key():
    window, prompt_lens = 6, [11, 7]
    cache, keys, lens = _written("quest", window, prompt_lens, steps=6, seed=3)
    page = 4  # scheme_overrides("quest"): quest_page_size=4
    for layer in range(LAYERS):
        if (layer, "page_max") not in cache.buffers:
            continue
        page_max, page_min = cache.buffers[(layer, "page_max")], cache.buffers[(layer, "page_min")]
        fp8 = _expected(keys[layer], lens, 0)
        for b, n in enumerate(lens.tolist()):
            # the FP8 copy of every key, and the exact key of every position that was ever among the newest W (the
            # prompt's last W, every decode token): attention read it while it was
            for version, first in ((fp8, 0), (keys[layer], prompt_lens[b] - window)):
                k = version[b, :, :n]
                for j in range(max(first, 0), n):
                    assert bool((page_max[b, :, j // page] >= k[:, j]).all()), (layer, b, j)
                    assert bool((page_min[b, :, j // page] <= k[:, j]).all()), (layer, b, j)
        # and the pages are tight: each page's max is some version's key (no bound is simply +inf)
        assert bool(torch.isfinite(page_max[:, :, : (int(lens.min()) // page)]).all())


def test_beam_reorder_moves_the_recent_keys_with_their_rows():
    cache, keys, lens = _written("dense", 4, [8, 8], steps=3, seed=5)
    before = cache.layer_keys(1).clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(cache.layer_keys(1), before.flip(0), atol=0, rtol=0)


def test_kv_bytes_count_the_recent_keys():
    plain, recent = _cache("dense", 0), _cache("dense", 8)
    for cache in (plain, recent):
        cache.reserve(2, 64, torch.bfloat16, "cpu")
    extra = recent.kv_bytes().total - plain.kv_bytes().total
    assert extra == LAYERS * 2 * HKV * 8 * D * 2  # layers x B x Hkv x W x D bf16 elements


def test_recent_keys_bring_fp8_logits_closer_to_bf16():
    """On the tiny model (sharpened q/k), keys of the newest 64 positions in fp32 (the model's dtype here) cover
    every position of these prompts: what is left of FP8's logit error is the values', and it is smaller than with
    every key in FP8."""
    prompts = sm_prompts([20, 13], seed=5)
    conts = [sm_prompts([6], seed=6)[0]] * 2
    logits = {}
    for name, sparse in (("bf16", {}), ("fp8", FP8), ("fp8+recent", {**FP8, "kv_cache_recent_keys": 64})):
        _, steps, _ = run_model(tiny_model(sparse=sparse), prompts, conts)
        logits[name] = torch.stack(steps)
    error = {name: (logits[name] - logits["bf16"]).abs().max().item() for name in ("fp8", "fp8+recent")}
    assert 0 < error["fp8+recent"] < error["fp8"], error


def test_cli_flag(tiny_checkpoint, capsys, compile_cache_env):  # noqa: F811
    from sparse_models.generate import main

    assert main(["--model", str(tiny_checkpoint), "--prompt", "the quick brown fox", "--max-new-tokens", "3",
                 "--device", "cpu", "--no-warmup", "--kv-cache-dtype", "fp8_e4m3", "--kv-cache-recent-keys", "8"]) == 0
    assert "kv_cache_dtype=fp8_e4m3 recent_keys=8" in capsys.readouterr().err
    assert main(["--model", str(tiny_checkpoint), "--prompt", "x", "--max-new-tokens", "3", "--device", "cpu",
                 "--no-warmup", "--kv-cache-recent-keys", "8"]) == 2  # a bfloat16 cache: one line, exit 2
    assert "kv_cache_recent_keys=8 is invalid: expected 0 with kv_cache_dtype='bfloat16'" in capsys.readouterr().err
