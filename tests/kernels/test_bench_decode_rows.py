"""eval/bench/kernels_decode.py's new row builders run end to end on CPU (Triton interpreter, timers
replaced by a single call), so that a Python error cannot first show up in the lead's GPU run; the
bench's torch composition of POD + TidalDecode equals the reference it is timed against."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU smoke run of the bench rows")


@pytest.fixture
def kd(monkeypatch):
    import eval.bench.kernels_decode as KD
    monkeypatch.setattr(KD, "_bench", lambda fn, rep=100: (fn(), 1.0)[1])
    monkeypatch.setattr(KD, "_bench_graph", lambda fn, iters=50: (fn(), 2.0)[1])
    for name, val in dict(HQ=4, HKV=2, D=16, DTYPE=torch.float32, SELECTION_BUDGET=40).items():
        monkeypatch.setattr(KD, name, val)
    return KD


def test_selection_pod_and_pod_sparse_rows(kd):
    gen = torch.Generator().manual_seed(0)
    rows = kd.run_bench([150], [1], torch.device("cpu"), 1e12, families=("selection",))
    q, k, v, seq_lens = kd._inputs(1, 150, "cpu", gen)
    kd._pod_rows(rows, q, k, v, seq_lens, 1.0, 2.0, 1e12, gen, sink=2, recent=32)
    kd._pod_sparse_rows(rows, q, k, v, seq_lens, 1e12, gen, sink=2, recent=32)
    ops = [r["op"] for r in rows]
    assert ops.count("selection_head") == 1 and ops.count("selection_group") == 1
    assert all(r["rows_agreeing_with_legacy"] == 1.0 for r in rows if r["op"].startswith("selection"))
    skips = [r for r in rows if r["op"] == "pod_skip" and r["pattern"] == "groups"]
    assert [r["skipped_groups"] for r in skips] == [0.0, 0.0, 0.5, 1.0, 1.0]  # round(frac * 2 groups), half to even
    assert all("bw_util" in r for r in rows)
    assert {"pod_sparse_group", "pod_sparse_head"} <= set(ops)


def test_torch_pod_sparse_equals_reference(kd):
    from kernels import reference
    gen = torch.Generator().manual_seed(1)
    q, k, v, seq_lens = kd._inputs(2, 120, "cpu", gen)
    k_local = torch.randn(2, 2, 2 + 16, 16, generator=gen)
    idx = kd._random_lists(2, 2, 120, 30, "cpu", gen)
    got = kd.torch_pod_sparse(q, k_local, k, v, idx, seq_lens, 2, 16)
    want = reference.pod_sparse_decode_attention(q, k_local, k, v, idx, seq_lens, sink=2, recent=16)
    assert (got - want).abs().max() < 1e-5


def test_fp8_rows_pair_every_kernel_with_its_bf16_self(kd):
    rows = kd.run_bench([150], [1], torch.device("cpu"), 1e12, kv_cache_dtypes=("fp8_e4m3",))
    assert {r["op"] for r in rows} == {"fp8_decode", "fp8_selection_head", "fp8_selection_group", "fp8_sparse_head",
                                       "fp8_sparse_group", "fp8_pod_decode", "fp8_pod_sparse_group",
                                       "fp8_pod_sparse_head", "fp8_quest"}  # no bf16 rows without "bfloat16"
    assert not [r for r in rows if "error" in r]
    decode = next(r for r in rows if r["op"] == "fp8_decode")
    # D = 16: a (token, KV head) row of K + V is 16 + 4 bytes each in FP8 (fp32 scale), 16 * 2 in bf16 (DTYPE
    # is fp32 in this fixture: 16 * 4)
    assert decode["bytes_fp8"] == 1 * 2 * 150 * 2 * (16 + 4) and decode["bytes_bf16"] == 1 * 2 * 150 * 2 * 16 * 4
    assert decode["fp8_over_bf16"] == 1.0 and decode["bw_util"] == round(decode["bytes_fp8"] / 1e12 * 1e6 / 2.0, 2)
    sparse = next(r for r in rows if r["op"] == "fp8_sparse_group" and r["k"] == 256)
    assert sparse["bytes_fp8"] == 2 * 150 * 2 * (16 + 4) + 2 * 150 * 4  # k capped at the context; int32 lists


def test_fp8_rows_follow_the_families(kd):
    rows = kd.run_bench([64], [1], torch.device("cpu"), 1e12, families=("quest",),
                        kv_cache_dtypes=("bfloat16", "fp8_e4m3"))
    assert [r["op"] for r in rows] == ["decode", "quest", "fp8_decode", "fp8_quest"]


def test_kv_row_bytes_matches_kernels_fp8_kv():
    import eval.bench.kernels_decode as KD
    assert KD.kv_row_bytes("fp8_e4m3") == 2 * (128 + 4) == 264 and KD.kv_row_bytes("bfloat16") == 4 * 128


def test_a_bad_dtype_is_rejected_before_any_work(capsys, tmp_path):
    import eval.bench.kernels_decode as KD
    with pytest.raises(SystemExit):
        KD.main(["--out", str(tmp_path / "x.json"), "--kv-cache-dtypes", "fp8_e5m2"])
    err = capsys.readouterr().err
    assert "--kv-cache-dtypes" in err and "'fp8_e5m2'" in err and "'fp8_e4m3'" in err
    assert not (tmp_path / "x.json").exists()
