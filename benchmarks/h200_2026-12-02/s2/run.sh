#!/usr/bin/env bash
# Device call 2 of 2026-12-02: dense prefill variants round 2 (256-row tiles) with podkit's kernel after the
# tutorial-arithmetic port (autotuned per length bucket); the 1B-shape train step, HOPPER_CONFIGS=0 as on 2026-12-01.
set -u
R=$OUT; export PYTHONUNBUFFERED=1
timeout 240 python3 benchmarks/h200_2026-12-02/prefill_variants/bench_variants.py $R/prefill_variants.json --variants fma tma > $R/prefill_variants.log 2>&1; echo "rc=$?" >> $R/prefill_variants.log
grep -E " sdpa|rc=" $R/prefill_variants.log | tail -3
PODKIT_HOPPER_CONFIGS=0 timeout 330 python3 -m eval.bench train --no-deepspeed --steps 3 --warmup 1 --timeout-s 160 --out $R/train_1b.json > $R/train.log 2>&1; echo "rc=$?" >> $R/train.log
tail -8 $R/train.log
