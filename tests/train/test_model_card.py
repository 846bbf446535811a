"""The export's model card: its loading snippets run as written, with no interactive prompt.

AutoTokenizer.from_pretrained reads ``config.json`` before the tokenizer files, and an export's config
names its class through ``auto_map`` (``modeling_podkit.py``). Without podkit, an ``AutoTokenizer`` call
without ``trust_remote_code`` therefore brings up transformers' "Do you wish to run the custom code? [y/N]"
prompt (a 15 s stall on a terminal). Each ``python`` block of the card's "Loading" section runs here in a
subprocess with stdin closed (the "without podkit" one where podkit cannot be imported) and must print
no prompt.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from tiny_setup import REPO

HIDE_PODKIT = textwrap.dedent('''
    import importlib.abc, sys
    BLOCKED = {"kernels", "sparse_models", "train", "eval"}
    sys.path[:] = [p for p in sys.path if p not in ("", ".", %r)]
    class Hide(importlib.abc.MetaPathFinder):
        def __init__(self, inner):
            self.inner = inner
        def find_spec(self, name, path=None, target=None):
            return None if name.split(".")[0] in BLOCKED else self.inner.find_spec(name, path, target)
        def __getattr__(self, attr):
            return getattr(self.inner, attr)
    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
''' % str(REPO))
PROMPT_MARKS = ("custom code", "[y/N]", "trust_remote_code=True")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from tiny_setup import tiny_pod_model

    from train.export import export_model

    root = tmp_path_factory.mktemp("card")
    anchors = [[0, 0], [0, 0]]
    recipe, model, tokenizer = tiny_pod_model(root, anchors)
    return export_model(model, tokenizer, recipe, anchors, root / "export", base_model="tiny")


def _loading_blocks(card: str) -> list[str]:
    loading = card.split("## Loading", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", loading, flags=re.S)


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)


def test_card_snippets_load_model_and_tokenizer_without_a_prompt(export, tmp_path):
    blocks = _loading_blocks((export / "README.md").read_text())
    assert len(blocks) == 2, blocks  # with podkit, without podkit
    for block in blocks:
        assert "AutoTokenizer.from_pretrained(REPO" in block, block
        with_podkit = "sparse_models" in block
        code = ("" if with_podkit else HIDE_PODKIT) + block.replace("REPO", repr(str(export))) + textwrap.dedent('''
            ids = tokenizer("It is a truth universally acknowledged", return_tensors="pt").input_ids
            print("LOADED", type(model).__module__, ids.shape[1] > 0, flush=True)
            ''')
        done = _run(code, cwd=REPO if with_podkit else tmp_path)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-3000:]
        assert "LOADED" in done.stdout, output[-3000:]
        module = done.stdout.split("LOADED", 1)[1].split()[0]
        assert module.startswith("sparse_models") == with_podkit, module
        for mark in PROMPT_MARKS:
            assert mark not in output, (mark, output[-3000:])


def test_export_tokenizer_config_needs_no_remote_code(export):
    import json

    tokenizer_config = json.loads((export / "tokenizer_config.json").read_text())
    assert "auto_map" not in tokenizer_config  # the tokenizer itself is a stock class
