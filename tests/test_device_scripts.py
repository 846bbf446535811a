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
