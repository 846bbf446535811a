"""eval.harness.chain on a tiny exported POD checkpoint (CPU, fp32): the engine's teacher-forced POD decode reproduces
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
    from eval.harness import chain

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
    from eval.harness import chain

    with pytest.raises(SystemExit):
        chain.main([str(tmp_path), "--out", str(tmp_path / "o")])
    assert "no config.json" in capsys.readouterr().err


def test_remote_code_child_gets_absolute_paths(tmp_path, monkeypatch):
    """The trust_remote_code child runs in "/" (so the repository is not importable): a relative export path, as
    a user types it (`python -m eval.chain outputs/run/export ...`), must reach it absolute."""
    import subprocess

    import torch

    from eval.harness import chain

    export = tmp_path / "run" / "export"
    export.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    seen = {}

    def fake_run(command, **kwargs):
        seen["command"], seen["cwd"] = command, kwargs.get("cwd")
        assert Path(command[-1]).is_file()  # the windows file exists while the child runs
        return subprocess.CompletedProcess(command, 0, stdout='{"ppl": 1.0}\n', stderr="")

    monkeypatch.setattr(chain.subprocess, "run", fake_run)
    assert chain.remote_code_perplexity(Path("run/export"), torch.zeros(1, 4, dtype=torch.long), "cpu",
                                        "float32") == {"ppl": 1.0}
    assert seen["cwd"] == "/"
    assert seen["command"][3] == str(export) and seen["command"][-1] == str(export / ".chain_windows.pt")
    assert not (export / ".chain_windows.pt").exists()
