"""FP8 KV with the newest keys kept in the model's dtype (``kv_cache_recent_keys``), through podkit's model classes
on the embedded SmolLM2-135M-Instruct (CPU, fp32 model): decode-phase perplexity of the last 256 tokens of each
held-out Emma window, scored one decode step at a time (eval.runner.window_perplexity), per scheme and cache.
The reference cache is the model's dtype (fp32 here; bf16 KV differs from it by -0.03% / +0.03% on these windows,
BENCHMARKS.md "FP8 scale layouts against a bf16 cache").

    python benchmarks/cpu_2026-12-05/fp8_recent_keys.py [LENGTH] [ROW ...]
    POD_EXPORT=FOLDER python benchmarks/cpu_2026-12-05/fp8_recent_keys.py LENGTH pod/model_dtype pod/fp8 ...
    WINDOWS=12 ROWS_OUT=FILE python benchmarks/cpu_2026-12-05/fp8_recent_keys.py LENGTH ROW ...

ROW: ``scheme/cache`` with scheme in SCHEMES and cache in CACHES (default: every pair of the default model's
schemes). ``pod`` is an adapted POD export (``POD_EXPORT``, e.g. `make demo`'s) under its own decode scheme. Rows
append to fp8_recent_keys.jsonl beside this file (a row already there is skipped), so an interrupted run resumes."""
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from eval.models import load_model, load_tokenizer  # noqa: E402
from eval.runner import window_perplexity  # noqa: E402
from eval.tasks.perplexity import perplexity_windows  # noqa: E402

SCHEMES = {"dense": {}, "tidal@256": {"decode_scheme": "tidal", "tidal_budget": 256},
           "quest@256": {"decode_scheme": "quest", "quest_budget": 256}, "pod": {}}
CACHES = {"model_dtype": {}, "fp8": {"kv_cache_dtype": "fp8_e4m3"},
          "fp8+recent64": {"kv_cache_dtype": "fp8_e4m3", "kv_cache_recent_keys": 64}}
# WINDOWS / ROWS_OUT: a larger sample of the same rows into another file (the 2026-12-07 repeat of Quest at 1K)
WINDOWS, DECODE = int(os.environ.get("WINDOWS", 3)), 256
OUT = Path(os.environ.get("ROWS_OUT", HERE / "fp8_recent_keys.jsonl"))

length = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
wanted = sys.argv[2:] or [f"{s}/{c}" for s in SCHEMES if s != "pod" for c in CACHES]
done = {(r["length"], r["row"]) for r in map(json.loads, OUT.read_text().splitlines())} if OUT.exists() else set()
tokenizer = load_tokenizer("default")
windows = perplexity_windows(tokenizer, length, WINDOWS)
for row in wanted:
    if (length, row) in done:
        continue
    scheme, cache = row.split("/")
    started = time.perf_counter()
    source = os.environ["POD_EXPORT"] if scheme == "pod" else "default"
    model = load_model(source, device="cpu", dtype="float32", **SCHEMES[scheme], **CACHES[cache])
    nll = [window_perplexity(model, ids, decode_tokens=DECODE) for ids in windows]
    per_window = [math.exp(n.decode_nll / n.decode_tokens) for n in nll]
    ppl = math.exp(sum(n.decode_nll for n in nll) / sum(n.decode_tokens for n in nll))
    record = {"length": length, "row": row, "scheme": scheme, "cache": cache, "model": source, "decode_ppl": ppl,
              "per_window": per_window, "windows": WINDOWS, "decode_tokens": DECODE,
              "seconds": round(time.perf_counter() - started, 1)}
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(record, flush=True)
