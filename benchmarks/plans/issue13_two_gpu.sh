#!/usr/bin/env bash
# Issue 13's two-GPU runs, for a device call on `nvidia-h200-x2` that carries .whl and .cache
# (scripts/device_bundle.sh). One part per call keeps each under the 10-minute limit:
#   bash benchmarks/plans/issue13_two_gpu.sh sp-test       the 2-GPU SP test (NCCL; split POD route) + make test-gpu-parallel
#   bash benchmarks/plans/issue13_two_gpu.sh scaling       32-layer Llama-3-8B shape, POD, LoRA r 16, 32K: 1 vs 2 GPUs
#   bash benchmarks/plans/issue13_two_gpu.sh max-context   full fine-tuning, SP 2, optimizer on the CPU, doubling from
#                                                          64K with the chunked loss, tiled MLP and checkpoint offload
#   bash benchmarks/plans/issue13_two_gpu.sh before        the same without tiling/offload (the PNG's "before" line)
# Results (JSON, PNG, logs) under $OUT (default outputs/issue13_two_gpu). NVLink multicast stays off (KINDS.md).
set -u
part=${1:-}
case "$part" in
  sp-test|scaling|max-context|before) ;;
  *) echo "unknown part '$part'; allowed: sp-test, scaling, max-context, before" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/issue13_two_gpu}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# shellcheck source=scripts/device_setup.sh
source scripts/device_setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
bench=(python3 -m eval.bench train-multi-gpu --layers 32)
case "$part" in
  sp-test)
    timeout 200 python3 -m pytest -v -m gpu -rfE -p no:cacheprovider tests/train/test_sequence_parallel_dist.py \
      > "$OUT/sp_test.log" 2>&1; echo "rc=$?" >> "$OUT/sp_test.log"; tail -5 "$OUT/sp_test.log"
    LOGS=/tmp/test_gpu timeout 330 scripts/test_gpu_parallel.sh python3 > "$OUT/test_gpu.txt" 2>&1
    echo "rc=$?" >> "$OUT/test_gpu.txt"; cat "$OUT/test_gpu.txt"
    (cd /tmp/test_gpu && tar czf "$OUT/test_gpu_logs.tgz" ./*.log) ;;
  scaling)
    timeout 560 "${bench[@]}" --num-gpus 1,2 --seq 32768 --method lora --warmup 1 --steps 2 --timeout-s 270 \
      --out "$OUT/scaling_32k_lora.json" 2>&1 | tee "$OUT/scaling.log" | tail -8 ;;
  max-context)
    timeout 570 "${bench[@]}" --num-gpus 2 --sp 2 --find-max-context --seq 65536 --max-seq 524288 --tiled-mlp \
      --activation-offload --zero-config recipes/deepspeed/zero3_offload_optimizer.json --warmup 1 --steps 1 \
      --timeout-s 260 --out "$OUT/max_context_sp2_after.json" 2>&1 | tee "$OUT/max_context.log" | tail -8 ;;
  before)
    timeout 570 "${bench[@]}" --num-gpus 2 --sp 2 --find-max-context --seq 32768 --max-seq 262144 \
      --loss-chunk-tokens 0 --zero-config recipes/deepspeed/zero3_offload_optimizer.json --warmup 1 --steps 1 \
      --timeout-s 260 --out "$OUT/max_context_sp2_before.json" 2>&1 | tee "$OUT/before.log" | tail -8 ;;
esac
