"""FP8 KV cache against the unquantised cache on the embedded SmolLM2-135M (CPU, fp32 model): decode-phase
perplexity (the last 256 tokens of each held-out Emma window scored one decode step at a time through the model
classes' cache, eval.runner.window_perplexity) and the pass key (filler haystack, 5 depths), per scheme.
    python benchmarks/cpu_2026-12-03/fp8_kv_quality.py  ->  fp8_kv_quality.json beside this file"""
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from eval.models import load_model, load_tokenizer  # noqa: E402
from eval.runner import retrieval_generate, window_perplexity  # noqa: E402
from eval.tasks.passkey import passkey_correct, passkey_grid  # noqa: E402
from eval.tasks.perplexity import perplexity_windows  # noqa: E402

SCHEMES = {"dense": {}, "tidal@256": {"decode_scheme": "tidal", "tidal_budget": 256},
           "quest@256": {"decode_scheme": "quest", "quest_budget": 256}}
LENGTH, WINDOWS, DECODE = 1024, 3, 256

tokenizer = load_tokenizer("default")
windows = perplexity_windows(tokenizer, LENGTH, WINDOWS)
keys = passkey_grid(tokenizer, [LENGTH - 16], 5, haystack="filler")  # 16 tokens of answer room, as eval.quality
rows = []
for label, scheme in SCHEMES.items():
    for dtype in ("bfloat16", "fp8_e4m3"):  # "bfloat16": the unquantised cache, here in the fp32 model's dtype
        started = time.perf_counter()
        model = load_model("default", device="cpu", dtype="float32", **scheme, kv_cache_dtype=dtype)
        nll = [window_perplexity(model, ids, decode_tokens=DECODE) for ids in windows]
        ppl = math.exp(sum(n.decode_nll for n in nll) / sum(n.decode_tokens for n in nll))
        hits = [passkey_correct(retrieval_generate(model, tokenizer, s.context, s.question).text, s.passkey)
                for s in keys]
        rows.append({"scheme": label, "kv_cache_dtype": dtype, "decode_ppl": ppl, "passkey": sum(hits) / len(hits),
                     "seconds": round(time.perf_counter() - started, 1)})
        print(rows[-1], flush=True)
(HERE / "fp8_kv_quality.json").write_text(json.dumps({"length": LENGTH, "windows": WINDOWS, "decode_tokens": DECODE,
                                                      "passkey_prompts": len(keys), "rows": rows}, indent=1) + "\n")
