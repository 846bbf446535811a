"""The export's self-contained modeling file (``sparse_models/standalone/modeling_podkit.py`` + auto_map).

A subprocess that cannot import podkit (repo off sys.path, ``kernels`` / ``sparse_models`` / ``train``
/ ``eval`` blocked) loads each export with ``AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)``; its logits (prefill: batch of 2 with left padding; and greedy decode
steps) must equal podkit's classes on the same weights. Without ``trust_remote_code`` the subprocess
must refuse to load, and in the podkit process the Auto classes pick podkit's own classes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.tiny_models import tiny_config, tiny_model
from train.export import STANDALONE_CLASSES, STANDALONE_MODELING, _finish_config

# (family, query heads, KV heads, layers, anchor map): G = 1, 3, 4, 8; shared heads, several blocks
CASES = [
    ("llama", 3, 3, 4, [[0, 0, 0], [1, 0, 1], [1, 0, 2], [1, 3, 2]]),
    ("llama", 6, 2, 3, [[0, 0], [0, 0], [0, 2]]),
    ("qwen2", 8, 2, 3, [[0, 0], [1, 0], [1, 0]]),
    ("mistral", 8, 1, 3, [[0], [0], [2]]),
    # v1 score sharing (pod.sharing: scores), G = 3
    ("llama", 6, 2, 3, [[0, 0], [0, 1], [0, 1]], "scores"),
]
SINK, RECENT = 2, 5
LENGTHS = (23, 17)  # ragged batch, left-padded; both cross the proximal window several times
NEW_TOKENS = 4

CHILD = textwrap.dedent('''
    import importlib.abc, importlib.util, json, sys
    import torch
    BLOCKED = {"kernels", "sparse_models", "train", "eval"}
    repo = sys.argv[1]
    sys.path[:] = [p for p in sys.path if p not in ("", ".", repo)]
    class Hide(importlib.abc.MetaPathFinder):
        """Every finder answers "not found" for podkit's packages (an editable install included)."""
        def __init__(self, inner):
            self.inner = inner
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                return None
            return self.inner.find_spec(name, path, target)
        def __getattr__(self, attr):
            return getattr(self.inner, attr)
    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    from transformers import AutoModelForCausalLM
    result = {"importable": [n for n in BLOCKED if importlib.util.find_spec(n) is not None]}
    for folder in sys.argv[3:]:
        try:
            AutoModelForCausalLM.from_pretrained(folder)
            result[folder + ":untrusted"] = "loaded"
        except Exception as error:
            result[folder + ":untrusted"] = type(error).__name__ + ": " + str(error)[:200]
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        data = torch.load(folder + "/inputs.pt")
        with torch.no_grad():
            logits = model(input_ids=data["ids"], attention_mask=data["mask"]).logits
            gen = model.generate(input_ids=data["ids"], attention_mask=data["mask"], max_new_tokens=%d,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
            # the same prompts right-padded (a tokenizer with padding_side="right"): generate() left-aligns them
            keep = data["mask"].bool()
            order = torch.sort((~keep).int(), dim=1, stable=True).indices
            right = model.generate(input_ids=torch.gather(data["ids"], 1, order),
                                   attention_mask=torch.gather(data["mask"], 1, order), max_new_tokens=%d,
                                   do_sample=False, pad_token_id=0)
        torch.save({"logits": logits, "sequences": gen.sequences, "steps": torch.stack(gen.logits, 1),
                    "right_padded_sequences": right,
                    "class": type(model).__module__ + "." + type(model).__name__}, folder + "/standalone_out.pt")
    result["loaded_podkit"] = sorted({n.split(".")[0] for n in sys.modules} & BLOCKED)
    json.dump(result, open(sys.argv[2], "w"))
''' % (NEW_TOKENS, NEW_TOKENS))


def _config(family: str, heads: int, kv_heads: int, layers: int, anchors, sharing: str = "keys"):
    from sparse_models import PODKIT_CLASSES

    kwargs = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  sparse_attention={"prefill_scheme": "pod", "decode_scheme": "pod",
                                    "pod": {"anchor_layers": anchors, "sink_tokens": SINK, "recent_window": RECENT,
                                            "sharing": sharing}})
    if family == "qwen2":
        kwargs["use_sliding_window"] = False
    if family == "mistral":
        kwargs["sliding_window"] = None
    return PODKIT_CLASSES[family], tiny_config(layers=layers, family=family, vocab=97, heads=heads, kv_heads=kv_heads,
                                               hidden=16 * heads, intermediate=48, positions=128, **kwargs)


def _ragged_inputs(vocab: int):
    ids = torch.randint(3, vocab, (len(LENGTHS), max(LENGTHS)))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        mask[b, max(LENGTHS) - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Random podkit POD models exported like train/export.py does; the child process's outputs."""
    root = tmp_path_factory.mktemp("standalone")
    made = []
    for i, (family, heads, kv_heads, layers, anchors, *sharing) in enumerate(CASES):
        cls, config = _config(family, heads, kv_heads, layers, anchors, *sharing)
        # scale 3: random init is near-uniform; sharper logits make the comparison meaningful
        model = tiny_model(seed=None, config=config, scale=3.0)
        folder = root / f"{i}_{family}"
        model.save_pretrained(folder)
        import shutil

        shutil.copyfile(STANDALONE_MODELING, folder / "modeling_podkit.py")
        _finish_config(folder, recipe=None)
        ids, mask = _ragged_inputs(config.vocab_size)
        torch.save({"ids": ids, "mask": mask}, folder / "inputs.pt")
        made.append((folder, cls, ids, mask))
    result_file = root / "child.json"
    env = {"PATH": "/usr/bin:/bin", "HF_HOME": str(root / "hf_home"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if "PYTHONPATH" in os.environ:  # e.g. another transformers version under test; the child drops the repo
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    from tiny_setup import REPO

    run = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(result_file), *[str(f) for f, *_ in made]],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return made, json.loads(result_file.read_text())


def test_export_config_has_auto_map(exports):
    made, _ = exports
    for folder, cls, *_ in made:
        config = json.loads((folder / "config.json").read_text())
        names = STANDALONE_CLASSES[config["model_type"]]
        assert config["auto_map"] == {"AutoConfig": f"modeling_podkit.{names[0]}",
                                      "AutoModelForCausalLM": f"modeling_podkit.{names[1]}"}
        assert cls.__name__ == names[1]


def test_child_could_not_import_podkit_and_refused_untrusted_code(exports):
    made, result = exports
    assert result["importable"] == [] and result["loaded_podkit"] == []
    for folder, *_ in made:
        message = result[f"{folder}:untrusted"]
        assert message != "loaded" and "custom code" in message, message


def test_standalone_logits_equal_podkit(exports):
    made, _ = exports
    for folder, cls, ids, mask in made:
        out = torch.load(folder / "standalone_out.pt")
        assert out["class"].endswith(cls.__name__) and "sparse_models" not in out["class"]
        podkit = cls.from_pretrained(folder).eval()
        with torch.no_grad():
            expected = podkit(input_ids=ids, attention_mask=mask).logits
        valid = mask.bool()
        assert torch.isfinite(out["logits"][valid]).all()
        torch.testing.assert_close(out["logits"][valid], expected[valid], atol=2e-4, rtol=1e-4)
        # the POD structure matters here: dense attention gives clearly different logits
        dense = cls.from_pretrained(folder, prefill_scheme="dense", decode_scheme="dense").eval()
        with torch.no_grad():
            dense_logits = dense(input_ids=ids, attention_mask=mask).logits
        assert (dense_logits[valid] - expected[valid]).abs().max() > 1e-2


def test_standalone_generate_equals_podkit_decode(exports):
    made, _ = exports
    for folder, cls, ids, mask in made:
        out = torch.load(folder / "standalone_out.pt")
        podkit = cls.from_pretrained(folder).eval()
        with torch.no_grad():
            gen = podkit.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        assert torch.equal(out["sequences"], gen.sequences)
        # issue 33: right-padded prompts generate what the left-padded ones do (the short row included)
        assert torch.equal(out["right_padded_sequences"][:, ids.shape[1]:], gen.sequences[:, ids.shape[1]:])
        torch.testing.assert_close(out["steps"], torch.stack(gen.logits, 1), atol=2e-4, rtol=1e-4)


def test_podkit_process_auto_class_uses_podkit_without_remote_code(exports):
    from transformers import AutoModelForCausalLM

    made, _ = exports
    folder, cls, *_ = made[0]
    model = AutoModelForCausalLM.from_pretrained(folder)  # no trust_remote_code: podkit's registered class
    assert type(model) is cls


def _standalone_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("podkit_standalone_under_test", STANDALONE_MODELING)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass configs look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("sparse_attention, message", [
    ({"prefill_scheme": "pod", "decode_scheme": "tidal"}, "decode_scheme='tidal'"),
    ({"prefill_scheme": "token_sparse", "decode_scheme": "dense"}, "prefill_scheme='token_sparse'"),
    ({"prefill_scheme": "pod", "decode_scheme": "pod", "pod": {"sharing": "logits"}}, "sharing='logits'"),
    ({"prefill_scheme": "pod", "decode_scheme": "pod", "pod": {"anchor_layers": [[0], [0], [1]]}},
     r"anchor_layers\[2\]\[0\]=1"),
    ({"prefill_scheme": "pod", "decode_scheme": "pod", "pod": {"anchor_layers": [[0], [0]]}}, "expected 3 rows"),
])
def test_standalone_refuses_what_it_does_not_implement(sparse_attention, message):
    module = _standalone_module()
    with pytest.raises(ValueError, match=message):
        module.pod_settings(sparse_attention, 3, 1)


def test_standalone_settings_dense_and_pod():
    module = _standalone_module()
    dense = module.pod_settings({"prefill_scheme": "dense", "decode_scheme": "dense"}, 3, 2)
    assert dense["anchors"] == ((0, 0), (1, 1), (2, 2)) and dense["sources"] == set()
    pod = module.pod_settings({"prefill_scheme": "pod", "decode_scheme": "pod",
                               "pod": {"anchor_layers": [[0, 0], [0, 1], [0, 1]], "sink_tokens": 4,
                                       "recent_window": 9}}, 3, 2)
    assert pod["anchors"] == ((0, 0), (0, 1), (0, 1)) and pod["sources"] == {0, 1}
    assert (pod["sink"], pod["recent"]) == (4, 9)
