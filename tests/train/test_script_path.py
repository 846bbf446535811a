"""``python train/pod.py`` (and ``deepspeed train/pod.py``) runs the file as a script, so Python puts train/ first on
sys.path. There, train/evaluate.py and train/long_context_eval/ would shadow the installed ``evaluate`` and
``long_context_eval`` packages (the RULER samples of the eval stage failed to generate that way): the script takes
its own folder off the path."""

from __future__ import annotations

import importlib.machinery
import pkgutil
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "train"


def test_running_the_script_takes_its_folder_off_the_path(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(TRAIN), *[p for p in sys.path if p and Path(p).resolve() != TRAIN]])
    runpy.run_path(str(TRAIN / "pod.py"), run_name="podkit_script_check")  # __package__ is "": the script branch
    assert all(Path(p).resolve() != TRAIN for p in sys.path if p)
    assert Path(sys.path[0]).resolve() == REPO
    for name in ("evaluate", "long_context_eval"):  # resolved the way `import name` would from the script now
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
        assert spec is None or not Path(spec.origin).resolve().is_relative_to(TRAIN), (name, spec.origin)


def test_which_train_modules_would_shadow_an_installed_package():
    """The names this guards: every top-level module of train/ that an installed package also has."""
    others = [p for p in sys.path if p and Path(p).resolve() not in (TRAIN, REPO)]
    clashes = {m.name for m in pkgutil.iter_modules([str(TRAIN)])
               if importlib.machinery.PathFinder.find_spec(m.name, others) is not None}
    assert clashes <= {"evaluate", "long_context_eval"}, f"new clash with an installed package: {clashes}"
