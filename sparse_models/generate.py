"""Generate text with podkit's fast engine (static caches, CUDA-graph decode).

    python -m sparse_models.generate --model default --prompt "The capital of France is" --max-new-tokens 16
    python -m sparse_models.generate --model PATH --prompt-file F --decode-scheme tidal --budget 2048

``--model default`` is the embedded SmolLM2-135M-Instruct. ``--prompt-file``: a text file (one prompt),
or a ``.jsonl`` file with one ``{"prompt": ...}`` per line (a ragged batch). ``--budget B`` is the
number of cached positions one decode query reads in the chosen sparse decode scheme, current token
included (its scheme's ``budget``: TidalDecode ``tidal_budget``; Quest ``quest_budget``; StreamingLLM
4 sink tokens + ``B - 4`` recent ones, or ``--set streaming_sink_tokens=S`` + ``B - S``). Any other scheme
field goes through ``--set key=value`` (flat override names: ``tidal_selection=kv_group``,
``pod_recent_window=4080``, ``tidal_correction_period=128``...). Errors (prompt longer than the cache or
than the model's ``max_position_embeddings``, unknown scheme, bad values) are printed on one line with exit
status 2 before any generation; ``--truncate-prompt`` keeps the last tokens of a too-long prompt instead
(announced on stderr).

Timing (stderr, and ``--json``): the warm-up (Triton kernel compilation or loading from its on-disk cache,
CUDA-graph capture, torch.compile; a short generation on the same prompts, on by default on CUDA) is
reported apart from the timed run: prefill seconds, the first decode step, and the steady-state ms per
decode step. Compiled kernels persist under ``$PODKIT_CACHE/compile`` (sparse_models/engine/compile_cache.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from kernels.fp8_kv import KV_CACHE_DTYPES

from .config import ConfigError, parse_override_value
from .model_files import check_model_folder
from .schemes.registry import SCHEMES, budget_overrides, budgeted_schemes, scheme_names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparse_models.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="checkpoint folder, or 'default' (embedded SmolLM2-135M)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--prompt-file", type=Path, help="text file (one prompt) or .jsonl with {'prompt': ...} lines")
    p.add_argument("--decode-scheme", default=None, help=f"one of {', '.join(scheme_names('decode'))} (default: the checkpoint's)")
    p.add_argument("--prefill-scheme", default=None, help=f"one of {', '.join(scheme_names('prefill'))} (default: the checkpoint's)")
    p.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: bfloat16 (the model's dtype) or fp8_e4m3 (FP8 E4M3 + one fp32 scale per "
                        "token and KV head, kernels/fp8_kv.py; default: the checkpoint's)")
    p.add_argument("--kv-cache-recent-keys", type=int, default=None, metavar="W",
                   help="with --kv-cache-dtype fp8_e4m3: keep the newest W positions' keys in the model's dtype "
                        "(kernels/fp8_kv.py 'Recent keys'; default: the checkpoint's, 0)")
    p.add_argument("--budget", type=int, default=None,
                   help="positions one decode query reads, current token included: "
                        + "; ".join(f"{name}: {SCHEMES[name].budget.meaning}" for name in budgeted_schemes()))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="flat scheme override, e.g. tidal_selection=kv_group (value parsed as JSON if possible)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="cache slots per sequence (default: longest prompt + max-new-tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (a single token) or token id; "
                   "default: the tokenizer's EOS")
    p.add_argument("--no-eos-stop", action="store_true", help="do not stop at the tokenizer's EOS")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=None,
                        help="capture the decode step in a CUDA graph (default on CUDA)")
    graphs.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the non-attention parts of the decode step (fewer kernels; the first step "
                        "compiles for tens of seconds)")
    p.add_argument("--decode-kernels", choices=["auto", "standard", "fused"], default="auto",
                   help="the decode step: standard (one cuBLAS F.linear per projection and indexed cache writes), "
                        "fused (q/k/v and gate/up each as one grouped matrix-vector launch and a one-launch KV append; "
                        "batches of at most 64; faster per token on an H200, BENCHMARKS.md), or auto (default: "
                        "fused on CUDA when the batch fits)")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--warmup", dest="warmup", action="store_true", default=None,
                      help="before the timed run, generate 3 tokens on the same prompts to compile kernels and "
                           "capture graphs, reported separately (default on CUDA)")
    warm.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--truncate-prompt", action="store_true",
                   help="keep the last (max_position_embeddings - max-new-tokens) tokens of a longer prompt "
                        "instead of stopping with an error (announced on stderr)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated (batch of one)")
    p.add_argument("--json", type=Path, default=None, help="also write prompts, outputs and timings here")
    return p.parse_args(argv)


def scheme_overrides(args) -> dict:
    """Flat SparseAttentionConfig overrides from the CLI options."""
    overrides = {}
    if args.decode_scheme is not None:
        if args.decode_scheme not in scheme_names("decode"):
            raise ConfigError(f"--decode-scheme={args.decode_scheme!r} is not a known scheme: expected one of "
                              f"{', '.join(scheme_names('decode'))}")
        overrides["decode_scheme"] = args.decode_scheme
    if args.prefill_scheme is not None:
        if args.prefill_scheme not in scheme_names("prefill"):
            raise ConfigError(f"--prefill-scheme={args.prefill_scheme!r} is not a known scheme: expected one of "
                              f"{', '.join(scheme_names('prefill'))}")
        overrides["prefill_scheme"] = args.prefill_scheme
    if getattr(args, "kv_cache_dtype", None) is not None:
        overrides["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "kv_cache_recent_keys", None) is not None:
        overrides["kv_cache_recent_keys"] = args.kv_cache_recent_keys
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} is invalid: expected KEY=VALUE, e.g. tidal_selection=kv_group")
        key, value = item.split("=", 1)
        overrides[key.strip()] = parse_override_value(value.strip())
    if args.budget is not None:
        scheme = overrides.get("decode_scheme", args.decode_scheme)
        if scheme not in budgeted_schemes():
            raise ConfigError(f"--budget={args.budget} needs a sparse decode scheme ({', '.join(budgeted_schemes())}); "
                              f"the decode scheme is {scheme!r}")
        overrides.update(budget_overrides(scheme, args.budget, overrides))
    return overrides


def read_prompts(args) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    path = args.prompt_file
    if path.is_dir():
        raise ValueError(f"--prompt-file {str(path)!r} is a folder, not a file: pass a text file (one prompt) or a "
                         f".jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-file {str(path)!r} does not exist")
    try:
        content = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompt-file {str(path)!r} is not a text file (not UTF-8: byte "
                         f"{error.object[error.start]:#04x} at offset {error.start})") from None
    if path.suffix == ".jsonl":
        prompts = []
        for i, line in enumerate(content.splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--prompt-file {str(path)!r} line {i + 1} is not JSON ({error})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"--prompt-file line {i + 1}: expected an object with a string 'prompt'")
            prompts.append(row["prompt"])
        if not prompts:
            raise ValueError(f"--prompt-file {str(path)!r} holds no prompts")
        return prompts
    text = content
    if not text.strip():
        raise ValueError(f"--prompt-file {str(path)!r} is empty")
    return [text]


def load_model_and_tokenizer(name: str, device: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sparse_models  # registers podkit_* with the Auto classes

    if name == "default":
        model = sparse_models.load_default_model()
        tokenizer = sparse_models.load_default_tokenizer()
    else:
        if not Path(name).exists():
            raise FileNotFoundError(f"--model {name!r}: no such checkpoint folder (or use --model default)")
        check_model_folder(name, f"--model {name!r}")  # what transformers would misreport (a file, no config.json)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(name)
    model = model.to(device=device, dtype=dtype).eval()
    return model, tokenizer


def stop_ids(args, tokenizer) -> list[int]:
    ids = []
    for s in args.stop:
        if s.isdigit():
            ids.append(int(s))
            continue
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(f"--stop {s!r} is {len(enc)} tokens; stop strings must be single tokens (or pass an id)")
        ids.append(enc[0])
    if not args.no_eos_stop and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def main(argv=None) -> int:
    import torch

    with torch.no_grad():  # a context, not torch.set_grad_enabled(False): main also runs inside other programs
        return _main(argv)


def _main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch

        from .engine import EngineError, GenerationEngine, SamplingConfig
        from .engine.compile_cache import enable_persistent_compile_caches
        from .engine.engine import fit_to_positions

        overrides = scheme_overrides(args)
        prompts = read_prompts(args)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"--device {device!r} but no CUDA GPU is visible")
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.startswith("cuda")
                                                                else torch.float32)
        enable_persistent_compile_caches()
        model, tokenizer = load_model_and_tokenizer(args.model, device, dtype)
        if args.chat:
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                   add_generation_prompt=True) for p in prompts]
        else:
            texts = prompts
        ids = [tokenizer.encode(t, add_special_tokens=not args.chat) for t in texts]
        max_positions = getattr(model.config, "max_position_embeddings", None)
        try:  # before any work: positions beyond the model's range give garbage
            ids, truncated = fit_to_positions(ids, args.max_new_tokens, max_positions, args.truncate_prompt)
        except EngineError as err:
            raise EngineError(str(err).replace("truncate_prompts=True; CLI: ", "")) from None
        for i, length in truncated.items():
            print(f"warning: --truncate-prompt: prompt {i} has {length} tokens; kept its last {len(ids[i])} "
                  f"(max_position_embeddings={max_positions} - --max-new-tokens {args.max_new_tokens})",
                  file=sys.stderr)
        capacity = args.max_seq_len or max(len(i) for i in ids) + args.max_new_tokens
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            engine = GenerationEngine(model, max_batch_size=len(ids), max_seq_len=capacity,
                                      use_cuda_graphs=args.cuda_graphs, compile_layers=args.compile,
                                      decode_kernels=args.decode_kernels, **overrides)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        stream = None
        if args.stream:
            if len(ids) != 1:
                raise EngineError(f"--stream prints one sequence; got {len(ids)} prompts")
            emitted: list[int] = []

            def stream(step, new):
                if new[0] is None:
                    return
                previous = tokenizer.decode(emitted)
                emitted.append(new[0])
                sys.stdout.write(tokenizer.decode(emitted)[len(previous):])
                sys.stdout.flush()

        warmup = device.startswith("cuda") if args.warmup is None else args.warmup
        warmup_s = engine.warmup(ids) if warmup else None
        result = engine.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 stop_token_ids=stop_ids(args, tokenizer), on_tokens=stream)
    except (EngineError, ConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    outputs = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    if args.stream:
        print()
    else:
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            if len(prompts) > 1:
                print(f"--- [{i}] ({result.finish_reasons[i]})")
            print(prompt + out)
    t = dict(result.timings, warmup_s=warmup_s)
    print(f"[podkit engine: decode={engine.config.decode_scheme} prefill={engine.config.prefill_scheme} "
          f"kv_cache_dtype={engine.config.kv_cache_dtype}"
          f"{f' recent_keys={engine.config.kv_cache_recent_keys}' if engine.config.kv_cache_recent_keys else ''} graphs={engine.use_cuda_graphs} device={device} | {timing_line(t)}]", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"prompts": prompts, "outputs": outputs, "tokens": result.tokens,
                                         "finish_reasons": result.finish_reasons, "timings": t,
                                         "truncated_prompts": truncated,
                                         "sparse_attention": engine.config.to_dict()}, indent=2))
    return 0


def timing_line(t: dict) -> str:
    """The timings of GenerationEngine.generate (+ ``warmup_s``) as one line: warm-up apart from the
    steady state, so that compilation and graph capture are not read as per-token cost."""
    parts = []
    if t.get("warmup_s") is not None:
        parts.append(f"warm-up {t['warmup_s']:.2f} s (kernel compile/load, graph capture; not counted below)")
    else:
        parts.append("no warm-up (the prefill includes kernel compilation on first use; --warmup to separate it)")
    parts.append(f"prefill {t['prefill_s']:.3f} s")
    if not t["decode_steps"]:
        parts.append("no decode steps")
        return ", ".join(parts)
    first = f"first step {t['first_step_ms']:.1f} ms"
    if t.get("warmup_in_first_step"):
        first += " (includes graph capture / compilation)"
    parts.append(first)
    steady = (f"{t['steady_ms_per_step']:.2f} ms/token steady" if t["steady_ms_per_step"] is not None
              else "steady state not measured (1 step)")
    parts.append(f"{t['decode_steps']} decode steps, {steady}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
