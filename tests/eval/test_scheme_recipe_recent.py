"""ARCHITECTURE.md's add-a-scheme recipe, end to end: a ``recent`` decode scheme (the last ``recent.window``
positions, StreamingLLM without sinks) written as one file plus one ``BUILTIN`` line in a copy of sparse_models,
and nothing else, shows up with the right KV fractions in the leaderboard, in the fidelity sweep's settings, in
``generate``'s CLI, in ``eval.quality``'s settings and the leaderboard's labels, and in both decode paths
(``model.generate`` and the engine, equal tokens)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

RECENT_SCHEME = '''"""Recent window (StreamingLLM without attention sinks), a decode baseline: each step reads the last
``recent.window`` positions, the current one included. Budget B = B positions read per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import check_int
from .base import Budget, Footprint, Scheme, covers_cache


@dataclass
class RecentConfig:
    """The number of latest positions a decode step reads, the current one included."""

    window: int = 64

    def __post_init__(self) -> None:
        check_int("recent.window", self.window, 1)


def recent_decode(view, q: torch.Tensor, row, step) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] over the positions [lens - window, lens), -1 padded at the end."""
    window = view.config.recent.window
    if covers_cache(view, window):
        return view.full(q)
    lens = view.lens.long()
    pos = (lens - window).clamp(min=0)[:, None] + torch.arange(window, device=lens.device)[None, :]
    pos = torch.where(pos < lens[:, None], pos, torch.full_like(pos, -1))
    return view.sparse(q, pos[:, None, :].expand(-1, view.num_kv_heads, -1).contiguous())


def recent_roles(config, num_layers: int, anchors, family=None) -> list[tuple[str, None]]:
    return [("recent", None)] * num_layers


BUDGET = Budget("positions read per step = recent.window", lambda budget, given: {"recent_window": budget},
                reads=lambda config: config.recent.window)
SCHEME = Scheme("recent", "the latest positions only (decode)", config_key="recent", config_cls=RecentConfig,
                decode_roles=recent_roles, decode={"recent": recent_decode}, budget=BUDGET,
                footprint=Footprint(budget_roles=("recent",)), display_name="recent window", order=35)
'''

SCRIPT = '''
import argparse
import torch
from eval.harness import fidelity
from eval.harness import leaderboard
from eval.harness import plots
from eval import schemes
from sparse_models import SparseAttentionConfig
from sparse_models.engine import GenerationEngine
from sparse_models.generate import parse_args, scheme_overrides
from sparse_models.schemes.registry import scheme_names

assert "recent" in scheme_names("decode") and "recent" in SparseAttentionConfig().to_dict()
# the CLI: --decode-scheme's help lists it, --budget gives it its one meaning
import contextlib, io
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    parse_args(["--help"])
assert "recent" in help_text.getvalue(), help_text.getvalue()
args = argparse.Namespace(decode_scheme="recent", prefill_scheme=None, set=[], budget=16)
assert scheme_overrides(args) == {"decode_scheme": "recent", "recent_window": 16}
# eval's lists and order come from the registry
assert schemes.budget_sweep_methods() == ("tidal", "quest", "streaming", "recent"), schemes.budget_sweep_methods()
labels = [s.label for s in fidelity.build_settings(fidelity.REDUCED, {})[0]]
assert "recent@64" in labels, labels
assert "recent@1/16" in [s.label for s in leaderboard.podkit_settings(1024, ["1/16"], [0.005], {})]
assert plots._order(["recent@64", "streaming@64", "dense", "token_sparse@0.005"]) == \\
    ["dense", "streaming@64", "recent@64", "token_sparse@0.005"]
assert schemes.display_name("recent") == "recent window"
# eval's command lines: the settings eval.quality reads and names in its help, the leaderboard's label examples
from eval.harness import quality
assert schemes.parse_setting("recent@64") == schemes.budgeted("recent", 64)
assert "recent@B" in schemes.setting_forms() and "recent@B" in quality.build_parser().format_help().split()
assert "recent@1/8" in leaderboard.setting_labels("1/8")

from tests.tiny_models import tiny_model  # the repository root is on PYTHONPATH, after the copy
model = tiny_model(layers=4, seed=0, vocab=64, heads=4, kv_heads=2, hidden=32, intermediate=64, positions=64)
# KV fractions: recent@64 of 1024 tokens reads what streaming@64 reads (4 sinks + 60 recent): 1/16
model.set_sparse_attention(SparseAttentionConfig(), **schemes.budgeted("streaming", 64).overrides)
streaming = leaderboard.kv_fractions(model, 1024)
model.set_sparse_attention(SparseAttentionConfig(), **schemes.budgeted("recent", 64).overrides)
recent = leaderboard.kv_fractions(model, 1024)
assert recent == streaming == (1.0, 0.0625), (recent, streaming)
# both decode paths, equal tokens, and not dense's
prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
def model_tokens(**overrides):
    model.set_sparse_attention(SparseAttentionConfig(), **overrides)
    return model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
expected = model_tokens(decode_scheme="recent", recent_window=4)
engine = GenerationEngine(model, sparse_config=SparseAttentionConfig(), max_batch_size=1, max_seq_len=24,
                          decode_scheme="recent", recent_window=4)
assert engine.generate([prompt], max_new_tokens=6).tokens[0] == expected
assert expected != model_tokens(decode_scheme="dense")
import sparse_models
print(sparse_models.__file__)
'''


def test_recent_is_one_file_and_one_registry_line(tmp_path):
    root = Path(__file__).resolve().parents[2]
    copy = tmp_path / "sparse_models"
    shutil.copytree(root / "sparse_models", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "schemes" / "recent.py").write_text(RECENT_SCHEME)
    registry_file = copy / "schemes" / "registry.py"
    text = registry_file.read_text()
    assert text.count('    "streaming",\n') == 1
    registry_file.write_text(text.replace('    "streaming",\n', '    "streaming",\n    "recent",\n'))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{root}"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith(str(copy)), done.stdout
