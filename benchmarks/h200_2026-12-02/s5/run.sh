#!/usr/bin/env bash
# Device call 5 of 2026-12-02: every forward tile candidate launched directly (new GPU test) and the prefill GPU
# tests; the 1B-shape train step with the POD kernels' sm_90 candidates now opt-in (the default).
set -u
R=$OUT; export PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -q -m gpu -rfEs -p no:cacheprovider tests/kernels/test_prefill_attention.py > $R/pytest_prefill.log 2>&1; echo "rc=$?" >> $R/pytest_prefill.log
tail -4 $R/pytest_prefill.log
timeout 125 python3 -m eval.bench train --no-deepspeed --steps 5 --warmup 2 --timeout-s 60 --out $R/train_1b.json > $R/train.log 2>&1; echo "rc=$?" >> $R/train.log
tail -5 $R/train.log
