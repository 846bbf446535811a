#!/usr/bin/env bash
# One GPU session for issue 29's 8K runs (written 2026-12-06, when it ran on one H100), one part per device call,
# the calls back to back (the machine is given back after 30 s idle):
#   stage    x3  call 1 carries .whl, outputs/texts, outputs/gguf_parts/part_0 and count, outputs/ruler_samples.tgz
#                (and outputs/ruler_samples_devwide.tgz); call 2 part_1 and the 8K token shards; call 3 part_2 and
#                the podkit:recall-long pack (issue29_control_vs_pod.sh stage keeps them in /tmp/p29 and builds the
#                model once it is whole)
#   start        alone on the GPU first: generate() against the engine on the embedded model (issue 33, < 3 min;
#                PROBE=1 runs benchmarks/plans/gve_fp32_probe.py instead: the float32 paths after the autotune fix);
#                then the issue-29 runs RUNS (default: this session's pod_8k_scores_recall pod_8k_scores_auto) in the
#                background (issue29_serving_length.sh launch) and the GPU suite beside them
#                (scripts/test_gpu_parallel.sh, logs in /tmp/gpu_suite; no timed assertions, so sharing only slows it)
#   wait S       the runs' progress after at most S seconds, and the suite's summary once it is written
#   devrows      the wide dev split (13 tasks x 10) for every run (POD runs also with their weights run densely):
#                what a choice between them is made on
#   finish       the test-split rows of every run (POD runs also densely), the pass-key / needle target for them
#                and the original, the runs' curves and logs, the suite's logs, all under $OUT
# Inputs: benchmarks/plans/prep_8k_inputs.sh on the CPU machine. Next session (issue 29, fifth round):
#   RUNS="pod_8k_scores_recall control_8k_recall pod_8k_scores_recall_auto pod_8k_scores" (the last for run-to-run
#   noise), devrows to choose, finish for the test rows.
set -u
part=${1:-}; shift || true
case "$part" in
  stage|start|wait|devrows|finish) ;;
  *) echo "unknown part '$part'; allowed: stage, start, wait, devrows, finish" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/device_2026-12-06}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/p29/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PODKIT_CACHE=/tmp/p29/cache \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
read -r -a RUNS <<< "${RUNS:-pod_8k_scores_recall pod_8k_scores_auto}"
rows_of() {  # every run, and POD runs once more with their weights run densely
  for run in "${RUNS[@]}"; do echo "$run"; case "$run" in control_*) ;; *) echo "$run:dense" ;; esac; done
}
suite_summary() {
  if [ -f /tmp/gpu_suite/summary.txt ]; then cat /tmp/gpu_suite/summary.txt; else echo "GPU suite: still running"; fi
}
case "$part" in
  stage)
    # the public-domain texts come as outputs/texts (.cache also holds the packed corpus and converted models)
    if [ -d outputs/texts ]; then mkdir -p /tmp/p29/cache/texts && cp outputs/texts/* /tmp/p29/cache/texts/; fi
    OUT="$OUT/stage" bash benchmarks/plans/issue29_control_vs_pod.sh stage ;;
  start)
    if [ "${PROBE:-0}" = 1 ]; then
      PROBE_CASES=float32,engine_float32,engine_bfloat16 timeout 200 python3 benchmarks/plans/gve_fp32_probe.py \
        "$OUT/probe" 60
    else
      timeout 200 python3 -m eval.bench generate-vs-engine --out "$OUT/gve.json" > "$OUT/gve.log" 2>&1
      echo "generate-vs-engine rc=$?"; tail -12 "$OUT/gve.log"
    fi
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh launch "${RUNS[@]}"
    mkdir -p /tmp/gpu_suite
    setsid nohup bash -c "LOGS=/tmp/gpu_suite scripts/test_gpu_parallel.sh python3 > /tmp/gpu_suite/summary.tmp 2>&1;
      echo \"suite rc=\$?\" >> /tmp/gpu_suite/summary.tmp; mv /tmp/gpu_suite/summary.tmp /tmp/gpu_suite/summary.txt" \
      > /dev/null 2>&1 < /dev/null &
    echo "GPU suite started" ;;
  wait)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh wait "${1:-60}"
    suite_summary ;;
  devrows)
    # shellcheck disable=SC2046
    OUT="$OUT/issue29" ROWS_PARALLEL=4 bash benchmarks/plans/issue29_serving_length.sh devrows $(rows_of) ;;
  finish)
    # shellcheck disable=SC2046
    OUT="$OUT/issue29" ROWS_PARALLEL=4 bash benchmarks/plans/issue29_serving_length.sh rows $(rows_of)
    # shellcheck disable=SC2046
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh retrieval original $(rows_of)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh collect
    suite_summary
    [ -d /tmp/gpu_suite ] && (cd /tmp && tar czf "$OUT/gpu_suite.tgz" gpu_suite) ;;
esac
