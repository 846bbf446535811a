# The environment of the device calls after issue29_control_vs_pod.sh `stage` (wheels in /tmp/site, the model's
# package and the texts under /tmp/p29): `source benchmarks/plans/h200_env.sh` before python3 -m ... there.
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/p29/site:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PODKIT_CACHE=/tmp/p29/cache \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
