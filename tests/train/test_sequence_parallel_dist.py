"""Sequence parallelism for real: 2 processes, SP = 2, over the process group's backend (gloo on CPU, which
supports all_to_all in torch 2.13). Loss, logits and DeepSpeed-averaged gradients must equal the one-process run;
DeepSpeed's data-loader adapter must hand each rank its slice. Skipped, with the backend's error as the reason,
where the backend has no all_to_all."""

import json
import subprocess

import pytest
from pipeline_runs import REPO, VENV_BIN, free_port, pipeline_env

pytest.importorskip("deepspeed", reason="sequence parallelism uses DeepSpeed's Ulysses all-to-all")


def test_two_process_sequence_parallel_equals_one_process(tmp_path):
    report_path = tmp_path / "report.json"
    command = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(REPO / "tests" / "train" / "sp_dist_worker.py"), str(report_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=pipeline_env(), cwd=REPO, timeout=300)
    assert done.returncode == 0, f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-6000:]}"
    report = json.loads(report_path.read_text())
    if "unsupported" in report:
        pytest.skip(f"the {report['backend']} backend has no all_to_all here ({report['unsupported']}); "
                    f"Ulysses sequence parallelism needs one")
    assert report["world"] == 2
    assert len(report["cases"]) == 3
    for case in report["cases"]:
        assert abs(case["loss_sp"] - case["loss_reference"]) <= 1e-5 * abs(case["loss_reference"]), case
        assert case["logits_max_error"] <= 1e-4, case
        assert case["grad_max_error"] <= 1e-5 * max(case["grad_max_abs"], 1.0), case
    assert report["adapter_problems"] == [], report["adapter_problems"]
