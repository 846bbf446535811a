"""eval.studies.pod_gate_skip and sparse_models.schemes.pod_skip_stats: skip fractions, recording, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eval.studies import pod_gate_skip as pgs
from sparse_models.schemes.pod_skip_stats import (
    GateSkipRecorder,
    active_recorder,
    gate_histogram,
    record_gate_skips,
    skip_summary,
)

ANCHORS = [[0, 0], [0, 1], [0, 1], [3, 1]]  # 4 layers x 2 KV heads: layers 1-2 share head 0, 2-3 share head 1


def _record(recorder, layer, estimate, shared_kv, seq_lens, tau, group=4, sink=2, recent=3, skip=None):
    estimate = torch.tensor(estimate, dtype=torch.float32)
    shared_q = torch.tensor(shared_kv).repeat_interleave(group)
    if skip is None:
        skip = ((estimate >= tau) & shared_q[None, :] if tau is not None
                else torch.zeros_like(estimate, dtype=torch.bool))
    recorder.add(layer, estimate, skip, shared_q, group, torch.tensor(seq_lens), sink, recent, tau)


def test_fractions_on_a_hand_computed_case():
    """Two steps, one anchor layer and one shared layer (KV head 0 shared, head 1 its own anchor), G = 4.

    Step 0, seq_len 10 (D = 10 - 2 - 3 = 5): shared heads 0-3 have gates .92 .83 .77 .71 -> all skip at
    0.7 -> one group skip. Step 1, seq_len 11 (D = 6): gates .91 .93 .94 .22 -> 3 of 4 skip, no group skip.
    Heads: 7 / 8 skipped; groups: 1 / 2; distant bytes: 5 / (2 layers x 2 KV heads x (5 + 6)) = 5 / 44;
    all K/V rows: 5 / (4 x (10 + 11)) = 5 / 84. The unshared head 4 (gate .99) never counts.
    """
    recorder = GateSkipRecorder()
    for step, (seq_len, gates) in enumerate(((10, [.92, .83, .77, .71]), (11, [.91, .93, .94, .22]))):
        _record(recorder, 0, [[0.5] * 8], [False, False], [seq_len], 0.7)  # anchor layer: recorded, no shared head
        _record(recorder, 1, [gates + [0.99, 0.99, 0.1, 0.1]], [True, False], [seq_len], 0.7)
    assert [r.step for r in recorder.records] == [0, 0, 1, 1]
    summary = skip_summary(recorder.records)
    assert summary["steps"] == 2
    assert (summary["heads_skipped"], summary["shared_heads"]) == (7, 8)
    assert summary["head_skip_fraction"] == pytest.approx(7 / 8)
    assert (summary["groups_skipped"], summary["shared_groups"]) == (1, 2)
    assert summary["group_skip_fraction"] == pytest.approx(0.5)
    assert summary["distant_bytes_skipped_fraction"] == pytest.approx(5 / 44)
    assert summary["kv_bytes_skipped_fraction"] == pytest.approx(5 / 84)
    assert list(summary["per_layer"]) == ["1"]  # the anchor layer has no shared head
    assert summary["per_layer"]["1"]["head_skip_fraction"] == pytest.approx(7 / 8)
    # the same records at another tau: heads >= 0.85 -> .92 | .91 .93 .94 -> 4 / 8, no group skips
    at = skip_summary(recorder.records, tau=0.85)
    assert at["head_skip_fraction"] == pytest.approx(4 / 8) and at["group_skip_fraction"] == 0
    assert at["distant_bytes_skipped_fraction"] == 0
    # histogram of shared heads' estimates only, 20 bins over [0, 1]
    hist = gate_histogram(recorder.records)
    assert hist["total"] == 8 and len(hist["counts"]) == 20 and len(hist["edges"]) == 21
    assert hist["counts"][18] == 4 and hist["counts"][16] == 1 and hist["counts"][15] == 1
    assert hist["counts"][14] == 1 and hist["counts"][4] == 1


def test_tau_one_skips_exactly_the_gates_equal_to_one_and_recorder_scope():
    recorder = GateSkipRecorder()
    _record(recorder, 1, [[1.0, 0.9999999, 1.0, 1.0, 0.3, 0.3, 0.3, 0.3]], [True, False], [20], 1.0)
    summary = skip_summary(recorder.records)
    assert summary["heads_skipped"] == 3 and summary["groups_skipped"] == 0
    hist = gate_histogram(recorder.records)
    assert hist["counts"][19] == 4 and hist["exactly_one"] == 3   # a gate of exactly 1 falls in the last bin
    with pytest.raises(ValueError, match="tau=1.5"):
        skip_summary(recorder.records, tau=1.5)
    assert active_recorder() is None
    with record_gate_skips() as outer:
        with record_gate_skips() as inner:
            assert active_recorder() is inner
        assert active_recorder() is outer
    assert active_recorder() is None


def _tiny_pod_model(tokenizer=None, vocab: int = 61):
    from tests.tiny_models import SHARP_QK_STD, tiny_model

    model = tiny_model(4, 4, seed=0, qk_std=SHARP_QK_STD, vocab=len(tokenizer) if tokenizer is not None else vocab)
    model.set_sparse_attention({"prefill_scheme": "pod", "decode_scheme": "pod",
                                "pod": {"sink_tokens": 4, "recent_window": 12, "anchor_layers": ANCHORS}})
    return model


def _decode_logits(model, ids, prefill: int):
    cache = model.new_cache()
    out = [model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[:, -1]]
    for t in range(prefill, ids.shape[1]):
        out.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


@torch.no_grad()
def test_recording_changes_no_output_and_matches_the_model_skips():
    model = _tiny_pod_model()
    ids = torch.randint(0, 61, (2, 48))
    plain = _decode_logits(model, ids, 30)
    with record_gate_skips() as census:
        recorded = _decode_logits(model, ids, 30)
    assert torch.equal(plain, recorded)  # no tau: the recorded run's output is the unrecorded one, bit for bit
    assert len(census.records) == 18 * 4 and not any(bool(r.skip.any()) for r in census.records)
    assert skip_summary(census.records)["shared_heads"] == 18 * 2 * (4 + 8 + 4)  # B x shared heads per step
    base = model.sparse_config
    model.set_sparse_attention(base, pod_gate_tau=0.6)
    unrecorded = _decode_logits(model, ids, 30)
    with record_gate_skips() as run:
        with_tau = _decode_logits(model, ids, 30)
    assert torch.equal(unrecorded, with_tau)
    for record in run.records:   # the recorded decision is the anchor estimate >= tau on shared heads
        assert torch.equal(record.skip, (record.estimate >= 0.6) & record.shared_q[None, :])
    # layer 1's head 0 group reads layer 0's gate: its estimate is the recorded gate of layer 0
    by_key = {(r.layer, r.step): r for r in run.records}
    assert torch.equal(by_key[(1, 5)].estimate[:, :4], by_key[(0, 5)].estimate[:, :4])
    model.set_sparse_attention(base)


# ---- the command line ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory, tiny_tokenizer):
    tokenizer = tiny_tokenizer
    folder = tmp_path_factory.mktemp("tiny_pod_export")
    model = _tiny_pod_model(tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _args(export, out, *extra):
    return ["--model", str(export), "--context", "64", "--decode-tokens", "12", "--windows", "1",
            "--texts", "emma", "--device", "cpu", "--out", str(out), *extra]


def test_cli_end_to_end_on_a_tiny_export(tiny_export, fake_text_cache, tmp_path):
    out = tmp_path / "out"
    report = pgs.main(_args(tiny_export, out, "--taus", "0.3", "1.0", "--texts", "emma", "moby_dick"))
    data = json.loads((out / "pod_gate_skip.json").read_text())
    assert data["model"] == str(tiny_export) and data["texts"] == ["emma", "moby_dick"]
    assert data["settings"]["sink"] == 4 and data["settings"]["recent"] == 12  # from the export's config
    assert data["command"].startswith("python -m eval.pod_gate_skip --model")
    assert data["anchor_map"]["anchor_layers"] == ANCHORS and data["anchor_map"]["query_heads_per_kv_head"] == 4
    assert data["decode_steps"] == 2 * 11
    hist = data["gate_histogram"]
    assert hist["total"] == 22 * 16 and sum(hist["counts"]) == hist["total"]
    low, one = data["taus"]
    assert [low["tau"], one["tau"]] == [0.3, 1.0]
    for row in data["taus"]:
        assert 0 <= row["group_skip_fraction"] <= row["head_skip_fraction"] <= 1
        assert set(row["per_layer"]) == {"1", "2", "3"}
        assert row["by_text"]["emma"]["decode_ppl_no_tau"] > 0
    assert low["head_skip_fraction"] > one["head_skip_fraction"]
    # tau = 1: only gates of exactly 1 skip (none here), and the perplexity is the no-tau one
    assert one["heads_skipped"] == 0 and one["distant_bytes_skipped_fraction"] == 0
    assert one["at_no_tau_gates"]["head_skip_fraction"] == pytest.approx(hist["exactly_one"] / hist["total"])
    assert math.isclose(one["decode_ppl"], one["decode_ppl_no_tau"], rel_tol=1e-6)
    assert abs(one["decode_ppl_change"]) < 1e-6
    assert report["decode_ppl_no_tau"]["pooled"] == data["decode_ppl_no_tau"]["pooled"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "pod_gate_skip.png").stat().st_size > 1000


@pytest.mark.parametrize("extra, message", [
    (["--taus", "0.7", "1.5"], "--taus 1.5 is invalid: every tau must be in (0, 1]"),
    (["--taus", "0"], "--taus 0.0 is invalid"),
    (["--decode-tokens", "64"], "--decode-tokens 64 is invalid: expected fewer than --context - 1 = 63"),
    (["--decode-tokens", "1"], "--decode-tokens 1 is invalid: expected an integer >= 2"),
    (["--windows", "0"], "--windows 0 is invalid"),
    (["--texts", "ulysses"], "--texts 'ulysses' is invalid: expected held-out book names"),
    (["--recent", "60"], "--sink/--recent '4 + 60' is invalid: the proximal window must leave distant positions"),
    (["--blocks-file", "/nonexistent/blocks.json"],
     "--blocks-file '/nonexistent/blocks.json' is invalid: no such file"),
])
def test_bad_inputs_fail_before_loading_the_model(tiny_export, tmp_path, monkeypatch, extra, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(pgs, "load_model", no_loading)
    with pytest.raises(SystemExit) as error:
        pgs.main(_args(tiny_export, tmp_path / "out", *extra))
    assert message in str(error.value)


def test_unknown_model_and_model_without_pod_map_are_rejected(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit) as error:
        pgs.main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path)])
    assert "--model" in str(error.value) and "expected 'default'" in str(error.value)
    with pytest.raises(SystemExit) as error:   # a plain Llama: no POD anchor map in its config
        pgs.main(["--model", str(tiny_model_dir), "--out", str(tmp_path)])
    assert "carries no POD anchor map" in str(error.value)
