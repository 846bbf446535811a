"""eval.harness.fidelity end to end on a tiny random podkit Llama: calibration, settings, records, resume, outputs."""

import json

import pytest

pytest.importorskip("sparse_models")


@pytest.fixture(scope="module")
def tiny_podkit_dir(tmp_path_factory, tiny_tokenizer):
    from tests.tiny_models import tiny_model

    model = tiny_model(3, 6, seed=0, eval=False, vocab=len(tiny_tokenizer), intermediate=64, positions=1024)
    folder = tmp_path_factory.mktemp("tiny_podkit")
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_reduced_sweep_runs_and_resumes(tiny_podkit_dir, tmp_path, fake_text_cache):
    from eval.harness.fidelity import main

    out = tmp_path / "fidelity"
    argv = ["--reduced", "--model", str(tiny_podkit_dir), "--device", "cpu", "--out", str(out), "--lengths", "160",
            "--depths", "1", "--decode-tokens", "6", "--calibration-length", "96"]
    result = main(argv)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    settings = {"dense", "tidal@64", "quest@64", "streaming@64", "token_sparse@0.005", "pod_zero_shot"}
    assert {r["setting"] for r in records} == settings
    assert len([r for r in records if r["task"] == "passkey"]) == len(settings)
    assert len([r for r in records if r["task"] == "ppl"]) == len(settings)
    calibration = result["calibration"]
    assert len(calibration["tidal_selection_layers"]) == 2 and calibration["token_sparse_layers"]
    assert result["settings"]["tidal@64"]["tidal_selection_layers"] == calibration["tidal_selection_layers"]
    for name in ("fidelity.json", "fidelity.md", "passkey_grid.png", "perplexity.png", "calibration/pod/blocks.json",
                 "calibration/token_sparse_drift.png", "calibration/tidal_reselection.json"):
        assert (out / name).exists(), name
    dense_ppl = result["summary"]["ppl"]["dense"]["160"]
    assert dense_ppl["decode_tokens"] == 5 and 50 < dense_ppl["prefill_ppl"] < 2000
    assert "| dense |" in (out / "fidelity.md").read_text()
    # A rerun with the same --out finds every record done and adds none.
    main(argv)
    assert len((out / "records.jsonl").read_text().splitlines()) == len(records)
    # --replot redraws from the files alone.
    (out / "passkey_grid.png").unlink()
    (out / "calibration" / "tidal_reselection.png").unlink()
    replotted = main(["--replot", "--out", str(out)])
    assert replotted["summary"] == result["summary"]
    assert (out / "passkey_grid.png").exists() and (out / "calibration" / "tidal_reselection.png").exists()


def test_ablation_settings_and_more_windows_extend_a_run(tiny_podkit_dir, tmp_path, fake_text_cache):
    """--tidal-ablation adds labelled TidalDecode settings with their selection layers; a rerun with
    more --ppl-windows adds only the new windows."""
    from eval.harness.fidelity import main

    out = tmp_path / "fidelity"
    argv = ["--reduced", "--model", str(tiny_podkit_dir), "--device", "cpu", "--out", str(out), "--lengths", "160",
            "--depths", "1", "--decode-tokens", "4", "--no-calibrate", "--tasks", "ppl",
            "--settings", "dense", "tidal@128[2]", "tidal@128[all]", "--tidal-ablation", "2", "all"]
    result = main(argv)
    assert result["settings"]["tidal@128[2]"]["tidal_selection_layers"] == [2]
    assert result["settings"]["tidal@128[all]"]["tidal_selection_layers"] == [2, 3, 4, 5]
    assert result["settings"]["tidal@128[2]"]["tidal_budget"] == 128
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted((r["setting"], r["window"]) for r in records) == [("dense", 0), ("tidal@128[2]", 0), ("tidal@128[all]", 0)]
    main(argv + ["--ppl-windows", "2"])
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted((r["setting"], r["window"]) for r in records if r["setting"] == "dense") == [("dense", 0), ("dense", 1)]
    assert len(records) == 6
    assert "tidal@128[2]" in (out / "fidelity.md").read_text()


@pytest.mark.parametrize("spec", ["0", "2,x", "99", ""])
def test_bad_ablation_spec_is_refused_before_the_sweep(tiny_podkit_dir, tmp_path, spec):
    from eval.harness.fidelity import main

    out = tmp_path / "fidelity"
    with pytest.raises(SystemExit, match="--tidal-ablation"):
        main(["--model", str(tiny_podkit_dir), "--device", "cpu", "--out", str(out), "--tidal-ablation", spec])
    assert not (out / "calibration").exists() and not (out / "records.jsonl").exists()


def test_a_failing_setting_is_reported_and_the_others_run(tiny_podkit_dir, tmp_path, fake_text_cache, monkeypatch):
    import eval.harness.fidelity as fidelity

    real = fidelity.run_perplexity

    def flaky(model, tokenizer, setting, *args, **kwargs):
        if setting.label == "quest@64":
            raise RuntimeError("simulated kernel failure")
        return real(model, tokenizer, setting, *args, **kwargs)

    monkeypatch.setattr(fidelity, "run_perplexity", flaky)
    out = tmp_path / "fidelity"
    with pytest.raises(SystemExit, match="1 setting.s. failed: quest@64"):
        fidelity.main(["--reduced", "--model", str(tiny_podkit_dir), "--device", "cpu", "--out", str(out),
                       "--lengths", "160", "--decode-tokens", "4", "--no-calibrate", "--tasks", "ppl"])
    result = json.loads((out / "fidelity.json").read_text())
    assert "simulated kernel failure" in result["failures"]["quest@64"]
    assert set(result["summary"]["ppl"]) == {"dense", "tidal@64", "streaming@64", "token_sparse@0.005", "pod_zero_shot"}


def test_question_phase_is_recorded_and_not_mixed_in_one_out(tiny_podkit_dir, tmp_path, fake_text_cache):
    from eval.harness.fidelity import main

    out = tmp_path / "fidelity"
    argv = ["--reduced", "--model", str(tiny_podkit_dir), "--device", "cpu", "--out", str(out), "--lengths", "160",
            "--depths", "1", "--no-calibrate", "--tasks", "passkey", "--settings", "dense", "tidal@64"]
    result = main(argv + ["--question-phase", "prefill"])
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["question_phase"] for r in records} == {"prefill"} and len(records) == 2
    assert result["question_phase"] == "prefill"
    with pytest.raises(SystemExit, match="--question-phase decode differs"):
        main(argv)
    assert len((out / "records.jsonl").read_text().splitlines()) == 2


def test_markdown_names_the_devices_of_a_resumed_sweep(tmp_path):
    from eval.harness.fidelity import write_outputs

    def record(setting, device, correct):
        return {"task": "passkey", "setting": setting, "length": 2048, "depth": 0.5, "seed": 0, "correct": correct,
                "device": device}

    records = [record("dense", "NVIDIA H200", True), record("tidal@128", "NVIDIA H200", False),
               record("tidal@128[all]", "x86_64 CPU, 2 threads", True)]
    write_outputs(tmp_path, records, {"command": "python -m eval.fidelity"})
    markdown = (tmp_path / "fidelity.md").read_text()
    assert "- NVIDIA H200: 2 records (dense, tidal@128)" in markdown
    assert "- x86_64 CPU, 2 threads: 1 records (tidal@128[all])" in markdown
    write_outputs(tmp_path, records[:2], {})
    assert "Records by device" not in (tmp_path / "fidelity.md").read_text()


def test_variants_add_labelled_settings_and_bad_ones_fail_first(tiny_podkit_dir, tmp_path, fake_text_cache):
    from eval.harness.fidelity import main

    out = tmp_path / "fidelity"
    argv = ["--reduced", "--model", str(tiny_podkit_dir), "--device", "cpu", "--out", str(out), "--lengths", "160",
            "--decode-tokens", "4", "--no-calibrate", "--tasks", "ppl"]
    result = main(argv + ["--settings", "quest@64[quest_page_size=1]", "tidal@64[tidal_selection=kv_group+tidal_selection_layers=2,4]",
                          "--variants", "quest@64:quest_page_size=1",
                          "tidal@64:tidal_selection=kv_group+tidal_selection_layers=2,4"])
    assert result["settings"]["quest@64[quest_page_size=1]"] == {"decode_scheme": "quest", "quest_budget": 64,
                                                                 "quest_page_size": 1}
    assert result["settings"]["tidal@64[tidal_selection=kv_group+tidal_selection_layers=2,4]"]["tidal_selection_layers"] == [2, 4]
    for spec, message in (("quest@64:quest_page_size=0", "quest.page_size"), ("quest@64:nonsense=1", "flat override"),
                          ("quest@64", "expected <setting>"), ("bogus@3:quest_page_size=1", "not understood")):
        with pytest.raises(SystemExit, match=message):
            main(argv + ["--out", str(tmp_path / "bad"), "--variants", spec])
        assert not (tmp_path / "bad" / "records.jsonl").exists()


def test_parse_variant_values():
    from eval.schemes import parse_variant

    setting = parse_variant("tidal@128:tidal_selection_layers=2,16+tidal_correction_period=none+tidal_selection=kv_group")
    assert setting.label == "tidal@128[tidal_selection_layers=2,16+tidal_correction_period=none+tidal_selection=kv_group]"
    assert setting.overrides == {"decode_scheme": "tidal", "tidal_budget": 128, "tidal_selection_layers": [2, 16],
                                 "tidal_correction_period": None, "tidal_selection": "kv_group"}
    assert setting.method == "tidal" and setting.budget == 128
    assert parse_variant("token_sparse@0.005:token_sparse_window=64").overrides["token_sparse_window"] == 64
