"""``python -m eval.calibrate``: the calibration analyses' command line (moved here from sparse_models/)."""

from __future__ import annotations

import json
import runpy

import pytest


@pytest.mark.parametrize("analysis, name, key", [("drift", "token_sparse_drift", "sparse_layers"),
                                                 ("tidal", "tidal_reselection", "selection_layers")])
def test_calibrate_command_writes_json_and_png(analysis, name, key, tiny_model_dir, tmp_path, fake_text_cache):
    from eval.harness.calibrate import main

    out = tmp_path / "calibration"
    result = main([analysis, "--model", str(tiny_model_dir), "--device", "cpu", "--length", "96", "--samples", "1",
                   "--budget", "16", "--tidal-last-queries", "8", "--full-layers", "--first-selection", "0",
                   "--out-dir", str(out)])
    assert set(result) == {analysis}
    data = json.loads((out / f"{name}.json").read_text())
    assert data[key] == list(result[analysis][key])
    assert (out / f"{name}.png").stat().st_size > 0


@pytest.mark.parametrize("module, command", [("sparse_models.calibration.token_sparse_drift", "drift"),
                                             ("sparse_models.calibration.tidal_reselection", "tidal")])
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_old_module_entry_points_name_the_new_command(module, command):
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(module, run_name="__main__")
    assert f"python -m eval.calibrate {command}" in str(exit_info.value.code)
