#!/usr/bin/env bash
# The RULER leaderboard (issue 14) on a 2-GPU machine within one time budget, as measured on 2 x H200
# (BENCHMARKS.md, "RULER leaderboard"): GPU 0 runs podkit's rows (python -m eval.leaderboard: dense, TidalDecode,
# Quest, StreamingLLM at 1/2..1/16, Token Sparse, POD zero-shot; engine, bf16); GPU 1 runs kvpress's 6 presses x 4
# ratios + the no-press check (python -m eval.peers_kvpress in kvpress's own environment, GPU1_WORKERS processes
# sharing the samples through a claims folder); once podkit's rows are done, GPU0_WORKERS more kvpress processes
# join on GPU 0. Samples per task go in passes (PASSES, e.g. "10 20"); every process stops starting samples at STOP
# seconds and is killed by its timeout soon after. Resumable: records already in B are skipped.
#   B=outputs/leaderboard WHEELS=.peers-wheels OUT=outputs/leaderboard_out LENGTHS="2048" scripts/leaderboard_gpu.sh
# B must hold the samples (python -m eval.leaderboard --generate-only --lengths L --samples N --out B, on any
# machine); WHEELS kvpress's wheels for an offline machine (scripts/peers_env.sh --download WHEELS). ENV_SH: a file
# to source first (the device's package paths). Out: $OUT/leaderboard.{md,png,json} and ruler_board.tgz.
# CPU dry run: PY=.venv/bin/python PODKIT_ARGS="--tasks niah_single_1 --max-new-tokens 4 --engine" \
#   OUT=/tmp/ruler_dry/out B=/tmp/ruler_dry/board scripts/leaderboard_gpu.sh
T0=$(date +%s)
[ -n "${ENV_SH:-}" ] && source "$ENV_SH" >/dev/null 2>&1
export TQDM_DISABLE=1 PODKIT_TRITON_AUTOTUNE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}; B=${B:-outputs/leaderboard}; WHEELS=${WHEELS:-.peers-wheels}; STOP=${STOP:-470}; PASSES=${PASSES:-"10 20"}
GPU1_WORKERS=${GPU1_WORKERS:-10}; GPU0_WORKERS=${GPU0_WORKERS:-6}; LENGTHS=${LENGTHS:-"2048 4096"}
LOGS=/tmp/ruler_logs; CLAIMS=/tmp/ruler_claims; PEERS=${PEERS:-/tmp/ruler_peers}
OUT=${OUT:-$B/out}
rm -rf $LOGS $CLAIMS; mkdir -p $LOGS $OUT
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( STOP - $(now) )); }
say() { echo "[$(now)s] $*" | tee -a $LOGS/ruler.log; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader -l 20 > $LOGS/smi.log 2>&1 &
SMI=$!
M=$(timeout 120 $PY -c "from sparse_models.smollm2 import default_model_path; print(default_model_path())" 2>$LOGS/model.err | tail -1)
[ -f "$M/config.json" ] || { say "no model ($M): install the GGUF first"; tail -5 $LOGS/model.err; kill $SMI; exit 1; }
say "model $M; samples: $(ls $B/samples_*.json | xargs -n1 basename | tr '\n' ' '); records: $(cat $B/records*.jsonl 2>/dev/null | wc -l)"

podkit() {
  for S in $PASSES; do
    T=$(left); [ $T -gt 30 ] || break
    CUDA_VISIBLE_DEVICES=0 timeout $((T + 40)) $PY -m eval.leaderboard --lengths $LENGTHS --samples $S \
      --calibration-from benchmarks/results/fidelity_smollm2 --out $B --time-limit $T $PODKIT_ARGS >> $LOGS/podkit.log 2>&1
    say "podkit pass $S: rc=$?"
  done
}
worker() {  # worker NAME GPU
  for S in $PASSES; do
    T=$(left); [ $T -gt 20 ] || break
    CUDA_VISIBLE_DEVICES=$2 OMP_NUM_THREADS=2 PYTHONPATH=$PEERS_PATH timeout $((T + 30)) $PEERPY -m eval.peers_kvpress \
      --out $B --model "$M" --lengths $LENGTHS --samples $S --records records_kvpress_$1.jsonl --claim-dir $CLAIMS \
      --time-limit $T $PEER_ARGS >> $LOGS/kvpress_$1.log 2>&1
    echo "[$(now)s] pass $S rc=$?" >> $LOGS/kvpress_$1.log
  done
}

( podkit; say "podkit done"
  if [ $(left) -gt 60 ]; then for _ in $(seq 60); do [ -f $LOGS/peers.env ] && break; sleep 2; done; source $LOGS/peers.env; for i in $(seq 1 $GPU0_WORKERS); do worker g0w$i 0 & done; fi
  wait ) &
PIDS=$!
# kvpress's env: a venv over the image's torch with the carried transformers 5.2 (scripts/peers_env.sh), else
# the wheels in a --target folder ahead of the image's packages
PEERPY=$PEERS/bin/python; PEERS_PATH=$PWD
if ! PYTHONPATH=$PWD PYTHON=$PY timeout 150 scripts/peers_env.sh --offline $WHEELS $PEERS > $LOGS/peers_env.log 2>&1; then
  PEERPY=$PY; PEERS_PATH=/tmp/ruler_peers_site:$PWD
  timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/ruler_peers_site $WHEELS/*.whl >> $LOGS/peers_env.log 2>&1
fi
echo "PEERPY=$PEERPY; PEERS_PATH=$PEERS_PATH" > $LOGS/peers.env
PYTHONPATH=$PEERS_PATH timeout 90 $PEERPY -c "from eval.peers_kvpress import import_kvpress; import transformers; import_kvpress(); print('kvpress env ok:', transformers.__version__, transformers.__file__)" 2>&1 | tail -2 | tee -a $LOGS/ruler.log
for i in $(seq 1 $GPU1_WORKERS); do worker g1w$i 1 & PIDS="$PIDS $!"; done
wait $PIDS
say "all processes done"
timeout 30 $PY -m eval.leaderboard --replot --out $B > $LOGS/replot.log 2>&1; say "replot rc=$?"
kill $SMI 2>/dev/null
cp $B/leaderboard.md $B/leaderboard.png $B/leaderboard.json $OUT/ 2>/dev/null
tar czf $OUT/ruler_board.tgz --exclude='samples_*.json' --exclude=peer_checkpoint -C $B . -C /tmp ruler_logs
# the summary
for f in $B/records*.jsonl; do printf '%s %s | ' "$(basename $f .jsonl | sed 's/records_kvpress_//')" "$(wc -l < $f)"; done; echo
grep -h -E "Traceback|Error|FAILED|rc=[1-9]" $LOGS/*.log | sort | uniq -c | sort -rn | head -12
grep -E "^\[" $LOGS/podkit.log | tail -4; tail -4 $LOGS/smi.log
timeout 20 $PY - "$B/leaderboard.json" <<'EOF'
import json, sys
board = json.load(open(sys.argv[1]))
print(f"{'setting':28} {'len':>5} {'kept':>6} {'read':>6} {'avg':>6} {'n':>4}  categories")
for setting, lengths in board["summary"].items():
    for length, e in sorted(lengths.items()):
        cats = " ".join(f"{c[:5]} {v:.0f}" for c, v in e["categories"].items())
        print(f"{setting:28} {length:>5} {e['kv_kept']:6.3f} {e['kv_read']:6.3f} {e['average']:6.1f} {e['n']:4d}  {cats}")
losses = board.get("losses", [])
print(f"{len(losses)} rows more than 10 points below dense (leaderboard.md lists them all)", *losses[:8], sep="\n")
print("failures:", list(board.get("failures", {})) or "none", "| seconds", board.get("seconds"))
EOF
say "end"
