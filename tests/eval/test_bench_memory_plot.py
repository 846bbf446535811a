"""``python -m eval.bench memory-plot``: peak memory against context length from train-multi-gpu reports."""

import json

import pytest

from eval.bench.memory_plot import _label, main, plot_memory_vs_context


def _report(peaks: dict[int, float | None], failed: int | None = None, **args) -> dict:
    rows = [{"seq": seq, "peak_memory_gib_max_rank": peak, "device": "NVIDIA H200"} for seq, peak in peaks.items()]
    return {"args": {"sp": 2, "layers": 8, **args}, "rows": rows,
            "failures": [{"gpus": 2, "seq": failed, "output_tail": "CUDA out of memory"}] if failed else []}


def test_plot_before_and_after(tmp_path):
    before = _report({32768: 41.0, 65536: 80.9}, failed=131072)
    after = _report({32768: 30.2, 65536: 44.0, 131072: 71.5}, tiled_mlp=True, activation_offload=True)
    path = plot_memory_vs_context({"plain": before, "tiled": after}, tmp_path / "memory.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert _label(after) == "SP 2, 8 layers, tiled MLP, ckpt offload"


def test_cli_labels_and_errors(tmp_path, capsys):
    good, cpu = tmp_path / "good.json", tmp_path / "cpu.json"
    good.write_text(json.dumps(_report({4096: 10.0})))
    cpu.write_text(json.dumps(_report({4096: None})))
    assert main([f"a=b={good}", str(good), "--out", str(tmp_path / "m.png")]) == 0  # label "a=b", then its settings
    assert (tmp_path / "m.png").is_file()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "x.png")])
    assert "no such report file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(cpu), "--out", str(tmp_path / "x.png")])
    assert "no row with a measured peak memory" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
