#!/usr/bin/env bash
# One H200 session (2026-12-06), one part per device call, the calls back to back (the machine stays warm 30 s):
#   stage    x3  carry .whl, outputs/texts (.cache/podkit/texts' files) and a GGUF part each (outputs/gguf_parts/
#                part_0..2, `split -b 33M`), with the 8K
#                token shards, the 8K recipe's RULER samples and the podkit:recall-long pack spread over the calls
#                (issue29_control_vs_pod.sh stage keeps them in /tmp/p29 and builds the model once it is whole)
#   start        alone on the GPU first: generate() against the engine on the embedded model (issue 33, < 3 min);
#                then issue 29's fourth round in the background (issue29_serving_length.sh launch
#                pod_8k_scores_recall pod_8k_scores_auto) and the GPU suite beside it (scripts/test_gpu_parallel.sh,
#                logs in /tmp/gpu_suite; the suite has no timed assertions, so sharing the GPU only slows it)
#   wait S       the runs' progress after at most S seconds, and the suite's summary once it is written
#   finish       the test-split rows of both runs (export and weights run densely), the runs' curves and logs, the
#                suite's logs, all under $OUT
set -u
part=${1:-}; shift || true
case "$part" in
  stage|start|wait|finish) ;;
  *) echo "unknown part '$part'; allowed: stage, start, wait, finish" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/device_2026-12-06}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/p29/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PODKIT_CACHE=/tmp/p29/cache \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RUNS=(pod_8k_scores_recall pod_8k_scores_auto)
suite_summary() {
  if [ -f /tmp/gpu_suite/summary.txt ]; then cat /tmp/gpu_suite/summary.txt; else echo "GPU suite: still running"; fi
}
case "$part" in
  stage)
    # the public-domain texts come as outputs/texts (.cache also holds the packed corpus and converted models)
    if [ -d outputs/texts ]; then mkdir -p /tmp/p29/cache/texts && cp outputs/texts/* /tmp/p29/cache/texts/; fi
    OUT="$OUT/stage" bash benchmarks/plans/issue29_control_vs_pod.sh stage ;;
  start)
    timeout 200 python3 -m eval.bench generate-vs-engine --out "$OUT/gve.json" > "$OUT/gve.log" 2>&1
    echo "generate-vs-engine rc=$?"; tail -12 "$OUT/gve.log"
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh launch "${RUNS[@]}"
    mkdir -p /tmp/gpu_suite
    setsid nohup bash -c "LOGS=/tmp/gpu_suite scripts/test_gpu_parallel.sh python3 > /tmp/gpu_suite/summary.tmp 2>&1;
      echo \"suite rc=\$?\" >> /tmp/gpu_suite/summary.tmp; mv /tmp/gpu_suite/summary.tmp /tmp/gpu_suite/summary.txt" \
      > /dev/null 2>&1 < /dev/null &
    echo "GPU suite started" ;;
  wait)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh wait "${1:-60}"
    suite_summary ;;
  finish)
    OUT="$OUT/issue29" ROWS_PARALLEL=4 bash benchmarks/plans/issue29_serving_length.sh rows \
      "${RUNS[0]}" "${RUNS[0]}:dense" "${RUNS[1]}" "${RUNS[1]}:dense"
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh collect
    suite_summary
    [ -d /tmp/gpu_suite ] && (cd /tmp && tar czf "$OUT/gpu_suite.tgz" gpu_suite) ;;
esac
