"""``python -m eval.calibrate {pod,drift,tidal,all}``: the calibration analyses as one command.

Each analysis writes a JSON that a config can point to, and a heatmap PNG, under ``--out-dir``:

* ``pod``   -> ``pod/blocks.json`` + ``pod/similarity.png``: POD inter-layer attention similarity and
  greedy blocks (``train.explore.run_exploration`` over ``sparse_models.calibration.pod_similarity``,
  the same code the training pipeline runs); ``PodConfig.blocks_file`` / ``pod_blocks_file=``;
* ``drift`` -> ``token_sparse_drift.json|png``: Token Sparse sparse layers
  (``sparse_models.calibration.token_sparse_drift``); its ``sparse_layers`` go to
  ``token_sparse_sparse_layers=`` (or ``TokenSparseConfig.calibration_file``);
* ``tidal`` -> ``tidal_reselection.json|png``: TidalDecode re-selection layer
  (``sparse_models.calibration.tidal_reselection``); its ``selection_layers`` go to
  ``tidal_selection_layers=``.

Calibration text defaults to Persuasion (Emma is the held-out evaluation text).

    python -m eval.calibrate all --model default --length 2048 --samples 4 --out-dir outputs/calibration
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def pod_command(args) -> dict:
    from eval.models import load_model, load_tokenizer
    from eval.tasks.perplexity import perplexity_windows
    from train.explore import run_exploration

    model = load_model(args.model, device=args.device)
    windows = perplexity_windows(load_tokenizer(args.model), args.length, args.samples, text=args.text)
    return run_exploration(model, torch.tensor(windows), last_queries=args.last_queries, delta=args.delta,
                           compare_with=args.compare_with, out_dir=Path(args.out_dir) / "pod",
                           metadata={"model": args.model, "text": args.text})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="podkit calibration analyses (JSON + PNG each)")
    parser.add_argument("analysis", choices=["pod", "drift", "tidal", "all"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--text", default="persuasion")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", default="outputs/calibration")
    parser.add_argument("--delta", type=float, default=0.5, help="pod: similarity threshold")
    parser.add_argument("--compare-with", default="anchor", choices=["anchor", "previous"])
    parser.add_argument("--last-queries", type=int, default=64, help="pod: queries compared per sample")
    parser.add_argument("--budget", type=int, default=128, help="tidal: TidalDecode budget")
    args = parser.parse_args(argv)

    results = {}
    common = ["--model", args.model, "--text", args.text, "--length", str(args.length), "--samples",
              str(args.samples), "--device", args.device]
    if args.analysis in ("pod", "all"):
        results["pod"] = pod_command(args)
    if args.analysis in ("drift", "all"):
        from sparse_models.calibration import token_sparse_drift

        results["drift"] = token_sparse_drift.main(common + ["--out", str(Path(args.out_dir) / "token_sparse_drift")])
    if args.analysis in ("tidal", "all"):
        from sparse_models.calibration import tidal_reselection

        results["tidal"] = tidal_reselection.main(common + ["--budget", str(args.budget), "--out",
                                                            str(Path(args.out_dir) / "tidal_reselection")])
    return results


if __name__ == "__main__":
    main()
