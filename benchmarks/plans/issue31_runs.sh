# Issue 31's RULER runs on one H200, sourced by issue31_32_h200.sh's `sweep` / `board` parts (OUT, Q=/tmp/p31 and
# the environment set there; the dev / test samples unpacked under $Q).
#
#   sweep  the variant sweep on the dev seed (104729: 13 tasks x 5 samples x 2K / 4K; TidalDecode's full grid at
#          budgets 1/4 and 1/8 of the context, Token Sparse's full grid), one process per method and length (the
#          135M model leaves the GPU mostly idle), then one `variants` run over the merged records that scores
#          nothing new and writes the pick: $Q/variants/variants.{json,md}.
#   board  the test seed (7919: 13 tasks x 20 samples x 2K / 4K / 8K): today's rows, the calibrated picks and Quest,
#          one process per row on its own copy of the samples; then FP8 against bf16 KV (issue 32) for dense,
#          TidalDecode and Quest at 2K / 4K.
#   board2 the rest of the test board: Quest at 1/4 and 1/2 (to judge the calibrated TidalDecode there), TidalDecode
#          and calibrated TidalDecode at 1/2 (needs $Q/variants/variants.json, or VARIANTS=<its path>).
#   adapted EXPORT  POD and POD + TidalDecode (today's and calibrated, 1/4 and 1/8) on an adapted POD export.
# Config defaults throughout (--no-calibrate; the sweep is not given a tidal / drift calibration), so that a
# calibrated row differs from today's only by the swept options.
DEV=(--seed 104729 --samples 5)
TEST=(--seed 7919 --samples 20)
case "$1" in
  sweep)
    sweep_one() {  # method length
      timeout 500 python3 -m eval.calibrate variants --method "$1" --lengths "$2" "${DEV[@]}" \
        --samples-dir "$Q/issue31_dev" --out "$Q/v_$1_$2" --grid full --time-limit 460 \
        > "$OUT/sweep_$1_$2.log" 2>&1
      echo "sweep $1 $2 rc=$?" >> "$OUT/rc.txt"
    }
    for method in tidal token_sparse; do
      for length in 2048 4096; do sweep_one "$method" "$length" & done
    done
    wait
    mkdir -p "$Q/variants"
    for method in tidal token_sparse; do
      for length in 2048 4096; do
        cp "$Q/v_${method}_${length}/records.jsonl" "$Q/variants/records_${method}_${length}.jsonl" 2>/dev/null
      done
    done
    timeout 90 python3 -m eval.calibrate variants --method both --lengths 2048 4096 "${DEV[@]}" \
      --samples-dir "$Q/issue31_dev" --out "$Q/variants" --grid full --time-limit 60 > "$OUT/sweep_pick.log" 2>&1
    echo "sweep pick rc=$?" >> "$OUT/rc.txt"
    cat "$OUT/rc.txt"; tail -3 "$OUT"/sweep_*.log
    mkdir -p "$OUT/variants"
    cp "$Q"/variants/variants.{json,md} "$OUT/variants/" 2>/dev/null
    (cd "$Q/variants" && tar czf "$OUT/variants/records.tgz" records*.jsonl)
    cat "$OUT/variants/variants.md" 2>/dev/null | head -60 ;;
  board)
    board_row() {  # name, leaderboard arguments...
      local name=$1; shift
      rm -rf "$Q/board_$name"; cp -r "$Q/issue31_test" "$Q/board_$name"
      timeout 540 python3 -m eval.leaderboard --out "$Q/board_$name" "${TEST[@]}" --no-calibrate "$@" \
        > "$OUT/board_$name.log" 2>&1
      echo "board $name rc=$?" >> "$OUT/rc.txt"
      mkdir -p "$OUT/board/$name"
      cp "$Q/board_$name"/*.{json,md} "$OUT/board/$name/" 2>/dev/null
      rm -f "$OUT/board/$name"/samples_*.json
      cp "$Q/board_$name"/records*.jsonl "$OUT/board/$name/" 2>/dev/null
    }
    picks=()
    [ -f "$Q/variants/variants.json" ] && picks=(--variants-from "$Q/variants/variants.json")
    L3=(--lengths 2048 4096 8192)
    board_row dense "${L3[@]}" --settings dense &
    for s in tidal@1/4 tidal@1/8 quest@1/8 token_sparse@0.005; do
      board_row "${s//[@\/]/_}" "${L3[@]}" --settings "$s" &
    done
    if [ ${#picks[@]} -gt 0 ]; then
      for s in tidal_calibrated@1/4 tidal_calibrated@1/8 token_sparse_calibrated; do
        board_row "${s//[@\/]/_}" "${L3[@]}" "${picks[@]}" --settings "$s" &
      done
    fi
    board_row fp8 --lengths 2048 4096 --kv-cache-dtype fp8_e4m3 --settings dense tidal@1/8 quest@1/8 &
    wait
    cat "$OUT/rc.txt"; grep -h "Error\|error" "$OUT"/board_*.log | tail -10
    (cd "$OUT" && tar czf board_logs.tgz board_*.log && rm -f board_*.log) ;;
  board2|adapted)
    board_row() {  # name, leaderboard arguments...
      local name=$1; shift
      rm -rf "$Q/board_$name"; cp -r "$Q/issue31_test" "$Q/board_$name"
      timeout 560 python3 -m eval.leaderboard --out "$Q/board_$name" "${TEST[@]}" --no-calibrate "$@" \
        > "$OUT/board_$name.log" 2>&1
      echo "board $name rc=$?" >> "$OUT/rc.txt"
      mkdir -p "$OUT/board/$name"
      cp "$Q/board_$name"/*.{json,md} "$OUT/board/$name/" 2>/dev/null
      rm -f "$OUT/board/$name"/samples_*.json
      cp "$Q/board_$name"/records*.jsonl "$OUT/board/$name/" 2>/dev/null
    }
    variants=${VARIANTS:-$Q/variants/variants.json}
    picks=(); [ -f "$variants" ] && picks=(--variants-from "$variants")
    L3=(--lengths 2048 4096 8192)
    if [ "$1" = board2 ]; then
      for s in quest@1/4 quest@1/2 tidal@1/2; do board_row "${s//[@\/]/_}" "${L3[@]}" --settings "$s" & done
      [ ${#picks[@]} -gt 0 ] && board_row tidal_calibrated_1_2 "${L3[@]}" "${picks[@]}" --settings tidal_calibrated@1/2 &
    else
      export_dir=$2
      board_row "adapted_$(basename "$(dirname "$export_dir")")" "${L3[@]}" "${picks[@]}" --pod-adapted "$export_dir" \
        --fractions 1/4 1/8 --settings pod_adapted pod_adapted+tidal@1/4 pod_adapted+tidal@1/8 \
        pod_adapted+tidal_calibrated@1/4 pod_adapted+tidal_calibrated@1/8 --batch-size 64 &
    fi
    wait
    cat "$OUT/rc.txt"; grep -h "Error\|error" "$OUT"/board_*.log | tail -10
    (cd "$OUT" && tar czf "board_logs_$1.tgz" board_*.log && rm -f board_*.log) ;;
esac
