"""Ctrl-C on a real `gemray train` (issue 22): SIGINT to its process group, as a terminal sends it, is a
preemption notice: the workers (in that process group too) keep running, the run commits an emergency
checkpoint, exits 75 and says "re-run ... to resume from step N"; the re-run resumes from that checkpoint and
records a preemption, not a failure. A second Ctrl-C stops at once with status 130.

CPU, gloo, one worker, ml-latest-small with a tiny model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import DATA

from gemray.checkpoint import committed_checkpoints
from gemray.events import read_events

# two real `gemray train` runs (~130 s): make test-slow (CI); make test has the Ctrl-C unit tests in
# tests/test_preempt_wait.py and the SIGTERM -> exit 75 -> resume run in tests/test_elastic.py
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SRC = DATA / "ml-latest-small"
CONFIG = REPO / "configs" / "ml-latest-small.toml"


def _cmd(tmp: Path, name: str, poll_steps: int) -> list[str]:
    sets = [f"name={name}", f"data.raw_dir={SRC}", f"data.prepared_dir={tmp / 'prepared'}",
            "data.batch_size=16", "data.sub_batch_size=8", "data.eval_batch_size=256", "model.embedding_dim=16",
            "model.num_blocks=1", "model.attention_dim=8", "model.linear_dim=8", "model.num_negatives=16",
            "train.epochs=3", "train.eval_every=3", "train.log_every=1", "checkpoint.every_steps=1000",
            f"checkpoint.preempt_poll_steps={poll_steps}", "ray.num_workers=1"]
    return [str(Path(sys.executable).with_name("gemray")), "train", "--config", str(CONFIG),
            "--output", str(tmp / name), "--set", *sets]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # its own session: the process group a terminal's Ctrl-C reaches
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def _wait_for(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if re.search(pattern, log.read_text()):
            return
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before {pattern!r}: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {pattern!r} in {timeout} s: {log.read_text()[-3000:]}")


def _finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def tmp(tmp_path):
    if not SRC.is_dir():
        pytest.skip(f"{SRC} not available")
    return tmp_path


def test_ctrl_c_checkpoints_exits_75_and_the_rerun_resumes_there(tmp):
    cmd, log = _cmd(tmp, "ctrlc", poll_steps=1), tmp / "run1.log"
    proc = _start(cmd, log)
    _wait_for(proc, log, r"gemray\.train INFO epoch 1 step \d+/\d+ \(global \d+\)")  # the first step is logged
    os.killpg(proc.pid, signal.SIGINT)
    rc = _finish(proc)
    text = log.read_text()
    assert rc == 75, text[-3000:]
    m = re.search(r"re-run the same command to resume from step (\d+)", text)
    assert m, text[-3000:]
    step = int(m.group(1))
    (stop,) = [e for e in read_events(tmp / "ctrlc" / "events.jsonl") if e["kind"] == "preempted"]
    assert stop["detail"]["global_step"] == step and "SIGINT" in stop["detail"]["notice"]["reason"]
    assert "Received SIGINT" not in text  # Ray Train's abort (a failure) did not run
    ckpts = committed_checkpoints(tmp / "ctrlc" / "ray" / "ctrlc")
    assert len(ckpts) == 1  # the emergency checkpoint (periodic ones are off)
    state = json.loads((tmp / "ctrlc" / "metrics.json").read_text())
    assert state["preempted"] and state["global_step"] == step

    run2 = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, timeout=400)
    assert run2.returncode == 0, run2.stdout[-3000:]
    metrics = json.loads((tmp / "ctrlc" / "metrics.json").read_text())
    assert [(r["kind"], r["restored_step"], r["steps_lost"]) for r in metrics["recovery"]] == [
        ("preemption", step, 0)]
    assert not any(e["kind"] == "failure_detected" for e in metrics["events"])
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3]


def test_a_second_ctrl_c_stops_at_once_with_130(tmp):
    """The notice is only acted on at a poll step (here: never, 1000 steps apart), so the run is still
    training when the second Ctrl-C comes: it stops at once, 130, and the folder is free again."""
    from gemray.preemption import active_path

    cmd, log = _cmd(tmp, "twice", poll_steps=1000), tmp / "run.log"
    proc = _start(cmd, log)
    _wait_for(proc, log, r"gemray\.train INFO epoch 1 step \d+/\d+ \(global \d+\)")
    os.killpg(proc.pid, signal.SIGINT)
    _wait_for(proc, log, r"Ctrl-C: taking an emergency checkpoint", timeout=30)
    os.killpg(proc.pid, signal.SIGINT)
    rc = _finish(proc, timeout=120)
    text = log.read_text()
    assert rc == 130, text[-3000:]
    assert "second Ctrl-C: stopping at once" in text and "gemray: error: interrupted" in text
    assert not committed_checkpoints(tmp / "twice" / "ray" / "twice")
    assert not active_path(tmp / "twice" / "PREEMPT").exists()
