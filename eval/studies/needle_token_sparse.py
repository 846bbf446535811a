"""Does Token Sparse Attention keep the pass key in its sparse layers?

Token Sparse keeps the fidelity sweep's decode perplexity but loses passkeys at 8K. The suspected
cause: its importance scores come from the last ``window`` queries of the prefill. When the question
is decoded afterwards (the sweep's protocol), those queries are filler text that has no reason to
attend to the needle, so the key tokens are dropped in the sparse layers: their residual stream
skips those layers' attention, and the keys and values the question later reads are degraded.

This command measures it. For each passkey prompt it runs two Token Sparse prefills, the context
alone (``decode`` protocol) and context + question (``prefill`` protocol, the question's tokens then
being the scoring window). On every sparse layer it recomputes the kept positions per query head
(:func:`sparse_models.schemes.token_sparse.token_sparse_indices` on the q and k captured in that
same prefill, so the indices are the ones the forward used) and reports the share of pass-key tokens
kept against the share of all prefix tokens kept.

    python -m eval.needle_token_sparse --lengths 2048 4096 8192 --depths 3 \\
        --out benchmarks/results/fidelity_smollm2/needle_token_sparse

``--ruler-samples`` runs the same measurement on RULER prompts (a leaderboard ``samples_<length>.json``,
rendered with the chat template as the leaderboard renders them): the "key" is every token of the answer strings
where they occur in the context, ``decode`` is the leaderboard's default protocol (the context alone is
prefilled) and ``prefill`` its ``--question-phase prefill``.

    python -m eval.needle_token_sparse --ruler-samples outputs/issue31_test/samples_2048.json \
        --tasks niah_single_2 niah_single_3 niah_multikey_1 --ruler-count 10 --out outputs/ts_ruler_2048

The summary averages the prompts whose key lies before the scoring window (at depth 1 it sits
inside the window, which every head keeps); ``summary_with_key_in_window`` averages them all.
``--replot`` recomputes both summaries and the PNG from the JSON's records.

Writes ``<out>.json`` (format ``podkit.needle_token_sparse/1``) and ``<out>.png`` (key-token keep rate
per sparse layer, per protocol, against the overall keep rate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.models import load_model, load_tokenizer
from eval.studies.needle_heads import teacher_forced_prompt
from eval.tasks.passkey import passkey_grid
from sparse_models import capture_attention_inputs
from sparse_models.calibration.outputs import save_figure, write_json
from sparse_models.schemes.token_sparse import token_sparse_indices, token_sparse_layers
from train.long_context_eval import ruler

NEEDLE_TOKEN_SPARSE_FORMAT = "podkit.needle_token_sparse/1"
PROTOCOLS = ("decode", "prefill")   # where the question goes, as in eval.harness.fidelity --question-phase
DEFAULT_CALIBRATION = "benchmarks/results/fidelity_smollm2/calibration/summary.json"


def kept_shares(indices: torch.Tensor, seq_len: int, window: int, key_positions: list[int]) -> tuple[float, float]:
    """(share of key tokens kept, share of prefix tokens kept), averaged over heads.

    ``indices``: ``[1,Hq,K]`` kept positions (-1 padded) of one layer; the prefix is ``[0, seq_len -
    window)``, the window is always kept. Key positions inside the window count as kept.
    """
    num_heads = indices.shape[1]
    kept = torch.zeros(num_heads, seq_len + 1, dtype=torch.bool, device=indices.device)
    kept.scatter_(1, torch.where(indices[0] < 0, seq_len, indices[0]), True)
    kept = kept[:, :seq_len]
    prefix_len = max(seq_len - window, 0)
    key_share = float(kept[:, key_positions].float().mean())
    prefix_share = float(kept[:, :prefix_len].float().mean()) if prefix_len else 1.0
    return key_share, prefix_share


@torch.no_grad()
def analyse_prompts(model, prompts: list[dict], *, progress: bool = True) -> dict:
    """``prompts``: ``{"ids": {protocol: [token ids]}, "key_positions", "length", "depth"}``. The
    model must have ``prefill_scheme="token_sparse"`` set. Returns per-prompt, per-layer shares."""
    config = model.model.sparse_config
    if config.prefill_scheme != "token_sparse":
        raise ValueError(f"prefill_scheme={config.prefill_scheme!r}: set prefill_scheme='token_sparse' first")
    layers = token_sparse_layers(config, model.config.num_hidden_layers)
    cfg = config.token_sparse
    device = next(model.parameters()).device
    records = []
    for prompt in tqdm(prompts, desc="token sparse needle", disable=not progress, file=sys.stderr):
        for protocol in PROTOCOLS:
            ids = torch.tensor([prompt["ids"][protocol]], device=device)
            captured = capture_attention_inputs(model, ids, layers=layers)
            seq_lens = torch.tensor([ids.shape[1]], device=device)
            per_layer = {}
            for layer in layers:
                q, k = captured[layer]
                indices, _, sparse = token_sparse_indices(q, k, seq_lens, cfg)
                key_share, prefix_share = kept_shares(indices, ids.shape[1], cfg.window, prompt["key_positions"])
                per_layer[layer] = {"key": key_share, "prefix": prefix_share, "sparse": bool(sparse[0])}
            del captured
            in_window = min(prompt["key_positions"]) >= ids.shape[1] - cfg.window
            records.append({"length": prompt["length"], "depth": prompt["depth"], "protocol": protocol,
                            "tokens": ids.shape[1], "key_in_window": bool(in_window), "layers": per_layer,
                            "key_kept": sum(v["key"] for v in per_layer.values()) / len(per_layer),
                            "prefix_kept": sum(v["prefix"] for v in per_layer.values()) / len(per_layer),
                            **{k: prompt[k] for k in ("task", "index") if k in prompt}})   # RULER prompts
    return {"sparse_layers": layers, "coverage": cfg.coverage, "window": cfg.window, "records": records}


def summarise(result: dict, include_key_in_window: bool = False) -> dict:
    """Means over prompts: by (protocol, length) overall, and by (protocol, layer) over all lengths.
    Prompts whose key sits inside the scoring window (always kept) count only with
    ``include_key_in_window``."""
    by_length: dict = {}
    by_layer: dict = {}
    for record in result["records"]:
        if record["key_in_window"] and not include_key_in_window:
            continue
        cell = by_length.setdefault(record["protocol"], {}).setdefault(str(record["length"]), [])
        cell.append((record["key_kept"], record["prefix_kept"]))
        for layer, values in record["layers"].items():
            by_layer.setdefault(record["protocol"], {}).setdefault(str(layer), []).append((values["key"], values["prefix"]))

    def mean(pairs):
        return {"key_kept": round(sum(p[0] for p in pairs) / len(pairs), 5),
                "prefix_kept": round(sum(p[1] for p in pairs) / len(pairs), 5), "prompts": len(pairs)}

    return {"by_length": {p: {n: mean(v) for n, v in cells.items()} for p, cells in by_length.items()},
            "by_layer": {p: {n: mean(v) for n, v in cells.items()} for p, cells in by_layer.items()}}


def plot_summary(summary: dict, path: str | Path, key: str = "pass-key tokens") -> Path:
    """Key-token against prefix keep rates, per sparse layer and per length; ``key`` names the key tokens."""
    import matplotlib  # lazy: matplotlib is optional (plots only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (plots only)


    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, grouping, xlabel in zip(axes, ("by_layer", "by_length"), ("sparse layer", "context length (tokens)")):
        for protocol, style in zip(PROTOCOLS, ("-", "--")):
            cells = summary[grouping].get(protocol, {})
            xs = sorted(cells, key=int)
            for field, marker, color, what in (("key_kept", "o", None, key),
                                               ("prefix_kept", ".", "tab:gray", "all prefix tokens")):
                ax.plot([int(x) for x in xs], [100 * cells[x][field] for x in xs], style, marker=marker, color=color,
                        label=f"{what}, question in {protocol}")
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 102)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% kept (mean over heads and prompts)")
    axes[1].set_xscale("log", base=2)
    fig.suptitle(f"Token Sparse Attention: are the {key} kept in the sparse layers? (prompts with the key "
                 "before the scoring window)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def write_outputs(payload: dict, out: Path) -> tuple[Path, Path]:
    """(Re)compute the summaries from ``payload["records"]``, write ``<out>.json`` atomically and the PNG."""
    payload["summary"] = summarise(payload)
    payload["summary_with_key_in_window"] = summarise(payload, include_key_in_window=True)

    key = "pass-key tokens" if payload.get("prompts_from", "passkey grid") == "passkey grid" else "RULER answer tokens"
    return (write_json(out.with_suffix(".json"), payload),
            plot_summary(payload["summary"], out.with_suffix(".png"), key))


def build_prompts(tokenizer, samples) -> list[dict]:
    """The two prefills of each passkey sample and the key-token positions (same in both)."""

    prompts = []
    for sample in samples:
        forced = teacher_forced_prompt(tokenizer, sample)
        context = tokenizer(sample.context)["input_ids"]
        question = tokenizer(sample.question, add_special_tokens=False)["input_ids"]
        prompts.append({"ids": {"decode": list(context), "prefill": list(context) + list(question)},
                        "key_positions": forced.key_positions, "length": sample.target_tokens, "depth": sample.depth})
    return prompts


def answer_token_positions(tokenizer, context: str, answers: list[str]) -> list[int]:
    """Token positions of ``tokenizer(context)`` that overlap any occurrence of any of ``answers`` in ``context``
    (character offsets from the fast tokenizer's offset mapping)."""
    encoded = tokenizer(context, return_offsets_mapping=True)
    spans = []
    for answer in answers:
        start = context.find(answer)
        while answer and start >= 0:
            spans.append((start, start + len(answer)))
            start = context.find(answer, start + 1)
    return [i for i, (a, b) in enumerate(encoded["offset_mapping"])
            if b > a and any(a < end and b > begin for begin, end in spans)]


def build_ruler_prompts(tokenizer, samples, *, chat: bool = True) -> list[dict]:
    """The two prefills of each RULER *retrieval* sample (the NIAH tasks, whose answers are needles written into
    the context) as eval.leaderboard renders it (train/long_context_eval/ruler.py ``render``), and the answer
    tokens' positions in its context. Other categories are left out: their answers (variable names, frequent
    words, QA spans) are not needles, and a word can also match inside others; so is a sample whose answer does
    not occur in its context."""
    prompts = []
    for sample in samples:
        if sample.category != "retrieval":
            continue
        context, question = ruler.render(sample, tokenizer, chat)
        positions = answer_token_positions(tokenizer, context, sample.outputs)
        if not positions:
            continue
        context_ids = tokenizer(context)["input_ids"]
        question_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
        prompts.append({"ids": {"decode": list(context_ids), "prefill": list(context_ids) + list(question_ids)},
                        "key_positions": positions, "length": sample.max_length,
                        "depth": round(min(positions) / len(context_ids), 3), "task": sample.task,
                        "index": sample.index})
    return prompts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m eval.needle_token_sparse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2) or a checkpoint folder")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--depths", type=int, default=10)
    parser.add_argument("--coverage", type=float, default=0.005, help="token_sparse.coverage (tau)")
    parser.add_argument("--calibration", default=DEFAULT_CALIBRATION,
                        help="fidelity calibration summary whose token_sparse_layers to use ('none': config default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="outputs/needle_token_sparse", help="output path without suffix")
    parser.add_argument("--replot", action="store_true", help="recompute the summaries and the PNG from <out>.json")
    parser.add_argument("--ruler-samples", default=None,
                        help="a leaderboard samples_<length>.json: RULER prompts instead of the pass-key grid")
    parser.add_argument("--tasks", nargs="+", default=None, help="with --ruler-samples: only these tasks")
    parser.add_argument("--ruler-count", type=int, default=None,
                        help="with --ruler-samples: the first N samples of each task")
    parser.add_argument("--window", type=int, default=None, help="token_sparse.window (default: the config's)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        payload = json.loads(out.with_suffix(".json").read_text())
        if payload.get("format") != NEEDLE_TOKEN_SPARSE_FORMAT:
            parser.error(f"{out.with_suffix('.json')}: not a needle_token_sparse file (format {payload.get('format')!r})")
        print("wrote {} and {}".format(*write_outputs(payload, out)))
        return payload
    if not 0.0 < args.coverage < 1.0:
        parser.error(f"--coverage {args.coverage} is invalid: expected a number in (0, 1)")
    bad = [n for n in args.lengths if n < 16]
    if bad:
        parser.error(f"--lengths {args.lengths} is invalid: every length must be >= 16")
    ruler_samples = None
    if args.ruler_samples:
        path = Path(args.ruler_samples)
        if not path.is_file():
            parser.error(f"--ruler-samples {args.ruler_samples}: no such file (eval.leaderboard --generate-only "
                         "writes samples_<length>.json)")
        ruler_samples = [ruler.RulerSample.from_dict(d) for d in json.loads(path.read_text())["samples"]]
        known = sorted({sample.task for sample in ruler_samples})
        unknown = sorted(set(args.tasks or ()) - set(known))
        if unknown:
            parser.error(f"--tasks {' '.join(unknown)} is invalid: {path} holds {', '.join(known)}")
        if args.ruler_count is not None and args.ruler_count < 1:
            parser.error(f"--ruler-count {args.ruler_count} is invalid: expected >= 1")
        ruler_samples = [s for s in ruler_samples if (not args.tasks or s.task in args.tasks)
                         and (args.ruler_count is None or s.index < args.ruler_count)]
    if args.window is not None and args.window < 1:
        parser.error(f"--window {args.window} is invalid: expected >= 1")
    overrides = {"prefill_scheme": "token_sparse", "token_sparse_coverage": args.coverage}
    if args.window is not None:
        overrides["token_sparse_window"] = args.window
    if args.calibration.lower() != "none":
        path = Path(args.calibration)
        if not path.is_file():
            parser.error(f"--calibration {args.calibration}: no such file (use 'none' for the config default)")
        overrides["token_sparse_sparse_layers"] = json.loads(path.read_text())["token_sparse_layers"]

    tokenizer = load_tokenizer(args.model)
    if ruler_samples is not None:
        prompts = build_ruler_prompts(tokenizer, ruler_samples)
        if not prompts:
            parser.error(f"--ruler-samples {args.ruler_samples}: no retrieval sample with its answer in the context "
                         f"among the tasks chosen ({' '.join(args.tasks or ['all'])})")
        lengths = sorted({p["length"] for p in prompts})
    else:
        prompts = build_prompts(tokenizer, passkey_grid(tokenizer, args.lengths, args.depths))
        lengths = args.lengths
    model = load_model(args.model, device=args.device, **overrides)
    result = analyse_prompts(model, prompts)
    payload = {"format": NEEDLE_TOKEN_SPARSE_FORMAT, "model": args.model, "lengths": lengths,
               "prompts_from": args.ruler_samples or "passkey grid",
               "depths": args.depths, "device": str(args.device), "coverage": result["coverage"],
               "window": result["window"], "sparse_layers": result["sparse_layers"], "records": result["records"]}
    json_path, png_path = write_outputs(payload, out)
    summary = payload["summary"]
    for protocol in PROTOCOLS:
        cells = summary["by_length"][protocol]
        print(f"question in {protocol}: " + ", ".join(
            f"{n}: key tokens kept {100 * c['key_kept']:.0f}% vs all prefix tokens {100 * c['prefix_kept']:.0f}%"
            for n, c in sorted(cells.items(), key=lambda x: int(x[0]))))
    print(f"wrote {json_path} and {png_path}")
    return payload


if __name__ == "__main__":
    main()
