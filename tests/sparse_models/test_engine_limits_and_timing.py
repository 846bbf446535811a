"""Prompt length against the model's positions (engine and CLI), and the timing report: warm-up apart
from the steady state (issue 16, items 2 and 9). CPU checks the structure; the numbers matter on a GPU."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

from sparse_models.engine import EngineError, GenerationEngine
from sparse_models.engine.compile_cache import enable_persistent_compile_caches
from tests.tiny_models import tiny_model

POSITIONS = 64


def tiny_llama(vocab: int = 128) -> LlamaForCausalLM:
    return tiny_model(layers=2, seed=0, podkit=False, vocab=vocab, heads=2, kv_heads=1, hidden=32, positions=POSITIONS,
                      eos_token_id=None)


def test_engine_rejects_prompt_beyond_positions_before_any_work(monkeypatch):
    engine = GenerationEngine(tiny_llama(), max_seq_len=2 * POSITIONS)  # the cache alone would fit it
    monkeypatch.setattr(engine, "prefill", lambda *a, **k: pytest.fail("prefill ran"))
    with pytest.raises(EngineError, match=r"prompt 0 has 60 tokens \+ max_new_tokens=8 = 68 > the model's "
                                          r"max_position_embeddings=64.*--truncate-prompt"):
        engine.generate([list(range(60))], max_new_tokens=8)
    with pytest.raises(EngineError, match="leaves no room"):
        engine.generate([[1, 2]], max_new_tokens=POSITIONS)


def test_engine_truncation_is_chosen_and_announced():
    model = tiny_llama()
    engine = GenerationEngine(model, max_seq_len=2 * POSITIONS)
    prompt = torch.randint(0, 128, (70,)).tolist()
    with pytest.warns(RuntimeWarning, match="prompt 0 truncated from 70 to its last 56 tokens"):
        result = engine.generate([prompt], max_new_tokens=8, truncate_prompts=True)
    assert result.stats["truncated_prompts"] == {0: 70} and result.prompt_lens == [56]
    assert result.tokens == engine.generate([prompt[-56:]], max_new_tokens=8).tokens


def test_engine_timings_separate_first_step_and_steady_state():
    engine = GenerationEngine(tiny_llama(), max_seq_len=POSITIONS)
    assert engine.warmup([[1, 2, 3]]) > 0
    t = engine.generate([[1, 2, 3, 4]], max_new_tokens=6).timings
    assert t["decode_steps"] == 5 and t["warmup_in_first_step"] is False  # eager CPU: nothing to capture
    assert t["first_step_ms"] > 0 and t["steady_ms_per_step"] > 0
    total = t["first_step_ms"] + 4 * t["steady_ms_per_step"]
    assert total == pytest.approx(1000 * t["decode_s"], rel=1e-6)
    assert t["ms_per_step"] == pytest.approx(total / 5, rel=1e-6)
    one = engine.generate([[1, 2]], max_new_tokens=2).timings
    assert one["decode_steps"] == 1 and one["steady_ms_per_step"] is None


def test_compile_caches_persist_under_the_cache_root(tmp_path):
    environ = {}
    values = enable_persistent_compile_caches(tmp_path / "compile", environ=environ)
    assert values["TRITON_CACHE_DIR"] == str(tmp_path / "compile" / "triton")
    assert values["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    assert (tmp_path / "compile" / "triton").is_dir() and environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    # torch's own default, written into the environment when torch._dynamo is imported, is not the user's
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    torch_default = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(default_cache_dir())}
    assert enable_persistent_compile_caches(tmp_path / "c3", environ=torch_default)["TORCHINDUCTOR_CACHE_DIR"] == str(
        tmp_path / "c3" / "inductor")
    mine = {"TRITON_CACHE_DIR": "/elsewhere"}  # the user's setting wins
    assert enable_persistent_compile_caches(tmp_path / "c2", environ=mine)["TRITON_CACHE_DIR"] == "/elsewhere"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny Llama with SmolLM2's tokenizer (from the embedded model's cache), 64 positions."""
    from transformers import AutoTokenizer

    from sparse_models.smollm2 import default_model_path

    folder = tmp_path_factory.mktemp("tiny_generate")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.save_pretrained(folder)
    tiny_llama(vocab=len(tokenizer)).save_pretrained(folder)
    return folder


@pytest.fixture
def compile_cache_env(monkeypatch, tmp_path):
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE"):
        monkeypatch.setenv(name, str(tmp_path / name))  # the CLI sets them: keep them out of later tests


def test_cli_prompt_too_long(tiny_checkpoint, capsys, compile_cache_env):
    from sparse_models.generate import main

    prompt = "the quick brown fox " * 30  # ~120 tokens > 64 positions
    assert main(["--model", str(tiny_checkpoint), "--prompt", prompt, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "error: prompt 0 has" in err and "max_position_embeddings=64" in err and "(--truncate-prompt)" in err
    assert main(["--model", str(tiny_checkpoint), "--prompt", prompt, "--max-new-tokens", "4",
                 "--truncate-prompt"]) == 0
    err = capsys.readouterr().err
    assert "--truncate-prompt: prompt 0 has" in err and "kept its last 60" in err


def test_cli_reports_warmup_apart_from_steady_state(tiny_checkpoint, capsys, tmp_path, compile_cache_env):
    from sparse_models.generate import main, timing_line

    out = tmp_path / "run.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert main(["--model", str(tiny_checkpoint), "--prompt", "Hello", "--max-new-tokens", "5", "--no-eos-stop",
                     "--warmup", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warm-up" in err and "not counted below" in err and "ms/token steady" in err and "first step" in err
    timings = json.loads(out.read_text())["timings"]
    assert timings["warmup_s"] > 0 and timings["decode_steps"] == 4 and timings["steady_ms_per_step"] > 0
    # a first step that captured a graph says so; without a warm-up the line says the prefill compiled
    line = timing_line(dict(timings, warmup_s=None, warmup_in_first_step=True))
    assert "no warm-up" in line and "includes graph capture" in line


@pytest.mark.gpu
def test_warmup_takes_graph_capture_out_of_the_timed_run_on_gpu():
    """On CUDA the first decode step of a new batch size captures its graph; after warmup() it does not,
    and the steady state is measured on replays only (run by the lead on the H200)."""
    model = tiny_llama().cuda()
    cold = GenerationEngine(model, max_seq_len=POSITIONS)
    assert cold.use_cuda_graphs
    first = cold.generate([[1, 2, 3]], max_new_tokens=8).timings
    assert first["warmup_in_first_step"] is True
    warm = GenerationEngine(model, max_seq_len=POSITIONS)
    assert warm.warmup([[1, 2, 3]]) > 0
    timed = warm.generate([[1, 2, 3]], max_new_tokens=8).timings
    assert timed["warmup_in_first_step"] is False and timed["steady_ms_per_step"] > 0
    assert timed["first_step_ms"] < first["first_step_ms"]  # capture is much slower than a replay


SECOND_RUN_CHILD = """
import sys, torch
from sparse_models.engine.compile_cache import enable_persistent_compile_caches
enable_persistent_compile_caches(sys.argv[1])  # before the first kernel compiles, as the generate CLI does
from sparse_models.engine import GenerationEngine
from tests.tiny_models import tiny_model  # cwd: the repository root
model = tiny_model(layers=4, seed=0, vocab=128, heads=4, kv_heads=2, hidden=64, intermediate=96, positions=256).cuda()
engine = GenerationEngine(model, max_seq_len=96, decode_scheme="tidal", tidal_budget=16, tidal_full_layers=[0, 1],
                          tidal_selection_layers=[2], compile_layers=True)
engine.warmup([list(range(40))])
print(engine.generate([list(range(40))], max_new_tokens=6).tokens[0])
import json
from torch._dynamo.utils import counters
print(json.dumps({k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}))
"""


@pytest.mark.gpu
def test_second_run_compiles_nothing_new_on_gpu(tmp_path):
    """Issue 16 item 9: with the caches under the cache root, a second process running the same engine finds
    every Triton kernel and Inductor graph on disk: the cache folders gain no entry."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}

    def run() -> tuple[str, dict, set[str]]:
        done = subprocess.run([sys.executable, "-c", SECOND_RUN_CHILD, str(tmp_path / "compile")], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        tokens, inductor = done.stdout.strip().splitlines()[-2:]
        files = {str(p.relative_to(tmp_path)) for p in (tmp_path / "compile").rglob("*") if p.is_file()}
        return tokens, json.loads(inductor), files

    tokens, first_counters, after_first = run()
    assert any(f.startswith("compile/triton/") for f in after_first)
    again, second_counters, after_second = run()
    assert again == tokens
    triton_new = {f for f in after_second - after_first if f.startswith("compile/triton/")}
    assert not triton_new, sorted(triton_new)[:10]
    # torch.compile'd layers: the second process hits Inductor's FX-graph cache instead of compiling again
    assert second_counters.get("fxgraph_cache_hit", 0) >= 1 and not second_counters.get("fxgraph_cache_miss"), (
        first_counters, second_counters, sorted(f for f in after_first if "inductor" in f)[:20])
