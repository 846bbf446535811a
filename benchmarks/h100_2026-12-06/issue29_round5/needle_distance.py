"""Where the 8K POD exports lose RULER retrieval: by the needle's distance from the answer (CPU analysis of the
per-sample test records already scored; nothing is re-run).

For every retrieval sample of the 8K recipe's test split (seed 7919, 8 NIAH tasks x 20 samples per length), the
prompt is rendered as the pipeline scores it (train/long_context_eval/scoring.py: chat template, the context
prefilled, the question fed through decode) and the answer strings are located in the context
(eval/studies/needle_token_sparse.py ``build_ruler_prompts``). The distance of a sample is the number of tokens
between its farthest answer token and the first answer position. Under POD at 8K (16 sink tokens + a 1008-token
recent window, recipes/smollm2_135m_gpu_8k.yaml) a needle within 1008 tokens is read with the layer's own keys; beyond
it, through the shared distant path. Each row's mean retrieval score is reported per distance bucket.
    python3 benchmarks/h100_2026-12-06/issue29_round5/needle_distance.py RULER_SAMPLES_DIR
RULER_SAMPLES_DIR: the 8K recipe's samples (benchmarks/plans/ruler_samples.py; test_seed7919_<length>.json).
Writes needle_distance.json and needle_distance.png here."""
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
from eval.models import load_tokenizer  # noqa: E402
from eval.studies.needle_token_sparse import build_ruler_prompts  # noqa: E402
from train.long_context_eval import ruler  # noqa: E402

RECENT = 1008      # the 8K recipe's pod.recent_window
BUCKETS = [(0, RECENT), (RECENT, 2048), (2048, 4096), (4096, 8192)]
ROWS = {  # label -> rows JSON (per-sample records of the test split)
    "original": ROOT / "benchmarks/h200_2026-12-03/issue29/rows/original.json",
    "control, recall rows": HERE / "rows/control_8k_recall.json",
    "POD, recall rows": HERE.parent / "issue29_round4/rows/pod_8k_scores_recall.json",
    "its weights densely": HERE.parent / "issue29_round4/rows/pod_8k_scores_recall_dense.json",
    "POD, shipped 8K": ROOT / "benchmarks/h200_2026-12-04/issue29_round3/rows/pod_8k_scores.json",
}


def distances(samples_dir: Path, tokenizer) -> dict[tuple, int]:
    """(task, length, index) -> tokens from the farthest answer token to the first answer position (the prompt
    with its question, as eval.needle_token_sparse's RULER mode builds it)."""
    samples = [ruler.RulerSample.from_dict(data) for path in sorted(samples_dir.glob("test_seed7919_*.json"))
               for data in json.loads(path.read_text())["samples"]]
    return {(p["task"], p["length"], p["index"]): len(p["ids"]["prefill"]) - min(p["key_positions"])
            for p in build_ruler_prompts(tokenizer, samples)}


def bucket_of(distance: int) -> str:
    return next(f"{a}-{b}" for a, b in BUCKETS if a < distance <= b) if distance > 0 else f"0-{RECENT}"


def main(argv: list[str]) -> dict:
    tokenizer = load_tokenizer("default")
    far = distances(Path(argv[0]), tokenizer)
    result = {"recent_window": RECENT, "samples": len(far), "rows": {}}
    for label, path in ROWS.items():
        cells = defaultdict(list)
        for r in json.loads(path.read_text())["records"]:
            key = (r["task"], r["length"], r["index"])
            if key in far:
                cells[(r["length"], bucket_of(far[key]))].append(r["score"])
        result["rows"][label] = {f"{n}@{b}": {"score": round(sum(v) / len(v), 1), "n": len(v)}
                                 for (n, b), v in sorted(cells.items())}
    (HERE / "needle_distance.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result)
    for label, cells in result["rows"].items():
        print(label, {k: (v["score"], v["n"]) for k, v in cells.items()})
    return result


def plot(result: dict) -> None:
    lengths = sorted({int(k.split("@")[0]) for cells in result["rows"].values() for k in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4.2), sharey=True)
    for ax, length in zip(axes, lengths):
        names = [f"{a}-{b}" for a, b in BUCKETS if a < length]
        for i, (label, cells) in enumerate(result["rows"].items()):
            values = [cells.get(f"{length}@{b}", {}).get("score") for b in names]
            xs = [j + 0.16 * (i - 2) for j in range(len(names))]
            ax.bar([x for x, v in zip(xs, values) if v is not None], [v for v in values if v is not None],
                   width=0.16, label=label)
        counts = [result["rows"]["POD, recall rows"].get(f"{length}@{b}", {}).get("n", 0) for b in names]
        ax.set_xticks(range(len(names)), [f"{b}\n(n={c})" for b, c in zip(names, counts)], fontsize=8)
        ax.set_title(f"{length} tokens", fontsize=10)
        ax.set_xlabel("needle distance from the answer (tokens)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("RULER retrieval score, test split")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Retrieval by needle distance: within the {RECENT}-token recent window POD reads its own keys",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "needle_distance.png", dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
