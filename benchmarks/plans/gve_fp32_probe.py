"""Where a float32 ``generate()`` spends its time on a GPU (issue 33: the embedded default loads in float32, and
``eval.bench generate-vs-engine``'s float32 paths finished no 2K prompt within their limits, where bfloat16 did 40).
A random-init model of SmolLM2-135M's shape (no staged checkpoint needed), one 2048-token prompt then one of 2100
tokens, 8 new tokens each, in one child process per case; a child that runs past 30 s dumps its Python stack every
30 s (faulthandler), so the log says which call holds it. Cases: float32 with the kernels' autotuning,
float32 with PODKIT_TRITON_AUTOTUNE=0 (first candidate only), bfloat16, and the engine in float32 and bfloat16
(PROBE_CASES=a,b picks some).
    python benchmarks/plans/gve_fp32_probe.py OUT_DIR [LIMIT_S]"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import faulthandler, json, sys, time, torch
faulthandler.dump_traceback_later(30, repeat=True)
from sparse_models import PodkitLlamaConfig, PodkitLlamaForCausalLM
dtype = getattr(torch, sys.argv[1])
DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
LAYERS = int(sys.argv[2])
config = PodkitLlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=LAYERS,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     tie_word_embeddings=True, rope_theta=100000.0)
torch.manual_seed(0)
model = PodkitLlamaForCausalLM(config).to(DEVICE, dtype).eval()
sync = torch.cuda.synchronize if DEVICE == 'cuda' else (lambda: None)
times = []
engine = None
if sys.argv[3] == "engine":
    from sparse_models.engine import GenerationEngine
    engine = GenerationEngine(model, max_batch_size=1, max_seq_len=2100 + 8)
for length in (2048, 2100, 2048):
    ids = torch.randint(0, 49152, (1, length), device=DEVICE)
    sync(); t = time.perf_counter()
    with torch.no_grad():
        if engine is not None:
            engine.generate([ids[0].tolist()], max_new_tokens=8)
        else:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False)
    sync(); times.append(round(time.perf_counter() - t, 3))
    print(json.dumps({"length": length, "seconds": times[-1]}), flush=True)
'''


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    limit = float(sys.argv[2]) if len(sys.argv) > 2 else 100.0
    cases = {"float32": ("float32", {}, "generate"), "float32_autotune0": ("float32", {"PODKIT_TRITON_AUTOTUNE": "0"},
             "generate"), "bfloat16": ("bfloat16", {}, "generate"), "engine_float32": ("float32", {}, "engine"),
             "engine_bfloat16": ("bfloat16", {}, "engine")}
    wanted = os.environ.get("PROBE_CASES")
    if wanted:
        cases = {name: cases[name] for name in wanted.split(",")}
    results = {}
    for name, (dtype, env, path) in cases.items():
        start = time.perf_counter()
        log = out / f"{name}.log"
        with open(log, "w") as handle:
            try:
                proc = subprocess.run([sys.executable, "-c", CHILD, dtype, os.environ.get("PROBE_LAYERS", "30"),
                                       path], env={**os.environ, **env}, stdout=handle,
                                      stderr=subprocess.STDOUT, timeout=limit)
                status = proc.returncode
            except subprocess.TimeoutExpired:
                status = f"killed after {limit:.0f} s"
        calls = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        results[name] = {"status": status, "wall_s": round(time.perf_counter() - start, 1), "calls": calls}
        print(name, results[name], flush=True)
    (out / "gve_fp32_probe.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
