"""``python -m eval.bench e2e --kv-cache-dtypes``: the FP8 memory and decode rows on CPU (tiny model).

The bytes per token the memory rows report are the engine's own ``kv_bytes`` (FP8 data + fp32 scales); they are
checked against the hand count of kernels/fp8_kv.py, 2 * (D + 4) bytes per token per KV head per layer for K + V.
"""

import json

import pytest
import torch

from eval.bench import e2e
from eval.bench.memory_plot import plot_kv_memory


@pytest.fixture(scope="module")
def tiny_model():
    return e2e.build_model(e2e.TINY, "cpu", torch.float32)


def _args(*flags):
    args = e2e.parse_args(["--tiny", *flags])
    e2e.apply_tiny(args)
    return args


def test_a_bad_dtype_is_one_error_naming_flag_value_and_choices(capsys, monkeypatch):
    monkeypatch.setattr(e2e, "build_model", lambda *a, **k: pytest.fail("built a model before checking the flags"))
    with pytest.raises(SystemExit) as exit_:
        e2e.main(["--tiny", "--kv-cache-dtypes", "bfloat16", "fp8"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtypes" in err and "'fp8'" in err and "'bfloat16'" in err and "'fp8_e4m3'" in err
    assert err.count("error:") == 1


def test_dtypes_are_deduplicated_bf16_first():
    assert e2e.parse_args(["--kv-cache-dtypes", "fp8_e4m3", "bfloat16", "fp8_e4m3"]).kv_cache_dtypes == [
        "bfloat16", "fp8_e4m3"]
    assert e2e.parse_args([]).kv_cache_dtypes == ["bfloat16"]


def test_dense_bytes_per_token_by_hand():
    # Llama-3-8B: 32 layers x 8 KV heads x (K + V) x (128 bytes of e4m3 + a 4-byte fp32 scale)
    assert e2e.dense_kv_bytes_per_token(e2e.LLAMA3_8B, "fp8_e4m3", torch.bfloat16) == 32 * 8 * 2 * (128 + 4)
    assert e2e.dense_kv_bytes_per_token(e2e.LLAMA3_8B, "bfloat16", torch.bfloat16) == 32 * 8 * 2 * 128 * 2
    assert e2e.dense_kv_bytes(e2e.LLAMA3_8B, 1000, 3, 2) == 1000 * 3 * e2e.dense_kv_bytes_per_token(
        e2e.LLAMA3_8B, "bfloat16", torch.bfloat16)


def test_memory_rows_use_the_caches_bytes(tiny_model, tmp_path):
    args = _args("--kv-cache-dtypes", "bfloat16", "fp8_e4m3")
    run = e2e.Run({"memory": {}, "errors": []}, tmp_path / "m.json", 1e9)
    e2e.measure_memory(run, tiny_model, args, e2e.TINY, 0, "cpu")
    mem, layers, heads, d = run.result["memory"], 4, 2, 32  # TINY: 4 layers, 2 KV heads, D = 128 / 4
    assert not run.result["errors"]
    assert set(mem) == {f"{n}@{c}" for n in ("dense", "dense/fp8_e4m3", "pod", "pod/fp8_e4m3") for c in (512, 1024)}
    for context in (512, 1024):
        fp8, base = mem[f"dense/fp8_e4m3@{context}"], mem[f"dense@{context}"]
        assert fp8["kv_bytes_per_seq"] == context * layers * heads * 2 * (d + 4)
        assert base["kv_bytes_per_seq"] == context * layers * heads * 2 * d * 4  # CPU: the fp32 model's dtype
        assert fp8["kv_bytes_over_bfloat16"] == round((d + 4) / (4 * d), 4)
        assert fp8["max_batch"] == int(120e9 // fp8["kv_bytes_per_seq"])
        pod = mem[f"pod/fp8_e4m3@{context}"]
        assert pod["kv_bytes_per_seq"] < fp8["kv_bytes_per_seq"] and pod["kv_cache_dtype"] == "fp8_e4m3"
    assert e2e.bf16_memory_at_shortest(mem)["dense"] is mem["dense@512"]
    table = e2e.memory_lines(mem)
    assert any(line.startswith("| dense | fp8_e4m3 | 512 | 576 |") for line in table)  # 4 * 2 * 2 * 36


def test_check_fit_allocates_a_small_fp8_batch(tiny_model):
    overrides = e2e.scheme_overrides("pod", 4, 2, 32, True) | {"kv_cache_dtype": "fp8_e4m3"}
    assert e2e.check_fit(tiny_model, 512, 3, overrides)


def test_decode_rows_pair_each_scheme_with_its_fp8_cell(tiny_model, tmp_path):
    args = _args("--kv-cache-dtypes", "bfloat16", "fp8_e4m3", "--schemes", "podkit-dense", "pod")
    args.rows, args.hf_rows, args.steps = ["256x1"], [], 2
    run = e2e.Run({"decode": {}, "errors": [], "shape": e2e.TINY}, tmp_path / "r.json", 1e9)
    e2e.measure_decode(run, tiny_model, args, e2e.TINY, torch.float32, 1e12, 10 ** 6, "cpu")
    row = run.result["decode"]["256x1"]
    for scheme in ("podkit-dense", "pod"):
        cell = row[f"{scheme}/fp8_e4m3"]
        assert cell["over_bfloat16"] == round(cell["ms_per_token"] / row[scheme]["ms_per_token"], 4)
    per_token = 4 * 2 * 2 * (32 + 4)
    assert row["floor_fp8_e4m3_bytes"] == 10 ** 6 + 256 * per_token
    assert row["floor_bytes"] == 10 ** 6 + 256 * 4 * 2 * 2 * 32 * 4
    ratios = e2e.ratio_lines(run.result["decode"])
    assert ratios[0] == "| fp8_e4m3 / bfloat16 ms | podkit-dense | pod |"
    assert json.loads((tmp_path / "r.json").read_text())["decode"]["256x1"]["pod/fp8_e4m3"]["ms_per_token"] > 0


def test_tiny_run_writes_both_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "e2e.json"
    assert e2e.main(["--tiny", "--out", str(out), "--sections", "memory", "--kv-cache-dtypes", "bfloat16",
                     "fp8_e4m3"]) == 0
    result = json.loads(out.read_text())
    assert result["kv_cache_dtypes"] == ["bfloat16", "fp8_e4m3"] and len(result["memory"]) == 8
    assert (tmp_path / "e2e_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| pod | fp8_e4m3 | 1024 |" in (tmp_path / "e2e.md").read_text()


def test_kv_memory_plot_reads_old_and_new_rows(tmp_path):
    pytest.importorskip("matplotlib")
    old = {"memory": {"dense": {"context": 32768, "kv_bytes_per_seq": 4 << 30, "kv_gib_per_seq": 4.0,
                                "max_batch": 25}}}
    assert plot_kv_memory(old, tmp_path / "old.png").stat().st_size > 5000
    with pytest.raises(ValueError, match="no memory rows"):
        plot_kv_memory({"memory": {}}, tmp_path / "none.png")


def test_memory_plot_cli_draws_an_e2e_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from eval.bench.memory_plot import main as memory_plot_main
    row = {"scheme": "pod", "kv_cache_dtype": "fp8_e4m3", "context": 131072, "kv_bytes_per_seq": 5 << 30,
           "kv_gib_per_seq": 5.0, "max_batch": 20, "budget_note": "120.0 GB minus the weights (16.06 GB)"}
    report = tmp_path / "e2e.json"
    report.write_text(json.dumps({"benchmark": "e2e", "memory": {"pod/fp8_e4m3@131072": row}}))
    assert memory_plot_main([str(report), "--out", str(tmp_path / "kv.png")]) == 0
    assert (tmp_path / "kv.png").is_file()
    with pytest.raises(SystemExit):
        memory_plot_main([str(report), f"b={report}", "--out", str(tmp_path / "x.png")])
    assert "drawn alone" in capsys.readouterr().err
