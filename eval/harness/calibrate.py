"""``python -m eval.calibrate {pod,drift,tidal,all,variants}``: the calibration analyses as one command.

Each analysis writes a JSON that a config can point to, and a heatmap PNG, under ``--out-dir``:

* ``pod``   -> ``pod/blocks.json`` + ``pod/similarity.png``: POD inter-layer attention similarity and
  greedy blocks (``train.explore.run_exploration`` over ``sparse_models.calibration.pod_similarity``,
  the same code the training pipeline runs); ``PodConfig.blocks_file`` / ``pod_blocks_file=``;
* ``drift`` -> ``token_sparse_drift.json|png``: Token Sparse sparse layers
  (``sparse_models.calibration.token_sparse_drift``, ``--delta``); its ``sparse_layers`` go to
  ``token_sparse_sparse_layers=`` (or ``TokenSparseConfig.calibration_file``);
* ``tidal`` -> ``tidal_reselection.json|png``: TidalDecode re-selection layer
  (``sparse_models.calibration.tidal_reselection``, ``--budget``, ``--tidal-last-queries``,
  ``--full-layers``, ``--first-selection``); its ``selection_layers`` go to
  ``tidal_selection_layers=``.

The command-line mains of the analyses live here, not in sparse_models/ (which imports nothing above
it). Calibration text defaults to Persuasion (Emma is the held-out evaluation text).

    python -m eval.calibrate all --model default --length 2048 --samples 4 --out-dir outputs/calibration
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eval.harness import variants
from eval.models import load_model, load_tokenizer
from eval.tasks.perplexity import perplexity_windows
from sparse_models import capture_attention_inputs
from sparse_models.calibration import tidal_reselection as reselection
from sparse_models.calibration import token_sparse_drift as drift
from train.explore import run_exploration
from train.long_context_eval.protocol import DEV_SEED


def pod_command(args) -> dict:
    model = load_model(args.model, device=args.device)
    windows = perplexity_windows(load_tokenizer(args.model), args.length, args.samples, text=args.text)
    return run_exploration(model, torch.tensor(windows), last_queries=args.last_queries, delta=args.delta,
                           compare_with=args.compare_with, out_dir=Path(args.out_dir) / "pod",
                           metadata={"model": args.model, "text": args.text})


def drift_command(args) -> dict:
    """Token Sparse sparse layers by representation drift -> ``token_sparse_drift.json|png``."""
    model = load_model(args.model, device=args.device)
    windows = perplexity_windows(load_tokenizer(args.model), args.length, args.samples, text=args.text)
    result = drift.calibrate(model, (torch.tensor([w]) for w in windows), delta=args.delta)
    out = Path(args.out_dir) / "token_sparse_drift"
    json_path = drift.write_drift_json(out.with_suffix(".json"), result, model=args.model, text=args.text,
                                       length=args.length)
    png_path = drift.plot_drift(result, out.with_suffix(".png"))
    print(f"sparse layers ({len(result['sparse_layers'])}/{result['drift'].numel()}): {result['sparse_layers']}")
    print(f"wrote {json_path} and {png_path}")
    return result


def tidal_command(args) -> dict:
    """TidalDecode re-selection layer by top-k recall -> ``tidal_reselection.json|png``."""
    model = load_model(args.model, device=args.device)
    windows = perplexity_windows(load_tokenizer(args.model), args.length, args.samples, text=args.text)
    result = reselection.analyse((torch.tensor([w], device=args.device) for w in windows),
                                 lambda ids: capture_attention_inputs(model, ids),
                                 num_layers=model.config.num_hidden_layers, budget=args.budget,
                                 last_queries=args.tidal_last_queries, full_layers=args.full_layers,
                                 first_selection=args.first_selection)
    out = Path(args.out_dir) / "tidal_reselection"
    json_path = reselection.write_reselection_json(out.with_suffix(".json"), result, model=args.model,
                                                   text=args.text, length=args.length)
    png_path = reselection.plot_reselection(result, out.with_suffix(".png"))
    layer = result["reselection_layer"]
    print(f"re-selection layer {layer} (mean recall {result['scores'][layer]:.3f}, without re-selection "
          f"{result['scores'][None]:.3f}); wrote {json_path} and {png_path}")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m eval.calibrate", description="podkit calibration analyses (JSON + PNG each)")
    parser.add_argument("analysis", choices=["pod", "drift", "tidal", "all", "variants"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--text", default="persuasion")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", default="outputs/calibration")
    parser.add_argument("--delta", type=float, default=0.5, help="pod: similarity threshold; drift: quantile of the sparse layers")
    parser.add_argument("--compare-with", default="anchor", choices=["anchor", "previous"])
    parser.add_argument("--last-queries", type=int, default=64, help="pod: queries compared per sample")
    parser.add_argument("--budget", type=int, default=128, help="tidal: TidalDecode budget k (current token included)")
    parser.add_argument("--tidal-last-queries", type=int, default=32, help="tidal: last queries per sample")
    parser.add_argument("--full-layers", type=int, nargs="*", default=[0, 1], help="tidal: dense decode layers")
    parser.add_argument("--first-selection", type=int, default=2, help="tidal: the first selection layer")
    variants.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.analysis == "variants":  # the RULER sweep of eval/harness/variants.py
        args.seed = DEV_SEED if args.seed is None else args.seed
        args.samples_dir = args.samples_dir or args.out
        return {"variants": variants.sweep(args)}
    commands = {"pod": pod_command, "drift": drift_command, "tidal": tidal_command}
    return {name: command(args) for name, command in commands.items() if args.analysis in (name, "all")}


if __name__ == "__main__":
    main()
