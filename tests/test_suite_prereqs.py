"""The suite's prerequisite check (tests/conftest.py) stops only selections that read the shared inputs."""

import os
import subprocess
import sys

from paths import REPO


def _pytest(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GEMRAY_SHARED": "/nonexistent-shared"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_selection_without_shared_paths_runs_without_shared_inputs():
    r = _pytest("tests/test_metrics.py")
    assert r.returncode == 0, r.stdout[-2000:]
    assert "passed" in r.stdout


def test_selection_reading_shared_inputs_stops_with_one_line():
    r = _pytest("tests/test_metrics.py", "tests/test_pipelines_bbs.py")
    assert r.returncode == 4, r.stdout[-2000:]
    assert "missing /nonexistent-shared/data/ml-1m/ratings.dat" in r.stdout + r.stderr
    assert "passed" not in r.stdout
