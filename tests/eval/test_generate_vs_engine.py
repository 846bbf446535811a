"""``python -m eval.bench generate-vs-engine`` on CPU: the tiny configuration runs every path, records per-prompt
times, compiles and the repeat pass, respects its time limits, and the isolated mode merges its child processes."""

from __future__ import annotations

import json
import sys
import types

import pytest

from eval.bench import __main__ as bench
from eval.bench import generate_vs_engine as gve


def _run(tmp_path, *args):
    out = tmp_path / "gve.json"
    assert bench.main(["generate-vs-engine", "--tiny", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_lengths_spread_over_the_range_and_all_new():
    lengths = gve.prompt_lengths(40, 2048, 4096)
    assert lengths[0] == 2048 and lengths[-1] == 4096 and len(set(lengths)) == 40
    assert lengths == sorted(lengths)
    with pytest.raises(SystemExit):
        gve.prompt_lengths(0, 2048, 4096)


def test_tiny_run_in_process_records_every_path(tmp_path):
    report = _run(tmp_path, "--prompts", "3", "--repeat", "1", "--new-tokens", "4", "--no-isolate")
    assert list(report["paths"]) == list(gve.PATHS)
    assert [p["tokens"] for p in report["prompts"]] == gve.prompt_lengths(3, 48, 96)
    for name, path in report["paths"].items():
        s = path["summary"]
        assert (s["finished"], s["of"]) == (3, 3), name
        assert len(path["per_prompt"]) == 3 and len(path["repeat"]) == 1
        assert all(r["seconds"] > 0 and r["new_tokens"] == 4 and set(r["compiles"]) ==
                   {"triton_kernels", "autotuned", "compiled_graphs"} for r in path["per_prompt"])
        assert s["first_s"] == path["per_prompt"][0]["seconds"] and s["later_median_s"] and s["repeat_median_s"]
        assert "0" in s["first_time_over_repeat"]
    assert report["paths"]["generate default"]["dtype"] == "float32"
    assert report["paths"]["engine bf16"]["dtype"] == "bfloat16"
    # fp32 generate() and the fp32 engine give the same greedy tokens
    assert report["agreement"]["generate default | engine default"] == {"prompts": 3, "same_tokens": 3}


def test_generate_path_stops_at_its_time_limit(tmp_path):
    report = _run(tmp_path, "--prompts", "40", "--repeat", "0", "--no-isolate", "--paths", "generate default",
                  "--generate-time-limit", "0.5")
    path = report["paths"]["generate default"]
    assert 1 <= len(path["per_prompt"]) < 40
    assert path["summary"]["of"] == 40 and path["summary"]["finished"] <= len(path["per_prompt"])
    assert path["time_limit_s"] == 0.5


def test_total_time_limit_skips_what_does_not_fit(tmp_path):
    report = _run(tmp_path, "--prompts", "2", "--no-isolate", "--total-time-limit", "0")
    assert all("skipped" in path for path in report["paths"].values())


def test_isolated_paths_run_in_their_own_processes(tmp_path):
    report = _run(tmp_path, "--prompts", "2", "--repeat", "1", "--new-tokens", "2",
                  "--paths", "generate default", "engine default")
    assert report["isolated"] is True
    for name in ("generate default", "engine default"):
        path = report["paths"][name]
        assert path["process"] == {"returncode": 0}, path["process"]
        assert path["summary"]["finished"] == 2 and len(path["repeat"]) == 1
    assert report["agreement"]["generate default | engine default"]["same_tokens"] == 2


def test_compile_counts_read_triton_caches(monkeypatch):
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    def body(x):
        pass

    _kernel = JITFunction(body)  # what @triton.jit makes outside the interpreter (the tests run under it)
    tuned = triton.autotune(configs=[triton.Config({})], key=[])(_kernel)
    module = types.ModuleType("kernels._gve_test_kernels")
    module.tuned = tuned
    monkeypatch.setitem(sys.modules, module.__name__, module)
    before = gve.compile_counts()
    _kernel.device_caches["test-device"] = ({"a": 1, "b": 2}, {}, None, None, None)
    tuned.cache[("key",)] = "config"
    after = gve.compile_counts()
    assert after["triton_kernels"] - before["triton_kernels"] == 2
    assert after["autotuned"] - before["autotuned"] == 1


def test_real_prompts_are_pass_key_prompts_of_the_asked_lengths():
    args = types.SimpleNamespace(tiny=False, model="default", prompts=2, min_tokens=2048, max_tokens=4096)
    prompts = gve.build_prompts(args)
    assert [p["target"] for p in prompts] == [2048, 4096]
    for p in prompts:
        assert abs(len(p["ids"]) - p["target"]) <= 16 and p["passkey"].isdigit()


def test_bench_lists_the_command():
    assert bench.MODULES["generate-vs-engine"] == "eval.bench.generate_vs_engine"
