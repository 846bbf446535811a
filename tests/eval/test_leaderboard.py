"""The RULER leaderboard (eval/harness/leaderboard.py, eval/harness/leaderboard_records.py) on fake records, and the
peers' record format (eval/harness/peers_kvpress.py, which normally runs in .venv-peers)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from eval.harness import leaderboard, peers_kvpress
from eval.harness import leaderboard_records as lr
from train.long_context_eval.ruler import RulerSample

TASKS = {"niah_single_1": "retrieval", "vt": "multi-hop tracing", "cwe": "aggregation", "qa_1": "question answering"}


def fake(setting, task, score, *, length=2048, index=0, source="podkit", method=None, kv=1.0, seed=0):
    return {"source": source, "setting": setting, "method": method or setting.split("@")[0], "task": task,
            "category": TASKS[task], "length": length, "index": index, "seed": seed, "score": score,
            "kv_kept": 1.0 if source == "podkit" else kv, "kv_read": kv, "generation": "", "outputs": ["x"]}


def board():
    records = []
    for index in range(2):
        records += [fake("dense", t, 1.0, index=index) for t in TASKS]
        records += [fake("tidal@1/8", "niah_single_1", 0.0, index=index, kv=0.25), fake("tidal@1/8", "vt", 1.0, index=index,
                    kv=0.25), fake("tidal@1/8", "cwe", 0.5, index=index, kv=0.25),
                    fake("tidal@1/8", "qa_1", 1.0, index=index, kv=0.25)]
        records += [fake("kvpress:SnapKV@0.875", t, 1.0, index=index, source="kvpress", method="SnapKV", kv=0.125)
                    for t in TASKS]
    return records


def test_summary_per_task_category_and_average():
    summary = lr.summarise(board())
    dense, tidal = summary["dense"]["2048"], summary["tidal@1/8"]["2048"]
    assert dense["average"] == 100 and dense["n"] == 8
    assert tidal["tasks"] == {"cwe": 50.0, "niah_single_1": 0.0, "qa_1": 100.0, "vt": 100.0}
    assert tidal["average"] == 62.5 and tidal["categories"]["retrieval"] == 0.0
    assert tidal["kv_read"] == 0.25 and tidal["kv_kept"] == 1.0
    assert summary["kvpress:SnapKV@0.875"]["2048"]["source"] == "kvpress"


def test_losses_name_the_categories_below_dense():
    lines = lr.losses(lr.summarise(board()))
    assert len(lines) == 1 and lines[0].startswith("- tidal@1/8 at 2048: 62.5 vs dense 100.0 on 4 tasks")
    assert "retrieval -100" in lines[0] and "aggregation -50" in lines[0] and "tracing" not in lines[0]


def test_losses_compare_only_the_tasks_both_ran():
    records = [fake("dense", "vt", 0.0), fake("dense", "qa_1", 1.0), fake("quest@1/8", "qa_1", 1.0)]
    assert lr.losses(lr.summarise(records)) == []


def test_merge_resume_and_overwrite(tmp_path):
    podkit = lr.RecordFile(tmp_path / "records.jsonl")
    for record in board()[:8]:
        podkit.append(record)
    peers = lr.RecordFile(tmp_path / "records_kvpress.jsonl")
    peers.append(fake("kvpress:SnapKV@0.875", "vt", 0.0, source="kvpress", method="SnapKV", kv=0.125))
    peers.append(fake("kvpress:SnapKV@0.875", "vt", 1.0, source="kvpress", method="SnapKV", kv=0.125))  # a rerun
    with open(tmp_path / "records.jsonl", "a") as handle:
        handle.write('{"source": "podkit", "setting": "den')  # a line cut by a killed run
    again = lr.RecordFile(tmp_path / "records.jsonl")
    assert len(again.records) == 8 and ("dense", "vt", 2048, 0, 0) in again.done
    merged = lr.load_all(tmp_path)
    assert len(merged) == 9
    assert [r["score"] for r in merged if r["setting"].startswith("kvpress")] == [1.0]


def test_bad_records_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="lacks kv_read"):
        lr.RecordFile(tmp_path / "r.jsonl").append({k: v for k, v in fake("dense", "vt", 1.0).items() if k != "kv_read"})
    with pytest.raises(ValueError, match="score=1.5"):
        lr.check_record(fake("dense", "vt", 1.5))
    assert not (tmp_path / "r.jsonl").exists()


def test_outputs_table_and_plot_from_fake_records(tmp_path):
    pytest.importorskip("matplotlib")
    records = board() + [fake(f"tidal@1/{k}", t, 0.5, kv=1 / k) for k in (2, 4) for t in TASKS]
    records += [fake("dense", t, 0.5, length=4096) for t in TASKS]
    for record in records:
        lr.RecordFile(tmp_path / "records.jsonl").append(record)
    result = leaderboard.write_outputs(tmp_path, lr.load_all(tmp_path), {"command": "test", "samples_per_task": 2})
    assert set(result["summary"]) == {"dense", "tidal@1/2", "tidal@1/4", "tidal@1/8", "kvpress:SnapKV@0.875"}
    table = (tmp_path / "leaderboard.md").read_text()
    assert "| tidal@1/8 | podkit | 2048 | 1.000 | 0.250 | 62.5 |" in table
    assert table.index("| dense |") < table.index("| tidal@1/2 |") < table.index("| kvpress:SnapKV")
    assert (tmp_path / "leaderboard.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "leaderboard.json").read_text())["losses"]
    # --replot rebuilds the same summary from the records alone
    again = leaderboard.main(["--replot", "--out", str(tmp_path)])
    assert again["summary"] == json.loads(json.dumps(result["summary"]))


def test_plot_lines_group_budgets_of_one_method():
    summary = lr.summarise(board())
    assert leaderboard.line_name("tidal@1/8", summary["tidal@1/8"]["2048"]) == "tidal"
    assert leaderboard.line_name("kvpress:SnapKV@0.875", summary["kvpress:SnapKV@0.875"]["2048"]) == "kvpress SnapKV"
    assert leaderboard.line_name("token_sparse@0.005", {"source": "podkit", "method": "token_sparse"}) \
        == "token_sparse@0.005"


def test_settings_use_fractions_of_the_length():
    settings = leaderboard.podkit_settings(4096, ["1/2", "1/16"], [0.005], {})
    labels = {s.label: s for s in settings}
    assert {"dense", "tidal@1/2", "tidal@1/16", "quest@1/16", "streaming@1/2", "token_sparse@0.005"} <= set(labels)
    assert labels["tidal@1/16"].overrides["tidal_budget"] == 256 and labels["quest@1/2"].budget == 2048
    assert "pod_zero_shot" not in labels  # no calibrated blocks: POD would be dense under another name
    with_blocks = leaderboard.podkit_settings(2048, ["1/8"], [], {"pod_blocks_file": "blocks.json"})
    assert any(s.label == "pod_zero_shot" for s in with_blocks)


def test_kv_fractions_follow_the_plan():
    from sparse_models.config import SparseAttentionConfig

    config = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, model_type="llama", vocab_size=100)
    model = SimpleNamespace(config=config, sparse_config=SparseAttentionConfig())
    assert leaderboard.kv_fractions(model, 1000) == (1.0, 1.0)
    model.sparse_config = SparseAttentionConfig().with_overrides(decode_scheme="quest", quest_budget=100)
    kept, read = leaderboard.kv_fractions(model, 1000)
    assert kept == 1.0 and read == pytest.approx((2 * 1.0 + 2 * 0.1) / 4)  # layers 0, 1 dense (Quest paper)
    model.sparse_config = SparseAttentionConfig().with_overrides(decode_scheme="streaming", streaming_sink_tokens=4,
                                                                  streaming_recent_window=496)
    assert leaderboard.kv_fractions(model, 1000) == (1.0, pytest.approx(0.5))
    model.sparse_config = SparseAttentionConfig().with_overrides(
        prefill_scheme="pod", decode_scheme="pod", pod_sink_tokens=16, pod_recent_window=84,
        pod_anchor_layers=[[0, 0], [0, 1], [2, 2], [2, 2]])
    kept, read = leaderboard.kv_fractions(model, 1000)
    # 3 of the 8 (layer, KV head) pairs share keys (1/0, 3/0, 3/1): they keep 100 of 1000 keys, all values
    assert read == 1.0 and kept == pytest.approx(1 - 0.5 * (3 / 8) * 0.9)


def test_bad_arguments_fail_before_work(tmp_path):
    with pytest.raises(SystemExit):
        leaderboard.main(["--fractions", "3/2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        leaderboard.main(["--lengths", "1024", "--out", str(tmp_path)])  # qa_2 needs 2048
    with pytest.raises(SystemExit):
        leaderboard.main(["--pod-adapted", str(tmp_path / "missing"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # kvpress's class name instead of the press name
        leaderboard.main(["--peers", "--peer-presses", "SnapKVPress", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        leaderboard.main(["--peers", "--peer-ratios", "1.5", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # vLLM's "fp8" is spelled fp8_e4m3 here
        leaderboard.main(["--kv-cache-dtype", "fp8", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_kv_cache_dtype_is_a_load_time_override():
    args = leaderboard.parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert leaderboard.cache_override(args) == {"kv_cache_dtype": "fp8_e4m3"}
    assert leaderboard.cache_override(leaderboard.parse_args([])) == {}
    args = leaderboard.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--kv-cache-recent-keys", "64"])
    assert leaderboard.cache_override(args) == {"kv_cache_dtype": "fp8_e4m3", "kv_cache_recent_keys": 64}


def test_recent_keys_without_an_fp8_cache_is_one_parser_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as error:
        leaderboard.main(["--kv-cache-recent-keys", "64", "--out", str(tmp_path)])
    assert error.value.code == 2 and "--kv-cache-recent-keys 64 needs --kv-cache-dtype fp8_e4m3" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- peers

def test_peer_records_have_the_leaderboard_format():
    sample = RulerSample(task="niah_multivalue", index=3, seed=0, max_length=4096, input="ctx\nWhat are all q",
                         question_start=3, gen_prefix="The", outputs=["1111111", "2222222"], tokens_to_generate=128,
                         category="retrieval")
    record = peers_kvpress.peer_record(sample, "KVzip", 0.875, " 1111111 and 2222222", prompt_tokens=4000,
                                       seconds=1.0, device="cpu", model="m", chat=True, max_new_tokens=128)
    assert lr.check_record(record) is record
    assert record["setting"] == "kvpress:KVzip@0.875" and record["kv_kept"] == record["kv_read"] == 0.125
    assert record["score"] == 1.0 and lr.record_key(record) == ("kvpress:KVzip@0.875", "niah_multivalue", 4096, 3, 0)
    dense = peers_kvpress.peer_record(sample, "none", 0.0, "1111111", prompt_tokens=1, seconds=0, device="cpu",
                                      model="m", chat=True, max_new_tokens=1)
    assert dense["kv_read"] == 1.0 and dense["score"] == 0.5 and dense["setting"] == "kvpress:none@0"


def test_press_names_and_ratios_are_checked_before_kvpress_is_imported():
    assert peers_kvpress.make_press("none", 0.0) is None
    with pytest.raises(ValueError, match="press='H2O'"):
        peers_kvpress.make_press("H2O", 0.5)
    with pytest.raises(ValueError, match="ratio=1.0"):
        peers_kvpress.make_press("SnapKV", 1.0)
    assert peers_kvpress.PRESSES == ["KVzip", "Compactor", "LeverageScore", "SnapKV", "StreamingLLM",
                                     "ExpectedAttention"]


def test_plain_checkpoint_strips_the_podkit_type(tmp_path):
    source = tmp_path / "podkit"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "podkit_llama", "architectures":
                                                    ["PodkitLlamaForCausalLM"], "sparse_attention": {}}))
    (source / "model.safetensors").write_bytes(b"weights")
    plain = peers_kvpress.plain_checkpoint(source, tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    assert config == {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    assert (plain / "model.safetensors").read_bytes() == b"weights"
    assert peers_kvpress.plain_checkpoint(plain, tmp_path / "other") == plain.resolve()


def test_kvpress_stand_ins_only_where_a_module_is_missing(monkeypatch):
    import importlib.util
    import sys

    monkeypatch.setitem(sys.modules, "kvpress", SimpleNamespace(name="fake kvpress"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "fire" else real(name))
    monkeypatch.delitem(sys.modules, "fire", raising=False)
    assert peers_kvpress.import_kvpress().name == "fake kvpress"
    with pytest.raises(ImportError, match="fire.Fire is a stand-in"):
        sys.modules["fire"].Fire()
    monkeypatch.delitem(sys.modules, "fire")


def test_a_passed_deadline_stops_before_any_sample(tmp_path):
    sample = RulerSample(task="vt", index=0, seed=0, max_length=2048, input="c\nQuestion: Find all variables",
                         question_start=1, gen_prefix="Answer:", outputs=["A"], tokens_to_generate=30,
                         category="multi-hop tracing")
    records = lr.RecordFile(tmp_path / "records.jsonl")
    setting = leaderboard.podkit_settings(2048, ["1/8"], [], {})[0]
    assert leaderboard.run_setting(None, None, setting, [sample], records, chat=False, max_new_tokens=None,
                                   device_name="cpu", model_name="m", deadline=0.0) is False
    assert records.records == []


def test_samples_file_is_reused_and_a_missing_generator_is_named(tmp_path, monkeypatch):
    import importlib.util

    sample = RulerSample(task="vt", index=0, seed=0, max_length=2048, input="c\nQuestion: Find all variables",
                         question_start=1, gen_prefix="Answer:", outputs=["A"], tokens_to_generate=30)
    (tmp_path / "samples_2048.json").write_text(json.dumps({"seed": 0, "samples": [sample.to_dict()]}))
    assert leaderboard.load_samples(tmp_path, 2048, ["vt"], 1, 0, "m", None) == [sample]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "lm_eval" else real(name))
    with pytest.raises(SystemExit, match=r"lm_eval (and long_context_eval are|is) not installed here"):
        leaderboard.load_samples(tmp_path, 2048, ["vt"], 2, 0, "m", None)  # 2 asked, 1 stored


def test_peers_are_split_over_processes_with_their_own_records(tmp_path, monkeypatch):
    import subprocess

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda command, cwd: started.append(command) or SimpleNamespace())
    args = leaderboard.parse_args(["--out", str(tmp_path), "--model", str(tmp_path), "--lengths", "4096",
                                   "--device", "cpu", "--peers", "--peers-venv", str(tmp_path / "venv"),
                                   "--peer-jobs", "4", "--peer-ratios", "0.5", "0.875"])
    assert len(leaderboard.start_peers(args, 300)) == 4
    presses = [c[c.index("--presses") + 1:c.index("--records")] for c in started]
    assert sorted(p for share in presses for p in share) == sorted(peers_kvpress.PRESSES)
    records = [c[c.index("--records") + 1] for c in started]
    assert len(set(records)) == 4 and all(r.startswith("records_kvpress_") for r in records)
    assert sum("--no-dense-check" not in c for c in started) == 1  # one process runs the no-press check
    assert all(c[c.index("--ratios") + 1:c.index("--ratios") + 3] == ["0.5", "0.875"] for c in started)
    assert all(c[c.index("--time-limit") + 1] == "300" for c in started)
    with pytest.raises(SystemExit, match="make peers"):
        leaderboard.start_peers(leaderboard.parse_args(["--peers-venv", str(tmp_path / "none"), "--device", "cpu"]))


def _sample(task, index, length=2048):
    return RulerSample(task=task, index=index, seed=0, max_length=length, input="c\nQuestion: Find all variables",
                       question_start=1, gen_prefix="Answer:", outputs=["A"], tokens_to_generate=30)


def test_peer_work_units_come_in_rounds_and_skip_what_is_done():
    samples = {2048: [_sample(t, i) for i in range(2) for t in ("vt", "cwe")]}
    runs = [("none", 0.0), ("SnapKV", 0.5), ("SnapKV", 0.875)]
    done = {("kvpress:SnapKV@0.5", "vt", 2048, 0, 0), ("kvpress:SnapKV@0.5", "cwe", 2048, 0, 0),
            ("kvpress:none@0", "vt", 2048, 1, 0)}
    units = [(n, i, p, r, [s.task for s in todo]) for n, i, p, r, todo in
             peers_kvpress.work_units(samples, 2, runs, done)]
    assert units == [(2048, 0, "none", 0.0, ["vt", "cwe"]), (2048, 0, "SnapKV", 0.875, ["vt", "cwe"]),
                     (2048, 1, "none", 0.0, ["cwe"]), (2048, 1, "SnapKV", 0.5, ["vt", "cwe"]),
                     (2048, 1, "SnapKV", 0.875, ["vt", "cwe"])]


def test_peer_processes_sharing_a_claims_folder_split_the_units(tmp_path):
    samples = {2048: [_sample(t, i) for i in range(3) for t in ("vt", "qa_1")],
               4096: [_sample(t, i, 4096) for i in range(3) for t in ("vt", "qa_1")]}
    runs = [("none", 0.0)] + [("KVzip", r) for r in peers_kvpress.RATIOS]
    workers = [peers_kvpress.work_units(samples, 3, runs, set(), tmp_path / "claims") for _ in range(3)]
    (tmp_path / "claims").mkdir()
    taken: list[list[tuple]] = [[], [], []]
    active = list(range(3))
    while active:  # the workers interleave, as concurrent processes do
        for worker in list(active):
            unit = next(workers[worker], None)
            if unit is None:
                active.remove(worker)
            else:
                taken[worker].append(unit[:4])
    every = [u for share in taken for u in share]
    assert len(every) == len(set(every)) == 2 * 3 * len(runs)  # each unit once, none lost
    assert all(share for share in taken)
    # in rounds: every worker's units go through the lengths and sample indices in order
    assert all(share == sorted(share, key=lambda u: (u[0], u[1])) for share in taken)
    assert peers_kvpress.claim(None, "anything") and peers_kvpress.claim(None, "anything")


def test_plain_checkpoint_made_twice_at_once_is_complete(tmp_path, monkeypatch):
    source = tmp_path / "podkit"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "podkit_llama"}))
    (source / "model.safetensors").write_bytes(b"weights")
    dest = tmp_path / "plain"
    dest.mkdir()
    real_exists = type(dest).exists
    # another process linked the weights between this one's check and its link
    monkeypatch.setattr(type(dest), "exists", lambda self: False if self.name == "model.safetensors"
                        else real_exists(self))
    (dest / "model.safetensors").symlink_to(source / "model.safetensors")
    plain = peers_kvpress.plain_checkpoint(source, dest)
    assert json.loads((plain / "config.json").read_text()) == {"model_type": "llama", "architectures": []}
    assert sorted(p.name for p in plain.iterdir()) == ["config.json", "model.safetensors"]


def test_adapted_export_rows_add_pod_plus_tidal_per_fraction():
    from sparse_models.config import SparseAttentionConfig

    rows = {s.label: s for s in leaderboard.adapted_settings({}, 4096, ["1/4", "1/8"])}
    assert list(rows) == ["pod_adapted", "pod_adapted+tidal@1/4", "pod_adapted+tidal@1/8"]
    assert rows["pod_adapted"].overrides == {}  # the export's own config: POD decode
    assert rows["pod_adapted+tidal@1/8"].overrides == {"decode_scheme": "pod+tidal", "tidal_budget": 512}
    assert rows["pod_adapted+tidal@1/4"].budget == 1024
    picked = {s.label: s for s in leaderboard.adapted_settings({"tidal": {"tidal_selection": "all_union"}}, 2048,
                                                                 ["1/8"])}
    calibrated = picked["pod_adapted+tidal_calibrated@1/8"]
    assert calibrated.overrides == {"decode_scheme": "pod+tidal", "tidal_budget": 256, "tidal_selection": "all_union"}
    # the rows are loadable settings of a POD export: POD's anchors stay, TidalDecode reads the budget
    # (8 layers: TidalDecode keeps its first layers and a re-selection layer dense, so 4 would read everything)
    anchors = [[layer - layer % 2] * 2 for layer in range(8)]  # odd layers share both KV heads' keys
    export = SparseAttentionConfig().with_overrides(prefill_scheme="pod", decode_scheme="pod", pod_sink_tokens=16,
                                                    pod_recent_window=84, pod_anchor_layers=anchors)
    config = SimpleNamespace(num_hidden_layers=8, num_key_value_heads=2, model_type="llama", vocab_size=100)
    model = SimpleNamespace(config=config, sparse_config=export.with_overrides(**calibrated.overrides))
    kept, read = leaderboard.kv_fractions(model, 1000)
    assert kept == pytest.approx(1 - 0.5 * 0.5 * 0.9)  # POD's cache: half the units keep 100 of 1000 keys
    assert read < 1.0


def test_question_phase_is_recorded_and_a_folder_keeps_one_protocol(tmp_path, monkeypatch, capsys):
    """--question-phase prefill reaches the one-prompt loop as question_in_decode=False, each record says where the
    question went, and a folder scored with one protocol refuses the other before any model loads."""
    sample = RulerSample(task="vt", index=0, seed=0, max_length=2048, input="c\nQuestion: Find all variables",
                         question_start=1, gen_prefix="Answer:", outputs=["A"], tokens_to_generate=30,
                         category="multi-hop tracing")
    seen = []

    def fake_generate(model, tokenizer, context, question, **options):
        seen.append(options["question_in_decode"])
        return SimpleNamespace(text=" A", context_tokens=10, question_tokens=5, token_sparsity=None)

    monkeypatch.setattr(leaderboard, "retrieval_generate", fake_generate)
    monkeypatch.setattr(leaderboard.ruler, "render", lambda sample, tokenizer, chat: ("c", "q"))
    monkeypatch.setattr(leaderboard, "kv_fractions", lambda model, tokens: (1.0, 1.0))
    records = lr.RecordFile(tmp_path / "records.jsonl")
    setting = leaderboard.podkit_settings(2048, ["1/8"], [], {})[0]
    assert leaderboard.run_setting(None, None, setting, [sample], records, chat=False, max_new_tokens=None,
                                   device_name="cpu", model_name="m", question_in_decode=False)
    assert seen == [False] and records.records[0]["question_phase"] == "prefill"
    assert leaderboard.parse_args(["--out", str(tmp_path), "--question-phase", "prefill"]).question_phase == "prefill"
    with pytest.raises(SystemExit):
        leaderboard.parse_args(["--out", str(tmp_path)])   # the default, decode, against prefill records
    assert "scored with the question in prefill; use another --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        leaderboard.parse_args(["--out", str(tmp_path), "--question-phase", "middle"])
    with pytest.raises(SystemExit):
        leaderboard.parse_args(["--out", str(tmp_path / "new"), "--question-phase", "prefill", "--peers"])
    assert "invalid with --peers" in capsys.readouterr().err
