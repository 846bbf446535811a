# Issue 32's recent keys (kv_cache_recent_keys, kernels/fp8_kv.py "Recent keys") on one H200, for a device session:
# the GPU tests of the kernels that read the model-dtype ring, then its decode cost beside the plain FP8 cache.
# Not run yet (written 2026-12-05, when no device was lent). About 5 minutes:
#   OUT=outputs/issue32_recent bash benchmarks/plans/issue32_recent_keys.sh
# 1. the FP8 kernel tests' -m gpu cases (bf16 on CUDA, recent keys included: test_recent_keys_*_gpu);
# 2. e2e decode at 32K x 1, 128K x 1 and 128K x 4 (Llama-3-8B shape, random weights): each scheme with FP8 KV and
#    with FP8 KV + the newest 64 keys in bf16 (a --variants row of the same scheme), and bf16 KV for the ratio.
# 3. with `ruler` as the argument instead: the RULER test board (seed 7919, 13 tasks x 20, 2K / 4K) for dense,
#    TidalDecode and Quest at 1/8 with a bf16 cache, plain FP8 KV and FP8 KV + the newest 64 keys in bf16, side by
#    side in one run (so the three differ only by the cache). Needs the test samples under /tmp/p31/issue31_test: carry
#    outputs/issue31_test.tgz (`python -m eval.leaderboard --generate-only --lengths 2048 4096 8192 --samples 20
#    --seed 7919 --out outputs/issue31_test`, then tar czf) and the staged model (issue29_control_vs_pod.sh stage).
#    LENGTHS (default "2048 4096"), LIMIT (seconds per row, default 540: on 2026-12-06, beside three trainings, it
#    stopped the 4K pass after 2-5 samples per task), BATCH, POD_EXPORT (adds POD and POD + TidalDecode @1/8) and
#    BOARDS (the working folders' prefix under /tmp/p31, default board).
OUT=${OUT:-outputs/issue32_recent}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = ruler ]; then
  Q=/tmp/p31; mkdir -p "$Q"
  [ -f outputs/issue31_test.tgz ] && tar xzf outputs/issue31_test.tgz -C "$Q"
  [ -d "$Q/issue31_test" ] || { echo "no test samples at $Q/issue31_test: carry outputs/issue31_test.tgz" >&2; exit 2; }
  B=$Q/${BOARDS:-board}   # BOARDS names the working folders, so that two runs of this part can overlap
  for row in bf16 fp8 fp8_recent64; do
    extra=(--kv-cache-dtype fp8_e4m3); [ "$row" = fp8_recent64 ] && extra+=(--kv-cache-recent-keys 64)
    [ "$row" = bf16 ] && extra=()
    rm -rf "${B}_$row"; cp -r "$Q/issue31_test" "${B}_$row"
    # POD_EXPORT=<an adapted export> adds its rows (POD, and POD + TidalDecode @1/8) under the same cache
    settings=(dense tidal@1/8 quest@1/8); export_args=()
    if [ -n "${POD_EXPORT:-}" ]; then settings+=(pod_adapted pod_adapted+tidal@1/8); export_args=(--pod-adapted "$POD_EXPORT"); fi
    read -r -a lengths <<< "${LENGTHS:-2048 4096}"
    timeout "${LIMIT:-540}" python3 -m eval.leaderboard --out "${B}_$row" --seed 7919 --samples 20 --no-calibrate \
      --lengths "${lengths[@]}" --batch-size "${BATCH:-64}" "${extra[@]}" "${export_args[@]}" \
      --settings "${settings[@]}" > "$OUT/board_$row.log" 2>&1 &
  done
  wait
  for row in bf16 fp8 fp8_recent64; do
    mkdir -p "$OUT/board/$row"; cp "${B}_$row"/*.{json,md} "$OUT/board/$row/" 2>/dev/null
    rm -f "$OUT/board/$row"/samples_*.json; tail -2 "$OUT/board_$row.log"
  done
  exit 0
fi
timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_fp8_decode_attention.py \
  tests/kernels/test_fp8_pod_decode_attention.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
timeout 330 python3 -m eval.bench e2e --shape llama3-8b --sections decode --kv-cache-dtypes fp8_e4m3 \
  --rows 32768x1 131072x1 131072x4 --schemes podkit-dense tidal pod pod+tidal quest --budget 2048 --steps 10 \
  --variants podkit-dense:kv_cache_recent_keys=64 tidal:kv_cache_recent_keys=64 pod:kv_cache_recent_keys=64 \
  pod+tidal:kv_cache_recent_keys=64 quest:kv_cache_recent_keys=64 --time-budget-s 270 \
  --out "$OUT/e2e_recent.json" > "$OUT/e2e_recent.log" 2>&1
echo "e2e recent rc=$?"; cat "$OUT/e2e_recent.md"
