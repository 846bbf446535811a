"""The scheme registry: every scheme's plan roles have functions, ``--budget`` has one meaning, and a
scheme added as one object (no edit anywhere else) runs in both the model path and the engine."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
import torch

from sparse_models.config import SparseAttentionConfig
from sparse_models.plan import LayerPlan
from sparse_models.schemes import registry
from sparse_models.schemes.base import DecodeStepState, Scheme

NUM_LAYERS, NUM_KV, HQ, D = 6, 2, 6, 8


class SpyView:
    """A DecodeView that records how many positions each read covers (no cache behind it)."""

    def __init__(self, config, lens):
        self.layer, self.config, self.lens, self.num_kv_heads = 0, config, lens, NUM_KV
        self.capacity = int(lens.max())  # the cache holds the 96-token past (budgets below it stay sparse)
        self.read: list[int] = []

    def _out(self, q):
        return torch.zeros_like(q)

    def full(self, q):
        self.read.append(int(self.lens.max()))
        return self._out(q)

    pod = full

    def select(self, q, budget, selection="query_head", recent=1):
        self.read.append(int(self.lens.max()))
        heads = q.shape[1] if selection == "query_head" else NUM_KV
        idx = (self.lens[:, None, None] - budget + torch.arange(budget)[None, None, :]).expand(-1, heads, -1)
        return self._out(q), idx.contiguous()

    def sparse(self, q, indices):
        self.read.append(int((indices >= 0).sum(-1).max()))
        return self._out(q)

    def buffer(self, name):
        g = torch.Generator().manual_seed(0)
        pages = -(-int(self.lens.max()) // self.config.quest.page_size)
        page_max = torch.randn(self.lens.shape[0], NUM_KV, pages, D, generator=g)
        return {"page_max": page_max, "page_min": page_max - 1.0}[name]


def _config_for(name: str, **overrides) -> SparseAttentionConfig:
    scheme = registry.SCHEMES[name]
    phases = {f"{phase}_scheme": name for phase in scheme.phases}
    return SparseAttentionConfig().with_overrides(**phases, **overrides)


def _anchors():
    return [[layer] * NUM_KV for layer in range(NUM_LAYERS)]


@pytest.mark.parametrize("name", list(registry.SCHEMES))
def test_every_role_a_scheme_plans_has_a_function(name):
    scheme = registry.SCHEMES[name]
    config = _config_for(name)
    if scheme.prefill_roles is not None:
        roles = scheme.prefill_roles(config, NUM_LAYERS, _anchors())
        assert len(roles) == NUM_LAYERS and set(roles) <= set(scheme.prefill), (name, roles)
    if scheme.decode_roles is not None:
        rows = scheme.decode_roles(config, NUM_LAYERS, _anchors(), None)
        assert len(rows) == NUM_LAYERS and {r for r, _ in rows} <= set(scheme.decode), (name, rows)
    for section in scheme.sections:
        assert hasattr(config, section), (name, section)
    # what it reads per query is its budget in the roles it declares, which must be roles it runs
    assert set(scheme.footprint.budget_roles) <= set(scheme.decode), (name, scheme.footprint.budget_roles)
    if scheme.footprint.budget_roles:
        assert scheme.budget is not None and scheme.budget.reads is not None, name


@pytest.mark.parametrize("name", registry.budgeted_schemes())
@pytest.mark.parametrize("budget", [16, 48])
def test_budget_is_the_number_of_positions_a_sparse_layer_reads(name, budget):
    """The one meaning of ``--budget B``: every sparse read of a decode step covers at most B cached
    positions, and some layer reads exactly B (here with a 96-token past: whole pages for Quest, whose
    current page counts in the budget)."""
    overrides = registry.budget_overrides(name, budget)
    assert overrides["decode_scheme"] == name
    config = SparseAttentionConfig().with_overrides(**overrides)
    scheme = registry.SCHEMES[name]
    rows = scheme.decode_roles(config, NUM_LAYERS, _anchors(), None)
    lens = torch.tensor([96, 96])
    q = torch.randn(2, HQ, D)
    step = DecodeStepState()
    sparse_reads = []
    for layer, (role, source) in enumerate(rows):
        row = LayerPlan(layer, "dense", role, tuple(a for a in _anchors()[layer]), False, source)
        view = SpyView(config, lens)
        view.layer = layer
        scheme.decode[role](view, q, row, step)
        if role not in ("dense", "full", "full+select"):
            sparse_reads += view.read
    assert sparse_reads and max(sparse_reads) == budget, (name, sparse_reads)


def test_streaming_budget_counts_the_sinks():
    assert registry.budget_overrides("streaming", 64) == {
        "decode_scheme": "streaming", "streaming_sink_tokens": 4, "streaming_recent_window": 60}
    assert registry.budget_overrides("streaming", 64, {"streaming_sink_tokens": 8})["streaming_recent_window"] == 56
    with pytest.raises(ValueError, match="budget=4 is invalid for decode_scheme='streaming'"):
        registry.budget_overrides("streaming", 4)
    with pytest.raises(ValueError, match="decode_scheme='dense' has no budget"):
        registry.budget_overrides("dense", 64)


@pytest.mark.parametrize("name", registry.budgeted_schemes())
def test_generate_cli_budget_means_what_eval_means(name):
    from eval.schemes import budget_overrides
    from sparse_models.generate import scheme_overrides

    args = argparse.Namespace(decode_scheme=name, prefill_scheme=None, set=[], budget=64)
    assert scheme_overrides(args) == budget_overrides(name, 64)


def test_registry_rejects_duplicates_and_late_config_sections():
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.SCHEMES["dense"])
    late = Scheme("late", "x", config_key="late", config_cls=dict,
                  decode_roles=lambda c, n, a, f: [("dense", None)] * n)
    with pytest.raises(ValueError, match="must be a module listed"):
        registry.register(late)
    with pytest.raises(ValueError, match="decode_scheme='nope' is invalid: expected one of dense"):
        SparseAttentionConfig(decode_scheme="nope")


def _first_and_current(view, q, row, step):
    """A toy decode method: attend to position 0 and the current position only."""
    idx = torch.stack([torch.zeros_like(view.lens), view.lens - 1], dim=1)  # [B, 2]
    return view.sparse(q, idx[:, None, :].expand(-1, view.num_kv_heads, -1).contiguous())


def _toy_decode_scheme(name: str, toy_fn, **fields) -> Scheme:
    """A decode scheme: layer 0 dense, every other layer ``toy_fn`` (role ``toy``)."""
    return Scheme(name, f"toy: {toy_fn.__doc__.splitlines()[0]}",
                  decode_roles=lambda config, n, anchors, family: [("dense", None)] + [("toy", None)] * (n - 1),
                  decode={"dense": registry.SCHEMES["dense"].decode["dense"], "toy": toy_fn}, **fields)


def _check_both_paths(scheme: Scheme, model_seed: int, prompt_seed: int, runs: int = 1):
    """Register ``scheme``; ``model.generate`` and the engine (``runs`` calls) give the same 7 tokens, not dense's.
    Returns the engine."""
    from test_engine import podkit_model, random_prompts, reference_generate

    from sparse_models.engine import GenerationEngine

    registry.register(scheme)
    try:
        model = podkit_model(6, 2, seed=model_seed)
        prompts = random_prompts([13, 9], seed=prompt_seed)
        expected = reference_generate(model, prompts, {"decode_scheme": scheme.name})
        engine = GenerationEngine(model, sparse_config=SparseAttentionConfig(), max_batch_size=2, max_seq_len=24,
                                  decode_scheme=scheme.name)
        for _ in range(runs):
            assert engine.generate(prompts, max_new_tokens=7).tokens == expected
        assert expected != reference_generate(model, prompts, {"decode_scheme": "dense"})
        return engine
    finally:
        registry.unregister(scheme.name)


def test_a_scheme_added_as_one_object_runs_in_model_and_engine():
    """One Scheme object + one register() call: config validation, the plan, the model's attention and
    the engine's decode step all pick it up (nothing else is edited)."""
    _check_both_paths(_toy_decode_scheme("first_and_current", _first_and_current), model_seed=5, prompt_seed=3)


def test_a_registered_prefill_scheme_runs_in_the_engine_through_the_same_function():
    """One decode path and one prefill path: the engine's prefill calls the scheme's role functions (with its
    softmax scale), as the model does; a role without a function is refused before any work."""
    from test_engine import podkit_model, random_prompts

    from sparse_models.engine import EngineError, GenerationEngine

    dense_fn = registry.SCHEMES["dense"].prefill["dense"]
    calls = []

    def recording_prefill(layer, q, k, v, state, k_anchor=None, q_anchor=None):
        calls.append((layer, state.scale))
        return dense_fn(layer, q, k, v, state, k_anchor, q_anchor)

    toy = Scheme("toy_prefill", "toy", prefill_roles=lambda config, n, anchors: ["toy"] * n,
                 prefill={"toy": recording_prefill})
    broken = Scheme("broken_prefill", "toy", prefill_roles=lambda config, n, anchors: ["nowhere"] * n,
                    prefill={"toy": recording_prefill})
    registry.register(toy)
    registry.register(broken)
    try:
        model = podkit_model(6, 2, seed=1)
        prompts = random_prompts([11, 7], seed=2)
        engine = GenerationEngine(model, max_batch_size=2, max_seq_len=32, prefill_scheme="toy_prefill")
        tokens = engine.generate(prompts, max_new_tokens=4).tokens
        assert [layer for layer, _ in calls] == list(range(model.config.num_hidden_layers))
        assert all(scale == pytest.approx(model.config.head_dim ** -0.5) for _, scale in calls)
        dense = GenerationEngine(model, max_batch_size=2, max_seq_len=32).generate(prompts, max_new_tokens=4).tokens
        assert tokens == dense
        with pytest.raises(EngineError, match=r"prefill_scheme='broken_prefill' plans prefill role\(s\) \['nowhere'\]"):
            GenerationEngine(model, max_batch_size=1, max_seq_len=16, prefill_scheme="broken_prefill")
    finally:
        registry.unregister("toy_prefill")
        registry.unregister("broken_prefill")


def test_streaming_llm_is_one_file_and_one_registry_line(tmp_path):
    """ARCHITECTURE.md's recipe, checked on StreamingLLM: without schemes/streaming.py and its BUILTIN line
    the rest of sparse_models imports and works (so re-adding it is exactly that file and that line)."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    copy = tmp_path / "sparse_models"
    shutil.copytree(root / "sparse_models", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "schemes" / "streaming.py").unlink()
    registry_file = copy / "schemes" / "registry.py"
    text = registry_file.read_text()
    assert text.count('    "streaming",\n') == 1
    registry_file.write_text(text.replace('    "streaming",\n', ""))
    script = """
import torch
from sparse_models import SparseAttentionConfig
from sparse_models.engine import GenerationEngine
from sparse_models.schemes.registry import scheme_names
assert "streaming" not in scheme_names() and "streaming" not in SparseAttentionConfig().to_dict()
from tests.tiny_models import tiny_model  # the repository root is on PYTHONPATH, after the copy
model = tiny_model(layers=4, seed=0, vocab=64, heads=4, kv_heads=2, hidden=32, intermediate=64, positions=64)
engine = GenerationEngine(model, max_batch_size=1, max_seq_len=24, decode_scheme="quest", quest_budget=8,
                          quest_page_size=4)
import sparse_models
print(sparse_models.__file__)
print(len(engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], max_new_tokens=3).tokens[0]))
"""
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{root}"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    where, tokens = done.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(copy)) and tokens == "3", done.stdout


GENERIC_SCHEME_MODULES = {"base", "registry", "footprint"}  # they name no scheme


def specific_scheme_imports(root: Path) -> list[str]:
    """``file:line: module`` for each import of a specific scheme module (``schemes.<name>`` other than
    :data:`GENERIC_SCHEME_MODULES`) in the generic core below ``root`` (a ``sparse_models`` folder: its top-level
    modules and ``engine/``; the package ``__init__`` re-exports public names). Both import forms count,
    ``from .schemes.pod import x`` / ``from .schemes import pod`` and ``import sparse_models.schemes.pod``, at
    module level or inside a function."""
    offenders = []
    for path in sorted([*root.glob("*.py"), *(root / "engine").glob("*.py")]):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                dotted = [(node.module.split("."), alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                dotted = [(alias.name.split("."), None) for alias in node.names]
            else:
                continue
            for parts, name in dotted:
                if "schemes" not in parts:
                    continue
                after = parts[parts.index("schemes") + 1:]
                module = after[0] if after else name
                if module is not None and module not in GENERIC_SCHEME_MODULES:
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}: schemes.{module}")
    return list(dict.fromkeys(offenders))  # one line per module of an import of several names


def test_the_generic_core_imports_no_specific_scheme():
    """Config, plan, caches, attention, decode view, model loop and engine reach schemes only through the registry
    (and ``schemes/base.py`` / ``schemes/footprint.py``, which name none): a scheme is its file and its BUILTIN line."""
    root = Path(__file__).resolve().parents[2] / "sparse_models"
    assert not specific_scheme_imports(root)


def test_the_core_import_check_catches_each_form(tmp_path):
    """A planted core holding every form of a specific-scheme import, next to the allowed ones."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "__init__.py").write_text("from .schemes.pod import x\n")  # re-exports are allowed
    (tmp_path / "fine.py").write_text("from .schemes.registry import get_scheme\nfrom .schemes import base\n"
                                      "import sparse_models.schemes.footprint\n")
    (tmp_path / "core.py").write_text("from .schemes.pod import x\nfrom .schemes import registry, tidal\n"
                                      "def f():\n    import sparse_models.schemes.quest\n")
    (tmp_path / "engine" / "step.py").write_text("from ..schemes.token_sparse import y\n")
    assert specific_scheme_imports(tmp_path) == ["core.py:1: schemes.pod", "core.py:2: schemes.tidal",
                                                 "core.py:4: schemes.quest", "engine/step.py:1: schemes.token_sparse"]


def _recently_decoded(view, q, row, step):
    """A toy scheme with its own cache state: a per-position buffer holding the step at which each position was
    decoded (an H2O-like accumulated score); attend to position 0 and the 3 latest decoded positions."""
    seen = view.buffer("decoded_at")  # [B, Hkv, E]
    rows = torch.arange(view.lens.shape[0], device=view.lens.device)
    seen[rows, :, view.lens - 1] = view.lens.to(seen.dtype)[:, None]
    value, latest = seen[:, 0].topk(3, dim=-1)  # [B, 3]: never-decoded entries hold 0
    latest = torch.where(value > 0, latest, torch.full_like(latest, -1))
    big = torch.iinfo(latest.dtype).max
    idx = torch.cat([torch.zeros_like(latest[:, :1]), latest], dim=1)
    idx = torch.where(idx < 0, torch.full_like(idx, big), idx).sort(dim=1).values  # ascending, -1 padding last
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
    return view.sparse(q, idx[:, None, :].expand(-1, view.num_kv_heads, -1).contiguous())


def test_a_scheme_with_its_own_cache_state_is_one_object_in_both_paths():
    """A StateBuffer declared in CacheNeeds is allocated by the model's cache and the engine's from that one
    description and reaches the decode function as ``view.buffer``: nothing else is edited, the two paths
    generate the same tokens, and a second prompt on the engine starts the state over."""
    from sparse_models.schemes.base import CacheNeeds, StateBuffer

    toy = _toy_decode_scheme("recently_decoded", _recently_decoded,
                             cache=CacheNeeds(buffers=(StateBuffer("decoded_at", ("toy",), dtype=torch.float32),)))
    engine = _check_both_paths(toy, model_seed=7, prompt_seed=4, runs=2)
    assert set(engine.cache.buffers) == {(layer, "decoded_at") for layer in range(1, 4)}


def test_quest_pages_are_state_buffers_both_caches_allocate_from_one_description():
    """Quest's page max / min are StateBuffers with a KeyState in ``schemes/quest.py`` (no page fields in the generic
    CacheNeeds): both caches hold them for exactly the quest layers, with ceil(N / page_size) pages of D channels,
    fp32 in the model's cache (``dynamic_dtype``) and the model's dtype in the engine's, counted as kv_bytes metadata."""
    from dataclasses import fields

    from test_engine import podkit_model, random_prompts

    from sparse_models.engine import GenerationEngine
    from sparse_models.schemes.base import CacheNeeds

    assert not {"page_roles", "page_size"} & {f.name for f in fields(CacheNeeds)}
    model = podkit_model(6, 2, seed=5)
    overrides = dict(decode_scheme="quest", quest_budget=8, quest_page_size=4, quest_dense_layers=[0])
    model.set_sparse_attention(SparseAttentionConfig(), **overrides)
    prompt = random_prompts([13], seed=2)[0]
    cache = model.new_cache()
    model(torch.tensor([prompt]), cache=cache, use_cache=True)
    engine = GenerationEngine(model, max_batch_size=1, max_seq_len=cache.capacity, **overrides)
    engine.generate([prompt], max_new_tokens=1)
    quest_layers = {row.layer for row in model.plan if row.decode == "quest"}
    names = {(layer, name) for layer in quest_layers for name in ("page_max", "page_min")}
    assert quest_layers and set(cache.buffers) == names == set(engine.cache.buffers)
    head_dim = cache.head_dim
    for key in names:
        model_t, engine_t = cache.buffers[key], engine.cache.buffers[key]
        assert model_t.shape == engine_t.shape == (1, 2, -(-cache.capacity // 4), head_dim)
        assert model_t.dtype == torch.float32 and engine_t.dtype == engine.cache.dtype
        torch.testing.assert_close(model_t[:, :, :4], engine_t[:, :, :4].float())  # the prompt's 13 keys' pages
    metadata = sum(t.numel() * t.element_size() for t in cache.buffers.values())
    assert cache.kv_bytes().metadata == metadata
