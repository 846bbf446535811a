#!/usr/bin/env bash
# Session 11 device call: split POD attention on the GPU (tests + timing), dense prefill, POD vs dense train step.
set -u
R=$OUT/s11; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" > $R/versions.txt 2>&1
export PODKIT_HOPPER_CONFIGS=0
timeout 150 python3 -m pytest -q -m gpu -x tests/kernels/test_pod_split_attention.py tests/kernels/test_pod_prefill_attention.py > $R/pytest_pod.log 2>&1; echo "rc=$?" >> $R/pytest_pod.log
tail -3 $R/pytest_pod.log
timeout 170 python3 -m eval.bench kernels-prefill --out $R/kernels_prefill_32k.json --lengths 32768 --pod-lengths 32768 --skip sparse > $R/kernels_prefill.log 2>&1; echo "rc=$?" >> $R/kernels_prefill.log
tail -12 $R/kernels_prefill.log
timeout 170 python3 -m eval.bench train --no-deepspeed --steps 3 --warmup 1 --timeout-s 80 --out $R/train_1b_fused.json > $R/train_fused.log 2>&1; echo "rc=$?" >> $R/train_fused.log
tail -4 $R/train_fused.log
PODKIT_POD_ATTENTION=split timeout 100 python3 -m eval.bench train --no-deepspeed --steps 3 --warmup 1 --timeout-s 90 --schemes pod --out $R/train_1b_split.json > $R/train_split.log 2>&1; echo "rc=$?" >> $R/train_split.log
tail -4 $R/train_split.log
