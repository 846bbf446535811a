"""The long-context rows of the pipeline's report: RULER on the test split for each model of the comparison,
written into results.json (``results["long_context"]``) and rendered in the model card.

Rows, in this order (those that exist for the run):
  * ``dense``       the original dense model;
  * ``control``     a dense fine-tune control: the same recipe with ``train.attention: dense`` (``eval.control_export``,
                    or the run itself when it is the control);
  * ``pod_after``   the POD export (this model);
  * ``dense_after`` the POD export's weights run densely.
"""

from __future__ import annotations

from typing import Callable

from train.long_context_eval import protocol, scoring

LABELS = {"dense": "original dense model", "control": "dense fine-tune control (same data, steps, objective)",
          "pod_after": "POD export", "dense_after": "POD export's weights run densely"}


def ruler_report(rows: list[tuple[str, Callable]], tokenizer, recipe, *, folder, model_name: str,
                 max_positions: int | None, log=print) -> dict:
    """RULER's test split for each ``(row, build)``; ``build()`` returns the model (on its device). Checks the
    dev / test split apart first (train/long_context_eval/protocol.py)."""
    lc = recipe.long_context
    dev, test = protocol.splits(recipe, max_positions, log)
    log(f"[ruler] reported: {test.describe()}; {dev.describe()} (learning curve, choices)")
    test_samples = protocol.split_samples(test, tokenizer, folder, model_name)
    protocol.check_disjoint(protocol.split_samples(dev, tokenizer, folder, model_name), test_samples)
    records, scores = [], {}
    for name, build in rows:
        model = build()
        row_records = scoring.score_samples(model, tokenizer, test_samples, chat=lc.chat, batch_size=lc.batch_size,
                                            label=name, log=log)
        del model
        records += row_records
        scores[name] = scoring.summarise(row_records)
    result = {"protocol": protocol.protocol_record(dev, test, lc.chat), "rows": scores,
              "relative_to_dense": scoring.relative(scores, "dense")}
    if "control" in scores:
        result["relative_to_control"] = scoring.relative(scores, "control")
    return {"summary": result, "records": records}


def result_lines(summary: dict) -> list[str]:
    """``[result]`` lines of the run's printout."""
    lines = ["RULER average (test split; % of the original dense model in brackets):"]
    for name, row in summary["rows"].items():
        rel = summary["relative_to_dense"].get(name, {})
        cells = [f"{length}: {r['average']:.1f}" + (f" ({100 * rel[length]:.0f}%)" if rel.get(length) else "")
                 for length, r in row.items()]
        lines.append(f"  {LABELS.get(name, name):<52} " + ", ".join(cells))
    return lines


def card_lines(summary: dict) -> list[str]:
    """The model card's long-context section: a table of RULER averages per length, rows as in the module
    docstring, with each row's fraction of the original and of the control, and the protocol."""
    rows = summary["rows"]
    lengths = sorted({length for row in rows.values() for length in row}, key=int)
    p = summary["protocol"]["reported"]
    lines = ["## Long context (RULER)", "",
             f"RULER average over {len(p['tasks'])} tasks, {p['samples_per_task']} samples per task and length "
             f"(test seed {p['seed']}{', chat template' if summary['protocol']['chat_template'] else ''}); "
             "in brackets the fraction of the original dense model's score"
             + (" / of the dense fine-tune control's" if "relative_to_control" in summary else "") + ".", "",
             "| model | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name, row in rows.items():
        cells = []
        for length in lengths:
            if length not in row:
                cells.append("-")
                continue
            parts = [f"{100 * f:.0f}%" for f in (summary["relative_to_dense"][name].get(length),
                                                 summary.get("relative_to_control", {}).get(name, {}).get(length))
                     if f is not None and name not in ("dense",)]
            cells.append(f"{row[length]['average']:.1f}" + (f" ({' / '.join(parts)})" if parts else ""))
        lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
    dev = summary["protocol"]["dev"]
    lines += ["", f"Protocol: {summary['protocol']['rule']} (dev seed {dev['seed']}: {', '.join(dev['tasks'])}).", ""]
    return lines
