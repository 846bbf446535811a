"""The device-call helper scripts (scripts/device_bundle.sh, scripts/device_setup.sh, benchmarks/plans/*.sh) parse,
refuse what they cannot do before any work, and keep the bundle folders out of git."""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = [REPO / "scripts" / "device_bundle.sh", REPO / "scripts" / "device_setup.sh",
           *sorted((REPO / "benchmarks" / "plans").glob("*.sh"))]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_bundle_folders_are_ignored_by_git():
    for folder in (".whl", ".cache"):
        done = subprocess.run(["git", "check-ignore", "-q", f"{folder}/x"], cwd=REPO)
        assert done.returncode == 0, f"{folder} must stay out of git: it travels to the device only when carried"


def test_two_gpu_plan_refuses_an_unknown_part_before_any_setup(tmp_path):
    done = subprocess.run(["bash", "benchmarks/plans/issue13_two_gpu.sh", "everything"], cwd=REPO,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert done.returncode == 2
    assert "unknown part 'everything'; allowed: sp-test, scaling, max-context, before" in done.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_device_setup_says_what_is_missing(tmp_path):
    done = subprocess.run(["bash", "-c", f"source {REPO / 'scripts' / 'device_setup.sh'}"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "no wheels in .whl (carry it)" in done.stderr


def _devrows_archive(folder: Path, rows: dict, split: str = "dev split: seed 104729") -> Path:
    import io
    import json
    import tarfile

    archive = folder / "devrows.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for row, cells in rows.items():
            data = json.dumps({"row": row, "split": split,
                               "summary": {n: {"average": v} for n, v in cells.items()}}).encode()
            info = tarfile.TarInfo(f"devrows/{row}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def test_issue29_choice_keeps_the_shipped_setting_unless_clearly_beaten(tmp_path):
    import runpy

    choose = runpy.run_path(str(REPO / "benchmarks" / "plans" / "issue29_choose.py"))["main"]
    rows = {"pod_8k_scores": {"2048": 40.0, "4096": 35.0, "8192": 30.0},
            "pod_8k_scores_recall": {"2048": 41.0, "4096": 35.5, "8192": 30.5},   # +0.67: within the margin
            "pod_8k_scores_recall_dense": {"2048": 60.0, "4096": 60.0, "8192": 60.0}}  # weights run densely: ignored
    assert choose([str(_devrows_archive(tmp_path, rows))])["pick"] == "pod_8k_scores"
    rows["pod_8k_scores_recall_auto"] = {"2048": 42.0, "4096": 36.5, "8192": 31.0}   # +1.5
    result = choose([str(_devrows_archive(tmp_path, rows))])
    assert result["pick"] == "pod_8k_scores_recall_auto"
    assert (tmp_path / "choice.json").exists() and "pod_8k_scores_recall_dense" not in result["mean"]
    with pytest.raises(SystemExit, match="not the dev split"):
        choose([str(_devrows_archive(tmp_path, rows, split="test split: seed 7919"))])
    # a candidate stopped before 8K is averaged over the easier lengths only: left out; a POD-without-distant row
    # is the same export run another way: never a candidate
    rows["pod_8k_scores_recall_auto"] = {"2048": 60.0, "4096": 50.0}
    rows["pod_8k_scores_proximal"] = {"2048": 60.0, "4096": 60.0, "8192": 60.0}
    result = choose([str(_devrows_archive(tmp_path, rows))])
    assert result["pick"] == "pod_8k_scores" and result["left_out_incomplete"] == ["pod_8k_scores_recall_auto"]
    assert "pod_8k_scores_proximal" not in result["mean"]
    rows["pod_8k_scores"] = {"2048": 40.0}
    with pytest.raises(SystemExit, match="stopped early"):
        choose([str(_devrows_archive(tmp_path, rows))])
