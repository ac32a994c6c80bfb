"""The embedded cluster's watchdog (issue 22): after the driver is SIGKILLed, the dashboard and runtime-env
agents (and the rest of the cluster) do not linger; the pure process-tree selection it acts on."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import DATA

from gemray.controller import watchdog

REPO = Path(__file__).resolve().parents[1]
SRC = DATA / "ml-latest-small"
SESSION = "session_2026-12-02_04-44-26_309615_100"


def test_session_processes_takes_the_drivers_ray_children_and_their_descendants():
    table = {
        100: (1, "python gemray train", 10),
        101: (100, f"gcs_server --session_name={SESSION}", 11),
        102: (100, f"raylet --session_dir=/tmp/ray/{SESSION}", 12),
        103: (102, "ray::DashboardAgent", 13),  # retitled: found as the raylet's child
        104: (102, "ray::RuntimeEnvAgent", 13),
        105: (103, "python default_worker.py", 14),
        106: (100, "tee log", 15),  # the driver's other child: not Ray's
        107: (100, f"python -m gemray.controller.watchdog --session {SESSION}", 16),  # the watchdog itself
        200: (1, f"raylet --session_dir=/tmp/ray/{SESSION}", 17),  # not the driver's child
    }
    found = watchdog.session_processes(table, 100, SESSION, exclude=107)
    assert found == {101: 11, 102: 12, 103: 13, 104: 13, 105: 14}
    # a pid reused by another process (other start time) is not "still running"
    later = {**table, 103: (1, "something else", 99)}
    del later[104]
    assert watchdog.still_running(found, later) == {101: 11, 102: 12, 105: 14}


def test_the_last_look_adds_what_surviving_cluster_processes_started_since_the_last_poll():
    """After the driver dies the watchdog looks once more: children the known raylet started after its last poll
    (an agent, a worker, their own children) are reaped too; nothing outside the known processes' trees is, and a
    known pid reused by another process (other start time) is neither reaped nor followed."""
    known = {101: 11, 102: 12, 103: 13}
    table = {
        101: (1, f"gcs_server --session_name={SESSION}", 11),  # reparented after the driver's death
        102: (1, f"raylet --session_dir=/tmp/ray/{SESSION}", 12),
        103: (1, "an unrelated process on a reused pid", 99),
        110: (102, "ray::DashboardAgent", 20),  # started after the last poll
        111: (110, "python default_worker.py", 21),
        112: (103, "the unrelated process's child", 22),
        113: (1, "tee log", 23),
    }
    alive = watchdog.still_running(known, table)
    assert watchdog.descendants(table, alive) == {101: 11, 102: 12, 110: 20, 111: 21}
    assert watchdog.descendants(table, [999]) == {}


def _group(pgid: int) -> dict[int, str]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    return out


RAY_NAMES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "raylet", "gcs_server", "dashboard.py")


def _sigkill_driver_and_expect_no_ray_left(proc: subprocess.Popen) -> None:
    before = _group(proc.pid)
    assert any("ray::DashboardAgent" in c for c in before.values()), before
    assert any("ray::RuntimeEnvAgent" in c for c in before.values()), before
    os.kill(proc.pid, signal.SIGKILL)  # the driver only, as the OOM killer would
    proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = {p: c for p, c in _group(proc.pid).items() if any(n in c for n in RAY_NAMES)}
        if not left:
            break
        time.sleep(0.5)
    assert not left, left


def _kill_group(pgid: int) -> None:
    for pid in _group(pgid):  # whatever is left of this test's process group
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# A driver that starts the embedded cluster as `gemray train` does (session.connect: ray.init + the watchdog),
# runs one task (a worker process too) and then only waits: the watchdog's part without the training.
DRIVER = """
import sys, time
import ray
from gemray.config import load_config
from gemray.controller import session
assert session.connect(load_config(None, ["ray.num_workers=1"]))
assert ray.get(ray.remote(lambda: 1).remote()) == 1
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the watchdog reads /proc (Linux)")
def test_no_agents_linger_after_an_embedded_cluster_driver_is_sigkilled(tmp_path):
    """The cheap form of the test below (``make test``): the same cluster start and SIGKILL, no training."""
    log = tmp_path / "driver.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        while "ready" not in log.read_text().split():
            assert proc.poll() is None and time.monotonic() - t0 < 300, log.read_text()[-3000:]
            time.sleep(0.3)
        _sigkill_driver_and_expect_no_ray_left(proc)
    finally:
        _kill_group(proc.pid)


@pytest.mark.slow  # a real `gemray train` (~40 s); the test above covers the watchdog in `make test`
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the watchdog reads /proc (Linux)")
def test_no_agents_linger_after_the_driver_is_sigkilled(tmp_path):
    if not SRC.is_dir():
        pytest.skip(f"{SRC} not available")
    sets = ["name=wd", f"data.raw_dir={SRC}", f"data.prepared_dir={tmp_path / 'prepared'}", "data.batch_size=16",
            "data.sub_batch_size=8", "model.embedding_dim=16", "model.num_blocks=1", "model.attention_dim=8",
            "model.linear_dim=8", "model.num_negatives=16", "train.epochs=30", "train.eval_every=30",
            "train.log_every=1", "ray.num_workers=1"]
    cmd = [str(Path(sys.executable).with_name("gemray")), "train", "--config",
           str(REPO / "configs" / "ml-latest-small.toml"), "--output", str(tmp_path / "out"), "--set", *sets]
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not re.search(r"epoch 1 step \d+/\d+ \(global", log.read_text()):
            assert proc.poll() is None and time.monotonic() - t0 < 300, log.read_text()[-3000:]
            time.sleep(0.3)
        _sigkill_driver_and_expect_no_ray_left(proc)
    finally:
        _kill_group(proc.pid)


# A driver under coreutils `timeout` (not its group leader) that starts the embedded cluster as `gemray train` does,
# then takes SIGTERM as the run's preemption handling would (handled, the run goes on) and uses the cluster again.
UNDER_TIMEOUT = """
import os, signal, time
import ray
from gemray.config import load_config
from gemray.controller import session
group = os.getpgrp()
assert group != os.getpid(), "expected to run under timeout, in its process group"
assert session.connect(load_config(None, ["ray.num_workers=1"]))
assert os.getpgrp() == group, "the driver is back in its group"
assert ray.get(ray.remote(lambda: 1).remote()) == 1
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
print("ready", os.getpid(), flush=True)
t0 = time.monotonic()
while not got and time.monotonic() - t0 < 120:
    time.sleep(0.1)
time.sleep(3)  # a GCS killed by the signal is noticed within this
print("sigterms", len(got), flush=True)
print("after", ray.get(ray.remote(lambda: 2).remote(), timeout=60), flush=True)
ray.shutdown()
"""


@pytest.mark.skipif(shutil.which("timeout") is None or not hasattr(os, "setpgid"),
                    reason="needs coreutils timeout and POSIX process groups")
def test_the_embedded_cluster_outlives_a_sigterm_to_the_drivers_process_group(tmp_path):
    """``timeout`` relays its SIGTERM to the command and then to its whole process group: the embedded cluster's
    GCS and raylet, started in the driver's group, died of it (the driver then waited ~60 s for the GCS and
    exited 1 instead of finishing its emergency checkpoint). Started in a group of their own
    (session._cluster_process_group), they stay up: the driver handles the signal and runs a task after it."""
    log, driver = tmp_path / "driver.log", None
    with open(log, "w") as f:
        proc = subprocess.Popen(["timeout", "600", sys.executable, "-c", UNDER_TIMEOUT], stdout=f,
                                stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    try:
        t0 = time.monotonic()
        while "ready" not in log.read_text().split():
            assert proc.poll() is None and time.monotonic() - t0 < 300, log.read_text()[-3000:]
            time.sleep(0.3)
        words = log.read_text().split()
        driver = int(words[words.index("ready") + 1])
        os.kill(proc.pid, signal.SIGTERM)  # to timeout, which sends it to the driver and then to its group
        proc.wait(timeout=180)
        out = log.read_text()
        assert "sigterms" in out and "sigterms 0" not in out, out[-3000:]
        assert "after 2" in out, out[-3000:]
    finally:
        _kill_group(proc.pid)
        if driver is not None:
            _kill_group(driver)  # the cluster's own group (pgid: the driver's pid), whatever is left of it
