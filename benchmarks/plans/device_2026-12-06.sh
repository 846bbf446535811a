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
# Inputs: benchmarks/plans/prep_8k_inputs.sh on the CPU machine.
#
# The second session of the day (issue 29's fifth round, issue 31's placement sweep):
#   stage call 3 also carries outputs/issue31_dev.tgz and outputs/issue31_test.tgz (`python -m eval.leaderboard
#                --generate-only`, seeds 104729 x 10 at 2K / 4K and 7919 x 20 at 2K / 4K / 8K, tar czf)
#   start        with GVE=0 (no generate() measurement) and SWEEP31=1: RUNS="control_8k_recall pod_8k_scores
#                pod_8k_scores_recall" (the recall candidate's own control, and the shipped recipe beside the
#                candidate so that the wide dev split can choose between them), the GPU suite, and issue 31's
#                placement sweep on the dev seed (eval.calibrate variants --grid placement: the all-heads union
#                with the re-selection layer moved; one process per length) in the background
#   devrows      DEVROWS (default: every run, without the dense rows) on the wide dev split
#   board31      the sweep's pick (merged records -> variants.json), then issue 31's test board in the background:
#                dense, Quest and the calibrated TidalDecode at 1/8, 1/4 and 1/2, 2K / 4K / 8K, one process per row
#                (batch 16: seven of them share the GPU with the issue-29 rows); with ISSUE32=1 also issue 32's
#                RULER rows with a bf16, an FP8 and an FP8 + recent-keys cache (issue32_recent_keys.sh ruler)
#   finish       as above (ROWS_PARALLEL rows at a time, default 4), plus issue 31's sweep and board so far
#   podtidal [RUN]  issue 31's POD + TidalDecode rows on RUN's export (default pod_8k_scores_recall), test seed
#   collect31 S  wait at most S seconds for issue 31's / 32's board processes, then tar what they wrote
#
# The third session (the second one's start ran out of GPU memory: three trainings, the suite and two sweeps at
# batch 64 on one H100): RUNS="control_8k_recall pod_8k_scores_recall" (the candidate's own control and a second run
# of the candidate), SUITE=0 (the suite alone afterwards, if device time is left), SWEEP31=1 (the sweep now at
# --batch-size 16); board31 with BOARD31_PEERS=0 scores only the calibrated TidalDecode rows (dense and Quest are on
# the 2026-12-03 board, the same test samples).
set -u
part=${1:-}; shift || true
case "$part" in
  stage|start|wait|devrows|board31|podtidal|finish|collect31) ;;
  *) echo "unknown part '$part'; allowed: stage, start, wait, devrows, board31, podtidal, finish, collect31" >&2
     exit 2 ;;
esac
OUT=${OUT:-outputs/device_2026-12-06}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/p29/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PODKIT_CACHE=/tmp/p29/cache \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
read -r -a RUNS <<< "${RUNS:-pod_8k_scores_recall pod_8k_scores_auto}"
rows_of() {  # every run, and POD runs once more with their weights run densely
  for run in "${RUNS[@]}"; do echo "$run"; case "$run" in control_*) ;; *) echo "$run:dense" ;; esac; done
}
Q=/tmp/p31
DEV31=(--seed 104729 --samples 10)
TEST31=(--seed 7919 --samples 20)
sweep31_state() {  # the placement sweep's processes and their last lines
  for length in 2048 4096; do
    echo "placement $length: $(tail -c 300 "$Q/place_$length.log" 2>/dev/null | tr '\r' '\n' | tail -1)"
  done
  cat "$Q/rc.txt" 2>/dev/null
}
collect31() {  # issue 31: the sweep (records, pick) and the board rows written so far; issue 32's rows
  [ -d "$Q" ] || return 0
  sweep31_state
  pgrep -fa "eval.leaderboard --out $Q/board_" | cut -c1-160
  (cd "$Q" && tar czf "$OUT/issue31.tgz" --ignore-failed-read --exclude='samples_*' placement place_*/*.json \
    place_*/*.md place_*.log rc.txt board_*/*.json board_*/*.md board_*/records*.jsonl board_*.log issue32 issue32.log \
    2>/dev/null)
  ls -la "$OUT/issue31.tgz"
}
board_row() {  # issue 31's test board, one row in the background: name, leaderboard arguments...
  local name=$1; shift
  rm -rf "$Q/board_$name"; cp -r "$Q/issue31_test" "$Q/board_$name"
  setsid nohup bash -c "timeout 900 python3 -m eval.leaderboard --out $Q/board_$name ${TEST31[*]} --no-calibrate \
    --lengths 2048 4096 8192 --batch-size 16 $* > $Q/board_$name.log 2>&1; echo \"board $name rc=\$?\" >> $Q/rc.txt" \
    > /dev/null 2>&1 < /dev/null &
}
suite_summary() {
  if [ -f /tmp/gpu_suite/summary.txt ]; then cat /tmp/gpu_suite/summary.txt; else echo "GPU suite: still running"; fi
}
case "$part" in
  stage)
    # the public-domain texts come as outputs/texts (.cache also holds the packed corpus and converted models)
    if [ -d outputs/texts ]; then mkdir -p /tmp/p29/cache/texts && cp outputs/texts/* /tmp/p29/cache/texts/; fi
    OUT="$OUT/stage" bash benchmarks/plans/issue29_control_vs_pod.sh stage
    mkdir -p "$Q"
    for f in outputs/issue31_dev.tgz outputs/issue31_test.tgz; do [ -f "$f" ] && tar xzf "$f" -C "$Q"; done
    ls "$Q" ;;
  start)
    if [ "${GVE:-1}" = 0 ]; then
      echo "generate-vs-engine: skipped (GVE=0)"
    elif [ "${PROBE:-0}" = 1 ]; then
      PROBE_CASES=float32,engine_float32,engine_bfloat16 timeout 200 python3 benchmarks/plans/gve_fp32_probe.py \
        "$OUT/probe" 60
    else
      timeout 200 python3 -m eval.bench generate-vs-engine --out "$OUT/gve.json" > "$OUT/gve.log" 2>&1
      echo "generate-vs-engine rc=$?"; tail -12 "$OUT/gve.log"
    fi
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh launch "${RUNS[@]}"
    if [ "${SUITE:-1}" = 1 ]; then
      bash benchmarks/plans/gpu_suite_background.sh
    fi
    if [ "${SWEEP31:-0}" = 1 ]; then
      for length in 2048 4096; do
        setsid nohup bash -c "timeout 1500 python3 -m eval.calibrate variants --method tidal --grid placement \
          --lengths $length ${DEV31[*]} --samples-dir $Q/issue31_dev --out $Q/place_$length --time-limit 1400 \
          --batch-size 16 \
          > $Q/place_$length.log 2>&1; echo \"placement $length rc=\$?\" >> $Q/rc.txt" > /dev/null 2>&1 < /dev/null &
      done
      echo "issue 31 placement sweep started (2K, 4K)"
    fi ;;
  wait)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh wait "${1:-60}"
    suite_summary
    sweep31_state ;;
  devrows)
    # shellcheck disable=SC2046
    OUT="$OUT/issue29" ROWS_PARALLEL=4 bash benchmarks/plans/issue29_serving_length.sh devrows ${DEVROWS:-$(rows_of)} ;;
  board31)
    # the pick over both lengths' records (scores nothing new: the records resume), then the test board
    mkdir -p "$Q/placement"
    for length in 2048 4096; do cp "$Q/place_$length/records.jsonl" "$Q/placement/records_$length.jsonl" 2>/dev/null; done
    timeout 120 python3 -m eval.calibrate variants --method tidal --grid placement --lengths 2048 4096 "${DEV31[@]}" \
      --samples-dir "$Q/issue31_dev" --out "$Q/placement" --time-limit 60 > "$Q/placement.log" 2>&1
    echo "pick rc=$?"; head -30 "$Q/placement/variants.md" 2>/dev/null
    [ "${BOARD31_PEERS:-1}" = 1 ] && board_row dense --settings dense
    for f in 1/8 1/4 1/2; do
      [ "${BOARD31_PEERS:-1}" = 1 ] && board_row "quest_${f/\//_}" --settings "quest@$f"
      [ -f "$Q/placement/variants.json" ] && board_row "tidal_calibrated_${f/\//_}" \
        --variants-from "$Q/placement/variants.json" --settings "tidal_calibrated@$f"
    done
    echo "issue 31 board started"
    if [ "${ISSUE32:-0}" = 1 ]; then  # issue 32: bf16 / FP8 / FP8 + recent keys on the same test samples, 2K / 4K
      setsid nohup env OUT="$Q/issue32" BATCH=16 bash benchmarks/plans/issue32_recent_keys.sh ruler \
        > "$Q/issue32.log" 2>&1 < /dev/null &
      echo "issue 32 board started"
    fi ;;
  podtidal)
    # issue 31's item 4: POD + TidalDecode on an adapted export (RUN, default the recall candidate), with the export
    # alone beside it, on the test board's samples; the calibrated pick too once board31 wrote it
    export_dir=/tmp/p29/runs/${1:-pod_8k_scores_recall}/export
    [ -f "$export_dir/config.json" ] || { echo "no export at $export_dir"; exit 1; }
    rows=(pod_adapted pod_adapted+tidal@1/8 pod_adapted+tidal@1/4)
    calibrated=()
    if [ -f "$Q/placement/variants.json" ]; then
      calibrated=(--variants-from "$Q/placement/variants.json")
      rows+=(pod_adapted+tidal_calibrated@1/8 pod_adapted+tidal_calibrated@1/4)
    fi
    board_row pod_tidal --pod-adapted "$export_dir" "${calibrated[@]}" --settings "${rows[@]}"
    echo "POD + TidalDecode board started: ${rows[*]}" ;;
  finish)
    # shellcheck disable=SC2046
    OUT="$OUT/issue29" ROWS_PARALLEL=${ROWS_PARALLEL:-4} bash benchmarks/plans/issue29_serving_length.sh rows $(rows_of)
    # shellcheck disable=SC2046
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh retrieval original $(rows_of)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh collect
    suite_summary
    [ -d /tmp/gpu_suite ] && (cd /tmp && tar czf "$OUT/gpu_suite.tgz" gpu_suite)
    collect31 ;;
  collect31)
    started=$(date +%s)
    while pgrep -f "eval.leaderboard --out $Q/board_" > /dev/null && [ $(( $(date +%s) - started )) -lt "${1:-0}" ]; do
      sleep 10
    done
    collect31 ;;
esac
