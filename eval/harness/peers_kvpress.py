"""``.venv-peers/bin/python -m eval.peers_kvpress``: NVIDIA kvpress's presses on the leaderboard's RULER
samples, written as leaderboard records (eval/harness/leaderboard_records.py) to ``--out/records_kvpress.jsonl``.

Runs in its own virtualenv (``make peers``: kvpress 0.5.5 pins transformers < 5.3, podkit needs >= 5.17),
so it imports nothing of podkit's but the two standard-library-and-numpy modules it shares with the
sweep: eval.harness.leaderboard_records (the record format) and train.long_context_eval.ruler (the sample file format, the
prompt rendering and RULER's scoring; lm-eval is absent here, so its fallback scorer runs, which a CI
test checks against lm-eval's).

Protocol: kvpress's own pipeline code (``KVPressTextGenerationPipeline._forward``: prefill the context
under the press, which compresses the cache once, then prefill the question over the compressed cache
and decode greedily), fed the same token ids as podkit's rows: ``train.long_context_eval.ruler.render`` splits the
chat-templated prompt exactly as kvpress's ``preprocess`` does. Compression ratio r keeps and reads
1 - r of the context's KV pairs (kvpress's presses evict at prefill; KVzip and the head-wise presses
mask rather than free memory in kvpress, so "kept" is nominal for them).

    .venv-peers/bin/python -m eval.peers_kvpress --out outputs/leaderboard --model ~/.cache/podkit/smollm2-135m-instruct \\
        --lengths 4096 --samples 20

Several processes (one GPU fits many: a 135M model answering one prompt at a time leaves it mostly idle)
share the work through ``--claim-dir``: the work is cut into units (one sample index of every task under
one press and ratio, at one length, in the order of the rounds), and each process takes the next unit
that no other has claimed (an exclusive file create), so every row advances through the sample indices
together and a process started later (on a GPU freed by podkit's rows) joins in. Each process writes its
own ``--records`` file; what any ``records*.jsonl`` in ``--out`` holds is skipped (resume). Empty the
claims folder before a new run: a claim only says which process took a unit while they run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import types
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from eval.harness import leaderboard_records as lr
from train.long_context_eval import ruler

PRESS_CLASSES = {"KVzip": "KVzipPress", "Compactor": "CompactorPress", "LeverageScore": "LeverageScorePress",
                 "SnapKV": "SnapKVPress", "StreamingLLM": "StreamingLLMPress",
                 "ExpectedAttention": "ExpectedAttentionPress"}
PRESSES = list(PRESS_CLASSES)
RATIOS = [0.5, 0.75, 0.875, 0.9375]


def import_kvpress():
    """``import kvpress``. The package imports ``datasets``, ``fire`` and ``requests`` at import time for two presses
    this board does not run (DuoAttention, ExpectedAttentionStats: they download calibration data); where
    they are missing (the GPU image, offline) a stand-in whose functions raise lets the package import."""
    for name, functions in (("datasets", ("load_dataset",)), ("fire", ("Fire",)), ("requests", ("get",))):
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            continue
        module = types.ModuleType(name)
        for function in functions:
            def missing(*args, _name=f"{name}.{function}", **kwargs):
                raise ImportError(f"{_name} is a stand-in (eval/harness/peers_kvpress.py): install {_name.split('.')[0]}")
            setattr(module, function, missing)
        sys.modules[name] = module
    import kvpress  # lazy: kvpress lives in its own virtualenv

    return kvpress


def make_press(name: str, ratio: float):
    """A kvpress press by its leaderboard name, at ``ratio`` (fraction of the KV pairs removed); ``none``
    (ratio 0) is no press: kvpress's pipeline on the full cache, the check that this runner's dense
    answers match podkit's dense row on the same token ids."""
    if name == "none":
        return None
    if name not in PRESS_CLASSES:
        raise ValueError(f"press={name!r} is invalid: expected one of none, {', '.join(PRESS_CLASSES)}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ValueError(f"compression ratio={ratio!r} is invalid: expected a number in (0, 1)")
    return getattr(import_kvpress(), PRESS_CLASSES[name])(compression_ratio=ratio)


def setting_label(press: str, ratio: float) -> str:
    return f"kvpress:{press}@{ratio:g}"


def peer_record(sample: ruler.RulerSample, press: str, ratio: float, generation: str, *, prompt_tokens: int,
                seconds: float, device: str, model: str, chat: bool, max_new_tokens: int) -> dict:
    """The leaderboard record of one kvpress answer (format: eval/harness/leaderboard_records.py)."""
    return {"source": "kvpress", "setting": setting_label(press, ratio), "method": press, "task": sample.task,
            "category": sample.category, "length": sample.max_length, "index": sample.index, "seed": sample.seed,
            "score": ruler.score(sample.task, generation, sample.outputs), "generation": generation,
            "outputs": sample.outputs, "prompt_tokens": prompt_tokens, "kv_kept": 1.0 - ratio, "kv_read": 1.0 - ratio,
            "budget": None, "compression_ratio": ratio, "max_new_tokens": max_new_tokens, "chat": chat,
            "seconds": round(seconds, 3), "device": device, "model": model}


def plain_checkpoint(folder: str | Path, dest: Path) -> Path:
    """``folder`` as a checkpoint plain transformers loads: a podkit export (``model_type`` podkit_llama,
    ...) becomes a folder of links to its files with the stock ``model_type`` / architecture and no
    ``sparse_attention`` block (the weights are the same Llama / Mistral / Qwen2 weights). Other folders
    are returned as they are."""
    folder = Path(folder).expanduser().resolve()
    config = json.loads((folder / "config.json").read_text())
    if not str(config.get("model_type", "")).startswith("podkit_"):
        return folder
    config["model_type"] = config["model_type"].removeprefix("podkit_")
    config["architectures"] = [a.removeprefix("Podkit") for a in config.get("architectures", [])]
    config.pop("sparse_attention", None)
    config.pop("auto_map", None)
    dest.mkdir(parents=True, exist_ok=True)
    # safe when several processes make it at once: links that exist are kept, config.json is replaced
    # atomically (a process never reads half of it) and written last, after every link
    for item in folder.iterdir():
        if item.name != "config.json" and item.is_file() and not (dest / item.name).exists():
            try:
                (dest / item.name).symlink_to(item)
            except FileExistsError:
                pass
    partial = dest / f".config.json.{os.getpid()}"
    partial.write_text(json.dumps(config, indent=1))
    os.replace(partial, dest / "config.json")
    return dest


def claim(folder: Path | None, unit: str) -> bool:
    """True when this process takes ``unit``: always without a claims folder, else only for the one
    process whose exclusive create of ``folder/unit`` succeeds."""
    if folder is None:
        return True
    try:
        os.close(os.open(folder / unit, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def work_units(samples: dict[int, list[ruler.RulerSample]], num_samples: int, runs: list[tuple[str, float]],
               done: set, claims: Path | None = None) -> Iterator[tuple[int, int, str, float, list]]:
    """The work in rounds, as eval.harness.leaderboard orders its own (per length: sample 0 of every task under
    every press and ratio, then sample 1, ...): ``(length, index, press, ratio, todo)`` with the samples
    of that unit not in ``done`` (record keys), for the units this process claims (:func:`claim`).
    Lazy: a unit is claimed when the caller asks for it, so processes sharing ``claims`` interleave."""
    for length, rows in samples.items():
        for index in range(num_samples):
            for press, ratio in runs:
                label = setting_label(press, ratio)
                todo = [s for s in rows if s.index == index and (label, s.task, length, s.index, s.seed) not in done]
                if todo and claim(claims, f"{length}-{index}-{press}-{ratio:g}"):
                    yield length, index, press, ratio, todo


def read_samples(out: Path, length: int, tasks: list[str], num_samples: int) -> list[ruler.RulerSample]:
    path = out / f"samples_{length}.json"
    if not path.exists():
        raise SystemExit(f"{path} does not exist: write it with podkit's environment first "
                         f"(python -m eval.leaderboard --generate-only --lengths {length} --out {out})")
    samples = [ruler.RulerSample.from_dict(s) for s in json.loads(path.read_text())["samples"]]
    return [s for s in samples if s.task in tasks and s.index < num_samples]


def main(argv: list[str] | None = None) -> None:
    began = time.time()  # --time-limit counts from here: the model's load included
    import torch  # lazy: counted in --time-limit (began above); keeps the module light for eval.harness.leaderboard

    parser = argparse.ArgumentParser(prog="python -m eval.peers_kvpress", description="kvpress presses on the RULER leaderboard samples")
    parser.add_argument("--out", default="outputs/leaderboard")
    parser.add_argument("--model", required=True, help="a transformers checkpoint folder (with its tokenizer)")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--tasks", nargs="+", default=list(ruler.TASKS), choices=list(ruler.TASKS))
    parser.add_argument("--presses", nargs="+", default=PRESSES, choices=PRESSES)
    parser.add_argument("--ratios", nargs="+", type=float, default=RATIOS)
    parser.add_argument("--no-dense-check", action="store_true",
                        help="skip the no-press row (kvpress:none@0, which should score like podkit's dense)")
    parser.add_argument("--plain", action="store_true", help="no chat template (must match the podkit rows)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=None, help="seconds: start no new sample after that")
    parser.add_argument("--records", default="records_kvpress.jsonl",
                        help="file name in --out (one per process when several run at once; the board merges "
                             "every records*.jsonl)")
    parser.add_argument("--claim-dir", default=None,
                        help="a folder shared by processes that split the work (each takes the next unclaimed "
                             "unit: one sample index x press x ratio); empty it before a new run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    args = parser.parse_args(argv)
    for ratio in args.ratios:  # a bad ratio fails here, before the model loads
        if not 0 < ratio < 1:
            parser.error(f"--ratios {ratio} is invalid: expected compression ratios in (0, 1)")

    import_kvpress()  # registers the "kv-press-text-generation" pipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline  # lazy: after import_kvpress's stand-ins

    out = Path(args.out)
    samples = {n: read_samples(out, n, args.tasks, args.samples) for n in args.lengths}
    dtype = {"auto": torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    folder = plain_checkpoint(args.model, out / "peer_checkpoint")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=args.device)
    if not args.records.startswith("records") or not args.records.endswith(".jsonl") or "/" in args.records:
        parser.error(f"--records {args.records!r} is invalid: expected a file name records*.jsonl (the board merges those)")
    records = lr.RecordFile(out / args.records)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.machine()} CPU"
    chat = not args.plain
    deadline = began + args.time_limit if args.time_limit else float("inf")
    runs = ([] if args.no_dense_check else [("none", 0.0)]) + [(p, r) for p in args.presses for r in args.ratios]
    # what any process wrote before (every records*.jsonl here: other workers, earlier calls) is not redone
    done = records.done | {lr.record_key(r) for r in lr.load_all(out)}
    claims = Path(args.claim_dir) if args.claim_dir else None
    if claims is not None:
        claims.mkdir(parents=True, exist_ok=True)
    units = 0
    for length, index, press_name, ratio, todo in work_units(samples, args.samples, runs, done, claims):
        label = setting_label(press_name, ratio)
        for sample in tqdm(todo, desc=f"{label} {length} #{index}", leave=False):
            if time.time() > deadline:
                print(f"--time-limit reached: rerun to continue ({len(records.records)} records in {records.path})",
                      flush=True)
                return
            context, question = ruler.render(sample, tokenizer, chat)
            context_ids = tokenizer(context, return_tensors="pt").input_ids
            question_ids = tokenizer(question, add_special_tokens=False, return_tensors="pt").input_ids
            tokens = min(sample.tokens_to_generate, args.max_new_tokens or sample.tokens_to_generate)
            start = time.perf_counter()
            with torch.no_grad():
                (answer,) = pipe._forward({"context_ids": context_ids, "questions_ids": [question_ids]},
                                          max_new_tokens=tokens, press=make_press(press_name, ratio))
            records.append(peer_record(sample, press_name, ratio, answer,
                                       prompt_tokens=context_ids.shape[1] + question_ids.shape[1],
                                       seconds=time.perf_counter() - start, device=device,
                                       model=args.model, chat=chat, max_new_tokens=tokens))
        units += 1
        print(f"[{time.time() - began:6.0f}s] {label} at {length}, sample {index}: {len(todo)} done ({units} units, "
              f"{len(records.records)} records)", flush=True)
    print(f"[{time.time() - began:6.0f}s] done: {units} units, {len(records.records)} records in {records.path}",
          flush=True)


if __name__ == "__main__":
    main()
