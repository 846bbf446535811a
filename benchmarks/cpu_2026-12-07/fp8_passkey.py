"""Issue 32's pass-key target (within 5 points of the unquantised cache) at the 5-point resolution it needs: the
pass key on 20 filler-haystack prompts of 1008 tokens (10 depths x 2 samples per depth, so one prompt is 5
points; the 2026-12-03 study had 5 prompts, 20 points each), through podkit's model classes on the embedded
SmolLM2-135M-Instruct (CPU, fp32 model), per scheme and cache: the model's dtype (unquantised), FP8 e4m3, and FP8 +
the newest 64 keys in the model's dtype (kv_cache_recent_keys). Rows append to fp8_passkey.jsonl beside this file
(a row already there is skipped, so an interrupted run resumes); summary in fp8_passkey_summary.json.

    python benchmarks/cpu_2026-12-07/fp8_passkey.py [ROW ...]     # ROW: scheme/cache, default every pair
    POD_EXPORT=FOLDER python benchmarks/cpu_2026-12-07/fp8_passkey.py pod/model_dtype pod/fp8 pod/fp8+recent64
    PASSKEY_SEEDS=2-5 python benchmarks/cpu_2026-12-07/fp8_passkey.py ...  # other pass keys: fp8_passkey_seeds2-5.*

PASSKEY_SEEDS (default 0-1) picks the pass-key seeds, each one prompt per depth; other seeds than the default write
their own files, so a wider sample never mixes with the first one.

``pod`` is an adapted POD export (``POD_EXPORT``, e.g. `make demo`'s) under its own decode scheme; the default rows
leave it out.
"""
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from eval.models import load_model, load_tokenizer  # noqa: E402
from eval.runner import retrieval_generate  # noqa: E402
from eval.tasks.passkey import passkey_correct, passkey_grid  # noqa: E402

SCHEMES = {"dense": {}, "tidal@256": {"decode_scheme": "tidal", "tidal_budget": 256},
           "quest@256": {"decode_scheme": "quest", "quest_budget": 256}, "pod": {}}
CACHES = {"model_dtype": {}, "fp8": {"kv_cache_dtype": "fp8_e4m3"},
          "fp8+recent64": {"kv_cache_dtype": "fp8_e4m3", "kv_cache_recent_keys": 64}}
LENGTH, DEPTHS = 1024, 10


def seed_range(text: str) -> range:
    """'A-B' (inclusive) -> range(A, B + 1); one clear error otherwise."""
    first, _, last = text.partition("-")
    if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
        sys.exit(f"PASSKEY_SEEDS={text!r}: expected A-B with integers 0 <= A <= B, e.g. 0-1 or 2-5")
    return range(int(first), int(last) + 1)


SEEDS_TEXT = os.environ.get("PASSKEY_SEEDS", "0-1")
SEEDS = seed_range(SEEDS_TEXT)
PER_DEPTH = len(SEEDS)
STEM = "fp8_passkey" if SEEDS_TEXT == "0-1" else f"fp8_passkey_seeds{SEEDS_TEXT}"
OUT = HERE / f"{STEM}.jsonl"


def summarise() -> dict:
    rows = {r["row"]: r for r in map(json.loads, OUT.read_text().splitlines())} if OUT.exists() else {}
    summary = {"length": LENGTH - 16, "prompts": DEPTHS * PER_DEPTH, "seeds": list(SEEDS), "schemes": {}}
    for scheme in SCHEMES:
        base = rows.get(f"{scheme}/model_dtype")
        if base is None:
            continue
        cell = {"model_dtype": base["passkey"]}
        for cache in ("fp8", "fp8+recent64"):
            if f"{scheme}/{cache}" in rows:
                other = rows[f"{scheme}/{cache}"]
                cell[cache] = other["passkey"]
                cell[f"{cache}_change_points"] = round(100 * (other["passkey"] - base["passkey"]), 1)
                cell[f"{cache}_prompts_flipped"] = sum(a != b for a, b in zip(base["hits"], other["hits"]))
        summary["schemes"][scheme] = cell
    (HERE / f"{STEM}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    wanted = sys.argv[1:] or [f"{s}/{c}" for s in SCHEMES if s != "pod" for c in CACHES]
    for row in wanted:  # before any heavy work
        scheme, _, cache = row.partition("/")
        if scheme not in SCHEMES or cache not in CACHES:
            sys.exit(f"row {row!r}: expected scheme/cache with scheme in {list(SCHEMES)} and cache in {list(CACHES)}")
        if scheme == "pod" and not os.environ.get("POD_EXPORT"):
            sys.exit(f"row {row!r}: set POD_EXPORT to an adapted POD export folder")
    done = {json.loads(line)["row"] for line in OUT.read_text().splitlines()} if OUT.exists() else set()
    tokenizer = load_tokenizer("default")
    # 16 tokens of answer room, as eval.quality; each seed gives each depth one pass key and haystack offset
    samples = [s for seed in SEEDS
               for s in passkey_grid(tokenizer, [LENGTH - 16], DEPTHS, haystack="filler", seed=seed)]
    for row in wanted:
        if row in done:
            continue
        scheme, cache = row.split("/")
        started = time.perf_counter()
        source = os.environ["POD_EXPORT"] if scheme == "pod" else "default"
        model = load_model(source, device="cpu", dtype="float32", **SCHEMES[scheme], **CACHES[cache])
        hits = [passkey_correct(retrieval_generate(model, tokenizer, s.context, s.question).text, s.passkey)
                for s in samples]
        record = {"row": row, "scheme": scheme, "cache": cache, "model": source, "passkey": sum(hits) / len(hits),
                  "hits": [int(h) for h in hits], "depths": [s.depth for s in samples],
                  "seconds": round(time.perf_counter() - started, 1)}
        with OUT.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(record["row"], record["passkey"], record["seconds"], flush=True)
    print(json.dumps(summarise(), indent=1))


if __name__ == "__main__":
    main()
