#!/usr/bin/env bash
# Session 11, second device call: split path with native GQA + the Triton merge; default auto (= split on CUDA).
set -u
R=$OUT/s11c; mkdir -p $R
export PODKIT_HOPPER_CONFIGS=0
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_pod_split_attention.py tests/kernels/test_pod_prefill_attention.py > $R/pytest_pod.log 2>&1; echo "rc=$?" >> $R/pytest_pod.log
tail -3 $R/pytest_pod.log
timeout 200 python3 -m eval.bench kernels-prefill --out $R/kernels_prefill_32k.json --lengths 32768 --pod-lengths 32768 --skip sparse > $R/kernels_prefill.log 2>&1; echo "rc=$?" >> $R/kernels_prefill.log
tail -22 $R/kernels_prefill.log | head -12
timeout 220 python3 -m eval.bench train --no-deepspeed --steps 3 --warmup 1 --timeout-s 100 --out $R/train_1b_dense_split.json > $R/train.log 2>&1; echo "rc=$?" >> $R/train.log
tail -5 $R/train.log
