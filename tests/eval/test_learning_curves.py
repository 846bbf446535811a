"""eval.studies.learning_curves: first-tokens-to-target, the summary and the CLI on hand-made curves."""

import json

import pytest

from eval.studies import learning_curves


def _curve(objective, gaps):
    points = [{"step": 10 * i, "tokens": 1000 * i,
               "sources": {"in": {"pod_gap": g / 100, "dense_gap": 0.0}, "ood": {"pod_gap": 2 * g / 100,
                                                                               "dense_gap": 0.01}}}
              for i, g in enumerate(gaps)]
    return {"objective": objective, "tokens_per_step": 100, "points": points}


def test_first_tokens_within_target_and_summary():
    curve = _curve("lm", [500, 20, 4, 2.5, 3.5])
    assert learning_curves.first_tokens_within(curve["points"], "in", 3) == 3000
    assert learning_curves.first_tokens_within(curve["points"], "ood", 3) is None
    assert learning_curves.first_tokens_within(curve["points"], "missing", 3) is None
    summary = learning_curves.summarise({"a": curve}, {"in": 3.0})
    assert summary["a"]["final_tokens"] == 4000
    assert summary["a"]["sources"]["in"]["first_tokens_within_target"] == 3000
    assert summary["a"]["sources"]["ood"]["target_percent"] is None
    assert summary["a"]["sources"]["in"]["final_pod_gap"] == pytest.approx(0.035)


def test_cli_writes_json_and_png(tmp_path, capsys):
    for name, gaps in (("lm", [400, 10, 2]), ("distill", [400, 30, 12])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "learning_curve.json").write_text(json.dumps(_curve(name, gaps)))
    out = tmp_path / "out"
    assert learning_curves.main([f"lm={tmp_path / 'lm'}", f"distill={tmp_path / 'distill'}", "--targets", "in=3",
                                 "--out", str(out)]) == 0
    data = json.loads((out / "learning_curves.json").read_text())
    assert data["runs"]["lm"]["sources"]["in"]["first_tokens_within_target"] == 2000
    assert data["runs"]["distill"]["sources"]["in"]["first_tokens_within_target"] is None
    assert (out / "learning_curves.png").stat().st_size > 1000
    assert "not reached" in capsys.readouterr().out


def test_cli_errors_name_the_argument(tmp_path):
    with pytest.raises(SystemExit):
        learning_curves.main(["nolabel", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no learning_curve.json"):
        learning_curves.main([f"a={tmp_path}", "--out", str(tmp_path / "o")])
    (tmp_path / "learning_curve.json").write_text(json.dumps(_curve("lm", [1])))
    with pytest.raises(SystemExit):
        learning_curves.main([f"a={tmp_path}", "--targets", "in=abc", "--out", str(tmp_path / "o")])
