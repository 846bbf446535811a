"""``python -m eval.quality`` on a tiny podkit model: every task, two settings, summary shapes."""

import json

import pytest

pytest.importorskip("sparse_models")


def test_all_tasks_two_settings(tmp_path, tiny_tokenizer, fake_text_cache):
    from eval.harness.quality import main
    from tests.tiny_models import tiny_model

    tiny_model(3, 4, seed=0, eval=False, vocab=len(tiny_tokenizer), intermediate=64,
               positions=1024).save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "quality.json"
    result = main(["passkey", "passkey_text", "needle", "ppl", "--model", str(tmp_path / "model"), "--device", "cpu",
                   "--settings", "dense", "quest@32", "--lengths", "200", "--depths", "1", "--decode-tokens", "5",
                   "--out", str(out)])
    summary = json.loads(out.read_text())["summary"]
    assert summary == result["summary"]
    for task in ("passkey", "passkey_text", "needle"):
        for setting in ("dense", "quest@32"):
            cell = summary[task][setting]["200"]
            assert cell["n"] == 1 and 0.0 <= cell["accuracy"] <= 1.0
    assert summary["ppl"]["dense"]["200"]["decode_tokens"] == 4
    # quest only acts in decode: the prefill perplexity is the dense one, the decode one differs
    dense, quest = summary["ppl"]["dense"]["200"], summary["ppl"]["quest@32"]["200"]
    assert quest["prefill_ppl"] == pytest.approx(dense["prefill_ppl"], rel=1e-5)
    assert quest["decode_ppl"] != pytest.approx(dense["decode_ppl"], rel=1e-6)


def test_help_names_the_module_and_documents_every_option(capsys):
    """issue 16: ``python -m eval.quality --help`` showed ``quality.py`` and bare options."""
    from eval.harness.quality import build_parser, main

    parser = build_parser()
    undocumented = [action.dest for action in parser._actions if not action.help]
    assert undocumented == [], undocumented
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m eval.quality") and "quality.py" not in out


def test_fp8_cache_runs_the_same_tasks_and_moves_decode_perplexity_a_little(tmp_path, tiny_tokenizer, fake_text_cache):
    """--kv-cache-dtype fp8_e4m3: the decode-phase perplexity is read from the quantised cache (it moves, but by
    the format's rounding only), and the prefill part, which attends in the model dtype, does not move."""
    from eval.harness.quality import main
    from tests.tiny_models import tiny_model

    tiny_model(3, 2, seed=0, eval=False, vocab=len(tiny_tokenizer), intermediate=64,
               positions=1024).save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    args = ["ppl", "--model", str(tmp_path / "model"), "--device", "cpu", "--lengths", "200", "--decode-tokens", "6"]
    bf16, fp8 = main(args), main(args + ["--kv-cache-dtype", "fp8_e4m3"])
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and bf16["kv_cache_dtype"] == "bfloat16"
    dense, quantised = bf16["summary"]["ppl"]["dense"]["200"], fp8["summary"]["ppl"]["dense"]["200"]
    assert quantised["prefill_ppl"] == pytest.approx(dense["prefill_ppl"], rel=1e-6)
    assert quantised["decode_ppl"] != dense["decode_ppl"]
    assert quantised["decode_ppl"] == pytest.approx(dense["decode_ppl"], rel=0.05)
    with pytest.raises(SystemExit):
        main(args + ["--kv-cache-dtype", "fp8"])


def test_recent_keys_option_reaches_the_cache_and_bad_values_stop_before_any_model(tmp_path, tiny_tokenizer,
                                                                                    fake_text_cache, capsys):
    """--kv-cache-recent-keys W: the newest W keys are read in the model's dtype, so a window covering every decoded
    position brings the decode perplexity closer to the unquantised cache's than plain FP8; a window without an FP8
    cache, or a negative one, is one parser error."""
    from eval.harness.quality import main
    from tests.tiny_models import tiny_model

    tiny_model(3, 2, seed=0, eval=False, vocab=len(tiny_tokenizer), intermediate=64,
               positions=1024).save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    args = ["ppl", "--model", str(tmp_path / "model"), "--device", "cpu", "--lengths", "200", "--decode-tokens", "6"]
    fp8 = ["--kv-cache-dtype", "fp8_e4m3"]
    exact, plain, recent = main(args), main(args + fp8), main(args + fp8 + ["--kv-cache-recent-keys", "256"])
    assert recent["kv_cache_recent_keys"] == 256 and plain["kv_cache_recent_keys"] == 0
    cell = lambda r: r["summary"]["ppl"]["dense"]["200"]["decode_ppl"]  # noqa: E731
    assert abs(cell(recent) - cell(exact)) < abs(cell(plain) - cell(exact))
    for bad, message in ((["--kv-cache-recent-keys", "64"], "needs --kv-cache-dtype fp8_e4m3"),
                         (fp8 + ["--kv-cache-recent-keys", "-1"], "--kv-cache-recent-keys -1 is invalid")):
        with pytest.raises(SystemExit) as error:
            main(args + bad)
        assert error.value.code == 2 and message in capsys.readouterr().err
