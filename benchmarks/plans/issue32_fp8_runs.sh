# Issue 32's FP8 KV benchmarks on one H200 (Llama-3-8B shape, random weights), sourced by issue31_32_h200.sh's
# `fp8` part with OUT set (or on its own: OUT=outputs/issue32 bash benchmarks/plans/issue32_fp8_runs.sh). About
# 6 minutes: the kernel rows at 128K (about 1-2 min), then e2e's memory rows (both dtypes, dense and POD, 32K and
# 128K, the largest batch allocated) and decode rows (5 schemes x 3 rows x 2 dtypes, cut at 270 s by
# --time-budget-s; skipped cells are listed in the JSON). Writes $OUT/kernels_decode_fp8_128k.{json,log} and
# $OUT/e2e_fp8.{json,md,log}; the H200 image has no matplotlib, so the PNGs are drawn afterwards where it is:
#   python -m eval.bench e2e --plot-only e2e_fp8.json    # e2e_fp8.png (decode) and e2e_fp8_memory.png (memory)
OUT=${OUT:-outputs/issue32}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 150 python3 -m eval.bench kernels-decode --contexts 131072 --batches 1 4 --kv-cache-dtypes fp8_e4m3 \
  --out "$OUT/kernels_decode_fp8_128k.json" > "$OUT/kernels_decode_fp8_128k.log" 2>&1
echo "kernels-decode fp8 rc=$?"; tail -2 "$OUT/kernels_decode_fp8_128k.log"
timeout 330 python3 -m eval.bench e2e --shape llama3-8b --sections memory decode --kv-cache-dtypes bfloat16 fp8_e4m3 \
  --check-fit --memory-contexts 32768 131072 --rows 32768x1 131072x1 131072x4 --hf-rows \
  --schemes podkit-dense tidal pod pod+tidal quest --budget 2048 --steps 10 --time-budget-s 270 \
  --out "$OUT/e2e_fp8.json" > "$OUT/e2e_fp8.log" 2>&1
echo "e2e fp8 rc=$?"; cat "$OUT/e2e_fp8.md"
