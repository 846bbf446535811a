"""Which FP8 scale layout keeps quality, measured against a bf16 KV cache (issue 32's comparison), on the embedded
SmolLM2-135M (CPU, fp32 weights): decode-phase perplexity on held-out Emma, dense attention.

The K/V a decode step reads are the cache's, rounded by one storage format; the prefill attends over its own
unquantised K/V and stores them rounded, as podkit's caches do (ARCHITECTURE.md, "FP8 KV cache"). Formats:
    fp32                   no rounding (the reference; the model's own dtype here)
    bf16                   keys and values rounded to bfloat16: the cache the target compares against
    fp8/token              podkit's layout: one fp32 scale per token and KV head (kernels/fp8_kv.py quantize_kv)
    fp8/block16            one scale per 16 tokens and KV head
    fp8/head               one scale per KV head over the whole sequence (per-tensor-like, dynamic)
    fp8/unit               no scale (a plain cast, scale 1.0: vLLM's fp8 KV without calibrated scales)
    fp8/kchannel16         keys: one scale per channel per 16-token block (KIVI's key grouping, arXiv 2402.02750);
                           values per token
    fp8/keys, fp8/values   podkit's layout for the keys only / the values only, the other in bf16 (which of the
                           two the FP8 loss comes from)
    fp8/sink4              podkit's layout, the first 4 positions (the attention sink, arXiv 2309.17453) in bf16
    fp8/recent64           podkit's layout, the last 64 positions in bf16 (KIVI's full-precision residual window:
                           a token is quantised when it leaves the window)
Block layouts take each block's scale over the tokens stored so far (the partial last block is re-quantised at each
step from the unquantised values): their best case, which a real append that cannot re-quantise would not reach.
The study wraps transformers' own Llama (a DynamicCache subclass rounding what attention reads), so it measures the
storage format, not podkit's kernels; `fp8/token` reproduces the FP8 model path's number on the same windows
(benchmarks/cpu_2026-12-03/fp8_kv_quality.json: 22.248 -> 22.440).
    python benchmarks/cpu_2026-12-04/fp8_kv_layouts.py [FORMAT ...]  ->  fp8_kv_layouts.{json,png} beside this file
(named formats only: their rows replace or join the file's; the fp32 and bf16 rows must be there for the ratios)"""
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from eval.models import load_tokenizer  # noqa: E402
from eval.tasks.perplexity import perplexity_windows  # noqa: E402
from kernels.fp8_kv import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, dequantize_kv, quantize_kv  # noqa: E402
from sparse_models.smollm2 import default_model_path  # noqa: E402

WINDOWS = {1024: 3, 2048: 3}  # window length -> windows; the first 3 x 1024 are fp8_kv_quality.py's
DECODE = 256
BLOCK = 16
FORMATS = ("fp32", "bf16", "fp8/token", "fp8/block16", "fp8/head", "fp8/unit", "fp8/kchannel16", "fp8/keys",
           "fp8/values", "fp8/sink4", "fp8/recent64")


def fp8_grouped(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x [B, H, N, D] rounded through E4M3 with scale max(amax / 448, floor); amax broadcasts against x."""
    scale = (amax / torch.full((), FP8_MAX)).clamp(min=SCALE_FLOOR)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale


def block_amax(x: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """[B, H, N, D] -> |x|'s max within each 16-token block (per channel or over the block's channels too),
    broadcast back to [B, H, N, D]."""
    b, h, n, d = x.shape
    pad = (-n) % BLOCK
    blocks = torch.nn.functional.pad(x.abs(), (0, 0, 0, pad)).reshape(b, h, (n + pad) // BLOCK, BLOCK, d)
    amax = blocks.amax(dim=3, keepdim=True) if per_channel else blocks.amax(dim=(3, 4), keepdim=True)
    return amax.expand_as(blocks).reshape(b, h, n + pad, d)[:, :, :n]


def round_keys_values(fmt: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [B, H, N, D] fp32 -> what a cache in ``fmt`` gives back, in fp32."""
    if fmt == "fp32":
        return k, v
    if fmt == "bf16":
        return k.bfloat16().float(), v.bfloat16().float()
    if fmt == "fp8/token":
        return tuple(dequantize_kv(*quantize_kv(t)) for t in (k, v))
    if fmt == "fp8/block16":
        return tuple(fp8_grouped(t, block_amax(t, per_channel=False)) for t in (k, v))
    if fmt == "fp8/head":
        return tuple(fp8_grouped(t, t.abs().amax(dim=(2, 3), keepdim=True)) for t in (k, v))
    if fmt == "fp8/unit":
        return tuple(t.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() for t in (k, v))
    if fmt == "fp8/kchannel16":
        return fp8_grouped(k, block_amax(k, per_channel=True)), dequantize_kv(*quantize_kv(v))
    if fmt in ("fp8/sink4", "fp8/recent64"):
        kq, vq = (dequantize_kv(*quantize_kv(t)) for t in (k, v))
        keep = slice(0, 4) if fmt == "fp8/sink4" else slice(max(k.shape[2] - 64, 0), None)
        kq[:, :, keep], vq[:, :, keep] = k[:, :, keep].bfloat16().float(), v[:, :, keep].bfloat16().float()
        return kq, vq
    if fmt == "fp8/keys":
        return dequantize_kv(*quantize_kv(k)), v.bfloat16().float()
    if fmt == "fp8/values":
        return k.bfloat16().float(), dequantize_kv(*quantize_kv(v))
    raise ValueError(f"format={fmt!r}")


class RoundedCache(DynamicCache):
    """A DynamicCache that keeps the unquantised K/V and hands attention their rounding in ``fmt``, except during
    the prefill (the first update of a layer), which attends over its own unquantised K/V."""

    def __init__(self, fmt: str, **kwargs):
        super().__init__(**kwargs)
        self.fmt = fmt

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if keys.shape[-2] == key_states.shape[-2]:  # the prefill
            return keys, values
        return round_keys_values(self.fmt, keys, values)


@torch.no_grad()
def decode_nll(model, ids: torch.Tensor, fmt: str) -> tuple[float, int]:
    """Prefill ids[:L - DECODE], then teacher-force the rest one token per step: (summed NLL, tokens scored)."""
    cache = RoundedCache(fmt, config=model.config)
    prefill = ids.shape[1] - DECODE
    out = model(ids[:, :prefill], past_key_values=cache, use_cache=True)
    nll, count = 0.0, 0
    for pos in range(prefill, ids.shape[1] - 1):
        out = model(ids[:, pos:pos + 1], past_key_values=out.past_key_values, use_cache=True)
        nll -= torch.log_softmax(out.logits[0, -1].float(), -1)[ids[0, pos + 1]].item()
        count += 1
    return nll, count


def plot(rows: list[dict], png: Path) -> None:
    """Bars: each format's decode perplexity change against the bf16 cache, one group per window length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = [f for f in FORMATS if f not in ("fp32", "bf16") and any(r["format"] == f for r in rows)]
    lengths = sorted({r["length"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(lengths)
    for i, length in enumerate(lengths):
        by_format = {r["format"]: r["vs_bf16_pct"] for r in rows if r["length"] == length}
        xs = [j + i * width for j in range(len(formats))]
        ax.bar(xs, [by_format.get(f, float("nan")) for f in formats], width, label=f"{length}-token windows")
    ax.axhline(0.5, color="k", linestyle="--", linewidth=0.8, label="target: +0.5%")
    ax.set_xticks([j + width * (len(lengths) - 1) / 2 for j in range(len(formats))], formats, fontsize=8)
    ax.set_ylabel("decode perplexity vs bf16 KV (%)")
    ax.set_title("FP8 KV scale layouts, SmolLM2-135M, dense decode, held-out Emma (CPU, 2026-12-04)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main():
    torch.manual_seed(0)
    tokenizer = load_tokenizer("default")
    model = LlamaForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    formats = tuple(sys.argv[1:]) or FORMATS
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format(s) {unknown}: expected some of {', '.join(FORMATS)}")
    out = HERE / "fp8_kv_layouts.json"
    kept = json.loads(out.read_text())["rows"] if sys.argv[1:] and out.exists() else []
    rows = [r for r in kept if r["format"] not in formats]
    for length, count in WINDOWS.items():
        windows = [torch.tensor(w).reshape(1, -1) for w in perplexity_windows(tokenizer, length, count)]
        for fmt in formats:
            started = time.perf_counter()
            parts = [decode_nll(model, w, fmt) for w in windows]
            ppl = math.exp(sum(p[0] for p in parts) / sum(p[1] for p in parts))
            per_window = [math.exp(p[0] / p[1]) for p in parts]
            rows.append({"length": length, "format": fmt, "decode_ppl": ppl, "per_window": per_window,
                         "seconds": round(time.perf_counter() - started, 1)})
            print(rows[-1], flush=True)
    for row in rows:
        ref = {r["format"]: r["decode_ppl"] for r in rows if r["length"] == row["length"]}
        row["vs_fp32_pct"] = 100 * (row["decode_ppl"] / ref["fp32"] - 1)
        row["vs_bf16_pct"] = 100 * (row["decode_ppl"] / ref["bf16"] - 1)
    rows.sort(key=lambda r: (r["length"], FORMATS.index(r["format"])))
    out.write_text(json.dumps(
        {"model": "SmolLM2-135M-Instruct (fp32, transformers eager attention)", "text": "held-out Emma",
         "windows": WINDOWS, "decode_tokens": DECODE, "block": BLOCK, "rows": rows}, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
