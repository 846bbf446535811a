# Issue 32's recent keys (kv_cache_recent_keys, kernels/fp8_kv.py "Recent keys") on one H200, for a device session:
# the GPU tests of the kernels that read the model-dtype ring, then its decode cost beside the plain FP8 cache.
# Not run yet (written 2026-12-05, when no device was lent). About 5 minutes:
#   OUT=outputs/issue32_recent bash benchmarks/plans/issue32_recent_keys.sh
# 1. the FP8 kernel tests' -m gpu cases (bf16 on CUDA, recent keys included: test_recent_keys_*_gpu);
# 2. e2e decode at 32K x 1, 128K x 1 and 128K x 4 (Llama-3-8B shape, random weights): each scheme with FP8 KV and
#    with FP8 KV + the newest 64 keys in bf16 (a --variants row of the same scheme), and bf16 KV for the ratio.
OUT=${OUT:-outputs/issue32_recent}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_fp8_decode_attention.py \
  tests/kernels/test_fp8_pod_decode_attention.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
timeout 330 python3 -m eval.bench e2e --shape llama3-8b --sections decode --kv-cache-dtypes fp8_e4m3 \
  --rows 32768x1 131072x1 131072x4 --schemes podkit-dense tidal pod pod+tidal quest --budget 2048 --steps 10 \
  --variants podkit-dense:kv_cache_recent_keys=64 tidal:kv_cache_recent_keys=64 pod:kv_cache_recent_keys=64 \
  pod+tidal:kv_cache_recent_keys=64 quest:kv_cache_recent_keys=64 --time-budget-s 270 \
  --out "$OUT/e2e_recent.json" > "$OUT/e2e_recent.log" 2>&1
echo "e2e recent rc=$?"; cat "$OUT/e2e_recent.md"
