#!/usr/bin/env bash
# Issue 29 on one H200, second round: POD trained at the serving length (the 8K recipe), units chosen by learned
# gates (pod.protect_units: auto), LoRA and v1's score sharing, each beside the dense fine-tune control trained the same way, scored on the
# test split (13 tasks x 20 samples at 2K / 4K / 8K). Runs are started in the background so that a later device
# call (carrying the next inputs) does not wait for them, and they resume from their last checkpoint if a call's
# end took them down.
#
#   probe_start / probe_check   whether a background process outlives its call (the answer decides nothing here:
#                               `launch` restarts what is not running, resuming from checkpoints)
#   launch NAME...              start the named runs that have no export and are not running (see `settings`;
#                               next: pod_8k_recall_kv20 / 25 / 35, the trade-off curve of the shipped setting)
#   wait SECONDS                wait for the launched runs (at most SECONDS), then print their progress
#   rows ROW...                 score rows on the test split: RUN (its export), RUN:dense (POD's weights run densely)
#                               or RUN:proximal (POD decode, shared units without their distant part)
#   devrows ROW...              the same rows on the wide dev split (all 13 tasks x 10 samples, seed 104729, samples
#                               from outputs/ruler_samples_devwide.tgz, made on the CPU machine by ruler_samples.py
#                               with those dev overrides and checked disjoint from the test split): what a choice
#                               between candidates is made on when the learning curve's 6 x 5 dev split ties
#   retrieval ROW...            the pass-key and needle target (podkit_passkey / podkit_needle at 2K and 4K x 10 depths,
#                               scored as eval.chain's lm-eval run scores them: issue29_retrieval_row.py); ROW is
#                               `original`, RUN or RUN:dense, one process at a time (each takes well under a minute)
#   collect                     tar what the runs wrote (curves, losses, maps, gates, logs) under $OUT
#   bench                       alone on the GPU, before any `launch` (one call, about 9 minutes): the decode cost of
#                               score sharing, which the recipes ship since 2026-12-04, beside key sharing (eval.bench
#                               e2e, random-init Llama-3-8B shape, no staged input), then generate() against the
#                               engine on the embedded model (issue 33; needs the staged GGUF)
#
# Inputs are staged by issue29_control_vs_pod.sh stage (wheels, GGUF parts, token shards, RULER samples).
set -u
part=${1:-}; shift || true
case "$part" in
  probe_start|probe_check|launch|wait|rows|devrows|retrieval|collect|bench) ;;
  *) echo "unknown part '$part'; allowed: probe_start, probe_check, launch, wait, rows, devrows, retrieval, collect, bench" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/issue29_serving_length}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
P=/tmp/p29; RUNS=$P/runs; mkdir -p "$RUNS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$P/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PODKIT_CACHE="$P/cache" \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
common=(long_context.samples_dir="$P/ruler_samples" train.save_total_limit=1 pod.sharing=keys)
# the wide dev split's tasks: every RULER task (train/long_context_eval/ruler.py's TASKS)
DEV_WIDE="long_context.dev_tasks=[$(python3 -c "from train.long_context_eval.ruler import TASKS; print(','.join(TASKS))" 2>/dev/null)]"
# pod.sharing=keys: what these runs measured (the recipes' default until 2026-12-04; they ship scores since);
# a run that measures score sharing says pod.sharing=scores, which comes later on its command line and wins

# the 8K recipe's data.train before 2026-12-06 (recipes/smollm2_135m_gpu_8k.yaml without podkit:recall-long, which
# it ships since): every 8K run below trains on it unless its overrides name another data.train, so the run names
# keep the meaning their BENCHMARKS.md rows give them
MIX_8K=$(python3 -c "from train.recipe import load_recipe; print(load_recipe('recipes/smollm2_135m_gpu_8k.yaml', check_environment=False).data.train.replace(',podkit:recall-long=1', ''))" 2>/dev/null)

settings() {  # name -> recipe, token cache and overrides (globals RECIPE, TOKENS, OVR)
  local r2=recipes/smollm2_135m_gpu.yaml r8=recipes/smollm2_135m_gpu_8k.yaml
  case "$1" in
    control_8k)  RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(train.attention=dense eval.every_steps=1000 train.save_steps=250) ;;
    pod_8k)      RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(eval.every_steps=1000 train.save_steps=250) ;;
    # the gates see 4K episodes (8 of them): 8K ones would cost 4x the 2K recipe's gate optimisation
    pod_8k_auto) RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(pod.protect_units=auto "pod.unit_selection={length: 4096, samples: 8}"
                                                      eval.every_steps=1000 train.save_steps=250) ;;
    pod_auto)    RECIPE=$r2 TOKENS=$P/tokens OVR=(pod.protect_units=auto eval.every_steps=400 train.save_steps=100) ;;
    # LoRA instead of full fine-tuning (the issue's candidate: less of the model moves); peft's usual 5x learning rate
    pod_lora)    RECIPE=$r2 TOKENS=$P/tokens OVR=(train.method=lora train.learning_rate=5.0e-4 eval.every_steps=400
                                                  train.save_steps=100) ;;
    # POD v1's score sharing (member layers reuse the anchor's distant logits q_a . k_a): zero-shot it keeps far
    # more of the dev split's answers than key sharing (benchmarks/plans/pod_sharing_probe.py); scored through the
    # model's own cache, since the engine implements key sharing only
    pod_scores)  RECIPE=$r2 TOKENS=$P/tokens OVR=(pod.sharing=scores eval.every_steps=400 train.save_steps=100) ;;
    # the two levers measured so far together: training at the serving length with score sharing
    pod_8k_scores) RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(pod.sharing=scores eval.every_steps=1000 train.save_steps=250) ;;
    # the 8K recipe as shipped since 2026-12-04 (score sharing) with units chosen by gates learned under score sharing
    # (no task that is reported ranks them), against pod_8k_scores' pass-key-ranked four units
    pod_8k_scores_auto) RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(pod.sharing=scores pod.protect_units=auto
                                                             "pod.unit_selection={length: 4096, samples: 8}"
                                                             eval.every_steps=1000 train.save_steps=250) ;;
    # long-range training data that is not RULER's: 13% of the rows are podkit:recall-long episodes (facts 1.7K+
    # tokens before their question, train/corpus/recall.py), the rest the recipe's mixture; staged by
    # issue29_control_vs_pod.sh stage from outputs/tokens_recall_long_8k.tgz (merged into the 8K token cache)
    pod_8k_scores_recall) RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(pod.sharing=scores "data.train=$MIX_8K,podkit:recall-long=1"
                                                               eval.every_steps=1000 train.save_steps=250) ;;
    # the fourth round's follow-ups (BENCHMARKS.md "Long-range training data and learned units at the serving
    # length"): the recall candidate's own dense control (same data, steps, optimizer and objective), and the two
    # levers of that round together
    control_8k_recall) RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(train.attention=dense "data.train=$MIX_8K,podkit:recall-long=1"
                                                           eval.every_steps=1000 train.save_steps=250) ;;
    pod_8k_scores_recall_auto) RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(pod.sharing=scores "data.train=$MIX_8K,podkit:recall-long=1"
                                                                   pod.protect_units=auto
                                                                   "pod.unit_selection={length: 4096, samples: 8}"
                                                                   eval.every_steps=1000 train.save_steps=250) ;;
    # the trade-off curve at the serving length with score sharing: RULER against KV saved (the shipped run is the
    # 30% point; the paper's figure is 35%); pod.kv_saving sets the map's saving, min_kv_saving only lowers delta
    pod_8k_scores_kv20|pod_8k_scores_kv25|pod_8k_scores_kv35)
      RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(pod.sharing=scores "pod.kv_saving=0.${1##*_kv}" pod.min_kv_saving=null
                                          eval.every_steps=1000 train.save_steps=250) ;;
    # the same curve for the setting shipped since 2026-12-06 (13% podkit:recall-long rows): what capacity buys back
    # (BENCHMARKS.md "The recall rows ship": the gap to the control is the shared units' missing distant keys)
    pod_8k_recall_kv20|pod_8k_recall_kv25|pod_8k_recall_kv35)
      RECIPE=$r8 TOKENS=$P/tokens_8k OVR=(pod.sharing=scores "data.train=$MIX_8K,podkit:recall-long=1"
                                          "pod.kv_saving=0.${1##*_kv}" pod.min_kv_saving=null
                                          eval.every_steps=1000 train.save_steps=250) ;;
    *) return 1 ;;
  esac
}

running() { [ -f "$RUNS/$1.pid" ] && kill -0 "$(cat "$RUNS/$1.pid")" 2>/dev/null; }

case "$part" in
  probe_start)
    setsid nohup bash -c 'for i in $(seq 1 900); do date +%s > /tmp/bg_probe; sleep 1; done' >/dev/null 2>&1 < /dev/null &
    echo "probe started at $(date +%s)" | tee "$OUT/probe.txt" ;;
  probe_check)
    now=$(date +%s); last=$(cat /tmp/bg_probe 2>/dev/null || echo 0)
    echo "probe last beat $(( now - last )) s ago (alive if <= 2)" | tee -a "$OUT/probe.txt" ;;
  launch)
    for name in "$@"; do
      settings "$name" || { echo "unknown run '$name'" >&2; exit 2; }
      [ "$RECIPE" = recipes/smollm2_135m_gpu_8k.yaml ] && OVR=("data.train=$MIX_8K" "${OVR[@]}")  # a later data.train wins
      if [ -f "$RUNS/$name/export/config.json" ]; then echo "$name: exported"; continue; fi
      if running "$name"; then echo "$name: running"; continue; fi
      [ -d "$TOKENS" ] || { echo "$name: no token shards at $TOKENS, not started"; continue; }
      resume=()
      ls -d "$RUNS/$name"/checkpoint-* >/dev/null 2>&1 && resume=(train.resume_from_checkpoint=auto)
      cmd=$(printf '%q ' env PODKIT_TOKEN_CACHE="$TOKENS" timeout 1700 python3 train/pod.py "$RECIPE" \
        --stages explore,train,export train.output_dir="$RUNS/$name" "${common[@]}" "${resume[@]}" "${OVR[@]}")
      setsid nohup bash -c "$cmd; echo \"$name rc=\$?\" >> '$RUNS/rc.txt'" >> "$RUNS/$name.train.log" 2>&1 < /dev/null &
      echo $! > "$RUNS/$name.pid"
      echo "$name: started: $cmd"
    done ;;
  wait)
    limit=${1:-60}; started=$(date +%s)
    while [ $(( $(date +%s) - started )) -lt "$limit" ]; do
      alive=0
      for pidf in "$RUNS"/*.pid; do [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null && alive=$((alive + 1)); done
      [ "$alive" -eq 0 ] && break
      sleep 10
    done
    for log in "$RUNS"/*.train.log; do
      [ -f "$log" ] || continue
      name=$(basename "$log" .train.log)
      state=done; running "$name" && state=running
      echo "== $name ($state): $(grep -o 'step [0-9]*/[0-9]*' "$log" | tail -1)"
      grep "\[units\] [0-9]* unit\|\[curve\] step\|\[train\] \|\[export\]\|Error" "$log" | tail -4 | cut -c1-400
    done
    cat "$RUNS/rc.txt" 2>/dev/null
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  rows|devrows)
    # ROW is RUN (its export as exported) or RUN:dense (POD's weights run densely), scored in the order given,
    # ROWS_PARALLEL at a time (nine 8K rows at batch 64 do not fit in one H200's memory together)
    folder=$part; split=(long_context.samples_dir="$P/ruler_samples")
    [ "$part" = devrows ] && split=(split=dev long_context.samples_dir="$P/ruler_samples_devwide" "$DEV_WIDE"
                                    long_context.dev_samples=10)
    mkdir -p "$OUT/$folder"
    score() {  # row name, model, output, [dense]
      if [ ! -f "$2/config.json" ]; then echo "$1: no export at $2, skipped"; return; fi
      PYTHONPATH="$PWD:$PYTHONPATH" timeout 560 python3 benchmarks/plans/issue29_score_row.py "$@" \
        "${split[@]}" long_context.batch_size=64 > "$OUT/$folder/$1.log" 2>&1
      echo "$1 rc=$?"
    }
    started=$(date +%s)
    for row in "$@"; do
      while [ "$(jobs -rp | wc -l)" -ge "${ROWS_PARALLEL:-4}" ]; do sleep 2; done
      run=${row%%:*}
      case "$row" in
        *:dense) score "${run}_dense" "$RUNS/$run/export" "$OUT/$folder/${run}_dense.json" dense & ;;
        # POD decode with every shared unit's distant part skipped (its sink + recent window only; anchor units read
        # everything): does the merge cost near needles? (BENCHMARKS.md, "The recall candidate against its own
        # dense control")
        *:proximal) score "${run}_proximal" "$RUNS/$run/export" "$OUT/$folder/${run}_proximal.json" \
                      sparse:pod_gate_tau=0.000001 & ;;
        *) score "$run" "$RUNS/$run/export" "$OUT/$folder/$run.json" & ;;
      esac
    done
    wait
    echo "$folder wall $(( $(date +%s) - started )) s" | tee "$OUT/$folder/wall.txt"
    grep -h "s$\|Error" "$OUT/$folder"/*.log | tail -30
    (cd "$OUT" && tar czf "$folder.tgz" "$folder" && rm -rf "$folder") ;;
  bench)
    timeout 390 python3 -m eval.bench e2e --sections decode --rows 32768x1 131072x1 131072x4 --hf-rows \
      --schemes podkit-dense pod tidal pod+tidal --variants pod:pod_sharing=scores pod+tidal:pod_sharing=scores \
      --time-budget-s 360 --out "$OUT/e2e_scores.json" > "$OUT/e2e_scores.log" 2>&1
    echo "e2e rc=$?"; tail -12 "$OUT/e2e_scores.log"
    timeout 200 python3 -m eval.bench generate-vs-engine --out "$OUT/gve.json" > "$OUT/gve.log" 2>&1
    echo "generate-vs-engine rc=$?"; tail -8 "$OUT/gve.log" ;;
  retrieval)
    mkdir -p "$OUT/retrieval"
    for row in "$@"; do
      run=${row%%:*}; model="$RUNS/$run/export"; name=$run; dense=()
      [ "$row" = original ] && model=original
      case "$row" in
        *:dense) name=${run}_dense; dense=(dense) ;;
        *:*) echo "$row: the retrieval rows take RUN or RUN:dense, skipped"; continue ;;
      esac
      if [ "$model" != original ] && [ ! -f "$model/config.json" ]; then echo "$row: no export, skipped"; continue; fi
      (PYTHONPATH="$PWD:$PYTHONPATH" timeout 300 python3 benchmarks/plans/issue29_retrieval_row.py "$name" "$model" \
        "$OUT/retrieval/$name.json" "${dense[@]}" > "$OUT/retrieval/$name.log" 2>&1
       echo "$name rc=$?"; grep podkit_ "$OUT/retrieval/$name.log") &  # the rows side by side: one GPU, small model
    done
    wait
    (cd "$OUT" && tar czf retrieval.tgz retrieval && rm -rf retrieval) ;;
  collect)
    (cd "$RUNS" && tar czf "$OUT/runs.tgz" --ignore-failed-read ./*.train.log rc.txt \
      ./*/learning_curve.json ./*/learning_curve.png ./*/losses.jsonl ./*/train_metrics.json \
      ./*/export/pod_blocks.json ./*/export/README.md ./*/exploration/unit_gates.json ./*/exploration/unit_gates.png \
      2>/dev/null)
    ls -la "$OUT" ;;
esac
