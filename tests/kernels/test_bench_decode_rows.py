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
