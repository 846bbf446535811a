#!/usr/bin/env bash
# Start the GPU suite (scripts/test_gpu_parallel.sh, logs in /tmp/gpu_suite) in the background of a device call, so
# that it runs beside trainings; /tmp/gpu_suite/summary.txt appears when it ends, with its exit code last.
# Usage (from the repository root, on the device): bash benchmarks/plans/gpu_suite_background.sh
mkdir -p /tmp/gpu_suite
setsid nohup bash -c "LOGS=/tmp/gpu_suite scripts/test_gpu_parallel.sh python3 > /tmp/gpu_suite/summary.tmp 2>&1;
  echo \"suite rc=\$?\" >> /tmp/gpu_suite/summary.tmp; mv /tmp/gpu_suite/summary.tmp /tmp/gpu_suite/summary.txt" \
  > /dev/null 2>&1 < /dev/null &
echo "GPU suite started"
