"""Held-out perplexity during training: the learning curve of a POD adaptation.

Every ``eval.every_steps`` optimizer steps (and before the first), the model being trained is scored on
a few windows of each held-out source twice: as it is (POD) and with dense attention (the same
weights; ``train.teacher.dense_attention``). The step-0 dense score is the original dense model's,
so each point gives

  * ``pod_gap``   = POD ppl / original dense ppl - 1   (what adaptation must drive to 0), and
  * ``dense_gap`` = adapted-weights-run-densely ppl / original dense ppl - 1 (what adaptation costs
    the model's general ability),

against the training tokens seen so far. With ``long_context`` (the pipeline's RULER probe on the *dev* split,
train/long_context_eval/protocol.py), each point also holds RULER averages per length for POD and for the same
weights run densely (``point["ruler"]``), plotted in a panel of their own. Written to ``<output_dir>/learning_curve.json`` (rewritten
atomically after every point) and ``learning_curve.png``. Under ZeRO-3 every rank runs the forwards
(they gather parameters collectively); rank 0 writes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from train.evaluate import perplexity
from train.teacher import dense_attention


def tokens_per_step(args, context_length: int, sequence_parallel_size: int = 1) -> int:
    """Training tokens consumed by one optimizer step over all ranks."""
    replicas = max(args.world_size // sequence_parallel_size, 1)
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * replicas * context_length


def _learning_curve_callback_class():
    from transformers import TrainerCallback

    class LearningCurveCallback(TrainerCallback):
        """Scores ``windows`` ({source: [W, S] int64}) every ``every_steps`` steps; see the module docstring."""

        def __init__(self, windows: dict[str, torch.Tensor], every_steps: int, out_dir: Path, *, objective: str,
                     tokens_per_step: int, batch_size: int = 1, log=print, long_context=None):
            self.windows, self.every = windows, every_steps
            self.long_context = long_context  # model -> {length: {"average", ...}} on the dev split, or None
            self.out_dir, self.objective = Path(out_dir), objective
            self.tokens_per_step, self.batch_size, self.log = tokens_per_step, batch_size, log
            self.points: list[dict] = []
            self.original_dense: dict[str, float] = {}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0:
                self._score(args, state, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % self.every == 0 or state.global_step == state.max_steps:
                if not self.points or self.points[-1]["step"] != state.global_step:
                    self._score(args, state, model)

        def _score(self, args, state, model):
            started = time.perf_counter()
            was_training = model.training
            model.eval()
            point = {"step": state.global_step, "tokens": state.global_step * self.tokens_per_step, "sources": {}}
            for source, windows in self.windows.items():
                pod = perplexity(model, windows, self.batch_size)["ppl"]
                with dense_attention(model):
                    dense = perplexity(model, windows, self.batch_size)["ppl"]
                base = self.original_dense.setdefault(source, dense)  # the first point is the original model
                point["sources"][source] = {"pod_ppl": pod, "dense_ppl": dense, "original_dense_ppl": base,
                                            "pod_gap": pod / base - 1, "dense_gap": dense / base - 1}
            if self.long_context is not None:
                pod_ruler = self.long_context(model)
                with dense_attention(model):
                    dense_ruler = self.long_context(model)
                point["ruler"] = {length: {"pod": pod_ruler[length]["average"],
                                           "dense": dense_ruler[length]["average"]} for length in pod_ruler}
            point["seconds"] = time.perf_counter() - started
            if was_training:
                model.train()
            self.points.append(point)
            if args.process_index == 0:
                parts = ", ".join(f"{s}: POD {v['pod_ppl']:.2f} ({100 * v['pod_gap']:+.1f}%), dense "
                                  f"{v['dense_ppl']:.2f} ({100 * v['dense_gap']:+.1f}%)"
                                  for s, v in point["sources"].items())
                if "ruler" in point:
                    parts += "; RULER dev " + ", ".join(f"{n}: POD {v['pod']:.1f}, dense {v['dense']:.1f}"
                                                        for n, v in point["ruler"].items())
                self.log(f"[curve] step {state.global_step} ({point['tokens']:,} tokens): {parts}")
                self.write()

        def write(self):
            data = {"objective": self.objective, "tokens_per_step": self.tokens_per_step, "points": self.points}
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / "learning_curve.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
            plot_learning_curves({self.objective: data}, self.out_dir / "learning_curve.png")

    return LearningCurveCallback


def learning_curve_callback(*args, **kwargs):
    """A ``LearningCurveCallback`` (a transformers ``TrainerCallback``; imported lazily)."""
    return _learning_curve_callback_class()(*args, **kwargs)


def plot_learning_curves(curves: dict[str, dict], path: Path, title: str | None = None) -> Path | None:
    """One panel per held-out source: POD gap to the original dense model (%) against training tokens,
    one solid line per curve (label -> learning_curve.json data), the dense-run gap dotted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is in the train/eval extras; the JSON is the result
        return None
    sources = sorted({s for data in curves.values() for p in data["points"] for s in p["sources"]})
    lengths = sorted({n for data in curves.values() for p in data["points"] for n in p.get("ruler", {})}, key=int)
    if not sources:
        return None
    panels = len(sources) + bool(lengths)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    for ax, source in zip(axes[0], sources):
        for label, data in curves.items():
            points = [p for p in data["points"] if source in p["sources"]]
            tokens = [p["tokens"] / 1e6 for p in points]
            line, = ax.plot(tokens, [100 * p["sources"][source]["pod_gap"] for p in points], marker="o", ms=3,
                            label=f"{label}: POD")
            ax.plot(tokens, [100 * p["sources"][source]["dense_gap"] for p in points], ls=":",
                    color=line.get_color(), label=f"{label}: weights run densely")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("perplexity gap to the original dense model (%)")
        ax.set_title(source)
        ax.set_yscale("symlog", linthresh=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if lengths:
        ax = axes[0][-1]
        for label, data in curves.items():
            for length in lengths:
                points = [p for p in data["points"] if length in p.get("ruler", {})]
                tokens = [p["tokens"] / 1e6 for p in points]
                line, = ax.plot(tokens, [p["ruler"][length]["pod"] for p in points], marker="o", ms=3,
                                label=f"{label}: POD at {length}")
                ax.plot(tokens, [p["ruler"][length]["dense"] for p in points], ls=":", color=line.get_color(),
                        label=f"{label}: run densely at {length}")
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("RULER average, dev split")
        ax.set_title("long context (RULER dev split)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
