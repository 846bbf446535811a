"""CI smoke test: a local task through ``python -m eval.lm_eval`` on a tiny model, fully offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.harness.lm_eval import TASKS_DIR, with_podkit_tasks

REPO = Path(__file__).resolve().parents[2]


def test_include_path_added_once():
    argv = ["run", "--model", "podkit", "--tasks", "podkit_passkey"]
    assert with_podkit_tasks(argv)[-2:] == ["--include_path", str(TASKS_DIR)]
    assert with_podkit_tasks(argv + ["--include_path", "x"]).count("--include_path") == 1
    assert with_podkit_tasks(["--help"]) == ["--help"]


def test_budget_shorthand_expands_per_scheme():
    pytest.importorskip("lm_eval")
    from eval.harness.lm_eval_model import split_model_args

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
    from eval.harness.lm_eval import resolve_default_pretrained

    monkeypatch.setattr(smollm2, "default_model_path", lambda: Path("/models/smollm2"))
    assert resolve_default_pretrained(["--model_args", "pretrained=default", "budget=64"]) == \
        ["--model_args", "pretrained=/models/smollm2", "budget=64"]
    assert resolve_default_pretrained(["--model_args", "decode_scheme=tidal,pretrained=default,budget=64"]) == \
        ["--model_args", "decode_scheme=tidal,pretrained=/models/smollm2,budget=64"]
    untouched = ["--model_args", "pretrained=/x/defaults"]
    assert resolve_default_pretrained(untouched) == untouched


def test_wrapper_builds_without_spurious_warnings(tiny_model_dir):
    """issue 16: no "`pretrained` model kwarg is not of type `str`" (the model object is by design) and no
    "neither marked as CausalLM" (the backend is causal); issue 33: no "Passed an already-initialized model"."""
    pytest.importorskip("lm_eval")
    import logging

    from eval.harness.lm_eval_model import PodkitLM

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
    assert not [m for m in messages if "not of type `str`" in m or "neither marked" in m
                or "already-initialized" in m], messages
    assert not logging.getLogger("lm_eval.models.huggingface").filters  # the filter is scoped to the build


# issue 33: a bad eval.harness.lm_eval input is one line on stderr and exit 2, before any model work.
BAD_RUNS = {
    "misspelled override": ("decode_scheme=tidal,tidal_budgt=128", {}, None, "did you mean tidal_budget?"),
    "misspelled podkit argument": ("budgt=64", {}, None, "did you mean budget?"),
    "unknown scheme": ("decode_scheme=tidl", {}, None, "decode_scheme='tidl' is invalid"),
    # lm-eval's CLI reads '-1' as -1.0; the error names the value as typed
    "bad budget": ("decode_scheme=tidal,tidal_budget=-1", {}, None, "tidal.budget=-1 is invalid"),
    "bad pretrained": (None, {}, None, "neither 'default' nor a folder"),
    "unknown task": ("", {}, "podkit_pasky", "Tasks not found: podkit_pasky"),
    "length beyond the context": ("", {"lengths": [99999]}, None, "exceed the model's context"),
    "RULER length beyond max_length": ("max_length=512", {"max_seq_lengths": [1024]}, None, "max_length=512"),
    # a passkey prompt of the whole context: lm-eval would cut its first max_gen_toks tokens (the SmolLM2 8192 case)
    "passkey prompt + answer beyond the context": ("", {"lengths": [4096]}, None, "its 8 answer tokens"),
    "needle via its tag, default lengths": ("max_length=1024", {"lengths": None}, "podkit_longctx",
                                            "default lengths (no --metadata lengths given) [2048, 4096, 8192]"),
    "budget not a number": ("decode_scheme=tidal,budget=abc", {}, None, "budget='abc' is invalid: expected an "
                                                                        "integer >= 1"),
    "max_length not a number": ("max_length=1.5", {}, None, "max_length=1.5 is invalid: expected an integer"),
}


@pytest.mark.parametrize("case", list(BAD_RUNS))
def test_bad_input_is_one_line_and_exit_2(case, tiny_model_dir, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    import eval.harness.lm_eval as wrapper
    import eval.harness.lm_eval_model

    extra, metadata, task, message = BAD_RUNS[case]
    built = []
    monkeypatch.setattr(eval.harness.lm_eval_model, "load_model", lambda *a, **k: built.append(a) or 1 / 0)
    pretrained = "/nonexistent/model" if extra is None else str(tiny_model_dir)
    model_args = ",".join(x for x in (f"pretrained={pretrained}", extra) if x)
    argv = ["run", "--model", "podkit", "--model_args", model_args, "--tasks", task or "podkit_passkey",
            "--metadata", json.dumps({k: v for k, v in ({"lengths": [160], "num_depths": 1} | metadata).items()
                                      if v is not None}), "--device", "cpu",
            "--limit", "1"]
    monkeypatch.setattr(sys, "argv", ["eval.harness.lm_eval"])
    assert wrapper.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eval.lm_eval: error:")]
    assert len(err) == 1 and message in err[0], err
    assert not built


def test_python_api_refuses_a_misspelled_argument(tiny_model_dir):
    """PodkitLM (lm-eval's Python API: simple_evaluate(model="podkit", model_args=...)) checks its arguments
    with the same validation as from_pretrained: the close match, before any model is loaded."""
    pytest.importorskip("lm_eval")
    from eval.harness.lm_eval_model import PodkitLM
    from sparse_models.config import ConfigError

    with pytest.raises(ConfigError, match=r"tidal_budgt=128 is not .*did you mean tidal_budget\?"):
        PodkitLM(pretrained=str(tiny_model_dir), decode_scheme="tidal", tidal_budgt=128)


def test_prompt_sized_lengths_leave_room_for_the_answer(tiny_model_dir):
    """Passkey / needle lengths count the prompt alone, so they fit at context - max_gen_toks (4096 - 8 here);
    RULER's lengths count the answer and perplexity windows are never cut, so those fit at the whole context."""
    from eval.harness.lm_eval import PROMPT_SIZED_DEFAULT_LENGTHS, check_context_lengths
    from eval.tasks.lm_eval_tasks import DEFAULT_LENGTHS

    assert list(PROMPT_SIZED_DEFAULT_LENGTHS) == DEFAULT_LENGTHS
    args = {"pretrained": str(tiny_model_dir)}
    check_context_lengths(args, {"lengths": [4088]}, ["podkit_passkey", "podkit_needle"])
    check_context_lengths(args, {"lengths": [4096]}, ["podkit_ppl", "podkit_ruler_vt"])
    check_context_lengths(args, {"lengths": [4080]}, ["podkit_passkey"], {"max_gen_toks": 16})
    with pytest.raises(ValueError, match=r"podkit_passkey: --metadata lengths \[4089\] .* 8 answer tokens"):
        check_context_lengths(args, {"lengths": [2048, 4089]}, ["podkit_passkey"])
    with pytest.raises(ValueError, match=r"16 answer tokens .* last 4080 tokens"):
        check_context_lengths(args, {"lengths": [4088]}, ["podkit_passkey_text"], {"max_gen_toks": 16})
    with pytest.raises(ValueError, match=r"podkit_needle: default lengths .* \[4096, 8192\] .*\"lengths\": \[2048\]"):
        check_context_lengths(args | {"max_length": 4000}, {}, ["podkit_needle"])
