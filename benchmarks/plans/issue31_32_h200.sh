#!/usr/bin/env bash
# Issues 29, 31 and 32 (and the GPU suite) on one H200, one part per device call. The calls must follow each other
# at once: the machine keeps /tmp only while it stays warm (30 s idle). A call carries at most 64 MiB with the tree
# (about 25 MiB counted in disk blocks), so the embedded model's GGUF travels in three parts cut to fill each call
# (outputs/gguf_parts: 30,500,000 + 40,400,000 bytes + the rest, `head -c` / `tail -c`), staged by
# issue29_control_vs_pod.sh's `stage`.
#
#   suite  carry .whl .cache outputs/gguf_parts/part_0 outputs/gguf_parts/count: the wheels, then the whole GPU test
#          suite (scripts/test_gpu_parallel.sh).
#   fp8    carry outputs/gguf_parts/part_1: issue 32's FP8 benchmarks (kernels-decode, e2e memory and decode,
#          Llama-3-8B shape, random weights; benchmarks/plans/issue32_fp8_runs.sh), alone on the GPU.
#   train  carry outputs/gguf_parts/part_2 outputs/tokens_smollm2_135m_gpu.tgz outputs/issue31_dev.tgz
#          outputs/ruler_samples_dev.tgz (tar czf of ruler_samples/dev_*): the model is whole; issue 29's 2K
#          candidates (issue29_control_vs_pod.sh candidates: pod.protect_units auto, pod.kv_saving 0.20 / 0.25)
#          beside issue 31's variant sweep on the dev seed (benchmarks/plans/issue31_runs.sh sweep).
#   board  carry outputs/issue31_test.tgz outputs/ruler_samples.tgz: the test seed for issue 29's candidate rows and
#          issue 31's board (today's rows, the calibrated picks, Quest; FP8 against bf16 KV), side by side.
# Samples: `python -m eval.leaderboard --generate-only --lengths 2048 4096 8192 --samples 10 --seed 104729 --out
# outputs/issue31_dev` (and --samples 20 --seed 7919 --out outputs/issue31_test), then tar czf each folder.
set -u
part=${1:-}
case "$part" in
  suite|fp8|train|board) ;;
  *) echo "unknown part '$part'; allowed: suite, fp8, train, board" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/issue31_32}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
P=/tmp/p29; Q=/tmp/p31
mkdir -p "$Q"
OUT="$OUT/stage" bash benchmarks/plans/issue29_control_vs_pod.sh stage > "$OUT/stage.log" 2>&1
tail -3 "$OUT/stage.log"
for f in outputs/issue31_dev.tgz outputs/issue31_test.tgz; do [ -f "$f" ] && tar xzf "$f" -C "$Q"; done
export PYTHONUNBUFFERED=1 PYTHONPATH="$P/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PODKIT_CACHE="$P/cache" \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
started=$(date +%s)
case "$part" in
  suite)
    LOGS=/tmp/test_gpu timeout 480 scripts/test_gpu_parallel.sh python3 > "$OUT/test_gpu.txt" 2>&1
    echo "rc=$? wall $(( $(date +%s) - started )) s" >> "$OUT/test_gpu.txt"
    cat "$OUT/test_gpu.txt"
    (cd /tmp/test_gpu && tar czf "$OUT/test_gpu_logs.tgz" ./*.log) ;;
  fp8)
    source benchmarks/plans/issue32_fp8_runs.sh ;;
  train)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_control_vs_pod.sh candidates > "$OUT/issue29_candidates.log" 2>&1 &
    mkdir -p "$OUT/issue31"
    (OUT="$OUT/issue31"; source benchmarks/plans/issue31_runs.sh sweep) > "$OUT/issue31_sweep.log" 2>&1
    wait
    tail -30 "$OUT/issue29_candidates.log"; tail -40 "$OUT/issue31_sweep.log" ;;
  board)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_control_vs_pod.sh candidate_rows > "$OUT/issue29_rows.log" 2>&1 &
    mkdir -p "$OUT/issue31"
    (OUT="$OUT/issue31"; source benchmarks/plans/issue31_runs.sh board) > "$OUT/issue31_board.log" 2>&1
    wait
    tail -20 "$OUT/issue29_rows.log"; tail -20 "$OUT/issue31_board.log" ;;
esac
echo "$part wall $(( $(date +%s) - started )) s"
