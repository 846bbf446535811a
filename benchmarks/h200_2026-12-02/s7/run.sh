#!/usr/bin/env bash
# Device calls 7-8 of 2026-12-02: the Gluon sm_90 prefill kernel, one process per tile (correctness, then timing
# against SDPA and podkit's Triton kernel at 8K / 32K / 128K).
set -u
R=$OUT; export PYTHONUNBUFFERED=1
i=0
for tile in "128 128 3 8 1" "128 64 4 8 1" "128 128 3 4 2"; do
  i=$((i+1))
  timeout 100 python3 benchmarks/h200_2026-12-02/s7/gluon_ab.py $R/tile$i.json $tile > $R/tile$i.log 2>&1
  echo "tile $tile rc=$?" >> $R/tile$i.log
  grep -v "^ " $R/tile$i.log | cut -c1-600 | tail -8
done
