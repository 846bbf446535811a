"""CI smoke test: a local task through ``python -m eval.lm_eval`` on a tiny model, fully offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.lm_eval import TASKS_DIR, with_podkit_tasks

REPO = Path(__file__).resolve().parents[2]


def test_include_path_added_once():
    argv = ["run", "--model", "podkit", "--tasks", "podkit_passkey"]
    assert with_podkit_tasks(argv)[-2:] == ["--include_path", str(TASKS_DIR)]
    assert with_podkit_tasks(argv + ["--include_path", "x"]).count("--include_path") == 1
    assert with_podkit_tasks(["--help"]) == ["--help"]


def test_budget_shorthand_expands_per_scheme():
    pytest.importorskip("lm_eval")
    from eval.lm_eval_model import split_model_args

    overrides, rest = split_model_args({"decode_scheme": "tidal", "budget": 128, "batch_size": 2})
    assert overrides == {"decode_scheme": "tidal", "tidal_budget": 128} and rest == {"batch_size": 2}
    overrides, _ = split_model_args({"decode_scheme": "streaming", "budget": "64"})
    assert overrides["streaming_recent_window"] == 60 and overrides["streaming_sink_tokens"] == 4
    with pytest.raises(ValueError, match="decode_scheme='dense'"):
        split_model_args({"budget": 64})


def test_passkey_task_through_wrapper(tiny_model_dir, tmp_path, fake_text_cache):
    pytest.importorskip("lm_eval")
    out = tmp_path / "results"
    env = dict(os.environ, PODKIT_TEXT_CACHE=str(fake_text_cache), PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "eval.lm_eval", "run", "--model", "podkit",
               "--model_args", f"pretrained={tiny_model_dir}", "--tasks", "podkit_passkey", "podkit_ppl",
               "--metadata", json.dumps({"lengths": [160], "num_depths": 3, "ppl_windows": 2}),
               "--device", "cpu", "--batch_size", "2", "--output_path", str(out), "--log_samples"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["podkit_passkey"]["acc,none"] <= 1.0
    # A random model over a 400-token vocabulary: perplexity near the vocabulary size, far from 1.
    assert 100 < results["podkit_ppl"]["token_perplexity,none"] < 2000
    samples = [json.loads(line) for path in out.rglob("samples_podkit_passkey_*.jsonl") for line in open(path)]
    assert len(samples) == 3 and {s["doc"]["depth"] for s in samples} == {0.0, 0.5, 1.0}


def test_default_pretrained_is_rewritten_to_the_folder(monkeypatch):
    import sparse_models.smollm2 as smollm2
    from eval.lm_eval import resolve_default_pretrained

    monkeypatch.setattr(smollm2, "default_model_path", lambda: Path("/models/smollm2"))
    assert resolve_default_pretrained(["--model_args", "pretrained=default", "budget=64"]) == \
        ["--model_args", "pretrained=/models/smollm2", "budget=64"]
    assert resolve_default_pretrained(["--model_args", "decode_scheme=tidal,pretrained=default,budget=64"]) == \
        ["--model_args", "decode_scheme=tidal,pretrained=/models/smollm2,budget=64"]
    untouched = ["--model_args", "pretrained=/x/defaults"]
    assert resolve_default_pretrained(untouched) == untouched


def test_wrapper_builds_without_spurious_warnings(tiny_model_dir):
    """issue 16: no "`pretrained` model kwarg is not of type `str`" (the model object is by design) and no
    "neither marked as CausalLM" (the backend is causal)."""
    pytest.importorskip("lm_eval")
    import logging

    from eval.lm_eval_model import PodkitLM

    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("lm_eval")
    logger.addHandler(handler)
    try:
        lm = PodkitLM(pretrained=str(tiny_model_dir), device="cpu", batch_size=1)
    finally:
        logger.removeHandler(handler)
    assert lm.backend == "causal"
    assert not [m for m in messages if "not of type `str`" in m or "neither marked" in m], messages
    assert not logging.getLogger("lm_eval.models.huggingface").filters  # the filter is scoped to the build
