"""``python -m eval.bench e2e --variants``: a scheme's variant (eval.calibrate's pick) timed beside the scheme itself,
for decode and for Token Sparse prefill, and a bad variant refused before any model is built (tiny model, CPU)."""

import json

import pytest

from eval.bench import e2e


def test_variant_rows_sit_beside_their_scheme(tmp_path):
    out = tmp_path / "e2e.json"
    assert e2e.main(["--tiny", "--out", str(out), "--sections", "decode", "prefill", "--schemes", "tidal",
                     "--hf-rows", "--variants", "tidal:tidal_selection=all_union",
                     "tidal:tidal_selection=kv_group:tidal_recent_share=0.25",
                     "token_sparse@0.5:token_sparse_window=8"]) == 0
    result = json.loads(out.read_text())
    assert result["variants"][0] == "tidal:tidal_selection=all_union"
    for row in result["decode"].values():
        for name in ("tidal:tidal_selection=all_union", "tidal:tidal_selection=kv_group:tidal_recent_share=0.25"):
            cell = row[name]
            assert cell["ms_per_token"] > 0, cell
            assert cell["over_base"] == pytest.approx(cell["ms_per_token"] / row["tidal"]["ms_per_token"], rel=1e-3)
    (prefill,) = result["prefill"].values()
    assert prefill["token_sparse@0.5:token_sparse_window=8"]["seconds"] > 0
    assert "token_sparse@0.5" in prefill
    assert "tidal:tidal_selection=all_union" in (tmp_path / "e2e.md").read_text()


@pytest.mark.parametrize("spec, words", [
    ("tidal", ["BASE:key=value"]),
    ("tidal:tidal_selection", ["is not key=value"]),
    ("tidal:tidal_selectoin=all_union", ["tidal_selectoin", "did you mean tidal_selection"]),
    ("tidal:tidal_selection=everything", ["tidal.selection", "everything"]),
    ("nosuch:tidal_budget=8", ["'nosuch'", "decode scheme", "prefill case"]),
])
def test_a_bad_variant_is_one_line_before_any_model(spec, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(e2e, "build_model", lambda *a, **k: pytest.fail("built a model before checking --variants"))
    assert e2e.main(["--tiny", "--out", str(tmp_path / "e.json"), "--variants", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err
    assert not (tmp_path / "e.json").exists()


def test_a_pod_variant_gets_a_decode_row_and_a_prefill_row():
    """``pod`` names a decode scheme and a prefill case: its variant (score sharing) is timed in both sections."""
    args = e2e.parse_args(["--tiny", "--variants", "pod:pod_sharing=scores"])
    shape = dict(e2e.TINY)
    e2e.apply_tiny(args)
    cases = e2e.prefill_cases(shape, args)
    assert "pod" in cases
    decode, prefill = e2e.resolve_variants(args, shape, cases)
    assert decode["pod:pod_sharing=scores"]["pod_sharing"] == "scores"
    assert prefill["pod:pod_sharing=scores"][0] == cases["pod"][0] | {"pod_sharing": "scores"}


def test_a_recent_keys_variant_is_checked_with_the_kv_dtypes_its_cells_run():
    """Each decode cell sets its column's kv_cache_dtype: ``kv_cache_recent_keys`` is valid beside FP8 KV only, so a
    variant naming it runs under ``--kv-cache-dtypes fp8_e4m3`` and is refused, naming the dtype, beside bfloat16."""
    spec = "podkit-dense:kv_cache_recent_keys=4"
    shape = dict(e2e.TINY)
    args = e2e.parse_args(["--tiny", "--kv-cache-dtypes", "fp8_e4m3", "--variants", spec])
    e2e.apply_tiny(args)
    decode, _ = e2e.resolve_variants(args, shape, e2e.prefill_cases(shape, args))
    assert decode[spec]["kv_cache_recent_keys"] == 4
    args = e2e.parse_args(["--tiny", "--kv-cache-dtypes", "bfloat16", "fp8_e4m3", "--variants", spec])
    e2e.apply_tiny(args)
    with pytest.raises(e2e.ConfigError, match="with --kv-cache-dtypes bfloat16: kv_cache_recent_keys=4 is invalid"):
        e2e.resolve_variants(args, shape, e2e.prefill_cases(shape, args))
