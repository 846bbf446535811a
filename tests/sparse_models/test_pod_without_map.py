"""issue 33: POD on a model that was never adapted (no block map in its config) says so once: the map it uses (the
identity: every layer its own anchor) is exactly dense attention. It used to run without a word."""

import json
import warnings

import pytest
from sm_tiny import left_padded, pod_anchor_map, random_prompts, tiny_model
from test_engine_limits_and_timing import compile_cache_env, tiny_checkpoint  # noqa: F401  (fixtures)

from sparse_models.engine import GenerationEngine

POD = {"sink_tokens": 2, "recent_window": 3}
NOTICE = "not POD-adapted"


def _notices(caught):
    return [str(w.message) for w in caught if NOTICE in str(w.message)]


def test_pod_without_a_map_says_so_once_and_is_dense():
    prompts = random_prompts([12, 7], seed=4)
    ids, mask = left_padded(prompts)
    dense = tiny_model(3, 4, seed=3).generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                               pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        model = tiny_model(3, 4, {"prefill_scheme": "pod", "decode_scheme": "pod", "pod": POD}, seed=3)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        GenerationEngine(model, max_batch_size=2, max_seq_len=32)  # the same notice: printed once
    notices = _notices(caught)
    assert len(notices) == 1, notices
    assert "prefill_scheme='pod' and decode_scheme='pod'" in notices[0] and "identity map" in notices[0]
    assert "exactly dense attention" in notices[0] and "pod_blocks_file" in notices[0]
    assert out.tolist() == dense.tolist()


def test_pod_with_a_map_is_silent():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tiny_model(3, 4, {"decode_scheme": "pod", "pod": {**POD, "anchor_layers": pod_anchor_map(4, 2)}})
        GenerationEngine(model, max_batch_size=1, max_seq_len=32)
        tiny_model(3, 4, {"decode_scheme": "tidal", "tidal": {"budget": 4}})  # not POD: nothing to say
    assert not _notices(caught)


def test_engine_reads_a_blocks_file_given_as_an_override(tmp_path):
    """``generate --decode-scheme pod --set pod_blocks_file=...``: the engine reads the file as from_pretrained
    does (it used to keep anchor_layers unset: the identity map, dense, silently)."""
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps({"anchor_layers": pod_anchor_map(4, 2)}))
    model = tiny_model(3, 4, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = GenerationEngine(model, max_batch_size=1, max_seq_len=32, decode_scheme="pod",
                                  pod_blocks_file=str(blocks), pod_sink_tokens=2, pod_recent_window=3)
    assert not _notices(caught)
    assert engine.config.pod.anchor_layers == pod_anchor_map(4, 2)
    assert any(row.shared_heads for row in engine.plan)


def test_generate_cli_names_the_unadapted_model(tiny_checkpoint, capsys, compile_cache_env):  # noqa: F811
    from sparse_models.generate import main

    assert main(["--model", str(tiny_checkpoint), "--prompt", "Hello there", "--max-new-tokens", "3",
                 "--decode-scheme", "pod"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if NOTICE in line]
    assert len(warned) == 1 and warned[0].startswith("warning: decode_scheme='pod' on a model"), warned


@pytest.mark.parametrize("scheme", ["pod", "pod+tidal"])
def test_notice_names_the_decode_scheme(scheme):
    from sparse_models import SparseAttentionConfig
    from sparse_models.schemes.registry import scheme_notices

    config = SparseAttentionConfig.from_dict({"decode_scheme": scheme})
    [notice] = scheme_notices(config)
    assert f"decode_scheme={scheme!r}" in notice
    mapped = SparseAttentionConfig.from_dict({"decode_scheme": scheme, "pod": {"anchor_layers": [[0], [0]]}})
    assert scheme_notices(mapped) == []
    assert scheme_notices(SparseAttentionConfig()) == []
    # POD prefill with POD + TidalDecode decode: one notice (one function) naming both phases
    both = SparseAttentionConfig.from_dict({"prefill_scheme": "pod", "decode_scheme": scheme})
    assert scheme_notices(both) == [notice.replace(f"decode_scheme={scheme!r}",
                                                   f"prefill_scheme='pod' and decode_scheme={scheme!r}")]
