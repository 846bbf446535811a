# Source on the GPU machine, from the repository root, in a call that carries .whl and .cache
# (scripts/device_bundle.sh made them):   source scripts/device_setup.sh
# Installs the carried wheels and DeepSpeed (DS_BUILD_OPS=0: its ops compile on first use) into /tmp/site, puts it
# on PYTHONPATH, and points podkit's cache at the carried texts. Returns non-zero (and says why) on failure.
_podkit_device_setup() {
  local site=/tmp/site log=/tmp/device_setup.log
  ls .whl/*.whl >/dev/null 2>&1 || { echo "device_setup: no wheels in .whl (carry it)" >&2; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    > "$log" 2>&1 || { tail "$log" >&2; return 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  local sdist
  sdist=$(ls .whl/deepspeed-*.tar.gz 2>/dev/null | head -1)
  if [ -n "$sdist" ]; then
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "$sdist" \
      >> "$log" 2>&1 || { tail "$log" >&2; return 1; }
  fi
  export PODKIT_CACHE="$PWD/.cache/podkit" TORCH_EXTENSIONS_DIR=/tmp/torch_ext DS_ACCELERATOR=cuda
  python3 -c "import deepspeed, datasets; print('device_setup: deepspeed', deepspeed.__version__, 'datasets', datasets.__version__)"
}
_podkit_device_setup
