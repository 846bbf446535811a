"""Token Sparse Attention layer selection by inter-layer representation drift (arXiv 2602.03216, Eq. 1-2).

For each decoder layer l with input hidden states h_l and output h_{l+1} (attention + MLP residual
update), the drift of token t is ||h_{l+1,t} - h_{l,t}||_2 / (||h_{l,t}||_2 + eps), eps = 1e-8,
computed in fp32. R_l is its mean over all tokens (and calibration samples), R^_l = R_l / sum R, and
the sparse layers are the low-drift ones: {l : R^_l <= quantile(R^, delta)}, delta = 0.5 (METHODS.md
C.2). Low-drift layers change the residual stream little, so dropping tokens there costs little.

The hidden states are the residual stream before the final norm (``sparse_models.
capture_residual_stream`` for podkit models, forward hooks on the decoder layers otherwise), not
``output_hidden_states``: transformers applies the final norm to the last entry of that tuple, which
would make the last layer's drift meaningless.

Writes a JSON (``sparse_layers`` is what ``TokenSparseConfig.calibration_file`` reads) and a PNG: a
heatmap of drift per (position bucket, layer) above a bar chart of R^ with the threshold.

Command line (in eval/, which loads the model and the calibration text):

    python -m eval.calibrate drift --model default --text persuasion --length 4096 --samples 2 \\
        --out-dir outputs/calibration

Shapes: ``B`` batch, ``S`` tokens, ``C`` hidden size, ``L`` layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from .outputs import save_figure, write_json

DRIFT_FORMAT = "podkit.token_sparse_drift/1"
EPS = 1e-8


def token_drift(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """Per-token drift ``[B,S]`` fp32 of one layer: ||h_out - h_in|| / (||h_in|| + eps) for ``[B,S,C]`` inputs."""
    if h_in.shape != h_out.shape or h_in.dim() != 3:
        raise ValueError(f"h_in {tuple(h_in.shape)} and h_out {tuple(h_out.shape)}: expected equal [B,S,C] shapes")
    h_in, h_out = h_in.float(), h_out.float()
    return (h_out - h_in).norm(dim=-1) / (h_in.norm(dim=-1) + EPS)


def select_sparse_layers(drift: torch.Tensor, delta: float = 0.5) -> tuple[list[int], float]:
    """(layers with normalised drift <= quantile(normalised, delta), that threshold); ``drift[L]``."""
    if not 0.0 < float(delta) <= 1.0:
        raise ValueError(f"delta={delta!r} is invalid: expected a number in (0, 1] (paper: 0.5)")
    normalised = drift.double() / drift.double().sum()
    threshold = float(torch.quantile(normalised, float(delta)))
    return [layer for layer in range(drift.numel()) if float(normalised[layer]) <= threshold], threshold


class DriftAccumulator:
    """Sums of per-token drift per layer (and per position bucket) over calibration forwards."""

    def __init__(self, num_layers: int, num_buckets: int = 16) -> None:
        self.num_layers, self.num_buckets = num_layers, num_buckets
        self.total = torch.zeros(num_layers, dtype=torch.float64)
        self.bucket_total = torch.zeros(num_buckets, num_layers, dtype=torch.float64)
        self.bucket_count = torch.zeros(num_buckets, dtype=torch.float64)
        self.tokens = 0
        self.samples = 0

    def add(self, per_layer: list[torch.Tensor], valid: torch.Tensor | None = None) -> None:
        """``per_layer[l]``: drift ``[B,S]`` of layer l; ``valid``: ``[B,S]`` bool (padding False)."""
        if len(per_layer) != self.num_layers:
            raise ValueError(f"got drift for {len(per_layer)} layers, expected {self.num_layers}")
        batch, seq = per_layer[0].shape
        valid = torch.ones(batch, seq, dtype=torch.bool) if valid is None else valid.bool().cpu()
        bucket = (torch.arange(seq) * self.num_buckets // seq).expand(batch, seq)[valid]
        self.bucket_count += torch.bincount(bucket, minlength=self.num_buckets).double()
        for layer, drift in enumerate(per_layer):
            values = drift.detach().double().cpu()[valid]
            self.total[layer] += values.sum()
            self.bucket_total[:, layer] += torch.bincount(bucket, weights=values, minlength=self.num_buckets)
        self.tokens += int(valid.sum())
        self.samples += batch

    def drift(self) -> torch.Tensor:
        """R_l: mean drift per layer over every token seen, ``[L]`` float64."""
        if self.tokens == 0:
            raise ValueError("no calibration tokens were added")
        return self.total / self.tokens

    def bucket_drift(self) -> torch.Tensor:
        """Mean drift per (position bucket, layer), ``[num_buckets, L]``; NaN for empty buckets."""
        return self.bucket_total / self.bucket_count[:, None]


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: expected a Llama-family causal LM")
    return list(layers)


@torch.no_grad()
def residual_stream(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """L + 1 tensors ``[B,S,C]``: entry l is layer l's input, entry l + 1 its output (no final norm).

    podkit models run their own decoder loop (layer modules are not called), so they go through
    ``sparse_models.capture_residual_stream``; other transformers models through forward hooks.
    """
    if hasattr(model, "sparse_config"):
        from sparse_models.capture import capture_residual_stream

        return capture_residual_stream(model, input_ids, attention_mask)
    layers = decoder_layers(model)
    inputs: list[torch.Tensor | None] = [None] * len(layers)
    last_output: list[torch.Tensor] = []

    def hook(index):
        def record(module, args, kwargs, output):
            inputs[index] = args[0] if args else kwargs["hidden_states"]
            if index == len(layers) - 1:
                last_output.append(output[0] if isinstance(output, (tuple, list)) else output)
        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if any(h is None for h in inputs) or not last_output:
        raise RuntimeError(f"{type(model).__name__}: a decoder layer did not run its forward hook")
    return list(inputs) + last_output[-1:]  # type: ignore[operator]


@torch.no_grad()
def layer_drifts(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One forward of ``model`` on ``input_ids[B,S]``; the drift ``[B,S]`` of every decoder layer."""
    stream = residual_stream(model, input_ids, attention_mask)
    return [token_drift(stream[layer], stream[layer + 1]).cpu() for layer in range(len(stream) - 1)]


def calibrate(model, samples: Iterable[torch.Tensor], *, delta: float = 0.5, num_buckets: int = 16) -> dict:
    """Drift over ``samples`` (token id batches ``[B,S]``), then the sparse-layer choice."""
    acc = DriftAccumulator(model.config.num_hidden_layers, num_buckets)
    device = next(model.parameters()).device
    for ids in samples:
        acc.add(layer_drifts(model, ids.to(device)))
    drift = acc.drift()
    sparse_layers, threshold = select_sparse_layers(drift, delta)
    return {"drift": drift, "bucket_drift": acc.bucket_drift(), "sparse_layers": sparse_layers,
            "threshold": threshold, "delta": delta, "samples": acc.samples, "tokens": acc.tokens}


def write_drift_json(path: str | Path, result: dict, **metadata) -> Path:
    drift = result["drift"].double()
    payload = {
        "format": DRIFT_FORMAT,
        "num_layers": drift.numel(),
        "sparse_layers": result["sparse_layers"],
        "delta": result["delta"],
        "threshold": result["threshold"],
        "drift": [round(float(x), 6) for x in drift],
        "normalised_drift": [round(float(x), 6) for x in drift / drift.sum()],
        "samples": result["samples"],
        "tokens": result["tokens"],
        "bucket_drift": [[None if v != v else round(float(v), 6) for v in row] for row in result["bucket_drift"]],
        **metadata,
    }
    return write_json(path, payload)


def read_sparse_layers(path: str | Path) -> list[int]:
    """The ``sparse_layers`` of a drift JSON written by :func:`write_drift_json`."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != DRIFT_FORMAT or "sparse_layers" not in data:
        raise ValueError(f"{path}: not a Token Sparse drift file (format {data.get('format')!r}, expected {DRIFT_FORMAT})")
    return [int(x) for x in data["sparse_layers"]]


def result_from_json(path: str | Path) -> dict:
    """The :func:`calibrate` result (tensors included) back from a drift JSON, e.g. to redraw its PNG."""
    data = json.loads(Path(path).read_text())
    buckets = [[float("nan") if v is None else v for v in row] for row in data["bucket_drift"]]
    return {"drift": torch.tensor(data["drift"], dtype=torch.float64), "bucket_drift": torch.tensor(buckets),
            "sparse_layers": data["sparse_layers"], "threshold": data["threshold"], "delta": data["delta"],
            "samples": data["samples"], "tokens": data["tokens"]}


def plot_drift(result: dict, path: str | Path, title: str = "Token Sparse: inter-layer representation drift") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    drift = result["drift"].double()
    normalised = (drift / drift.sum()).numpy()
    num_layers = drift.numel()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.28 * num_layers), 6.2), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    # Log scales: the first layer's drift (from the small embedding norm) dwarfs the others.
    buckets = result["bucket_drift"].double().clamp_min(1e-6).numpy()
    image = top.imshow(buckets, aspect="auto", origin="lower", cmap="magma", norm=LogNorm(),
                       extent=(-0.5, num_layers - 0.5, 0.0, 1.0))
    top.set_ylabel("relative position")
    fig.colorbar(image, ax=top, label="drift")
    colours = ["tab:green" if layer in result["sparse_layers"] else "tab:gray" for layer in range(num_layers)]
    bottom.bar(range(num_layers), normalised, color=colours)
    bottom.axhline(result["threshold"], color="tab:red", linestyle="--", linewidth=1,
                   label=f"quantile {result['delta']:g} (green: sparse layers)")
    bottom.set_xlabel("layer")
    bottom.set_ylabel("normalised drift")
    bottom.set_yscale("log")
    bottom.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit("this command moved to eval/ (sparse_models imports nothing above it): "
                     "python -m eval.calibrate drift --help")
