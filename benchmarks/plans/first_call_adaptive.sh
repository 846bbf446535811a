#!/usr/bin/env bash
# One device call that does what the GPU it lands on is needed for (written 2026-12-07, fifth try of round 7, after
# four failed starts left too little device time for issue 29's whole chain to be sure of finishing):
#   an H200 (> 100 GiB): `make test-gpu` (issue 32's "passes on the H200"), then issue 31's e2e decode of the
#                        calibrated TidalDecode pick at 128K x 1 and 128K x 4 alone on the GPU;
#   an H100:             issue 29's first stage call (device_2026-12-06.sh stage), with the union profile and the
#                        128K x 1 e2e in the background (issues_29_31_32_round7.sh e2e, BG=1).
# Carry: .whl outputs/texts outputs/gguf_parts/part_0 outputs/gguf_parts/count outputs/ruler_samples.tgz.
# Usage (on the device): OUT0=$OUT bash benchmarks/plans/first_call_adaptive.sh [E2E_BUDGET_S]
set -u
budget=${1:-100}
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$mib" -gt 100000 ]; then
  # shellcheck source=scripts/device_setup.sh
  source scripts/device_setup.sh
  mkdir -p /tmp/p29/cache/texts && cp outputs/texts/* /tmp/p29/cache/texts/
  PODKIT_CACHE=/tmp/p29/cache LOGS=$OUT0/gpu_suite timeout 330 scripts/test_gpu_parallel.sh python3
  echo "gpu suite rc=$?"
  OUT=/tmp/r7 bash benchmarks/plans/issues_29_31_32_round7.sh e2e "$budget"
else
  OUT=/tmp/r7 BG=1 bash benchmarks/plans/issues_29_31_32_round7.sh e2e "$budget"
  sleep 10
  OUT=/tmp/r7 bash benchmarks/plans/device_2026-12-06.sh stage 2>&1 | tail -8
  tail -c 600 /tmp/p31/e2e.log 2>/dev/null
fi
cp -r /tmp/r7/. "$OUT0/" 2>/dev/null
true
