#!/usr/bin/env bash
# Device call 3 of 2026-12-02: the setup (wheels carried in .whl, DeepSpeed's sdist without build isolation, the
# text cache carried in .cache), the whole GPU suite on this tree, then eval.bench kernels-prefill.
set -u
R=$OUT; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/setup.log 2>&1 || { tail $R/setup.log; exit 1; }
export PYTHONPATH=/tmp/site
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-0.19.8.tar.gz >> $R/setup.log 2>&1 || { tail $R/setup.log; exit 1; }
export PODKIT_CACHE=$PWD/.cache/podkit TORCH_EXTENSIONS_DIR=/tmp/torch_ext
python3 -c "import deepspeed, datasets; print('deepspeed', deepspeed.__version__, 'datasets', datasets.__version__)"
LOGS=/tmp/test_gpu timeout 330 scripts/test_gpu_parallel.sh python3 > $R/test_gpu.txt 2>&1; echo "rc=$?" >> $R/test_gpu.txt
cat $R/test_gpu.txt
( cd /tmp/test_gpu && tar czf $R/test_gpu_logs.tgz *.log )
timeout 200 python3 -m eval.bench kernels-prefill --out $R/kernels_prefill.json --lengths 8192 32768 131072 --pod-lengths 32768 --skip sparse --pod-paths split > $R/kernels_prefill.log 2>&1; echo "rc=$?" >> $R/kernels_prefill.log
tail -14 $R/kernels_prefill.log
