"""Score one model on the 2K GPU recipe's RULER test split, length by length (records written after each), so
that several rows run side by side on one GPU (benchmarks/plans/issue29_control_vs_pod.sh, part `rows`).
Usage: python3 benchmarks/plans/issue29_score_row.py ROW MODEL OUT.json [dense] [split=dev] [sparse:KEY=VALUE ...]
       [recipe overrides]
MODEL: `original` (the recipe's base model) or an export folder; `dense` runs it with dense attention; `split=dev`
scores the dev split instead (the one choices are made on; widened by long_context.dev_tasks / dev_samples
overrides, issue29_serving_length.sh part `devrows`); `sparse:KEY=VALUE` sets a flat scheme override on the loaded
model (sparse_models/config.py, e.g. sparse:pod_gate_tau=0.000001: every shared unit's decode query skips POD's
distant part, sparse_models/engine/decode_layers.py)."""
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from sparse_models import PODKIT_CLASSES
from sparse_models.config import parse_override_value
from train.long_context_eval import protocol, scoring
from train.models import load_config, load_dense_reference, load_tokenizer, model_source, public_model_name
from train.recipe import load_recipe

row, path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
dense = "dense" in sys.argv[4:]
use_dev = "split=dev" in sys.argv[4:]
bad = [a for a in sys.argv[4:] if a.startswith("sparse:") and "=" not in a]
if bad:
    sys.exit(f"{bad[0]!r} is invalid: expected sparse:KEY=VALUE (a flat scheme override, e.g. sparse:pod_gate_tau=0.5)")
schemes = dict(a[len("sparse:"):].split("=", 1) for a in sys.argv[4:] if a.startswith("sparse:"))
overrides = [a for a in sys.argv[4:] if a not in ("dense", "split=dev") and not a.startswith("sparse:")]  # recipe's
recipe = load_recipe("recipes/smollm2_135m_gpu.yaml", overrides, check_environment=False)
source = model_source(recipe)
tokenizer = load_tokenizer(recipe, source)
dev, test = protocol.splits(recipe, getattr(load_config(recipe, source), "max_position_embeddings", None))
split = dev if use_dev else test
if path == "original":
    model = load_dense_reference(recipe, source)
else:
    model = PODKIT_CLASSES["llama"].from_pretrained(path, dtype=torch.bfloat16)
if dense:
    model.set_sparse_attention(prefill_scheme="dense", decode_scheme="dense")
if schemes:   # validated by the config: a bad key or value stops here, before any sample
    model.set_sparse_attention(**{key: parse_override_value(value) for key, value in schemes.items()})
model = model.to("cuda")
print(row, path, "sparse config:", model.sparse_config, flush=True)
records = []
for length in split.lengths:
    started = time.perf_counter()
    samples = protocol.split_samples(dataclasses.replace(split, lengths=(length,)), tokenizer,
                                     Path(recipe.long_context.samples_dir), public_model_name(recipe))
    records += scoring.score_samples(model, tokenizer, samples, chat=recipe.long_context.chat,
                                     batch_size=recipe.long_context.batch_size, label=row)
    out.write_text(json.dumps({"row": row, "model": path, "dense": dense, "split": split.describe(),
                               "summary": scoring.summarise(records), "records": records}, indent=1))
    print(f"{row} {length}: {time.perf_counter() - started:.0f}s", flush=True)
