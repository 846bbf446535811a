#!/usr/bin/env bash
# One device call that does what the GPU it lands on is needed for (written 2026-12-07, fifth try of round 7, after
# failed starts left too little device time for issue 29's chain of stage calls and trainings to be sure of
# finishing). First the GPU suite (`scripts/test_gpu_parallel.sh`, what `make test-gpu` runs, on this commit), then
#   an H200 (> 100 GiB): issue 31's e2e decode of the calibrated TidalDecode pick at 128K x 1 and 128K x 4, alone on
#                        the GPU (issues_29_31_32_round7.sh e2e: union_gpu_check.py first, then the e2e rows);
#   an H100:             issue 31's union profile alone (benchmarks/plans/union_gpu_check.py; the 128K x 1 e2e was
#                        measured twice on 2026-12-07, and 128K x 4 does not fit in 80 GB).
# Carry: .whl outputs/texts. Usage (on the device): OUT0=$OUT bash benchmarks/plans/first_call_adaptive.sh [E2E_S]
set -u
budget=${1:-100}
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# shellcheck source=scripts/device_setup.sh
source scripts/device_setup.sh
mkdir -p /tmp/p29/cache/texts /tmp/r7 && cp outputs/texts/* /tmp/p29/cache/texts/
PODKIT_CACHE=/tmp/p29/cache LOGS=$OUT0/gpu_suite timeout 330 scripts/test_gpu_parallel.sh python3
echo "gpu suite rc=$?"
if [ "$mib" -gt 100000 ]; then
  OUT=/tmp/r7 bash benchmarks/plans/issues_29_31_32_round7.sh e2e "$budget"
else
  timeout 150 python3 benchmarks/plans/union_gpu_check.py /tmp/r7/union_gpu_check.json 2>&1 | tail -30
fi
cp -r /tmp/r7/. "$OUT0/" 2>/dev/null
true
