#!/usr/bin/env bash
# Start the GPU suite (scripts/test_gpu_parallel.sh, logs in /tmp/gpu_suite) in the background of a device call, so
# that it runs beside trainings; /tmp/gpu_suite/summary.txt appears when it ends, with its exit code last.
# It runs from a copy of the tree (/tmp/gpu_suite_code): the next device call replaces the working tree under it.
# The training tests need their texts under $PODKIT_CACHE/texts (device_2026-12-06.sh stage puts them there).
# Usage (from the repository root, on the device): bash benchmarks/plans/gpu_suite_background.sh
set -u
mkdir -p /tmp/gpu_suite
rm -rf /tmp/gpu_suite_code && mkdir -p /tmp/gpu_suite_code
tar --exclude=./outputs --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C /tmp/gpu_suite_code
setsid nohup bash -c "cd /tmp/gpu_suite_code && LOGS=/tmp/gpu_suite scripts/test_gpu_parallel.sh python3 \
  > /tmp/gpu_suite/summary.tmp 2>&1; echo \"suite rc=\$?\" >> /tmp/gpu_suite/summary.tmp;
  mv /tmp/gpu_suite/summary.tmp /tmp/gpu_suite/summary.txt" > /dev/null 2>&1 < /dev/null &
echo "GPU suite started from /tmp/gpu_suite_code (PODKIT_CACHE=${PODKIT_CACHE:-unset})"
