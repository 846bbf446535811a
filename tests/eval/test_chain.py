"""eval.chain on a tiny exported POD checkpoint (CPU, fp32): the engine's teacher-forced POD decode reproduces
the pipeline's perplexity, the trust_remote_code load gives the same perplexity, and the card shows the chain."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from pipeline_runs import pipeline_env, python_command, run  # noqa: E402
from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe  # noqa: E402


@pytest.mark.slow
def test_chain_on_a_tiny_export(tmp_path, monkeypatch):
    from eval import chain

    model_dir = make_tiny_model(tmp_path / "model")
    train_text, held_out = make_texts(tmp_path / "text")
    recipe = tiny_recipe(tmp_path, model_dir, train_text, held_out,
                         train={"max_steps": 2, "objective": "distill", "save_steps": 100},
                         eval={"perplexity": True, "every_steps": 1, "curve_max_tokens": 128})
    run(python_command(write_recipe(tmp_path / "tiny.yaml", recipe)), pipeline_env())
    export = tmp_path / "out" / "export"
    assert (export / "learning_curve.png").is_file() and (export / "eval_results.json").is_file()
    code = chain.main([str(export), "--out", str(tmp_path / "chain"), "--held-out", str(held_out), "--windows", "2",
                       "--length", "64", "--dtype", "float32", "--device", "cpu", "--skip-lm-eval", "--update-card"])
    report = json.loads((tmp_path / "chain" / "chain.json").read_text())
    assert code == 0, report
    assert report["decode_scheme"] == "pod" and not report["engine"]["cuda_graphs"]
    assert abs(report["engine_vs_pipeline"]) < 1e-4
    assert report["remote_code"]["ppl"] == pytest.approx(report["pipeline"]["ppl"], rel=1e-4)
    card = (export / "README.md").read_text()
    assert "## Through the serving chain" in card and "## Learning curve" in card and "this model run densely" in card


def test_chain_rejects_a_folder_without_a_checkpoint(tmp_path, capsys):
    from eval import chain

    with pytest.raises(SystemExit):
        chain.main([str(tmp_path), "--out", str(tmp_path / "o")])
    assert "no config.json" in capsys.readouterr().err
