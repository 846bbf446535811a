"""The README's command lines name modules and scripts that exist, and it says where they run (issue 33 s5).

Every ``python -m X`` in the README (code blocks and inline code) must be an importable module spec, every
``python path.py`` / ``deepspeed ... path.py`` script and every ``scripts/*.sh`` a file of the checkout, and every
``python -m eval.bench COMMAND`` a command of ``eval.bench``; so a rename cannot leave the README stale.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _command_text() -> str:
    """Fenced code blocks plus inline code spans, with shell line continuations joined."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README, flags=re.S)
    outside = re.sub(r"```[a-z]*\n.*?```", "", README, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", outside.replace("\n", " "))
    return "\n".join(blocks + spans).replace("\\\n", " ")


COMMANDS = _command_text()


def _modules() -> set[str]:
    return set(re.findall(r"\bpython3? -m ([A-Za-z_][\w.]*)", COMMANDS))


def test_readme_names_commands():
    assert {"train.corpus", "sparse_models.generate", "eval.lm_eval", "eval.bench"} <= _modules()
    assert "train/pod.py" in COMMANDS


def test_every_python_module_in_the_readme_exists():
    missing = sorted(m for m in _modules() if m not in ("pytest", "pip", "deepspeed.launcher.runner")
                     and importlib.util.find_spec(m) is None)
    assert missing == [], missing


def test_every_script_in_the_readme_exists():
    scripts = set(re.findall(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.(?:py|sh))\b", COMMANDS))
    scripts |= set(re.findall(r"\bpython3? ([\w./-]+\.py)\b", COMMANDS))
    assert "train/pod.py" in scripts and "scripts/setup_env.sh" in scripts
    missing = sorted(s for s in scripts if not (REPO / s).is_file() and not s.startswith(("outputs/", "/")))
    assert missing == [], missing


def test_every_eval_bench_command_in_the_readme_exists():
    from eval.bench.__main__ import COMMANDS as BENCH
    from eval.bench.__main__ import MODULES

    named = set(re.findall(r"\bpython3? -m eval\.bench ([\w-]+)", COMMANDS))
    assert named, "no eval.bench command found"
    assert sorted(named - set(BENCH)) == []
    assert sorted(c for c in named if c in MODULES and importlib.util.find_spec(MODULES[c]) is None) == []


def test_readme_says_to_activate_the_virtualenv_before_the_usage_lines():
    top = " ".join(README.split("## Results", 1)[0].split())
    assert "source .venv/bin/activate" in top and ".venv/bin/python" in top
