"""Which token ranking keeps RULER's answer tokens in Token Sparse's sparse layers, at the same budget? (issue 31)

BENCHMARKS.md "Why calibrated Token Sparse stays below dense" found the answer tokens of RULER's needles ranked
*below* the average prefix token by the paper's score (the window queries' mean softmax probability, average-pooled
over 7 tokens). This study keeps each layer's budget exactly as podkit computes it (dynamic token coverage,
``token_sparse_indices``) and changes only the ranking inside it, on the q and k captured in the same Token Sparse
prefill:

    mean       the paper's score (the window queries' mean probability), avg-pooled: what podkit runs
    max        the largest probability any one window query gives the key, avg-pooled
    mean_maxpool  the mean score, pooled with a max-pool of the same width instead (a peak's neighbours kept)
    max_maxpool   the max score, max-pooled
    headmean   the mean score averaged over the KV group's query heads (one list per group)

Per prompt and protocol it reports the share of answer tokens kept (mean over sparse layers and query heads) against
the share of all prefix tokens kept, which is the same for every ranking (same budget). Dev seed only
(``outputs/issue31_dev``, seed 104729): this is for choosing, not for reporting.

    python benchmarks/cpu_2026-12-07/token_sparse_ranking.py outputs/issue31_dev/samples_4096.json 3 \
        benchmarks/cpu_2026-12-07/token_sparse_ranking_4096.json
    python benchmarks/cpu_2026-12-07/token_sparse_ranking.py --plot OUT.png RESULT.json [RESULT.json ...]

``--plot`` draws, per length and protocol, the answer tokens kept under each ranking beside the prefix share.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.models import load_model, load_tokenizer
from eval.studies.needle_token_sparse import build_ruler_prompts
from sparse_models import capture_attention_inputs
from sparse_models.schemes.token_sparse import token_sparse_indices, token_sparse_layers
from train.long_context_eval import ruler

TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue")
RANKINGS = ("mean", "max", "mean_maxpool", "max_maxpool", "headmean")
WINDOW = 256   # the calibrated pick's window (benchmarks/h200_2026-12-03/issue31/variants.json)


def window_probs(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """q [Hq, n, D], k [Hkv, n, D] -> the last ``window`` queries' causal softmax over all keys: [Hq, W, n] fp32."""
    num_heads, n, dim = q.shape
    group = num_heads // k.shape[0]
    q_win = q[:, n - window:].float() * dim ** -0.5
    logits = torch.einsum("hwd,hnd->hwn", q_win, k.float().repeat_interleave(group, 0))
    causal = torch.arange(n)[None, :] <= torch.arange(n - window, n)[:, None]
    return logits.masked_fill(~causal[None], float("-inf")).softmax(-1)


def rankings(probs: torch.Tensor, prefix: int, group: int, pool: int) -> dict[str, torch.Tensor]:
    """Per ranking, a score [Hq, prefix] over the prefix keys (higher = kept first)."""
    mean = probs[:, :, :prefix].mean(1)
    top = probs[:, :, :prefix].amax(1)
    pad = pool // 2
    avg = lambda s: F.avg_pool1d(s[:, None], pool, stride=1, padding=pad, count_include_pad=True)[:, 0]  # noqa: E731
    mx = lambda s: F.max_pool1d(s[:, None], pool, stride=1, padding=pad)[:, 0]  # noqa: E731
    heads = mean.shape[0]
    group_mean = avg(mean).reshape(heads // group, group, prefix).mean(1).repeat_interleave(group, 0)
    return {"mean": avg(mean), "max": avg(top), "mean_maxpool": mx(mean), "max_maxpool": mx(top),
            "headmean": group_mean}


def kept_share(score: torch.Tensor, budget: int, positions: list[int]) -> float:
    """Share of ``positions`` among each head's top-``budget`` of ``score`` [H, prefix], averaged over heads."""
    top = score.topk(min(budget, score.shape[1]), dim=-1).indices
    kept = torch.zeros_like(score, dtype=torch.bool).scatter_(1, top, True)
    return float(kept[:, positions].float().mean())


@torch.no_grad()
def main(samples_path: str, count: int, out: str) -> None:
    torch.manual_seed(0)
    samples = [ruler.RulerSample.from_dict(d) for d in json.loads(Path(samples_path).read_text())["samples"]]
    samples = [s for s in samples if s.task in TASKS and s.index < count]
    tokenizer = load_tokenizer("default")
    prompts = build_ruler_prompts(tokenizer, samples)
    model = load_model("default", device="cpu", prefill_scheme="token_sparse", token_sparse_window=WINDOW)
    config = model.model.sparse_config
    cfg = config.token_sparse
    layers = token_sparse_layers(config, model.config.num_hidden_layers)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    records = []
    for i, prompt in enumerate(prompts):
        for protocol in ("decode", "prefill"):
            start = time.time()
            ids = torch.tensor([prompt["ids"][protocol]])
            n = ids.shape[1]
            prefix = n - cfg.window
            positions = [p for p in prompt["key_positions"] if p < prefix]
            if not positions:
                continue
            captured = capture_attention_inputs(model, ids, layers=layers)
            per_layer = {}
            for layer in layers:
                q, k = captured[layer]
                _, kept, sparse = token_sparse_indices(q, k, torch.tensor([n]), cfg)
                budget = int(kept[0]) - min(n, cfg.window)   # the prefix tokens each head keeps
                scores = rankings(window_probs(q[0], k[0], cfg.window), prefix, group, cfg.pool_kernel)
                per_layer[layer] = {"budget": budget, "prefix_kept": budget / prefix, "sparse": bool(sparse[0]),
                                    **{name: kept_share(s, budget, positions) for name, s in scores.items()}}
            del captured
            record = {"task": prompt["task"], "index": prompt["index"], "protocol": protocol, "tokens": n,
                      "depth": prompt["depth"], "layers": per_layer,
                      "prefix_kept": sum(v["prefix_kept"] for v in per_layer.values()) / len(per_layer),
                      **{name: sum(v[name] for v in per_layer.values()) / len(per_layer) for name in RANKINGS}}
            records.append(record)
            print(f"[{i + 1}/{len(prompts)}] {prompt['task']} #{prompt['index']} {protocol} ({time.time() - start:.0f} s): "
                  f"prefix {100 * record['prefix_kept']:.0f}% | "
                  + " ".join(f"{name} {100 * record[name]:.0f}%" for name in RANKINGS), flush=True)
            summary = {protocol: {name: sum(r[name] for r in records if r["protocol"] == protocol)
                                  / max(1, sum(r["protocol"] == protocol for r in records))
                                  for name in ("prefix_kept", *RANKINGS)} for protocol in ("decode", "prefill")}
            Path(out).write_text(json.dumps({"samples": samples_path, "count_per_task": count, "tasks": TASKS,
                                             "window": cfg.window, "coverage": cfg.coverage,
                                             "sparse_layers": layers, "summary": summary, "records": records},
                                            indent=1))
    print(json.dumps(summary, indent=1))


def plot(out: str, paths: list[str]) -> None:
    """Grouped bars: per (length, protocol), the mean share of answer tokens kept per ranking, and the prefix's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparse_models.calibration.outputs import save_figure

    groups = []
    for path in paths:
        payload = json.loads(Path(path).read_text())
        length = Path(payload["samples"]).stem.removeprefix("samples_")  # samples_<length>.json
        for protocol, cell in payload["summary"].items():
            prompts = sum(r["protocol"] == protocol for r in payload["records"])
            groups.append((f"RULER {length}, question in {protocol}\n({prompts} prompts)", cell))
    names = ("prefix_kept", *RANKINGS)
    fig, ax = plt.subplots(figsize=(2.2 * len(groups) + 3.5, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ax.bar([i + j * width for i in range(len(groups))], [100 * cell[name] for _, cell in groups], width,
               label="all prefix tokens" if name == "prefix_kept" else f"answer tokens, {name}",
               color="0.75" if name == "prefix_kept" else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [label for label, _ in groups], fontsize=8)
    ax.set_ylabel("kept, % (mean over sparse layers and heads)")
    ax.set_ylim(0, 100)
    ax.set_title("Token Sparse: RULER answer tokens kept per ranking, same budget (dev seed)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    print(f"wrote {save_figure(fig, out)}")


if __name__ == "__main__":
    if sys.argv[1] == "--plot":
        plot(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
