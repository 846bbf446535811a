"""Issue 29's pass-key and needle target for one model, on a GPU image without lm-eval: the podkit_passkey and
podkit_needle tasks' own samples (eval/tasks: lengths x 10 depths, seed 0) scored as lm-eval's HFLM scores them in
`python -m eval.chain` (no chat template, the prompt encoded without special tokens, greedy, at most 8 new tokens,
cut at the task's `until` strings, eval/tasks/podkit_{passkey,needle}.yaml), one prompt at a time.
Usage: python3 benchmarks/plans/issue29_retrieval_row.py ROW MODEL OUT.json [dense] [--lengths 2048 4096]
MODEL: `original` (the embedded default as stored) or an export folder; `dense` runs it with dense attention.
Runs in bf16 on CUDA (the original too), fp32 on CPU."""
import argparse
import json
import time
from pathlib import Path

import torch

from eval.models import load_model, load_tokenizer
from eval.tasks.needle import needle_correct, needle_grid
from eval.tasks.passkey import passkey_correct, passkey_grid

TASKS = {  # task -> (samples, check, until), as eval/tasks/podkit_<task>.yaml and lm_eval_tasks.py define them
    "podkit_passkey": (lambda tok, lengths: passkey_grid(tok, lengths, 10, haystack="filler"), passkey_correct, ["\n"]),
    "podkit_needle": (lambda tok, lengths: needle_grid(tok, lengths, 10, haystack="pride_and_prejudice"),
                      needle_correct, ["\n", "."]),
}
MAX_GEN_TOKS = 8


def cut_at(text: str, until: list[str]) -> str:
    """The generation up to the first stop string, as lm-eval's generate_until returns it."""
    for stop in until:
        text = text.split(stop)[0]
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("row")
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("dense", nargs="?", choices=["dense"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pretrained = "default" if args.model == "original" else args.model
    overrides = {"prefill_scheme": "dense", "decode_scheme": "dense"} if args.dense else {}
    model = load_model(pretrained, device=device, dtype="bfloat16" if device == "cuda" else "float32", **overrides)
    tokenizer = load_tokenizer(pretrained)
    report = {"row": args.row, "model": args.model, "dense": bool(args.dense), "device": device,
              "lengths": args.lengths, "tasks": {}, "records": []}
    for task, (samples_of, correct, until) in TASKS.items():
        started, hits = time.perf_counter(), []
        for sample in samples_of(tokenizer, args.lengths):
            ids = torch.tensor([tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]], device=device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_GEN_TOKS,
                                     do_sample=False, pad_token_id=tokenizer.eos_token_id)
            text = cut_at(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), until)
            hits.append(correct(text, sample.passkey))
            report["records"].append({"task": task, "length": sample.target_tokens, "depth": sample.depth,
                                      "answer": sample.passkey, "generation": text, "correct": hits[-1]})
        report["tasks"][task] = {"acc": sum(hits) / len(hits), "samples": len(hits),
                                 "seconds": round(time.perf_counter() - started, 1)}
        print(f"{args.row} {task}: {report['tasks'][task]}", flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
