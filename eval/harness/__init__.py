"""The product evaluation: what a user runs to score a model, documented in README.md and the Makefile.

lm-eval's ``podkit`` model and CLI (``lm_eval_model``, ``lm_eval``), the local tasks without lm-eval (``quality``),
the fidelity sweep (``fidelity``), the RULER leaderboard with its records and kvpress peers (``leaderboard``,
``leaderboard_records``, ``peers_kvpress``), their plots (``plots``), the calibration command line (``calibrate``)
and the export chain check (``chain``). The rules of eval's rooms: ARCHITECTURE.md, "eval".
"""
