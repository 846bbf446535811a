"""Benchmarks: ``python -m eval.bench {kernels,kernels-decode,kernels-prefill,train,e2e} [ARGS]``.

Each benchmark measures podkit against its peers and the hardware floor in the same run and writes
JSON (see BENCHMARKS.md). The modules are owned by the layers they measure: ``kernels_decode`` and
``kernels_prefill`` (kernels/), ``train`` (train/), ``e2e`` (the engine); this package only dispatches.
"""
