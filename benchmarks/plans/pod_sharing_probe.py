"""Zero-shot probe: does POD's v1 score sharing keep retrieval where v2 key sharing loses it, on the original model?

For each RULER *dev* sample (train/long_context_eval/protocol.py; never the test split) the prompt as the pipeline
renders it (chat template) is followed by the first reference answer, and one teacher-forced forward scores the
answer tokens: the share predicted exactly (argmax) and their mean log-probability. Rows: dense, POD with key
sharing (paper v2, podkit's default) and POD with score sharing (v1), both on the 2K GPU recipe's map (blocks file +
protected units), no training. A proxy for greedy RULER, cheap enough for the CPU machine.
Usage: python benchmarks/plans/pod_sharing_probe.py SAMPLES_DIR OUT.json [LENGTH ...]"""
import json
import sys
import time
from pathlib import Path

import torch

from sparse_models import PODKIT_CLASSES
from sparse_models.calibration.pod_similarity import kv_saving_fraction, protect_units
from train.long_context_eval import protocol, ruler
from train.models import load_config, load_tokenizer, model_source, public_model_name
from train.recipe import load_recipe

samples_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
lengths = [int(x) for x in sys.argv[3:]] or [2048]
recipe = load_recipe("recipes/smollm2_135m_gpu.yaml", [], check_environment=False)
source = model_source(recipe)
tokenizer = load_tokenizer(recipe, source)
dev, _ = protocol.splits(recipe, getattr(load_config(recipe, source), "max_position_embeddings", None))
blocks = json.loads(Path(recipe.pod.blocks_file).read_text())["anchor_layers"]
anchors, _ = protect_units(blocks, [tuple(u) for u in recipe.pod.protect_units])
saved = kv_saving_fraction(anchors, 2048, recipe.pod.sink_tokens, recipe.pod.recent_window)
model = PODKIT_CLASSES["llama"].from_pretrained(str(source), dtype=torch.float32).eval()
settings = {"dense": dict(prefill_scheme="dense", decode_scheme="dense")}
for sharing in ("keys", "scores"):
    settings[f"pod_{sharing}"] = dict(prefill_scheme="pod", decode_scheme="pod", pod_anchor_layers=anchors,
                                      pod_sink_tokens=recipe.pod.sink_tokens,
                                      pod_recent_window=recipe.pod.recent_window, pod_sharing=sharing)
results = {"kv_saved": saved, "split": dev.describe(), "rows": {}}
for length in lengths:
    import dataclasses
    samples = protocol.split_samples(dataclasses.replace(dev, lengths=(length,)), tokenizer, samples_dir,
                                     public_model_name(recipe))
    for name, overrides in settings.items():
        model.set_sparse_attention(**overrides)
        started, per_task = time.perf_counter(), {}
        for s in samples:
            context, question = ruler.render(s, tokenizer, recipe.long_context.chat)
            prompt = tokenizer(context).input_ids + tokenizer(question, add_special_tokens=False).input_ids
            answer = tokenizer(" " + s.outputs[0], add_special_tokens=False).input_ids
            ids = torch.tensor([prompt + answer])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            target = torch.tensor(answer)
            hit = (logits.argmax(-1) == target).float().mean().item()
            logp = torch.log_softmax(logits, -1).gather(-1, target[:, None]).mean().item()
            per_task.setdefault(s.task, []).append((hit, logp))
        row = {t: {"token_acc": sum(h for h, _ in v) / len(v), "logp": sum(lp for _, lp in v) / len(v)}
               for t, v in per_task.items()}
        row["_mean"] = {k: sum(r[k] for r in row.values()) / len(row) for k in ("token_acc", "logp")}
        results["rows"][f"{name}@{length}"] = row
        print(f"{name}@{length}: token_acc {row['_mean']['token_acc']:.3f} logp {row['_mean']['logp']:.3f} "
              f"({time.perf_counter() - started:.0f}s)", flush=True)
        out.write_text(json.dumps(results, indent=1))
