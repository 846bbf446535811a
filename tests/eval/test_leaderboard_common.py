"""The leaderboard's common-samples view (eval/harness/leaderboard_records.py ``common_samples``, eval/harness/leaderboard.py's
tables and plot) on synthetic records: rows scored on different sample indices, one row missing a task."""

from __future__ import annotations

import json

import pytest

from eval.harness import leaderboard
from eval.harness import leaderboard_records as lr

CATEGORY = {"niah_single_1": "retrieval", "vt": "multi-hop tracing", "cwe": "aggregation", "qa_1": "question answering"}


def rec(setting, task, index, score, *, length=2048, source=None, kv=1.0, seed=0):
    source = source or ("kvpress" if setting.startswith("kvpress:") else "podkit")
    method = setting.split(":")[-1].split("@")[0]
    return {"source": source, "setting": setting, "method": method, "task": task, "category": CATEGORY[task],
            "length": length, "index": index, "seed": seed, "score": score,
            "kv_kept": 1.0 if source == "podkit" else kv, "kv_read": kv, "generation": "", "outputs": ["x"]}


def rows(setting, scores, **keywords):
    """``scores``: {task: [score of index 0, of index 1, ...]} (None: that index was not run)."""
    return [rec(setting, task, index, score, **keywords) for task, values in scores.items()
            for index, score in enumerate(values) if score is not None]


def board():
    return (
        # dense and tidal: every task at indices 0, 1, 2
        rows("dense", {"niah_single_1": [1, 1, 0], "vt": [0, 1, 1], "cwe": [0.5, 0.5, 0.5], "qa_1": [1, 0, 0]})
        + rows("tidal@1/8", {t: [0, 0, 1] for t in CATEGORY}, kv=0.25)
        # SnapKV cut by a time limit: indices 0, 1, and qa_1 only index 0 -> 7 common samples
        + rows("kvpress:SnapKV@0.875", {"niah_single_1": [1, 0], "vt": [0, 0], "cwe": [1, 0], "qa_1": [1]},
               kv=0.125)
        # KVzip never reached qa_1: incomplete, left out (else the common view would lose qa_1)
        + rows("kvpress:KVzip@0.5", {"niah_single_1": [1, 1, 1], "vt": [1, 1, 1], "cwe": [0, 0, 0]}, kv=0.5)
    )


def test_common_view_scores_every_row_on_the_same_samples():
    view = lr.common_samples(board())["2048"]
    assert view["tasks"] == sorted(CATEGORY)
    assert view["rows"] == ["dense", "kvpress:SnapKV@0.875", "tidal@1/8"]
    assert view["samples"] == {"cwe": [[0, 0], [1, 0]], "niah_single_1": [[0, 0], [1, 0]], "qa_1": [[0, 0]],
                               "vt": [[0, 0], [1, 0]]}
    assert view["n"] == 7 and view["reference"] == "dense"
    dense, snap, tidal = (view["summary"][s] for s in ("dense", "kvpress:SnapKV@0.875", "tidal@1/8"))
    # dense on indices 0-1 (qa_1: 0): niah 100, vt 50, cwe 50, qa_1 100 -> 75 (on all its samples: 54.2)
    assert dense["tasks"] == {"cwe": 50.0, "niah_single_1": 100.0, "qa_1": 100.0, "vt": 50.0}
    assert dense["average"] == 75.0 and dense["delta"] == 0.0 and dense["n"] == 7
    # SnapKV: niah 50, vt 0, cwe 50, qa_1 100 -> 50, 25 below dense
    assert snap["categories"] == {"aggregation": 50.0, "multi-hop tracing": 0.0, "question answering": 100.0,
                                  "retrieval": 50.0}
    assert snap["average"] == 50.0 and snap["delta"] == -25.0 and snap["kv_read"] == 0.125
    # tidal scored only at index 2, which is not common: 0 here, 33.3 on all its samples
    assert tidal["average"] == 0.0 and tidal["delta"] == -75.0 and tidal["n"] == 7
    assert lr.summarise(board())["tidal@1/8"]["2048"]["average"] == pytest.approx(100 / 3)
    assert [line.split(": ")[0] for line in view["losses"]] == ["- kvpress:SnapKV@0.875 at 2048", "- tidal@1/8 at 2048"]
    assert "multi-hop tracing -50" in view["losses"][0] and "question answering" not in view["losses"][0]


def test_a_row_missing_a_task_is_listed_as_incomplete_with_its_paired_dense():
    view = lr.common_samples(board())["2048"]
    assert "kvpress:KVzip@0.5" not in view["summary"]
    kvzip = view["incomplete"]["kvpress:KVzip@0.5"]
    # on the 9 samples both scored: KVzip niah 100, vt 100, cwe 0 -> 66.7; dense niah 66.7, vt 66.7, cwe 50 -> 61.1
    assert kvzip["missing"] == ["qa_1"] and kvzip["n"] == 9
    assert kvzip["average"] == pytest.approx(200 / 3) and kvzip["reference_average"] == pytest.approx(550 / 9)


def test_without_the_incomplete_row_the_view_is_the_same():
    complete = [r for r in board() if r["setting"] != "kvpress:KVzip@0.5"]
    again = lr.common_samples(complete)["2048"]
    view = lr.common_samples(board())["2048"]
    assert again["incomplete"] == {} and again["summary"] == view["summary"] and again["n"] == view["n"]


def test_lengths_are_separate_and_an_incomplete_dense_leaves_no_reference():
    records = board() + rows("dense", {"vt": [1]}, length=4096) \
        + rows("quest@1/8", {"vt": [0, 1], "qa_1": [1, 1]}, length=4096)
    common = lr.common_samples(records)
    assert common["2048"]["n"] == 7
    view = common["4096"]
    assert view["rows"] == ["quest@1/8"] and view["n"] == 4 and view["reference"] is None
    assert view["incomplete"] == {"dense": {"missing": ["qa_1"], "n": 1, "average": 100.0, "reference_average": 100.0}}
    assert view["summary"]["quest@1/8"]["average"] == 75.0 and view["summary"]["quest@1/8"]["delta"] is None
    assert view["losses"] == []
    assert "no reference" in leaderboard.common_markdown({"4096": view})


def test_disjoint_samples_give_an_empty_view():
    records = rows("dense", {"vt": [1, None]}) + rows("quest@1/8", {"vt": [None, 1]})
    view = lr.common_samples(records)["2048"]
    assert view["n"] == 0 and view["rows"] == [] and view["summary"] == {} and view["incomplete"] == {}
    assert "No sample is common" in leaderboard.common_markdown({"2048": view})


def test_outputs_carry_both_views_and_replot_rebuilds_them(tmp_path):
    pytest.importorskip("matplotlib")
    for record in board():
        lr.RecordFile(tmp_path / "records.jsonl").append(record)
    result = leaderboard.write_outputs(tmp_path, lr.load_all(tmp_path), {"command": "test", "samples_per_task": 3})
    stored = json.loads((tmp_path / "leaderboard.json").read_text())
    assert stored["common"]["2048"]["n"] == 7 and stored["summary"]["dense"]["2048"]["n"] == 12
    table = (tmp_path / "leaderboard.md").read_text()
    assert table.index("**All samples**") < table.index("**Common samples at 2048 tokens**: n = 7")
    assert "(4 of 4 tasks, 1-2 per task)" in table
    assert "| kvpress:SnapKV@0.875 | kvpress | 0.125 | 0.125 | 50.0 | -25.0 | 50.0 | 0.0 | 100.0 | 50.0 | 7 |" in table
    assert "| dense | podkit | 1.000 | 1.000 | 75.0 | +0.0 |" in table
    assert "kvpress:KVzip@0.5 (no qa_1; 66.7 vs 61.1 on n = 9)" in table
    assert (tmp_path / "leaderboard.png").stat().st_size > 10_000
    # a stale common view in leaderboard.json is recomputed from the records, which stay as they were
    before = (tmp_path / "records.jsonl").read_text()
    (tmp_path / "leaderboard.json").write_text(json.dumps(stored | {"common": {"2048": {"n": -1}}}))
    again = leaderboard.main(["--replot", "--out", str(tmp_path)])
    assert again["common"] == json.loads(json.dumps(result["common"]))
    assert (tmp_path / "records.jsonl").read_text() == before
