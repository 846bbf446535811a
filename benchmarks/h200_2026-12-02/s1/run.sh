#!/usr/bin/env bash
# Device call 1 of 2026-12-02: dense prefill inner-loop variants vs SDPA; the 1B-shape POD vs dense train step with
# the final split-route merge kernel (never re-measured after the race fix).
set -u
R=$OUT; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
timeout 290 python3 benchmarks/h200_2026-12-02/prefill_variants/bench_variants.py $R/prefill_variants.json > $R/prefill_variants.log 2>&1; echo "rc=$?" >> $R/prefill_variants.log
grep -E "sdpa|podkit|rc=" $R/prefill_variants.log | tail -6
timeout 250 python3 -m eval.bench train --no-deepspeed --steps 3 --warmup 1 --timeout-s 110 --out $R/train_1b.json > $R/train.log 2>&1; echo "rc=$?" >> $R/train.log
tail -6 $R/train.log
