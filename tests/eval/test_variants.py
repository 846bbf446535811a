"""eval/harness/variants.py: grids validated before any model loads, the pick rule, the export write, the test seed."""

from __future__ import annotations

import json

import pytest

from eval.harness import variants as va
from sparse_models.config import ConfigError, SparseAttentionConfig
from train.long_context_eval import protocol
from train.recipe_schema import LongContextSection


def test_the_seeds_are_defined_once_and_the_recipe_agrees():
    assert (protocol.TEST_SEED, protocol.DEV_SEED) == (LongContextSection().seed, LongContextSection().dev_seed)


def test_the_test_seed_is_refused_unless_allowed():
    with pytest.raises(SystemExit, match="reported test seed"):
        va.check_seed(protocol.TEST_SEED, False)
    va.check_seed(protocol.TEST_SEED, True)
    va.check_seed(protocol.DEV_SEED, False)


def test_small_grids_validate_and_include_the_calibrated_layer(tmp_path):
    path = tmp_path / "tidal_reselection.json"
    path.write_text(json.dumps({"reselection_layer": 11}))
    grid = va.tidal_grid(30, str(path), "small") + va.token_sparse_grid(30, None, "small")
    assert any(v.overrides.get("tidal_selection_layers") == [2, 11] for v in grid)
    va.validate(grid, [2048, 4096], va.FRACTIONS)
    settings = va.settings(grid[0], 4096, ["1/4", "1/8"])
    assert [s.overrides["tidal_budget"] for s in settings] == [1024, 512]


def test_a_bad_variant_fails_with_the_configs_error_before_any_model():
    with pytest.raises(ConfigError):
        va.validate([va.Variant("bad", "tidal", {"tidal_selection": "nonsense"})], [2048], ["1/4"])
    with pytest.raises(ConfigError):
        va.validate([va.Variant("bad", "tidal", {"tidal_no_such_option": 1})], [2048], ["1/4"])


def _records(scores: dict[str, float], sparsity: dict[str, float] | None = None):
    out = []
    for setting, score in scores.items():
        out.append({"source": "podkit", "setting": setting, "method": setting.split("[")[0], "task": "niah_single_1",
                    "category": "retrieval", "length": 2048, "index": 0, "seed": 1, "score": score, "kv_kept": 1.0,
                    "kv_read": 1.0, "token_sparsity": (sparsity or {}).get(setting)})
    return out


def _variants_parser(device: str):
    """The ``eval.calibrate variants`` options with the parent command's --model / --device / --samples."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default=device)
    parser.add_argument("--samples", type=int, default=1)
    va.add_arguments(parser)
    return parser


def _no_model(monkeypatch, run_sweep) -> None:
    """sweep() without a model: stand-ins for loading, the samples and the device name, and ``run_sweep``."""
    monkeypatch.setattr(va, "load_model", lambda *a, **k: object())
    monkeypatch.setattr(va, "load_tokenizer", lambda *a, **k: object())
    monkeypatch.setattr(va.lb, "load_samples", lambda *a, **k: [])
    monkeypatch.setattr(va.lb, "device_name", lambda device: "test device")
    monkeypatch.setattr(va, "run_sweep", run_sweep)


def test_tidal_pick_is_the_best_mean_and_ties_go_to_the_cheaper():
    grid = [va.Variant("default", "tidal", {}), va.Variant("three", "tidal", {"tidal_selection_layers": [2, 9, 18]}),
            va.Variant("one", "tidal", {"tidal_selection_layers": [2]})]
    records = _records({"dense": 1.0, "tidal[default]@1/4": 0.5, "tidal[three]@1/4": 0.75, "tidal[one]@1/4": 0.75,
                        "tidal[default]@1/8": 0.5, "tidal[three]@1/8": 0.5, "tidal[one]@1/8": 0.5})
    summary = va.summarise(records, grid)
    assert summary["one"]["mean"] == pytest.approx(62.5) and summary["one"]["vs_dense"] == pytest.approx(-37.5)
    assert va.pick(summary, grid)[0].label == "one"


def test_token_sparse_pick_does_not_buy_accuracy_by_not_compressing():
    grid = [va.Variant("default", "token_sparse", {}),
            va.Variant("tau_0.001", "token_sparse", {"token_sparse_coverage": 0.001}),
            va.Variant("tau_0.01", "token_sparse", {"token_sparse_coverage": 0.01})]
    scores = {"token_sparse[default]": 0.5, "token_sparse[tau_0.001]": 1.0, "token_sparse[tau_0.01]": 0.6}
    best, rule = va.pick(va.summarise(_records(scores), grid), grid)
    assert best.label == "tau_0.01" and "coverage" in rule
    sparsity = {"token_sparse[default]": 0.3, "token_sparse[tau_0.001]": 0.1, "token_sparse[tau_0.01]": 0.2}
    best, rule = va.pick(va.summarise(_records(scores, sparsity), grid), grid)
    assert best.label == "default" and "sparsity" in rule


def test_the_pick_goes_into_the_export_config_atomically_and_validated(tiny_model_dir, tmp_path):
    import shutil

    from eval.models import load_model

    export = tmp_path / "export"
    shutil.copytree(tiny_model_dir, export)
    pick = va.Variant("kv_group", "tidal", {"tidal_selection": "kv_group", "tidal_correction_period": 8,
                                           "tidal_full_layers": [0]})
    va.write_pick(export, pick, {"seed": protocol.DEV_SEED})
    config = json.loads((export / "config.json").read_text())
    assert config["sparse_attention"]["tidal"]["selection"] == "kv_group"
    assert config[va.CALIBRATION_KEY]["tidal"]["variant"] == "kv_group"
    assert not list(export.glob(".config.*"))
    stored = SparseAttentionConfig.from_dict(config["sparse_attention"])
    assert stored.tidal.correction_period == 8
    model = load_model(str(export), device="cpu", decode_scheme="tidal")
    assert model.sparse_config.tidal.selection == "kv_group" and model.sparse_config.tidal.correction_period == 8
    before = (export / "config.json").read_text()
    with pytest.raises(ConfigError):
        va.write_pick(export, va.Variant("bad", "tidal", {"tidal_selection": "nonsense"}), {})
    assert (export / "config.json").read_text() == before


def test_full_tidal_grid_validates_with_the_new_options():
    grid = va.tidal_grid(30, None, "full")
    assert 12 <= len(grid) <= 16
    assert {"group_union", "all_union"} <= {v.overrides.get("tidal_selection") for v in grid}
    va.validate(grid, [2048, 4096], va.FRACTIONS)


def test_full_token_sparse_grid_validates_and_sets_its_kept_region_options_away_from_the_defaults():
    grid = va.token_sparse_grid(30, None, "full")
    assert 11 <= len(grid) <= 13
    va.validate(grid, [2048], va.FRACTIONS)
    overrides = [v.overrides for v in grid]
    assert {"token_sparse_keep_window": False} in overrides  # the window competing for the budget is swept
    assert {"token_sparse_score_reduce": "max"} in overrides  # and the max ranking
    assert any(o.get("token_sparse_sink_tokens", 0) > 0 for o in overrides)


@pytest.mark.parametrize("method, overrides", [
    ("token_sparse", {"token_sparse_keep_window": True}),   # the default: a sweep row that tests nothing
    ("token_sparse", {"token_sparse_sink_tokens": 0}),
    ("token_sparse", {"token_sparse_score_reduce": "mean"}),
    ("tidal", {"tidal_selection": "query_head"}),
])
def test_a_variant_equal_to_its_default_is_refused(method, overrides):
    variants = [va.Variant("default", method, {}), va.Variant("same", method, overrides)]
    with pytest.raises(ValueError, match=r"variant 'same' .* configures the same scheme as"):
        va.validate(variants, [2048], ["1/4"])
    va.validate(variants[:1], [2048], ["1/4"])


def test_tiny_sweep_end_to_end_with_resume(tiny_model_dir, tiny_tokenizer, tmp_path):
    from eval.models import load_model
    from train.long_context_eval.ruler import RulerSample

    samples = {2048: [RulerSample(task="vt", index=i, seed=protocol.DEV_SEED, max_length=2048,
                                  input="a b c " * 20 + "\nQuestion: Find all variables", question_start=60,
                                  gen_prefix="Answer:", outputs=["A"], tokens_to_generate=30,
                                  category="multi-hop tracing") for i in range(2)]}
    grid = [va.Variant("default", "tidal", {"tidal_full_layers": [0]}),
            va.Variant("kv_group", "tidal", {"tidal_full_layers": [0], "tidal_selection": "kv_group"})]
    model = load_model(str(tiny_model_dir), device="cpu")
    options = dict(chat=False, max_new_tokens=2, device_name="cpu", model_name="tiny")
    assert va.run_sweep(model, tiny_tokenizer, grid, samples, tmp_path, ["1/4"], engine=False, **options)
    records = va.lr.load_all(tmp_path)
    assert {r["setting"] for r in records} == {"dense", "tidal[default]@1/4", "tidal[kv_group]@1/4"}
    assert len(records) == 6
    va.run_sweep(model, tiny_tokenizer, grid, samples, tmp_path, ["1/4"], engine=False, **options)
    assert len(va.lr.load(tmp_path / "records.jsonl")) == 6  # resumed: nothing redone
    merged = tmp_path / "merged"   # per-length sweeps copied in as records_<length>.jsonl: nothing scored again
    merged.mkdir()
    (tmp_path / "records.jsonl").rename(merged / "records_2048.jsonl")
    va.run_sweep(model, tiny_tokenizer, grid, samples, merged, ["1/4"], engine=False, **options)
    assert not (merged / "records.jsonl").exists()
    assert len(va.lr.load_all(merged)) == 6
    summary = va.summarise(records, grid)
    assert va.pick(summary, grid)[0] is not None
    va.write_outputs(tmp_path, {"protocol": {"seed": protocol.DEV_SEED}, "methods": {"tidal": {
        "summary": summary, "rule": "r", "pick": "default", "dense": 0.0}}})
    assert (tmp_path / "variants.md").read_text().count("| kv_group |") == 1


def test_the_leaderboard_adds_calibrated_rows_from_variants_json_or_an_export(tmp_path):
    from eval.harness import leaderboard

    path = tmp_path / "variants.json"
    path.write_text(json.dumps({"methods": {
        "tidal": {"pick_overrides": {"tidal_selection": "kv_group"}},
        "token_sparse": {"pick_overrides": {"token_sparse_coverage": 0.01}}}}))
    picks = leaderboard.calibrated_picks(str(path))
    rows = leaderboard.calibrated_settings(picks, 4096, ["1/4", "1/8"])
    assert [r.label for r in rows] == ["tidal_calibrated@1/4", "tidal_calibrated@1/8", "token_sparse_calibrated"]
    assert rows[1].overrides["tidal_budget"] == 512 and rows[1].overrides["tidal_selection"] == "kv_group"
    for row in rows:
        SparseAttentionConfig().with_overrides(**row.overrides)
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({va.CALIBRATION_KEY: {"tidal": {"overrides": {"tidal_recent_share": 0.125}}}}))
    assert leaderboard.calibrated_picks(str(export)) == {"tidal": {"tidal_recent_share": 0.125}}
    assert leaderboard.parse_args(["--variants-from", str(path), "--device", "cpu"]).variants_from == str(path)


def test_placement_grid_moves_the_reselection_layer_of_the_union_and_validates():
    from sparse_models.schemes.tidal import default_reselection_layer

    grid = va.placement_grid(30)
    va.validate(grid, [2048, 4096], va.FRACTIONS)
    assert all(v.overrides["tidal_selection"] == "all_union" for v in grid)
    plans = [v.overrides.get("tidal_selection_layers") for v in grid]
    assert plans[0] is None                                       # the union at today's layers
    today = default_reselection_layer(30)
    seconds = [p[1] for p in plans[1:] if len(p) == 2]
    assert seconds == [10, 14, 16, 18] and today not in seconds   # the middle third, today's layer not repeated
    assert [2, today, 20] in plans                                # one three-layer plan
    assert len({v.label for v in grid}) == len(grid)


def test_placement_grid_needs_the_tidal_method_before_any_model(monkeypatch):
    monkeypatch.setattr(va, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    args = _variants_parser("cpu").parse_args(["--grid", "placement", "--method", "both", "--seed", str(protocol.DEV_SEED)])
    with pytest.raises(SystemExit, match="--grid placement .* needs --method tidal, got --method both"):
        va.sweep(args)


def test_batch_size_is_checked_before_any_model_and_reaches_the_engine(monkeypatch, tmp_path):
    parser = _variants_parser("cuda")
    monkeypatch.setattr(va, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    bad = parser.parse_args(["--method", "tidal", "--batch-size", "0", "--seed", str(protocol.DEV_SEED)])
    with pytest.raises(SystemExit, match="--batch-size 0 is invalid: expected an integer >= 1"):
        va.sweep(bad)

    seen = {}

    def fake_sweep(*args, **options):
        seen.update(options)
        return False

    _no_model(monkeypatch, fake_sweep)
    good = parser.parse_args(["--method", "tidal", "--grid", "placement", "--batch-size", "16", "--lengths", "2048",
                              "--seed", str(protocol.DEV_SEED), "--samples-dir", str(tmp_path),
                              "--out", str(tmp_path / "out")])
    va.sweep(good)
    assert seen["batch_size"] == 16 and seen["engine"] is True


def test_second_stage_moves_the_picks_layers_and_skips_what_stage_one_scored():
    first = va.tidal_grid(30)
    union = next(v for v in first if v.label == "all_union")
    stage = va.second_stage(first, union, 30)
    assert [v.label for v in stage] == [v.label for v in va.placement_grid(30)[1:]]  # the placement sweep's
    assert all(v.overrides["tidal_selection"] == "all_union" for v in stage)
    scored = [va.configured(v) for v in first]
    assert all(va.configured(v) not in scored for v in stage)
    va.validate(stage, [2048, 4096], va.FRACTIONS)
    # a pick with its own layers keeps its granularity and other options; the layers move
    combo = next(v for v in first if v.label.endswith("+kv_group") and "tidal_selection_layers" in v.overrides)
    moved = va.second_stage(first, combo, 30)
    assert moved and all(v.label.startswith("kv_group+sel[") for v in moved)
    assert va.second_stage(first, None, 30) == []


def test_staged_sweep_scores_the_second_stage_around_the_first_pick(monkeypatch, tmp_path):
    calls = []

    def fake_sweep(model, tokenizer, variants, samples, out, fractions, **options):
        calls.append([v.label for v in variants])
        records = va.lr.RecordFile(out / "records.jsonl")
        for variant in variants:
            score = 0.9 if variant.label == "all_union+sel[2,14]" else 0.6 if variant.label == "all_union" else 0.2
            for setting in va.settings(variant, 2048, fractions):
                records.append({"source": "podkit", "setting": setting.label, "method": "tidal", "task": "vt",
                                "category": "multi-hop tracing", "length": 2048, "index": 0, "seed": 1,
                                "score": score, "kv_kept": 1.0, "kv_read": 0.2})
        return True

    _no_model(monkeypatch, fake_sweep)
    parser = _variants_parser("cpu")
    args = parser.parse_args(["--method", "tidal", "--lengths", "2048", "--seed", str(protocol.DEV_SEED),
                              "--samples-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert args.grid == "staged"
    result = va.sweep(args)
    assert calls[0] == [v.label for v in va.tidal_grid(30)]
    assert calls[1] == [v.label for v in va.placement_grid(30)[1:]]
    assert result["methods"]["tidal"]["pick"] == "all_union+sel[2,14]"
    assert result["protocol"]["finished"] and result["protocol"]["grid"] == "staged"
