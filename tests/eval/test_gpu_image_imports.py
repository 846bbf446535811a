"""The sweep modules must import on the H200 image, which has no lm-eval, datasets, deepspeed or pydantic."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCKED = ("lm_eval", "datasets", "deepspeed", "pydantic")
MODULES = ("eval.harness.fidelity", "eval.harness.quality", "eval.runner", "eval.harness.calibrate", "eval.models",
           "eval.schemes", "eval.harness.plots", "eval.tasks.passkey", "eval.tasks.needle", "eval.tasks.perplexity", "eval.data.texts",
           "sparse_models.calibration.token_sparse_drift", "sparse_models.calibration.tidal_reselection",
           "eval.harness.leaderboard", "eval.harness.leaderboard_records", "train.long_context_eval.ruler")

SCRIPT = f"""
import importlib, sys
for blocked in {BLOCKED!r}:
    sys.modules[blocked] = None  # import raises ImportError, find_spec says absent
for name in {MODULES!r}:
    importlib.import_module(name)
import eval.harness.fidelity, eval.harness.leaderboard
for command in (eval.harness.fidelity.main, eval.harness.leaderboard.main):
    try:
        command(['--help'])
    except SystemExit as e:
        assert e.code == 0
from train.long_context_eval.ruler import score
assert score('qa_1', 'It is Paris.', ['paris', 'Lyon']) == 1.0  # the scorer's fallback without lm-eval
print('OK')
"""


def test_sweep_modules_import_without_lm_eval_datasets_deepspeed():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("OK")
