#!/usr/bin/env bash
# Device call 9 of 2026-12-02: the dense prefill benchmark with the Gluon sm_90 kernel as the default route (the
# tl.dot kernel timed beside it), then the whole GPU suite on this tree. Carries .whl and .cache
# (scripts/device_bundle.sh).
set -u
R=$OUT; export PYTHONUNBUFFERED=1
source scripts/device_setup.sh > $R/setup.log 2>&1 || { tail $R/setup.log; exit 1; }
timeout 100 python3 -m eval.bench kernels-prefill --out $R/kernels_prefill.json --lengths 8192 32768 131072 \
  --skip sparse pod > $R/kernels_prefill.log 2>&1; echo "rc=$?" >> $R/kernels_prefill.log
tail -16 $R/kernels_prefill.log
LOGS=/tmp/test_gpu timeout 320 scripts/test_gpu_parallel.sh python3 > $R/test_gpu.txt 2>&1; echo "rc=$?" >> $R/test_gpu.txt
cat $R/test_gpu.txt
( cd /tmp/test_gpu && tar czf $R/test_gpu_logs.tgz ./*.log )
grep -h -E "PASSED|FAILED|ERROR|SKIPPED" /tmp/test_gpu/k_prefill.log | grep gluon | cut -c1-160
