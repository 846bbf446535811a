#!/usr/bin/env bash
# Device call 4 of 2026-12-02: the 1B-shape POD vs dense train step on the final tree, autotuning as users get it
# (sm_90 candidates on), each scheme in its own process.
set -u
R=$OUT; export PYTHONUNBUFFERED=1
timeout 430 python3 -m eval.bench train --no-deepspeed --steps 5 --warmup 2 --timeout-s 210 --out $R/train_1b.json > $R/train.log 2>&1; echo "rc=$?" >> $R/train.log
tail -8 $R/train.log
