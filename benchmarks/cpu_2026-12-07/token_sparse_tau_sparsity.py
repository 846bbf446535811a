"""How many tokens does Token Sparse drop on RULER prompts at each coverage tau, and how does that move with length?
(issue 31)

The 10-sample sweep of 2026-12-07 (BENCHMARKS.md "Token Sparse's grid at 10 samples per task") found one setting that
moves 4K: tau 0.001, a larger budget than the paper's 0.005. Its engine rows recorded no sparsity, so the sweep could
not say what that budget costs. This study prefills the same dev prompts (seed 104729, the context only: the
question-decoded protocol of those rows) with each tau and records Token Sparse's own report
(``model.token_sparse_stats``): per prompt, the dropped share of each sparse layer's tokens, averaged over the sparse
layers (15-29) and the heads, as the leaderboard records it. Dev seed only: it chooses nothing.

    python benchmarks/cpu_2026-12-07/token_sparse_tau_sparsity.py outputs/issue31_dev 2 \
        benchmarks/cpu_2026-12-07/token_sparse_tau_sparsity.json 2048 4096 8192
    python benchmarks/cpu_2026-12-07/token_sparse_tau_sparsity.py --plot OUT.png RESULT.json
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from eval.models import load_model, load_tokenizer
from eval.runner import apply_overrides, new_cache, token_sparse_sparsity
from train.long_context_eval import ruler

TAUS = (0.005, 0.001)


@torch.no_grad()
def main(samples_dir: str, per_task: int, out: str, lengths: list[int]) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model("default", device="cpu", dtype="float32"), load_tokenizer("default")
    base = model.sparse_config
    result = {"protocol": {"seed": 104729, "samples_per_task": per_task, "taus": TAUS, "phase": "context prefill",
                           "model": "default", "dtype": "float32", "device": "cpu"}, "rows": []}
    for length in lengths:
        data = json.loads((Path(samples_dir) / f"samples_{length}.json").read_text())["samples"]
        counts: dict[str, int] = defaultdict(int)
        samples = []
        for d in data:
            if counts[d["task"]] < per_task:
                counts[d["task"]] += 1
                samples.append(ruler.RulerSample.from_dict(d))
        for sample in samples:
            context, _ = ruler.render(sample, tokenizer, True)
            ids = tokenizer(context, return_tensors="pt")["input_ids"]
            row = {"length": length, "task": sample.task, "index": sample.index, "tokens": ids.shape[1]}
            for tau in TAUS:
                apply_overrides(model, base, {"prefill_scheme": "token_sparse", "token_sparse_coverage": tau})
                began = time.perf_counter()
                model(input_ids=ids, past_key_values=new_cache(model), use_cache=True)
                row[f"dropped_{tau}"] = token_sparse_sparsity(model)
                row[f"seconds_{tau}"] = round(time.perf_counter() - began, 2)
            apply_overrides(model, base, {})
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(out).write_text(json.dumps(result, indent=1))   # partial results survive a stop
    result["summary"] = summary(result["rows"])
    Path(out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


def summary(rows: list[dict]) -> dict:
    """Per length and tau: the mean dropped share over prompts, its range, and the prompt count."""
    out = {}
    for length in sorted({r["length"] for r in rows}):
        cells = [r for r in rows if r["length"] == length]
        out[str(length)] = {str(tau): {"mean_dropped": round(sum(r[f"dropped_{tau}"] for r in cells) / len(cells), 4),
                                       "min": round(min(r[f"dropped_{tau}"] for r in cells), 4),
                                       "max": round(max(r[f"dropped_{tau}"] for r in cells), 4),
                                       "prompts": len(cells)} for tau in TAUS}
    return out


def plot(out: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = json.loads(Path(path).read_text())["summary"]
    lengths = sorted(int(n) for n in table)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for tau in TAUS:
        cells = [table[str(n)][str(tau)] for n in lengths]
        ax.errorbar(lengths, [c["mean_dropped"] for c in cells], fmt="o-", capsize=4, label=f"tau {tau}",
                    yerr=[[c["mean_dropped"] - c["min"] for c in cells], [c["max"] - c["mean_dropped"] for c in cells]])
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
    ax.set_ylim(0, 1)
    ax.set_ylabel("tokens dropped per sparse layer")
    ax.set_title("Token Sparse on RULER dev prompts (mean, min-max), SmolLM2-135M, CPU", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    if sys.argv[1] == "--plot":
        plot(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3], [int(n) for n in sys.argv[4:]])
