"""The generation engine (sparse_models.engine) against transformers' generate() and podkit's model class.

Greedy tokens through the engine must equal greedy tokens through ``PodkitLlamaForCausalLM.generate()``
for every decode scheme (and the sparse prefill schemes), on tiny random models with GQA groups 1, 3, 4
and a ragged batch, with budgets small enough that every sparse scheme really drops tokens.
"""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

from sparse_models import PodkitLlamaForCausalLM
from sparse_models.engine import EngineError, GenerationEngine, SamplingConfig
from tests.tiny_models import tiny_model

VOCAB = 128
NEW_TOKENS = 7
# 4 layers, 2 KV heads; POD blocks: head 0 = {0, 1, 2} + {3}, head 1 = {0} + {1, 2, 3}
POD_ANCHORS_2 = [[0, 0], [0, 1], [0, 1], [3, 1]]
TIDAL = dict(tidal_budget=8, tidal_full_layers=[0, 1], tidal_selection_layers=[2])

SCHEMES = {
    "dense": dict(decode_scheme="dense"),
    "tidal": dict(decode_scheme="tidal", **TIDAL),
    "tidal-kv-group": dict(decode_scheme="tidal", tidal_selection="kv_group", **TIDAL),
    "tidal-correction": dict(decode_scheme="tidal", tidal_correction_period=3, **TIDAL),
    # podkit's selection options beyond the paper (METHODS.md B.2): scores + the torch selection in both paths
    "tidal-group-union": dict(decode_scheme="tidal", tidal_selection="group_union", **TIDAL),
    "tidal-all-union": dict(decode_scheme="tidal", tidal_selection="all_union", **TIDAL),
    "tidal-recent": dict(decode_scheme="tidal", tidal_recent_share=0.25, **TIDAL),
    "tidal-group-union-recent": dict(decode_scheme="tidal", tidal_selection="group_union", tidal_recent_share=0.5,
                                     **TIDAL),
    "quest": dict(decode_scheme="quest", quest_budget=8, quest_page_size=4, quest_dense_layers=[0]),
    "streaming": dict(decode_scheme="streaming", streaming_sink_tokens=2, streaming_recent_window=6),
    "pod": dict(decode_scheme="pod", pod_sink_tokens=2, pod_recent_window=6),
    "pod-gate-skip": dict(decode_scheme="pod", pod_sink_tokens=2, pod_recent_window=6, pod_gate_tau=0.5,
                          pod_gate_estimate="exact"),
    # the anchor layer's gate decides the skip: the engine's distant reads are skipped, not only masked
    "pod-gate-skip-anchor": dict(decode_scheme="pod", pod_sink_tokens=2, pod_recent_window=6, pod_gate_tau=0.5,
                                 pod_gate_estimate="anchor"),
    "pod+tidal": dict(decode_scheme="pod+tidal", pod_sink_tokens=2, pod_recent_window=6, tidal_budget=8,
                      tidal_full_layers=[0], tidal_selection_layers=[2]),
    "pod+tidal-all-union": dict(decode_scheme="pod+tidal", pod_sink_tokens=2, pod_recent_window=6, tidal_budget=8,
                                tidal_full_layers=[0], tidal_selection_layers=[2], tidal_selection="all_union"),
    "pod+tidal-scores": dict(prefill_scheme="pod", decode_scheme="pod+tidal", pod_sink_tokens=2, pod_recent_window=6,
                             pod_sharing="scores", tidal_budget=8, tidal_full_layers=[0], tidal_selection_layers=[2]),
    "token_sparse-prefill": dict(prefill_scheme="token_sparse", token_sparse_window=4, token_sparse_min_tokens=4,
                                 token_sparse_coverage=0.3, token_sparse_sparse_layers=[2, 3]),
    "pod-prefill+pod": dict(prefill_scheme="pod", decode_scheme="pod", pod_sink_tokens=2, pod_recent_window=6),
    # v1 score sharing: distant logits are the anchor layer's q . k in the prefill and every decode step
    "pod-scores": dict(prefill_scheme="pod", decode_scheme="pod", pod_sink_tokens=2, pod_recent_window=6,
                       pod_sharing="scores"),
    "pod-scores-gate-skip": dict(prefill_scheme="pod", decode_scheme="pod", pod_sink_tokens=2, pod_recent_window=6,
                                 pod_sharing="scores", pod_gate_tau=0.5),
}


def engine_model(num_heads: int, num_kv_heads: int, seed: int, **kw):
    """A random model of these tests' shape (tests/tiny_models.py): 16 per head, 4 layers, init std 0.2, no special
    tokens; ``kw``: the factory's family / podkit and further config fields."""
    return tiny_model(layers=4, seed=seed, vocab=VOCAB, heads=num_heads, kv_heads=num_kv_heads, hidden=16 * num_heads,
                      intermediate=96, positions=256, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None, **kw)


def _valid_anchor_map(num_kv_heads: int) -> list[list[int]]:
    # head h even: block {0,1,2} then {3}; odd: {0} then {1,2,3}
    rows = []
    for layer in range(4):
        row = []
        for h in range(num_kv_heads):
            if h % 2 == 0:
                row.append(0 if layer < 3 else 3)
            else:
                row.append(0 if layer == 0 else 1)
        rows.append(row)
    return rows


def podkit_model(num_heads: int, num_kv_heads: int, seed: int) -> PodkitLlamaForCausalLM:
    return engine_model(num_heads, num_kv_heads, seed)


def scheme_overrides(name: str, num_kv_heads: int) -> dict:
    overrides = dict(SCHEMES[name])
    if "pod" in name:
        overrides["pod_anchor_layers"] = _valid_anchor_map(num_kv_heads)
    return overrides


def random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference_generate(model, prompts, overrides, new_tokens=NEW_TOKENS):
    """podkit's transformers path, one prompt at a time (no padding involved)."""
    model.set_sparse_attention(model.sparse_config.__class__(), **overrides)
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


HEADS = {"G1": (4, 4), "G3": (6, 2), "G4": (8, 2)}
# every scheme with GQA group 3; the decode kernels' layouts (dense, TidalDecode, POD) also with 1 and 4
ENGINE_CASES = [(scheme, "G3") for scheme in SCHEMES] + [
    (scheme, g) for g in ("G1", "G4") for scheme in ("dense", "tidal", "tidal-kv-group", "tidal-group-union",
                                                     "tidal-all-union", "pod", "pod+tidal")]


@pytest.mark.parametrize("scheme, group", ENGINE_CASES, ids=[f"{s}-{g}" for s, g in ENGINE_CASES])
def test_engine_greedy_matches_podkit_generate(scheme, group):
    heads = HEADS[group]
    num_heads, num_kv = heads
    model = podkit_model(num_heads, num_kv, seed=zlib.crc32(f"{scheme}-{group}".encode()) % 1000)
    prompts = random_prompts([23, 14, 19], seed=len(scheme) + num_heads)
    overrides = scheme_overrides(scheme, num_kv)
    expected = reference_generate(model, prompts, overrides)
    engine = GenerationEngine(model, sparse_config=model.sparse_config.__class__(), max_batch_size=3,
                              max_seq_len=40, **overrides)
    result = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert result.tokens == expected
    assert result.finish_reasons == ["length"] * 3


@pytest.mark.parametrize("scheme", ["tidal", "tidal-group-union", "tidal-all-union", "tidal-recent", "quest",
                                    "streaming", "pod+tidal", "token_sparse-prefill"])
def test_sparse_schemes_differ_from_dense_with_small_budgets(scheme):
    """Guards the test above: with these budgets the schemes really drop tokens."""
    model = podkit_model(6, 2, seed=3)
    prompts = random_prompts([23, 14, 19], seed=11)
    dense = GenerationEngine(model, max_batch_size=3, max_seq_len=40, decode_scheme="dense").generate(
        prompts, max_new_tokens=NEW_TOKENS)
    sparse = GenerationEngine(model, max_batch_size=3, max_seq_len=40, **scheme_overrides(scheme, 2)).generate(
        prompts, max_new_tokens=NEW_TOKENS)
    assert sparse.tokens != dense.tokens


@pytest.mark.parametrize("scheme, covering", [
    ("tidal", dict(decode_scheme="tidal", tidal_budget=64)),
    ("quest", dict(decode_scheme="quest", quest_budget=64, quest_page_size=4)),
    ("streaming", dict(decode_scheme="streaming", streaming_sink_tokens=2, streaming_recent_window=64)),
    ("pod", dict(decode_scheme="pod", pod_sink_tokens=2, pod_recent_window=64)),
    ("token_sparse", dict(prefill_scheme="token_sparse", token_sparse_coverage=0.0, token_sparse_min_tokens=0,
                          token_sparse_window=4)),
])
def test_covering_budgets_equal_dense(scheme, covering):
    model = podkit_model(8, 2, seed=5)
    prompts = random_prompts([21, 9], seed=4)
    if scheme == "pod":
        covering = dict(covering, pod_anchor_layers=_valid_anchor_map(2))
    dense = GenerationEngine(model, max_batch_size=2, max_seq_len=40).generate(prompts, max_new_tokens=NEW_TOKENS)
    other = GenerationEngine(model, max_batch_size=2, max_seq_len=40, **covering).generate(
        prompts, max_new_tokens=NEW_TOKENS)
    assert other.tokens == dense.tokens


def test_dense_engine_matches_plain_transformers_generate():
    model = engine_model(6, 2, 7, podkit=False)
    prompts = random_prompts([17, 6, 12], seed=8)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    engine = GenerationEngine(model, max_batch_size=3, max_seq_len=32)
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS).tokens == expected


@pytest.mark.parametrize("period", [3, 4])
def test_tidal_correction_restores_full_attention_kv(period):
    """After a correction, the K/V of every corrected slot equal those of a dense prefill of the same tokens."""
    model = podkit_model(6, 2, seed=9)
    prompt = random_prompts([20], seed=10)[0]
    new = 2 * period + 1  # 2 * period decode steps -> two corrections, the last right at the end
    # selection at layer 1 so that layers 2 and 3 decode sparsely and layer 3's K/V get polluted
    tidal = dict(tidal_budget=8, tidal_full_layers=[0], tidal_selection_layers=[1])
    engine = GenerationEngine(model, max_seq_len=40, decode_scheme="tidal", tidal_correction_period=period, **tidal)
    tokens = engine.generate([prompt], max_new_tokens=new).tokens[0]
    full = prompt + tokens[:-1]  # the last token was sampled but never fed
    dense = GenerationEngine(model, max_seq_len=40)
    dense.prefill([full])
    no_fix = GenerationEngine(model, max_seq_len=40, decode_scheme="tidal", **tidal)
    assert no_fix.generate([prompt], max_new_tokens=new).tokens[0][:period + 1] == tokens[:period + 1]
    n = len(full)
    for layer in range(4):
        torch.testing.assert_close(engine.cache.keys[layer][0, :, :n], dense.cache.keys[layer][0, :, :n],
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(engine.cache.values[layer][0, :, :n], dense.cache.values[layer][0, :, :n],
                                   atol=2e-5, rtol=1e-4)
    # without the correction the sparse-decoded slots of the upper layers differ
    assert not torch.allclose(no_fix.cache.values[3][0, :, :n], dense.cache.values[3][0, :, :n], atol=1e-4)


def test_pod_cache_bytes_match_block_map():
    model = podkit_model(6, 2, seed=1)
    sink, recent, n, batch = 2, 6, 40, 3
    engine = GenerationEngine(model, max_batch_size=batch, max_seq_len=n, decode_scheme="pod", pod_sink_tokens=sink,
                              pod_recent_window=recent, pod_anchor_layers=POD_ANCHORS_2)
    d, elt = 16, 4
    anchor_units = sum(1 for layer, row in enumerate(POD_ANCHORS_2) for a in row if a == layer)
    layers_with_shared = sum(1 for layer, row in enumerate(POD_ANCHORS_2) if any(a != layer for a in row))
    expected_keys = (anchor_units * n + layers_with_shared * 2 * (sink + recent)) * batch * d * elt
    expected_values = 4 * 2 * n * batch * d * elt
    report = engine.kv_bytes()
    assert report.keys == expected_keys
    assert report.values == expected_values
    assert report.dense == 2 * expected_values
    assert report.ratio_to_dense == pytest.approx((expected_keys + expected_values) / (2 * expected_values))


def test_stop_tokens_and_streaming_callback():
    model = podkit_model(6, 2, seed=2)
    prompts = random_prompts([15, 9], seed=3)
    engine = GenerationEngine(model, max_batch_size=2, max_seq_len=40)
    free = engine.generate(prompts, max_new_tokens=6).tokens
    stop = free[0][2]  # row 0 stops after its 3rd token
    seen = []
    out = engine.generate(prompts, max_new_tokens=6, stop_token_ids=[stop], on_tokens=lambda i, new: seen.append(new))
    cut = free[0].index(stop) + 1
    assert out.tokens[0] == free[0][:cut]
    assert out.finish_reasons[0] == "stop"
    row1_cut = free[1].index(stop) + 1 if stop in free[1] else len(free[1])
    assert out.tokens[1] == free[1][:row1_cut]
    assert [s[0] for s in seen[:cut]] == free[0][:cut]
    assert all(s[0] is None for s in seen[cut:])


def test_sampling_top_p_and_seed():
    model = podkit_model(6, 2, seed=4)
    prompts = random_prompts([12, 7], seed=5)
    engine = GenerationEngine(model, max_batch_size=2, max_seq_len=40)
    greedy = engine.generate(prompts, max_new_tokens=6).tokens
    nucleus = engine.generate(prompts, max_new_tokens=6, sampling=SamplingConfig(temperature=1.0, top_p=1e-6, seed=1))
    assert nucleus.tokens == greedy  # the top-p set is the argmax alone
    a = engine.generate(prompts, max_new_tokens=6, sampling=SamplingConfig(temperature=1.5, seed=123)).tokens
    b = engine.generate(prompts, max_new_tokens=6, sampling=SamplingConfig(temperature=1.5, seed=123)).tokens
    c = engine.generate(prompts, max_new_tokens=6, sampling=SamplingConfig(temperature=1.5, seed=124)).tokens
    assert a == b
    assert a != c


def test_clear_errors():
    model = podkit_model(6, 2, seed=6)
    engine = GenerationEngine(model, max_batch_size=2, max_seq_len=16)
    with pytest.raises(EngineError, match="cache capacity max_seq_len=16"):
        engine.generate([list(range(12))], max_new_tokens=5)
    with pytest.raises(EngineError, match="max_batch_size=2"):
        engine.generate([[1], [2], [3]], max_new_tokens=2)
    with pytest.raises(EngineError, match="prompt 1 is empty"):
        engine.generate([[1], []], max_new_tokens=2)
    with pytest.raises(EngineError, match="decode_scheme='sparse'.*expected one of"):
        GenerationEngine(model, decode_scheme="sparse")
    with pytest.raises(EngineError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(EngineError, match="tidal.budget"):
        GenerationEngine(model, decode_scheme="tidal", tidal_budget=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cuda_graphs_requested_on_cpu_warns_and_runs_eagerly():
    model = podkit_model(6, 2, seed=6)
    with pytest.warns(RuntimeWarning, match="CUDA graphs"):
        engine = GenerationEngine(model, max_seq_len=16, use_cuda_graphs=True)
    assert engine.use_cuda_graphs is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(engine.generate([[1, 2, 3]], max_new_tokens=3).tokens[0]) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cuda_graph_decode_matches_eager_on_gpu(scheme):
    model = podkit_model(8, 2, seed=12).cuda()
    prompts = random_prompts([70, 33, 51], seed=13)
    overrides = scheme_overrides(scheme, 2)
    overrides = {k: (v * 4 if k in ("tidal_budget", "quest_budget") else v) for k, v in overrides.items()}
    eager = GenerationEngine(model, max_batch_size=3, max_seq_len=128, use_cuda_graphs=False, **overrides)
    graphed = GenerationEngine(model, max_batch_size=3, max_seq_len=128, use_cuda_graphs=True, **overrides)
    a = eager.generate(prompts, max_new_tokens=12).tokens
    b = graphed.generate(prompts, max_new_tokens=12).tokens
    assert a == b


def test_cli_rejects_unknown_scheme_before_loading(capsys, tmp_path):
    from sparse_models.generate import main

    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    assert main(["--model", "default", "--prompt-file", str(prompt), "--decode-scheme", "bogus"]) == 2
    assert "--decode-scheme='bogus' is not a known scheme" in capsys.readouterr().err
    assert main(["--model", "default", "--prompt-file", str(prompt), "--budget", "64"]) == 2
    assert "--budget=64 needs a sparse decode scheme" in capsys.readouterr().err
    assert main(["--model", "default", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _compiled_vs_eager(device: str, scheme: str):
    model = podkit_model(8, 2, seed=21).to(device)
    prompts = random_prompts([30, 12], seed=22)
    overrides = scheme_overrides(scheme, 2)
    eager = GenerationEngine(model, max_batch_size=2, max_seq_len=48, **overrides).generate(prompts, max_new_tokens=6)
    compiled = GenerationEngine(model, max_batch_size=2, max_seq_len=48, compile_layers=True, **overrides).generate(
        prompts, max_new_tokens=6)
    assert compiled.tokens == eager.tokens


@pytest.mark.slow
def test_compiled_layers_match_eager_on_cpu():
    _compiled_vs_eager("cpu", "tidal")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["dense", "tidal", "pod+tidal"])
def test_compiled_layers_with_cuda_graphs_match_eager_on_gpu(scheme):
    _compiled_vs_eager("cuda", scheme)


def test_sliding_window_models_are_limited_to_their_window():
    model = engine_model(6, 2, 0, podkit=False, family="mistral", sliding_window=16)
    with pytest.raises(EngineError, match="sliding_window=16"):
        GenerationEngine(model, max_seq_len=32)
    engine = GenerationEngine(model, max_seq_len=16)
    prompt = random_prompts([9], seed=1)[0]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, 9:].tolist()
    assert engine.generate([prompt], max_new_tokens=5).tokens[0] == expected


def _grouped_vs_torch(device: str, scheme: str, compile_layers: bool, qwen_biases: bool = False):
    """decode_kernels='fused' (q/k/v and gate/up each one kernels.decode_linear launch, one-launch KV append)
    gives the tokens of the standard path."""
    if qwen_biases:
        model = engine_model(8, 2, 31, podkit=False, family="qwen2").to(device)
    else:
        model = podkit_model(8, 2, seed=31).to(device)
    prompts = random_prompts([27, 9, 18], seed=32)
    overrides = scheme_overrides(scheme, 2) if not qwen_biases else {"decode_scheme": "dense"}
    plain = GenerationEngine(model, max_batch_size=3, max_seq_len=48, decode_kernels="standard",
                             **overrides).generate(prompts, max_new_tokens=6)
    grouped = GenerationEngine(model, max_batch_size=3, max_seq_len=48, decode_kernels="fused",
                               compile_layers=compile_layers, **overrides).generate(prompts, max_new_tokens=6)
    assert grouped.tokens == plain.tokens


@pytest.mark.parametrize("scheme", ["dense", "pod", "pod+tidal"])
def test_grouped_projections_match_on_cpu(scheme):
    _grouped_vs_torch("cpu", scheme, compile_layers=False)


def test_grouped_projections_with_biases_match_on_cpu():
    _grouped_vs_torch("cpu", "dense", compile_layers=False, qwen_biases=True)


def test_grouped_projections_are_checked():
    model = podkit_model(6, 2, seed=6)
    with pytest.raises(EngineError, match="decode_kernels='grouped' is invalid: expected one of"):
        GenerationEngine(model, max_seq_len=16, decode_kernels="grouped")
    with pytest.raises(EngineError, match="at most 64 rows; max_batch_size=65"):
        GenerationEngine(model, max_seq_len=16, max_batch_size=65, decode_kernels="fused")


def test_auto_decode_kernels_pick_fused_only_on_cuda_for_batches_that_fit():
    model = podkit_model(4, 2, seed=1)
    assert GenerationEngine(model, max_seq_len=16).decode_kernels == "standard"  # CPU
    assert GenerationEngine(model, max_seq_len=16, decode_kernels="fused").decode_kernels == "fused"
    if torch.cuda.is_available():
        gpu = podkit_model(4, 2, seed=1).cuda()
        assert GenerationEngine(gpu, max_seq_len=16).decode_kernels == "fused"
        assert GenerationEngine(gpu, max_seq_len=16, max_batch_size=65).decode_kernels == "standard"


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["dense", "tidal", "pod", "pod+tidal"])
def test_grouped_projections_compiled_with_cuda_graphs_match_on_gpu(scheme):
    _grouped_vs_torch("cuda", scheme, compile_layers=True)


def test_pod_anchor_gate_estimate_skips_some_heads(monkeypatch):
    """Guards the pod-gate-skip-anchor case above: the engine passes the anchor layers' gates as the estimate
    of the shared runs (some heads skip, some do not), and computes a gate only in layers a run reads from."""
    import kernels as K

    calls = []
    real = K.pod_decode_attention

    def spy(q, k_local, k_anchor, v, lens, **kw):
        est = kw.get("gate_estimate")
        calls.append((k_local is None, None if est is None else (est >= kw["gate_tau"]).float().mean().item()))
        return real(q, k_local, k_anchor, v, lens, **kw)

    monkeypatch.setattr(K, "pod_decode_attention", spy)
    model = podkit_model(6, 2, seed=7)
    engine = GenerationEngine(model, max_batch_size=3, max_seq_len=40, use_cuda_graphs=False,
                              **scheme_overrides("pod-gate-skip-anchor", 2))
    engine.generate(random_prompts([23, 14, 19], seed=2), max_new_tokens=NEW_TOKENS)
    own_anchor = [c for c in calls if c[0]]
    estimated = [c[1] for c in calls if c[1] is not None]
    # anchors 0, 1 and 3 are read by later layers (map above); every shared run got an estimate
    assert own_anchor and estimated and len(estimated) == len(calls) - len(own_anchor)
    skipped = sum(estimated) / len(estimated)
    assert 0 < skipped < 1, skipped
