"""Export of the adapted model: save_pretrained (safetensors) + tokenizer + block map + model card.

The export folder holds
  * ``model.safetensors`` (or shards) and ``config.json`` -- the podkit config carries the scheme
    defaults (prefill and decode ``pod``) and the block map inline (``sparse_attention.pod.
    anchor_layers``), so ``from_pretrained`` needs nothing else;
  * the tokenizer files; ``pod_blocks.json`` (the exploration's output, similarity included);
  * ``recipe.yaml`` (the recipe as run, local paths reduced to their last component);
  * ``modeling_podkit.py`` (a copy of ``sparse_models/standalone/modeling_podkit.py``: torch +
    transformers only) and ``auto_map`` in ``config.json``, so that
    ``AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)`` works without podkit;
    with podkit installed the registered podkit classes load it (no remote code runs);
  * ``README.md``: the model card (base model, recipe, block map, KV saving, eval results, loading
    snippet).

Nothing written here may carry a local path or a secret (train/hub.py checks again before a push).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from sparse_models.calibration.pod_similarity import blocks_per_head, kv_saving_fraction
from sparse_models.model_files import write_export_manifest, write_text_atomically
from train.checkpoints import staged_folder
from train.long_context_eval.report import card_lines
from train.recipe import Recipe

STANDALONE_MODELING = Path(__file__).resolve().parent.parent / "sparse_models" / "standalone" / "modeling_podkit.py"
STANDALONE_CLASSES = {  # model_type -> (config class, model class) in modeling_podkit.py
    "podkit_llama": ("PodkitLlamaConfig", "PodkitLlamaForCausalLM"),
    "podkit_mistral": ("PodkitMistralConfig", "PodkitMistralForCausalLM"),
    "podkit_qwen2": ("PodkitQwen2Config", "PodkitQwen2ForCausalLM"),
}


def sanitized_recipe(recipe: Recipe) -> dict:
    """The recipe as plain data with absolute / home paths cut to ``<local>/<name>``."""

    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, str) and (value.startswith(("/", "~")) or "\\" in value):
            return f"<local>/{Path(value).name}"
        return value

    return clean(recipe.to_dict())


def card_recipe(recipe: Recipe) -> dict:
    """The recipe the card shows: :func:`sanitized_recipe` without ``eval.report_note``, console text about the
    run (the demo's says how many steps ran, on which device) that the card's own sections replace.
    ``recipe.yaml`` keeps the whole recipe."""
    data = sanitized_recipe(recipe)
    data.get("eval", {}).pop("report_note", None)
    return data


def export_model(model, tokenizer, recipe: Recipe, anchor_layers: list[list[int]], export_dir: str | Path, *,
                 base_model: str, blocks_file: str | Path | None = None, results: dict | None = None) -> Path:
    """Write the export folder (see module docstring); returns its path.

    Crash-safe: everything is written into a staging folder next to ``export_dir`` (same file system), which
    replaces ``export_dir`` only once whole (train/checkpoints.py ``staged_folder``, as checkpoints are
    saved); until then the previous export stays. The manifest (``podkit_export.json``,
    sparse_models/model_files.py) is written first as incomplete and last with the file list, so a folder
    that lost a part is refused by the loaders with what is missing.
    """
    export_dir = Path(export_dir)
    with staged_folder(export_dir, "train.export_dir") as staging:
        write_export_manifest(staging, complete=False)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if blocks_file is not None:
            shutil.copyfile(blocks_file, staging / "pod_blocks.json")
        (staging / "recipe.yaml").write_text(yaml.safe_dump(sanitized_recipe(recipe), sort_keys=False))
        shutil.copyfile(STANDALONE_MODELING, staging / "modeling_podkit.py")
        _finish_config(staging, recipe)
        write_model_card(staging, recipe, anchor_layers, base_model=base_model, results=results)
        write_export_manifest(staging, complete=True)
    return export_dir


def _finish_config(export_dir: Path, recipe: Recipe) -> None:
    path = export_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop("_name_or_path", None)
    pod = config.get("sparse_attention", {}).get("pod", {})
    pod["blocks_file"] = None  # the anchor map is inline; a path would be local
    model_type = config.get("model_type")
    if model_type not in STANDALONE_CLASSES:
        raise ValueError(f"model_type={model_type!r}: the export's standalone modeling file covers "
                         f"{', '.join(STANDALONE_CLASSES)}")
    config_class, model_class = STANDALONE_CLASSES[model_type]
    # Only read by transformers when the loader passes trust_remote_code=True (podkit never does)
    config["auto_map"] = {"AutoConfig": f"modeling_podkit.{config_class}",
                          "AutoModelForCausalLM": f"modeling_podkit.{model_class}"}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def update_card_results(export_dir: str | Path, recipe: Recipe, anchor_layers, *, base_model: str, results: dict) -> None:
    """Rewrite the card once evaluation results exist."""
    write_model_card(Path(export_dir), recipe, anchor_layers, base_model=base_model, results=results)


def _trained_delta(export_dir: Path, pod) -> str:
    """The delta of the trained map (``pod_blocks.json``): ``pod.min_kv_saving`` may have lowered it."""
    blocks = Path(export_dir) / "pod_blocks.json"
    delta = json.loads(blocks.read_text()).get("delta", pod.delta) if blocks.is_file() else pod.delta
    if getattr(pod, "kv_saving", None) is not None:
        return f"{delta:.4g}, the largest that saves at least {pod.kv_saving:.0%} (`pod.kv_saving`)"
    if pod.min_kv_saving is not None and delta != pod.delta:
        return f"{delta:.4g}, lowered from {pod.delta:g} to save at least {pod.min_kv_saving:.0%} (`pod.min_kv_saving`)"
    return f"{delta:g}"


def _distant_sharing_words(sharing: str) -> str:
    """How a member layer reads distant tokens under ``pod.sharing`` (METHODS.md A.3), for the card's summary."""
    if sharing == "scores":
        return ("to distant tokens with the anchor layer's attention scores (its queries against its keys, the "
                "paper's v1 score sharing) applied to their own values")
    return "to distant tokens with the anchor layer's keys (the paper's v2 key sharing)"


def write_model_card(export_dir: Path, recipe: Recipe, anchor_layers: list[list[int]] | None, *, base_model: str,
                     results: dict | None = None) -> Path:
    """The card of a POD export, or of the dense fine-tune control (``anchor_layers`` None,
    ``train.attention: dense``)."""
    if anchor_layers is None:
        return _write_control_card(export_dir, recipe, base_model=base_model, results=results)
    p = recipe.pod
    length = recipe.eval_context_length
    saving = kv_saving_fraction(anchor_layers, length, p.sink_tokens, p.recent_window)
    num_layers, num_kv = len(anchor_layers), len(anchor_layers[0])
    shared = sum(a != layer for layer, row in enumerate(anchor_layers) for a in row)
    blocks = blocks_per_head(anchor_layers)
    front = {"library_name": "transformers", "tags": ["podkit", "pod", "long-context", "kv-cache-compression"],
             "pipeline_tag": "text-generation"}
    hub_base = "/" in base_model and " " not in base_model
    if hub_base:
        front["base_model"] = base_model
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# POD-adapted {base_model.split(' ')[0].split('/')[-1] if '/' in base_model else 'model'}", "",
             "This checkpoint was adapted with **POD** (Proximal tokens Over Distant tokens, arXiv 2412.02252) by "
             "podkit: within each block of consecutive layers (per KV head), layers above the block's anchor attend "
             + _distant_sharing_words(p.sharing) + ", so those keys are cached once per block. Proximal "
             f"tokens ({p.sink_tokens} sink + {p.recent_window} recent) use each layer's own keys; both parts go "
             "through one softmax (parameter-free gate).", "",
             f"- **Base model:** {base_model}",
             f"- **Training:** {recipe.train.method} fine-tuning, context {recipe.data.context_length}, "
             f"lr {recipe.train.learning_rate:g} ({recipe.train.lr_scheduler}), "
             f"{'max ' + str(recipe.train.max_steps) + ' steps' if recipe.train.max_steps > 0 else str(recipe.train.num_train_epochs) + ' epochs'}",
             f"- **Blocks:** delta={_trained_delta(export_dir, p)} ({p.compare_with}); {num_layers * num_kv - shared} anchor and {shared} "
             f"shared (layer, KV head) units of {num_layers * num_kv}"
             + (f"; kept as anchors for retrieval (`pod.protect_units`): "
                f"{', '.join(f'({layer}, {head})' for layer, head in p.protect_units)}"
                if p.protect_units and not isinstance(p.protect_units, str) else "")
             + ("; the units that keep their own distant keys were chosen by learned gates under the KV budget "
                "(`pod.protect_units: auto`, exploration/unit_gates.json)" if p.protect_units == "auto" else ""),
             f"- **KV saving** (closed form at {length} tokens): {100 * saving:.1f}% of the dense KV cache", ""]
    if recipe.train.objective != "lm":
        lines.insert(len(lines) - 1,  # after the bullet list, before its blank line
                     f"- **Objective:** {recipe.train.objective} (token-level KL to the dense starting model, "
                     f"T={recipe.train.distill_temperature:g}"
                     + (f", weight {recipe.train.distill_weight:g}" if recipe.train.objective == "lm+distill" else "")
                     + ")")
    if results:
        lines += ["## Evaluation", ""]
        labels = (("dense", "dense base"), ("control", "dense fine-tune control"), ("pod_before", "POD before adaptation"),
                  ("pod_after", "POD after adaptation (this model)"), ("dense_after", "this model run densely"))
        sources = results.get("sources") or {results.get("data", "held-out text"): results.get("perplexity", {})}
        names = list(sources)
        lines += ["Held-out perplexity (text never trained on; gap to the dense base in brackets):", "",
                  "| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for key, label in labels:
            cells = []
            for name in names:
                scores = sources[name]
                if key not in scores:
                    cells.append("-")
                    continue
                gap = 100 * (scores[key]["ppl"] / scores["dense"]["ppl"] - 1) if "dense" in scores else None
                cells.append(f"{scores[key]['ppl']:.3f}" + (f" ({gap:+.1f}%)" if gap is not None and key != "dense" else ""))
            if any(c != "-" for c in cells):
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if "kv" in results:
            kv = results["kv"]
            lines += ["", f"Measured KV cache at {kv['tokens']} tokens: {kv['kv_bytes']:,} bytes vs "
                      f"{kv['dense_kv_bytes']:,} dense ({100 * kv['saving']:.1f}% saved)."]
        if results.get("data"):
            lines += ["", f"Held-out text: {results['data']}."]
        lines.append("")
    if results and "long_context" in results:
        lines += card_lines(results["long_context"])
    if (export_dir / "learning_curve.png").is_file():
        lines += ["## Learning curve", "", "Held-out perplexity gap to the dense base during adaptation (POD solid, the "
                  "same weights run densely dotted); the numbers are in `learning_curve.json`.", "",
                  "![learning curve](learning_curve.png)", ""]
    chain = export_dir / "chain.json"
    if chain.is_file():
        import json

        lines += ["## Through the serving chain", ""] + [f"- {line}" for line in json.loads(chain.read_text()).get(
            "summary", [])] + [""]
    lines += ["## Block map (per KV head: [first layer, last layer] of each block)", "", "```"]
    lines += [f"kv head {h}: {b}" for h, b in enumerate(blocks)]
    lines += ["```", "", "## Loading", "", "With podkit installed:", "", "```python",
              "from transformers import AutoTokenizer",
              "from sparse_models import PodkitLlamaForCausalLM  # registers podkit's config classes: no remote code",
              "model = PodkitLlamaForCausalLM.from_pretrained(REPO)  # POD prefill + POD KV cache",
              "tokenizer = AutoTokenizer.from_pretrained(REPO)",
              "# an FP8 KV cache (keys, values and POD's ring in float8_e4m3 with per-token scales):",
              "# PodkitLlamaForCausalLM.from_pretrained(REPO, kv_cache_dtype=\"fp8_e4m3\")",
              "```", ""]
    if (export_dir / "modeling_podkit.py").is_file():
        lines += ["Without podkit (the self-contained `modeling_podkit.py`: torch + transformers only, POD attention "
                  "in plain PyTorch SDPA; same logits as podkit, but every layer's keys stay in transformers' "
                  "DynamicCache, so the KV memory saving needs podkit's cache):", "", "```python",
                  "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "model = AutoModelForCausalLM.from_pretrained(REPO, trust_remote_code=True)",
                  # AutoTokenizer reads config.json first, whose class is in modeling_podkit.py (auto_map): without
                  # trust_remote_code transformers asks "run the custom code? [y/N]" (tests/train/test_model_card.py)
                  "tokenizer = AutoTokenizer.from_pretrained(REPO, trust_remote_code=True)", "```", ""]
    lines += ["## Recipe", "", "```yaml", yaml.safe_dump(card_recipe(recipe), sort_keys=False).strip(), "```", ""]
    return write_text_atomically(export_dir / "README.md", "\n".join(lines))  # the eval stage rewrites it in place


def _write_control_card(export_dir: Path, recipe: Recipe, *, base_model: str, results: dict | None) -> Path:
    """The card of the dense fine-tune control: what it is for, its perplexity and long-context rows."""
    lines = ["---", yaml.safe_dump({"library_name": "transformers", "tags": ["podkit", "pod-control"],
                                    "pipeline_tag": "text-generation"}, sort_keys=False).strip(), "---", "",
             f"# Dense fine-tune control of {base_model}", "",
             "The control of a POD adaptation (podkit, `train.attention: dense`): the same model, data, steps, "
             "optimizer and objective as the POD run of this recipe, with dense attention. Comparing the POD export "
             "with this model separates what POD costs from what the fine-tuning costs.", "",
             f"- **Base model:** {base_model}",
             f"- **Training:** {recipe.train.method} fine-tuning, objective {recipe.train.objective}, context "
             f"{recipe.data.context_length}, lr {recipe.train.learning_rate:g} ({recipe.train.lr_scheduler}), "
             f"{recipe.train.max_steps} steps", ""]
    if results:
        sources = results.get("sources", {})
        names = list(sources)
        lines += ["## Evaluation", "", "Held-out perplexity (text never trained on):", "",
                  "| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for key, label in (("dense", "original dense model"), ("control", "this model")):
            cells = [f"{sources[n][key]['ppl']:.3f}" if key in sources[n] else "-" for n in names]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
        if "long_context" in results:
            lines += card_lines(results["long_context"])
    lines += ["## Recipe", "", "```yaml", yaml.safe_dump(card_recipe(recipe), sort_keys=False).strip(), "```", ""]
    return write_text_atomically(export_dir / "README.md", "\n".join(lines))
