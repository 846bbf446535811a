"""scripts/test_gpu_parallel.sh runs the GPU suite as fixed groups of test files: a file with GPU tests that is in
no group would never run there. (The script checks the same at start on the GPU machine; this catches it in CI.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_with_gpu_tests_is_in_a_group():
    script = (ROOT / "scripts" / "test_gpu_parallel.sh").read_text()
    grouped = set(re.findall(r"tests/[\w/]+\.py", script))
    with_gpu_tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                      if p.name != Path(__file__).name and re.search(r"pytest\.mark\.gpu\b", p.read_text())}
    assert with_gpu_tests, "no GPU tests found: the marker name changed?"
    assert not with_gpu_tests - grouped, sorted(with_gpu_tests - grouped)
    assert not grouped - with_gpu_tests, sorted(grouped - with_gpu_tests)  # stale entries
