#!/usr/bin/env bash
# Device call 6 of 2026-12-02 (second session of the day, one H200; the two-GPU kind not lent): Triton's automatic
# warp specialisation on the dense prefill loop (variants ws / wsm against tma, each variant in its own process so a
# compiler crash costs one row), and the 1B-shape POD vs dense train step under the current default (POD kernels on base configs).
set -u
R=$OUT; export PYTHONUNBUFFERED=1
log=$R/all.log
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >> $log 2>&1
for spec in ws:110 wsm:80 tma:70; do
  v=${spec%%:*}
  timeout ${spec##*:} python3 benchmarks/h200_2026-12-02/prefill_variants/bench_variants.py $R/pv_$v.json \
    --lengths 8192 32768 131072 --variants $v >> $log 2>&1; echo "variants $v rc=$?" >> $log
done
grep -E "rc=| sdpa " $log
timeout 300 python3 -m eval.bench train --no-deepspeed --steps 6 --warmup 2 --timeout-s 145 --out $R/train_1b.json \
  >> $log 2>&1; echo "train rc=$?" >> $log
tail -30 $log
