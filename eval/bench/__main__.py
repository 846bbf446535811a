"""``python -m eval.bench COMMAND [ARGS]``: dispatch to the benchmark modules.

* ``kernels [--out-dir DIR]``: both kernel benchmarks, ``DIR/kernels_decode.json`` and
  ``DIR/kernels_prefill.json`` (default DIR ``outputs/bench``), with their default shapes;
* ``kernels-decode ARGS`` / ``kernels-prefill ARGS``: one of them, ARGS passed through;
* ``train ARGS`` -> ``eval.bench.train``; ``e2e ARGS`` -> ``eval.bench.e2e``;
* ``train-multi-gpu ARGS`` -> ``eval.bench.train_multi_gpu`` (launches ``deepspeed --num_gpus N`` per N).
* ``memory-plot LABEL=REPORT.json ... --out PNG`` -> ``eval.bench.memory_plot`` (peak memory against context;
  an ``e2e`` JSON alone: its KV memory per sequence and largest batch, per KV dtype).
* ``distill-memory ARGS`` -> ``eval.bench.distill_memory`` (what the distillation teacher costs in memory).
* ``decode-profile ARGS`` -> ``eval.bench.decode_profile`` (where the time of one decode step goes, by kernel kind).
* ``generate-vs-engine ARGS`` -> ``eval.bench.generate_vs_engine`` (``generate()`` vs the engine over prompt lengths).

Modules are imported only when their command runs, so a missing one fails alone, by name.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

MODULES = {"kernels-decode": "eval.bench.kernels_decode", "kernels-prefill": "eval.bench.kernels_prefill",
           "train": "eval.bench.train", "e2e": "eval.bench.e2e", "train-multi-gpu": "eval.bench.train_multi_gpu",
           "memory-plot": "eval.bench.memory_plot", "distill-memory": "eval.bench.distill_memory",
           "decode-profile": "eval.bench.decode_profile", "generate-vs-engine": "eval.bench.generate_vs_engine"}
COMMANDS = ("kernels",) + tuple(MODULES)


def run_module(command: str, argv: list[str]):
    module_name = MODULES[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            raise SystemExit(f"eval.bench {command}: {module_name} does not exist in this checkout") from None
        raise
    return module.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command != "kernels":
        code = run_module(command, rest)
        return code if isinstance(code, int) else 0
    parser = argparse.ArgumentParser(prog="python -m eval.bench kernels")
    parser.add_argument("--out-dir", default="outputs/bench")
    args = parser.parse_args(rest)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    codes = []
    for name in ("kernels-decode", "kernels-prefill"):
        code = run_module(name, ["--out", str(out / f"{MODULES[name].rsplit('.', 1)[1]}.json")])
        codes.append(code if isinstance(code, int) else 0)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
