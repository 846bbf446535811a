"""How much POD's compute skipping (``pod.gate_tau``) skips on real text, and what it costs in perplexity.

    python -m eval.pod_gate_skip [--model default|EXPORT] [--blocks-file JSON] [--taus 0.5 0.7 0.9]
        [--context 1024] [--decode-tokens 256] [--windows 2] [--texts emma moby_dick] --out DIR

POD (Ma et al., arXiv 2412.02252, section 2.3) lets a query head skip its distant attention when its
proximal gate g = sigmoid(lse_P - lse_D) is >= tau (paper: 0.7). Under key sharing the gate of a
shared head is estimated before the distant keys are read: ``pod.gate_estimate="anchor"`` (default)
takes the gate the anchor layer computed for the same query head in the same step
(sparse_models/schemes/pod.py, ``pod_decode``). The Triton kernel saves bytes only for a KV group whose
G query heads all skip. For each tau this tool reports, on held-out text, with decode steps recorded by
``sparse_models.schemes.pod_skip_stats.record_gate_skips``:

1. head skip fraction: (decode step, layer, query head) of shared (non-anchor) heads with estimated
   gate >= tau, overall and per layer;
2. group skip fraction: (step, layer, KV head) of shared KV heads whose G query heads all skip, and
   the distant bytes skipped = sum over skipped groups of D / sum over every (step, layer, KV head),
   anchor layers included, of D, with D = max(0, seq_len - sink - recent) the step's distant positions
   (one anchor-key row + one own-value row each, the same size in every layer); also the same skipped
   rows over all K/V rows the step's attention reads (``kv_bytes_skipped_fraction``);
3. the quality cost: decode-phase perplexity (eval.harness.quality.run_perplexity / eval.runner.window_perplexity:
   each window's first ``context - decode_tokens`` tokens prefilled, the rest fed one decode step at a
   time through the model's sparse cache and scored) with gate_tau=tau against gate_tau=None, same
   windows, and the relative change.

The no-tau run also records every shared head's estimated gate (computed on the side, the output
unchanged): its 20-bin histogram shows where tau falls, and ``at_no_tau_gates`` gives the fractions
each tau would skip at those gates (the tau runs' own fractions differ a little: a skip changes the
later layers' inputs).

Models: ``--model default`` (the embedded SmolLM2-135M-Instruct) runs POD zero-shot with the block map
of ``--blocks-file`` (default recipes/pod_blocks/smollm2_135m_2k.json) and 16 sink + 240 recent tokens;
``--model EXPORT`` (a folder written by train/pod.py) runs with the block map and window of its config.
Texts (``--texts``): the held-out books, *Emma* (in domain, left out of POD training) and *Moby Dick*
(out of domain), ``--windows`` non-overlapping windows of ``--context`` tokens each
(eval/tasks/perplexity.py).

Writes ``DIR/pod_gate_skip.json`` (everything above, the command, date, model, texts and settings) and
``DIR/pod_gate_skip.png`` (left: the gate histogram with the taus; right: head / group skip and
distant bytes skipped, and the perplexity change, against tau) where matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eval.data.texts import TEXT_NAMES
from eval.harness.fidelity import (  # POD_SINK / POD_RECENT: the zero-shot window of the fidelity sweep (recipe 16 + 240)
    POD_RECENT,
    POD_SINK,
    plot_if_possible,
)
from eval.harness.plots import _plt
from eval.harness.quality import run_perplexity, summarise
from eval.models import is_default_model, load_model, load_tokenizer
from eval.runner import apply_overrides
from eval.schemes import Setting, pod_zero_shot
from sparse_models.calibration.outputs import save_figure
from sparse_models.calibration.pod_similarity import read_blocks_json
from sparse_models.schemes.pod_skip_stats import gate_histogram, record_gate_skips, skip_summary

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BLOCKS = "recipes/pod_blocks/smollm2_135m_2k.json"
DEFAULT_TEXTS = ["emma", "moby_dick"]
HISTOGRAM_BINS = 20


def _fail(option: str, value: Any, allowed: str) -> None:
    raise SystemExit(f"error: {option} {value!r} is invalid: {allowed}")


def _model_pod_config(model: str) -> dict | None:
    """The ``sparse_attention.pod`` section of an export's config.json (None for the embedded default)."""

    if is_default_model(model):
        return None
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        _fail("--model", model, "expected 'default' (the embedded SmolLM2-135M) or an export folder with config.json "
                                "(written by train/pod.py)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        _fail("--model", model, f"its config.json is not JSON ({error})")
    return dict((config.get("sparse_attention") or {}).get("pod") or {})


def check_arguments(args: argparse.Namespace) -> dict:
    """Every check that needs no model (bad input fails here, before any loading); returns the resolved
    POD settings: blocks file, sink, recent, sharing."""

    if not args.taus:
        _fail("--taus", args.taus, "expected one or more numbers in (0, 1], e.g. 0.5 0.7 0.9")
    for tau in args.taus:
        if not 0.0 < tau <= 1.0:
            _fail("--taus", tau, "every tau must be in (0, 1] (a head skips when its estimated gate >= tau; paper 0.7)")
    if args.context < 4:
        _fail("--context", args.context, "expected an integer >= 4 (tokens per window)")
    if args.decode_tokens < 2:
        _fail("--decode-tokens", args.decode_tokens, "expected an integer >= 2 (the first decoded token is not scored)")
    if args.decode_tokens >= args.context - 1:
        _fail("--decode-tokens", args.decode_tokens, f"expected fewer than --context - 1 = {args.context - 1} "
                                                     f"(the rest of the {args.context}-token window is prefilled)")
    if args.windows < 1:
        _fail("--windows", args.windows, "expected an integer >= 1 (windows per text)")
    for text in args.texts:
        if text not in TEXT_NAMES:
            _fail("--texts", text, f"expected held-out book names among {', '.join(TEXT_NAMES)}")
    if args.sink is not None and args.sink < 0:
        _fail("--sink", args.sink, "expected an integer >= 0")
    if args.recent is not None and args.recent < 1:
        _fail("--recent", args.recent, "expected an integer >= 1")
    pod = _model_pod_config(args.model)
    blocks = args.blocks_file
    if pod is None:
        blocks = blocks or str(REPO / DEFAULT_BLOCKS)
        sink = POD_SINK if args.sink is None else args.sink
        recent = POD_RECENT if args.recent is None else args.recent
        sharing = "keys"
    else:
        if blocks is None and not pod.get("anchor_layers"):
            _fail("--model", args.model, "its config carries no POD anchor map (sparse_attention.pod.anchor_layers): "
                                         "pass a POD export written by train/pod.py, or --blocks-file BLOCKS.json")
        sink = int(pod.get("sink_tokens", 16)) if args.sink is None else args.sink
        recent = int(pod.get("recent_window", 4080)) if args.recent is None else args.recent
        sharing = pod.get("sharing", "keys")
    if sharing != "keys":
        _fail("--model", args.model, f"its pod.sharing is {sharing!r}: the skip statistics cover key sharing "
                                     "(sharing='keys', paper v2) only")
    if blocks is not None:
        path = Path(blocks)
        if not path.is_file():
            _fail("--blocks-file", blocks, "no such file: expected a POD blocks JSON (recipes/pod_blocks/*.json, "
                                           "or the pod_blocks.json that train/pod.py writes)")
        try:
            read_blocks_json(path)
        except (ValueError, KeyError, json.JSONDecodeError) as error:
            _fail("--blocks-file", blocks, f"not a POD blocks JSON ({error})")
    first_decode = args.context - args.decode_tokens + 1  # cache length at the first decode step
    if sink + recent >= first_decode:
        _fail("--sink/--recent", f"{sink} + {recent}", f"the proximal window must leave distant positions at every "
              f"decode step: sink + recent < --context - --decode-tokens + 1 = {first_decode}")
    return {"blocks_file": str(blocks) if blocks else None, "sink": sink, "recent": recent}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.pod_gate_skip", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M, POD zero-shot) or a POD export folder (train/pod.py)")
    parser.add_argument("--blocks-file", default=None,
                        help=f"POD blocks JSON (default: {DEFAULT_BLOCKS} for the default model, the export's own map)")
    parser.add_argument("--taus", type=float, nargs="+", default=[0.5, 0.7, 0.9], help="gate thresholds in (0, 1]")
    parser.add_argument("--context", type=int, default=1024, help="tokens per window (default 1024)")
    parser.add_argument("--decode-tokens", type=int, default=256,
                        help="last tokens of each window decoded one at a time and scored (default 256)")
    parser.add_argument("--windows", type=int, default=2, help="windows per text (default 2)")
    parser.add_argument("--texts", nargs="+", default=DEFAULT_TEXTS,
                        help="held-out books (default: emma, in domain, and moby_dick, out of domain)")
    parser.add_argument("--sink", type=int, default=None,
                        help="POD sink tokens (default: the export's; 16 for the default model)")
    parser.add_argument("--recent", type=int, default=None,
                        help="POD recent window (default: the export's; 240 for the default model)")
    parser.add_argument("--gate-estimate", default="anchor", choices=["anchor", "exact"],
                        help="how a shared head's gate is estimated: the anchor layer's (default, what the kernel "
                             "can skip on) or the layer's own exact gate")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=Path("outputs/pod_gate_skip"),
                        help="folder for pod_gate_skip.json and pod_gate_skip.png")
    return parser


def _ppl(records: list[dict]) -> float | None:
    table = summarise(records).get("ppl", {})
    cells = [cell for by_length in table.values() for cell in by_length.values()]
    return cells[0]["decode_ppl"] if len(cells) == 1 else None


def _ppl_by_text(records: list[dict], texts: list[str]) -> dict:
    return {"pooled": _ppl(records), **{text: _ppl([r for r in records if r["text"] == text]) for text in texts}}


def _change(value: float | None, reference: float | None) -> float | None:
    return value / reference - 1 if value is not None and reference else None


def _compact(summary: dict) -> dict:
    return {key: summary[key] for key in ("head_skip_fraction", "group_skip_fraction",
                                          "distant_bytes_skipped_fraction", "kv_bytes_skipped_fraction")}


def measure(model, tokenizer, settings: dict, args: argparse.Namespace) -> dict:
    """The no-tau run and one run per tau, each recorded; returns the report's measurements."""
    base = model.sparse_config
    overrides = pod_zero_shot(settings["blocks_file"], pod_sink_tokens=settings["sink"],
                              pod_recent_window=settings["recent"], pod_gate_estimate=args.gate_estimate).overrides
    apply_overrides(model, base, overrides)
    anchor_map = _anchor_map_summary(model)
    runs = [None] + list(args.taus)
    bar = tqdm(total=len(runs) * len(args.texts) * args.windows, desc="windows", unit="window")
    results: dict[Any, dict] = {}
    for tau in runs:
        label = "pod" if tau is None else f"pod[gate_tau={tau:g}]"
        apply_overrides(model, base, overrides | {"pod_gate_tau": tau})
        bar.set_postfix_str(label)
        records: list[dict] = []
        with record_gate_skips() as recorder:
            for text in args.texts:
                for record in run_perplexity(model, tokenizer, Setting(label, "pod", {"pod_gate_tau": tau}),
                                             [args.context], args.windows, args.decode_tokens, text=text,
                                             emit=lambda _record: bar.update(1)):
                    records.append(record | {"text": text})
        results[tau] = {"records": records, "gates": recorder.records}
    bar.close()
    apply_overrides(model, base, {})

    reference = results[None]
    no_tau_ppl = _ppl_by_text(reference["records"], args.texts)
    histogram = gate_histogram(reference["gates"], bins=HISTOGRAM_BINS)
    taus = []
    for tau in args.taus:
        recorded = skip_summary(results[tau]["gates"])
        ppl = _ppl_by_text(results[tau]["records"], args.texts)
        taus.append({
            "tau": tau, **{k: v for k, v in recorded.items() if k not in ("tau", "from")},
            "decode_ppl": ppl["pooled"], "decode_ppl_no_tau": no_tau_ppl["pooled"],
            "decode_ppl_change": _change(ppl["pooled"], no_tau_ppl["pooled"]),
            "by_text": {text: {"decode_ppl": ppl[text], "decode_ppl_no_tau": no_tau_ppl[text],
                               "decode_ppl_change": _change(ppl[text], no_tau_ppl[text])} for text in args.texts},
            "at_no_tau_gates": _compact(skip_summary(reference["gates"], tau=tau)),
        })
    return {"anchor_map": anchor_map, "decode_ppl_no_tau": no_tau_ppl,
            "gate_histogram": histogram | {"from": "the no-tau run's estimates"},
            "taus": taus, "decode_steps": skip_summary(reference["gates"])["steps"],
            "windows": [{"text": r["text"], "window": r["window"], "decode_nll_no_tau": r["decode_nll"],
                         "decode_tokens": r["decode_tokens"]} for r in reference["records"]]}


def _anchor_map_summary(model) -> dict:
    anchors = model.sparse_config.pod.anchor_map(model.config.num_hidden_layers, model.config.num_key_value_heads)
    shared = sum(a != layer for layer, row in enumerate(anchors) for a in row)
    return {"num_layers": len(anchors), "num_kv_heads": len(anchors[0]),
            "query_heads_per_kv_head": model.config.num_attention_heads // model.config.num_key_value_heads,
            "shared_units": shared, "units": len(anchors) * len(anchors[0]), "anchor_layers": anchors}


def plot_report(report: dict, path: Path) -> Path:
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    hist = report["gate_histogram"]
    total = max(hist["total"], 1)
    edges = hist["edges"]
    left.bar(edges[:-1], [c / total for c in hist["counts"]], width=edges[1] - edges[0], align="edge",
             color="#7a9cc6", edgecolor="white")
    for row in report["taus"]:
        left.axvline(row["tau"], color="#c0392b", linestyle="--", linewidth=1)
        left.text(row["tau"], left.get_ylim()[1] * 0.95, f" τ={row['tau']:g}", color="#c0392b", fontsize=8, va="top")
    left.set_xlim(0, 1)
    left.set_xlabel("estimated proximal gate g of shared heads (no-tau run)")
    left.set_ylabel("fraction of (step, layer, head)")
    left.set_title("gate distribution", fontsize=10)
    taus = [row["tau"] for row in report["taus"]]

    def percent(key):
        return [100 * (row[key] or 0.0) for row in report["taus"]]

    right.plot(taus, percent("head_skip_fraction"), marker="o", label="heads skipped")
    right.plot(taus, percent("group_skip_fraction"), marker="s", label="KV groups skipped")
    right.plot(taus, percent("distant_bytes_skipped_fraction"), marker="^", label="distant bytes skipped")
    right.set_xlabel("tau")
    right.set_ylabel("% skipped")
    right.set_ylim(0, 100)
    twin = right.twinx()
    twin.plot(taus, [100 * (row["decode_ppl_change"] or 0.0) for row in report["taus"]], marker="D", color="black",
              linestyle=":", label="decode ppl change")
    twin.set_ylabel("decode-phase perplexity change vs no tau (%)")
    lines = right.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    right.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15),
                 ncol=2, frameon=False)
    right.set_title("skipping and its perplexity cost", fontsize=10)
    fig.suptitle(f"POD gate skipping: {report['model_label']}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def _print_table(report: dict) -> None:
    ppl = report["decode_ppl_no_tau"]["pooled"]
    print(f"[pod_gate_skip] {report['model_label']}: decode-phase perplexity without tau {ppl:.4f} "
          f"({report['decode_steps']} decode steps)")
    print("  tau   heads   groups  distant bytes   ppl       change   (at no-tau gates: heads / groups / bytes)")
    for row in report["taus"]:
        at = row["at_no_tau_gates"]
        print(f"  {row['tau']:<5g} {100 * row['head_skip_fraction']:5.1f}%  {100 * row['group_skip_fraction']:5.1f}%  "
              f"{100 * row['distant_bytes_skipped_fraction']:6.1f}%        {row['decode_ppl']:.4f}  "
              f"{100 * row['decode_ppl_change']:+6.2f}%   ({100 * at['head_skip_fraction']:.1f}% / "
              f"{100 * at['group_skip_fraction']:.1f}% / {100 * at['distant_bytes_skipped_fraction']:.1f}%)")


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    settings = check_arguments(args)

    started = time.time()
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    measured = measure(model, tokenizer, settings, args)
    label = ("SmolLM2-135M zero-shot POD" if is_default_model(args.model) else f"export {args.model}")
    command = "python -m eval.pod_gate_skip " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {
        "command": command.strip(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": str(args.model),
        "model_label": label, "blocks_file": settings["blocks_file"] or "the export's config",
        "texts": args.texts,
        "settings": {"context": args.context, "decode_tokens": args.decode_tokens, "windows_per_text": args.windows,
                     "sink": settings["sink"], "recent": settings["recent"], "gate_estimate": args.gate_estimate,
                     "taus": args.taus, "device": args.device, "dtype": args.dtype, "torch": torch.__version__},
        "formulas": {
            "head_skip_fraction": "skipped (step, layer, query head) of shared heads / all shared (step, layer, "
                                  "query head); a head skips when its estimated gate >= tau",
            "group_skip_fraction": "(step, layer, KV head) of shared KV heads whose G query heads all skip / all "
                                   "shared (step, layer, KV head)",
            "distant_bytes_skipped_fraction": "sum over skipped groups of D / sum over every (step, layer, KV head), "
                                              "anchor layers included, of D; D = max(0, seq_len - sink - recent)",
            "kv_bytes_skipped_fraction": "sum over skipped groups of D / sum over every (step, layer, KV head) of "
                                         "seq_len (all K/V rows the step's attention reads)",
            "decode_ppl_change": "decode_ppl(gate_tau=tau) / decode_ppl(gate_tau=None) - 1, same windows",
        },
        **measured,
        "seconds": round(time.time() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pod_gate_skip.json").write_text(json.dumps(report, indent=1))
    plot_if_possible(plot_report, report, args.out / "pod_gate_skip.png")
    _print_table(report)
    print(f"[pod_gate_skip] wrote {args.out / 'pod_gate_skip.json'} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
