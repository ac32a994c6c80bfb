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


def _abort_after(rank: int, root: str, write_first: bool) -> None:
    import time
    from pathlib import Path

    if write_first:
        (Path(root) / f"done{rank}").write_text("ok")
    if rank == 1:
        for _ in range(300):  # teardown comes after every rank's work (both ranks meet in destroy_process_group)
            if not write_first or (Path(root) / "done0").exists():
                break
            time.sleep(0.1)
        os.abort()  # what a C++ "terminate called ..." does
    (Path(root) / f"done{rank}").write_text("ok")


def test_spawn_ranks_accepts_only_an_abort_after_the_work(tmp_path):
    """proc_utils.spawn_ranks: a rank that aborts after writing its done file passes (with a warning); one
    that aborts before raises."""
    import pytest
    import torch.multiprocessing as mp
    from proc_utils import spawn_ranks

    done = [tmp_path / "done0", tmp_path / "done1"]
    with pytest.warns(UserWarning, match="aborted after its work was done"):
        spawn_ranks(_abort_after, (str(tmp_path), True), 2, done)
    for p in done:
        p.unlink()
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn_ranks(_abort_after, (str(tmp_path), False), 2, done)
