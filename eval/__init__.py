"""podkit evaluation: lm-eval model, local long-context tasks, calibration commands, fidelity sweeps.

Entry points (each ``python -m ...``):

* ``eval.lm_eval``: lm-eval's CLI with the ``podkit`` model registered (eval/lm_eval_model.py) and the
  local tasks of eval/tasks on the include path, offline;
* ``eval.quality``: the local tasks (passkey, passkey_text, needle, ppl) without lm-eval, with each
  scheme in its own phase (eval/runner.py);
* ``eval.fidelity``: the fidelity sweep of issue 6 (``--reduced`` for ``make eval``);
* ``eval.calibrate``: POD blocks, Token Sparse drift, TidalDecode re-selection (JSON + PNG);
* ``eval.bench``: benchmark dispatcher; ``eval.data.texts``: public-domain books from Debian.

Only ``eval.lm_eval`` / ``eval.lm_eval_model`` / ``eval.tasks.lm_eval_tasks`` need lm-eval and
datasets; everything else runs on the GPU image (torch, transformers, matplotlib).
"""
