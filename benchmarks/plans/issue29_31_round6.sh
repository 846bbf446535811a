#!/usr/bin/env bash
# The next GPU session (written 2026-12-06 after the third session of that day), one part per device call, the calls
# back to back (the machine is given back after 30 s idle). Inputs: benchmarks/plans/prep_8k_inputs.sh and
# `python -m eval.leaderboard --generate-only` (outputs/issue31_test.tgz) on the CPU machine, then the three stage
# calls of benchmarks/plans/device_2026-12-06.sh (the tracked dated benchmark folders moved out of the tree for them).
#
#   start    issue 29: the shipped 8K recipe, the recall candidate and the recall candidate with learned units, trained
#            side by side (issue29_serving_length.sh launch; the fourth and fifth rounds' control with the recall
#            rows is already scored), and the GPU suite beside them (SUITE=0 leaves it out)
#   board31  (once the trainings are done: three trainings, the suite and two sweeps at once ran out of an H100's
#            memory on 2026-12-06) issue 31 in the background, test seed, one process per row: the calibrated TidalDecode (the union with
#            its re-selection layer at 14, benchmarks/h100_2026-12-06/issue31_placement) at 1/2; Token Sparse today's
#            and calibrated, and dense, with the question prefilled (eval.leaderboard --question-phase prefill: what
#            the Token Sparse paper's RULER setting prefills); then the e2e decode time of the new pick beside
#            today's TidalDecode and the first pick (128K x 1 and x 4, Llama-3-8B shape: on an H200 only, since
#            128K x 4 does not fit an H100); with TS_SWEEP=1 Token Sparse's full grid again on the dev seed at the
#            issue's 10 samples per task (the 2026-12-03 sweep had 5), one process per length; with ISSUE32=1 issue
#            32's RULER rows (issue32_recent_keys.sh ruler: bf16, FP8 and FP8 + recent keys)
#   e2e [S]  the pick's e2e decode time alone on the GPU (H200), when board31 ran with E2E31=0
#   ts_sweep [S]  the Token Sparse grid alone (what board31 starts with TS_SWEEP=1), S seconds per length
#   wait S   the trainings' progress after at most S seconds, the suite's summary, the board's processes
#   choose   the wide dev split (13 tasks x 10, seed 104729) of the three exports, then the pre-registered rule of
#            benchmarks/plans/issue29_choose.py (the shipped setting stays unless beaten by >= 1 point); prints the
#            pick; then, in the background, issue 31's POD + TidalDecode rows on the shipped setting's export (the
#            export alone, POD + TidalDecode at 1/8 and 1/4, today's and calibrated; test seed)
#   finish   the test split of the pick (its weights run densely, and POD decode with the shared units' distant
#            part skipped: the needle-distance ablation) and of the shipped setting, the pass-key /
#            needle rows, the runs' curves and logs, issue 31's board and e2e, all under $OUT
set -u
part=${1:-}; shift || true
case "$part" in
  start|board31|e2e|ts_sweep|wait|choose|finish) ;;
  *) echo "unknown part '$part'; allowed: start, board31, e2e, ts_sweep, wait, choose, finish" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/round6}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/p29/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PODKIT_CACHE=/tmp/p29/cache \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RUNS=(pod_8k_scores pod_8k_scores_recall pod_8k_scores_recall_auto)
Q=/tmp/p31
PICK=benchmarks/h100_2026-12-06/issue31_placement/placement/variants.json     # TidalDecode's pick (layer 14)
TOKEN_SPARSE_PICK=benchmarks/h200_2026-12-03/issue31/variants.json           # Token Sparse's (window 256)
E2E=/tmp/e2e31
board_row() {  # name, leaderboard arguments...: one test-board row in the background
  local name=$1; shift
  rm -rf "$Q/board_$name"; cp -r "$Q/issue31_test" "$Q/board_$name"
  setsid nohup bash -c "timeout 900 python3 -m eval.leaderboard --out $Q/board_$name --seed 7919 --samples 20 \
    --no-calibrate --lengths 2048 4096 8192 --batch-size 32 $* > $Q/board_$name.log 2>&1; \
    echo \"board $name rc=\$?\" >> $Q/rc.txt" > /dev/null 2>&1 < /dev/null &
}
e2e_pick() {  # time budget (s) -> the command line of the pick's e2e decode time beside today's TidalDecode
  mkdir -p "$E2E"
  echo "timeout $(( $1 + 80 )) python3 -m eval.bench e2e --sections decode --rows ${E2E_ROWS:-131072x1 131072x4} --schemes tidal \
    --variants tidal:tidal_selection=all_union 'tidal:tidal_selection=all_union:tidal_selection_layers=[2,14]' \
    --time-budget-s $1 --out $E2E/e2e_pick.json > $E2E/e2e_pick.log 2>&1"
}
ts_sweep() {  # time limit (s): Token Sparse's full grid at the issue's 10 samples per task, one process per length
  for length in 2048 4096; do
    setsid nohup bash -c "timeout $(( $1 + 100 )) python3 -m eval.calibrate variants --method token_sparse --grid full \
      --lengths $length --seed 104729 --samples 10 --samples-dir $Q/issue31_dev --out $Q/ts_sweep_$length \
      --batch-size 16 --time-limit $1 > $Q/ts_sweep_$length.log 2>&1; echo \"ts sweep $length rc=\$?\" >> $Q/rc.txt" \
      > /dev/null 2>&1 < /dev/null &
  done
}
case "$part" in
  start)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh launch "${RUNS[@]}"
    if [ "${SUITE:-1}" = 1 ]; then
      bash benchmarks/plans/gpu_suite_background.sh
    fi ;;
  board31)
    for d in issue31_test issue31_dev; do
      [ -d "$Q/$d" ] || { echo "no $Q/$d: run device_2026-12-06.sh stage first"; exit 1; }
    done
    board_row tidal_calibrated_1_2 --variants-from "$PICK" --settings tidal_calibrated@1/2
    board_row prefill_token_sparse --question-phase prefill --variants-from "$TOKEN_SPARSE_PICK" \
      --settings dense token_sparse@0.005 token_sparse_calibrated
    # 128K x 4 needs about 85 GB (16 GB of weights, 69 GB of bf16 KV): an H200 only
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    # E2E31=0 leaves it for a later call, alone on the GPU (its ratios are timings)
    if [ "${E2E31:-1}" = 0 ]; then
      echo "e2e of the pick: not now (E2E31=0)"
    elif [ "${gpu_mib:-0}" -ge 100000 ]; then
      setsid nohup bash -c "$(e2e_pick 420); echo \"e2e rc=\$?\" >> $Q/rc.txt" > /dev/null 2>&1 < /dev/null &
    else
      echo "e2e of the pick skipped: ${gpu_mib} MiB of GPU memory, 128K x 4 needs an H200"
    fi
    [ "${TS_SWEEP:-0}" = 1 ] && ts_sweep 1100  # about 18 minutes of two processes: only when the session has the time
    if [ "${ISSUE32:-0}" = 1 ]; then  # issue 32's RULER rows: bf16, FP8 and FP8 + recent keys, dense / tidal / quest
      setsid nohup bash -c "OUT=$Q/issue32 BATCH=16 bash benchmarks/plans/issue32_recent_keys.sh ruler \
        > $Q/issue32.log 2>&1; echo \"issue32 rc=\$?\" >> $Q/rc.txt" > /dev/null 2>&1 < /dev/null &
    fi
    echo "issue 31 board started (e2e on an H200, TS_SWEEP=1 the Token Sparse sweep, ISSUE32=1 issue 32's rows)" ;;
  e2e)  # the pick's e2e decode time beside today's TidalDecode, in the foreground (nothing else on the GPU)
    bash -c "$(e2e_pick "${1:-420}")"
    echo "e2e rc=$?"; tail -12 "$E2E/e2e_pick.log"; cp "$E2E"/e2e_pick.* "$OUT/" 2>/dev/null ;;
  ts_sweep)  # Token Sparse's full grid on the dev seed in the background, one process per length: [time limit]
    ts_sweep "${1:-1100}" ;;
  wait)
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh wait "${1:-60}"
    if [ -f /tmp/gpu_suite/summary.txt ]; then cat /tmp/gpu_suite/summary.txt; else echo "GPU suite: not finished"; fi
    pgrep -fa "eval.leaderboard --out $Q/board_|eval.bench e2e|eval.calibrate variants" | cut -c1-120
    cat "$Q/rc.txt" 2>/dev/null ;;
  choose)
    OUT="$OUT/issue29" ROWS_PARALLEL=3 bash benchmarks/plans/issue29_serving_length.sh devrows "${RUNS[@]}"
    python3 benchmarks/plans/issue29_choose.py "$OUT/issue29/devrows.tgz"
    export_dir=/tmp/p29/runs/pod_8k_scores/export
    if [ -f "$export_dir/config.json" ]; then
      board_row pod_tidal --pod-adapted "$export_dir" --variants-from "$PICK" --settings pod_adapted \
        pod_adapted+tidal@1/8 pod_adapted+tidal@1/4 pod_adapted+tidal_calibrated@1/8 pod_adapted+tidal_calibrated@1/4
      echo "POD + TidalDecode rows started on $export_dir"
    fi ;;
  finish)
    pick=$(python3 -c "import json; print(json.load(open('$OUT/issue29/choice.json'))['pick'])" 2>/dev/null)
    [ -n "$pick" ] || { echo "no pick in $OUT/issue29/choice.json: run the choose part first"; exit 1; }
    rows=(pod_8k_scores "$pick" "$pick:dense" "$pick:proximal")
    [ "$pick" = pod_8k_scores ] && rows=(pod_8k_scores pod_8k_scores:dense pod_8k_scores:proximal pod_8k_scores_recall)
    OUT="$OUT/issue29" ROWS_PARALLEL=3 bash benchmarks/plans/issue29_serving_length.sh rows "${rows[@]}"
    served=(); for row in "${rows[@]}"; do case "$row" in *:proximal) ;; *) served+=("$row") ;; esac; done
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh retrieval "${served[@]}"
    OUT="$OUT/issue29" bash benchmarks/plans/issue29_serving_length.sh collect
    [ -d /tmp/gpu_suite ] && (cd /tmp && tar czf "$OUT/gpu_suite.tgz" gpu_suite)
    (cd "$Q" && tar czf "$OUT/issue31.tgz" --ignore-failed-read board_*/*.md board_*/leaderboard.json \
      board_*/records*.jsonl board_*.log issue32 issue32.log ts_sweep_*/records*.jsonl ts_sweep_*/variants.* ts_sweep_*.log rc.txt \
      2>/dev/null)
    cp "$E2E"/e2e_pick.* "$OUT/" 2>/dev/null
    ls -la "$OUT" ;;
esac
