"""Issue 32: where TidalDecode's pass-key loss under an FP8 cache comes from (fp8_passkey.py beside this file: 25% with
the unquantised cache, 0% with FP8). The same 20 prompts at 1K, TidalDecode @256 on an FP8 cache, but some layers'
keys are also kept in the model's dtype (a shadow copy, patched into sparse_models/cache.py's SparseKVCache, that
attention reads instead of the dequantised FP8 keys; values stay FP8):
  selection   the selection layers only (what the ranking reads)
  all         every layer (an upper bound: FP8 values, unquantised keys)
A probe, not an option: the patch lives in this file. CPU, fp32 model, one run per row; rows append to
fp8_selection_keys_passkey.jsonl beside this file.

    python benchmarks/cpu_2026-12-07/fp8_selection_keys_passkey.py selection|all
"""
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
import torch  # noqa: E402

from eval.models import load_model, load_tokenizer  # noqa: E402
from eval.runner import retrieval_generate  # noqa: E402
from eval.tasks.passkey import passkey_correct, passkey_grid  # noqa: E402
from sparse_models.cache import SparseKVCache  # noqa: E402

SHADOW_LAYERS: set[int] = set()  # the layers whose keys attention reads from the shadow copy
_write, _keys = SparseKVCache.write, SparseKVCache._keys_as_read


def write(self, layer, k_new, v_new, start, num_new):
    _write(self, layer, k_new, v_new, start, num_new)
    if layer in SHADOW_LAYERS:
        store = self.__dict__.setdefault("_shadow", {})
        if layer not in store or store[layer].shape[2] < self.capacity or store[layer].shape[0] != k_new.shape[0]:
            old = store.get(layer)
            new = torch.zeros(k_new.shape[0], k_new.shape[1], self.capacity, k_new.shape[3], dtype=k_new.dtype)
            if old is not None and old.shape[0] == k_new.shape[0]:
                new[:, :, : old.shape[2]] = old
            store[layer] = new
        s = k_new.shape[2]
        slots = start[:, None] + torch.arange(s)[None, :]
        index = slots[:, None, :, None].expand(-1, k_new.shape[1], -1, k_new.shape[3])
        store[layer].scatter_(2, index, k_new)


def keys_as_read(self, layer, view=True):
    k = _keys(self, layer, view)
    if layer in SHADOW_LAYERS:
        shadow = self._shadow[layer][:, :, : k.shape[2]]
        if len(self.full_heads[layer]) != self.num_kv_heads:
            shadow = shadow[:, self.full_heads[layer]]
        return shadow.to(k.dtype)
    return k


SparseKVCache.write, SparseKVCache._keys_as_read = write, keys_as_read

mode = sys.argv[1]
if mode not in ("selection", "all"):
    sys.exit(f"mode={mode!r}: expected 'selection' or 'all'")
tokenizer = load_tokenizer("default")
samples = [s for seed in range(2) for s in passkey_grid(tokenizer, [1008], 10, haystack="filler", seed=seed)]
model = load_model("default", device="cpu", dtype="float32", decode_scheme="tidal", tidal_budget=256,
                   kv_cache_dtype="fp8_e4m3")
n = model.config.num_hidden_layers
sel = [p.layer for p in model.plan if p.decode == "full+select"]
print("selection layers", sel, flush=True)
SHADOW_LAYERS.update(range(n) if mode == "all" else sel)
started = time.perf_counter()
hits = [passkey_correct(retrieval_generate(model, tokenizer, s.context, s.question).text, s.passkey) for s in samples]
record = {"mode": mode, "shadow_layers": sorted(SHADOW_LAYERS), "passkey": sum(hits) / len(hits),
          "hits": [int(h) for h in hits], "depths": [s.depth for s in samples],
          "seconds": round(time.perf_counter() - started, 1)}
with (HERE / "fp8_selection_keys_passkey.jsonl").open("a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(record), flush=True)
