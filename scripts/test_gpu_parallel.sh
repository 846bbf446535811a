#!/usr/bin/env bash
# The GPU test suite (pytest -m gpu) as concurrent pytest processes (`make test-gpu` runs it serially: about 12
# minutes on an H200, mostly Triton compiles on the CPU). With one GPU every group shares it and the 2-GPU tests skip.
# Kernel tests share GPU 0, model/engine/training tests GPU 1, the 2-GPU sequence-parallel test uses both.
# On 2 x H200 (2026-11-30) this took about 210 s. Logs: $LOGS (default outputs/test_gpu), one per group.
# Usage: scripts/test_gpu_parallel.sh [python]      exit status: 0 when every group passed
set -u
PY=${1:-python3}
LOGS=${LOGS:-outputs/test_gpu}
mkdir -p "$LOGS"
export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
  echo "no CUDA GPU: nothing to run" >&2; exit 2
fi
declare -A TEST_GROUPS=(
  [k_prefill]="0|tests/kernels/test_prefill_attention.py tests/kernels/test_gluon_prefill_attention.py tests/kernels/test_pod_prefill_attention.py tests/kernels/test_pod_split_attention.py tests/kernels/test_sparse_prefill_attention.py tests/kernels/test_token_sparse_scores.py"
  [k_decode]="0|tests/kernels/test_decode_attention.py tests/kernels/test_decode_topk_split.py tests/kernels/test_pod_decode_attention.py tests/kernels/test_pod_sparse_decode_attention.py tests/kernels/test_sparse_decode_attention.py tests/kernels/test_quest_pages.py"
  [k_fp8]="0|tests/kernels/test_cache_append.py tests/kernels/test_decode_linear.py tests/kernels/test_fp8_decode_attention.py tests/kernels/test_fp8_pod_decode_attention.py"
  [k_autotuned]="0|tests/kernels/test_autotuned_kernels_gpu.py"
  [engine]="1|tests/sparse_models/test_engine.py"
  [models]="1|tests/sparse_models/test_engine_limits_and_timing.py tests/sparse_models/test_training_on_kernels.py tests/sparse_models/test_calibration_tidal_reselection.py"
  [mixed_precision]="1|tests/train/test_mixed_precision_gpu.py"
  [sequence_parallel]="0,1|tests/train/test_sequence_parallel_dist.py"
)
# every GPU test file must be in a group: a new one would otherwise never run here
listed=" $(for g in "${TEST_GROUPS[@]}"; do echo "${g#*|}"; done | tr '\n' ' ') "
for f in $("$PY" -m pytest -q -m gpu --collect-only -p no:cacheprovider tests 2>/dev/null | grep '::' | cut -d: -f1 | sort -u); do
  case "$listed" in *" $f "*) ;; *) echo "error: $f has GPU tests but no group in $0" >&2; exit 2 ;; esac
done
# the training tests read two public-domain texts (tests/train's tiny setup: TRAIN_TEXT and HELD_OUT_TEXT): fetch
# them now, or stop before any test with one clear error (a GPU machine without network needs them carried:
# outputs/texts -> $PODKIT_CACHE/texts)
if ! texts_error=$("$PY" -c "import sys; sys.path.insert(0, 'tests/train')
from tiny_setup import TRAIN_TEXT
from train.corpus.texts import HELD_OUT_TEXT, load_text
for name in (TRAIN_TEXT, HELD_OUT_TEXT): load_text(name)" 2>&1); then
  echo "error: the GPU training tests need their two texts under \$PODKIT_CACHE/texts" \
    "(PODKIT_CACHE=${PODKIT_CACHE:-unset}) and could not fetch them: ${texts_error##*$'\n'}" >&2
  echo "  copy a cached texts folder there (benchmarks/plans/prep_8k_inputs.sh writes outputs/texts), then rerun" >&2
  exit 2
fi
pids=()
for name in "${!TEST_GROUPS[@]}"; do
  devices=${TEST_GROUPS[$name]%%|*}; files=${TEST_GROUPS[$name]#*|}
  # one GPU: every group shares it (the Triton compiles, most of the time, run on the CPU cores in parallel);
  # the 2-GPU sequence-parallel tests then skip themselves
  [ "$gpus" -lt 2 ] && devices=0
  # shellcheck disable=SC2086
  ( CUDA_VISIBLE_DEVICES=$devices "$PY" -m pytest -v -m gpu -rfE -p no:cacheprovider $files > "$LOGS/$name.log" 2>&1
    echo "rc=$?" >> "$LOGS/$name.log" ) &
  pids+=($!)
done
wait "${pids[@]}"
status=0
for name in "${!TEST_GROUPS[@]}"; do
  rc=$(tail -1 "$LOGS/$name.log"); passed=$(grep -c " PASSED" "$LOGS/$name.log")
  echo "$name: $passed passed, $rc"
  grep -E "^(FAILED|ERROR) " "$LOGS/$name.log" || true
  [ "$rc" = "rc=0" ] || status=1
done
exit $status
