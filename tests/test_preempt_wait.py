"""``gemray preempt --notice/--wait`` (the Kubernetes preStop hook) and the driver's side of it: the notice
marked handled once the emergency checkpoint is committed, the active marker that says a run is listening.
CPU only, no Ray: the driver is stood in for by a thread, a subprocess or a direct ``_preempted_result`` call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gemray.cli import main
from gemray.preemption import (NOTICE_NAME, SIGTERM_REPEAT_S, active_path, clear_active, is_handled, mark_active,
                               mark_handled, read_notice, wait_outcome, wait_until_handled, write_notice)

REPO = Path(__file__).resolve().parents[1]


def _when_notice_appears(path: Path, then, timeout_s: float = 20.0) -> threading.Thread:
    """Stand-in driver: once the notice exists, run ``then()`` (e.g. mark it handled)."""
    def run():
        t0 = time.monotonic()
        while read_notice(path) is None and time.monotonic() - t0 < timeout_s:
            time.sleep(0.02)
        time.sleep(0.1)
        then()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_wait_outcome_decisions():
    pending, handled = {"reason": "x"}, {"reason": "x", "handled": {"global_step": 7}}
    assert wait_outcome(handled, active=True, elapsed_s=99, timeout_s=1) == "handled"
    assert wait_outcome(handled, active=False, elapsed_s=0, timeout_s=1) == "handled"
    assert wait_outcome(pending, active=False, elapsed_s=0, timeout_s=1) == "no_run"
    assert wait_outcome(None, active=False, elapsed_s=0, timeout_s=1) == "no_run"
    assert wait_outcome(pending, active=True, elapsed_s=0.5, timeout_s=1) is None
    assert wait_outcome(pending, active=True, elapsed_s=1.0, timeout_s=1) == "timeout"
    assert wait_outcome(pending, active=True, elapsed_s=0, timeout_s=0) == "timeout"
    with pytest.raises(ValueError, match="timeout"):
        wait_outcome(pending, active=True, elapsed_s=0, timeout_s=-1)
    assert not is_handled(None) and not is_handled(pending) and is_handled(handled)


def test_mark_handled_keeps_the_notice_and_active_marker_round_trip(tmp_path):
    p = tmp_path / NOTICE_NAME
    write_notice(p, "spot reclaim")
    mark_handled(p, 23, "/ckpt/checkpoint_000004")
    n = read_notice(p)
    assert n["reason"] == "spot reclaim" and n["handled"]["global_step"] == 23
    assert n["handled"]["checkpoint"] == "/ckpt/checkpoint_000004" and n["handled"]["t"] > 0
    assert mark_handled(tmp_path / "gone", 1, None) and read_notice(tmp_path / "gone")["reason"] == "unknown"
    run_dir = tmp_path / "runs" / "name"  # created: the run folder may not exist before Ray Train makes it
    assert mark_active(run_dir / NOTICE_NAME) == active_path(run_dir / NOTICE_NAME)
    assert active_path(run_dir / NOTICE_NAME).name == "PREEMPT.active"
    assert clear_active(run_dir / NOTICE_NAME) and not clear_active(run_dir / NOTICE_NAME)
    assert not list(tmp_path.rglob(".*.tmp"))  # atomic writes leave no temp files


def test_wait_returns_0_once_another_thread_marks_handled(tmp_path, capsys):
    p = tmp_path / NOTICE_NAME
    mark_active(p)
    th = _when_notice_appears(p, lambda: mark_handled(p, 31, str(tmp_path / "checkpoint_000006")))
    t0 = time.monotonic()
    rc = main(["preempt", "--notice", str(p), "--reason", "preStop: pod {host} is being deleted",
               "--wait", "20"])
    th.join(5)
    assert rc == 0 and time.monotonic() - t0 < 15
    out = capsys.readouterr().out
    assert "emergency checkpoint of global step 31 committed" in out
    assert read_notice(p)["reason"] == f"preStop: pod {socket.gethostname()} is being deleted"


def test_wait_answered_by_a_finished_run_says_so(tmp_path, capsys):
    """A notice marked handled by a run that finished instead of stopping (it came after the last step's
    vote): --wait returns 0 and says the checkpoint is the final one, not an emergency one."""
    p = tmp_path / NOTICE_NAME
    mark_active(p)
    th = _when_notice_appears(p, lambda: mark_handled(p, 40, "/ckpt/final", finished=True))
    rc = main(["preempt", "--notice", str(p), "--wait", "20"])
    th.join(5)
    out = capsys.readouterr().out
    assert rc == 0 and "finished before it could stop: final checkpoint of global step 40 committed at " \
        "/ckpt/final; nothing to resume" in out and "emergency" not in out.split("\n", 1)[1]


def test_wait_returns_0_once_another_process_marks_handled(tmp_path):
    p = tmp_path / NOTICE_NAME
    mark_active(p)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "gemray.cli", "preempt", "--notice", str(p), "--wait", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        t0 = time.monotonic()
        while read_notice(p) is None and proc.poll() is None and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0]  # written, and waiting
        time.sleep(0.3)
        assert proc.poll() is None  # still waiting: active run, notice not handled
        mark_handled(p, 12, "/ckpt/c")
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "emergency checkpoint of global step 12 committed at /ckpt/c" in out


def test_wait_times_out_non_zero_with_a_clear_message(tmp_path, capsys):
    p = tmp_path / NOTICE_NAME
    mark_active(p)  # a run is active but never reaches its poll step
    t0 = time.monotonic()
    assert main(["preempt", "--notice", str(p), "--wait", "0.4"]) == 1
    assert 0.4 <= time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gemray: error: --wait 0.4: the run did not commit its "
                                               "emergency checkpoint within 0.4 s")
    assert read_notice(p) is not None and not is_handled(read_notice(p))


def test_wait_returns_at_once_when_no_run_is_active(tmp_path, capsys):
    p = tmp_path / NOTICE_NAME  # e.g. the cluster torn down after the job finished
    t0 = time.monotonic()
    assert main(["preempt", "--notice", str(p), "--wait", "60"]) == 0
    assert time.monotonic() - t0 < 5 and "no run is active" in capsys.readouterr().out
    # a driver that ends without a preemption (finished, failed) drops its marker: waiters return too
    mark_active(p)
    th = _when_notice_appears(p, lambda: clear_active(p))
    assert wait_until_handled(p, 30, poll_s=0.05)[0] == "no_run"
    th.join(5)


def test_notice_folder_missing_means_nothing_to_preempt(tmp_path, capsys):
    p = tmp_path / "runs" / "not-started" / NOTICE_NAME
    assert main(["preempt", "--notice", str(p), "--wait", "60"]) == 0
    assert "no run has started there" in capsys.readouterr().out
    assert not p.parent.exists()


def test_pending_notice_is_not_replaced(tmp_path, capsys):
    p = tmp_path / NOTICE_NAME
    write_notice(p, "first pod")
    assert main(["preempt", "--notice", str(p), "--reason", "second pod"]) == 0
    assert read_notice(p)["reason"] == "first pod" and "already" in capsys.readouterr().out


def test_a_handled_notice_of_a_gone_run_is_replaced_not_reported(tmp_path, capsys):
    """A finished / preempted run's handled notice (its active marker removed) is history: a new `preempt --wait`
    writes its own notice and says no run is active, instead of answering with the old emergency checkpoint (a new
    user's finding). While the marker is there (the stopping driver has not exited yet), the handled notice answers."""
    p = tmp_path / NOTICE_NAME
    write_notice(p, "user test")
    mark_handled(p, 15, "/ckpt/old")
    assert main(["preempt", "--output", str(tmp_path), "--reason", "again", "--wait", "10"]) == 0
    out = capsys.readouterr().out
    assert "replacing the handled notice of an earlier preemption" in out and "global step 15" in out
    assert "no run is active" in out and "/ckpt/old" not in out
    assert read_notice(p)["reason"] == "again" and not is_handled(read_notice(p))
    mark_handled(p, 20, "/ckpt/stopping")
    mark_active(p)  # the stopping driver still there: its handled notice is the answer
    try:
        assert main(["preempt", "--output", str(tmp_path), "--wait", "10"]) == 0
        out = capsys.readouterr().out
        assert "already" in out and "emergency checkpoint of global step 20 committed at /ckpt/stopping" in out
    finally:
        clear_active(p)


def test_output_and_notice_are_exclusive_and_one_is_required(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["preempt", "--output", str(tmp_path), "--notice", str(tmp_path / NOTICE_NAME)])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["preempt"])
    assert e.value.code == 2
    assert main(["preempt", "--output", str(tmp_path / "missing")]) == 2  # as before: no such run folder
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["preempt", "--output", str(tmp_path / "afile")]) == 2
    assert "a file, not a folder" in capsys.readouterr().err
    assert main(["preempt", "--output", str(tmp_path), "--wait", "-1"]) == 2
    run = tmp_path / "run"  # (tmp_path holds afile now: no run's folder)
    run.mkdir()
    assert main(["preempt", "--output", str(run)]) == 0 and (run / NOTICE_NAME).is_file()


def test_driver_marks_the_notice_handled_after_the_emergency_checkpoint(tmp_path):
    from gemray.config import load_config
    from gemray.controller.results import finish_preempted
    from gemray.events import Event

    cfg = load_config(REPO / "configs" / "ml-latest-small.toml")
    cfg.checkpoint.preempt_notice = str(tmp_path / NOTICE_NAME)
    cfg.train.events_path = str(tmp_path / "events.jsonl")
    write_notice(cfg.checkpoint.preempt_notice, "Kubernetes preStop: pod w-1 is being deleted")
    mark_active(cfg.checkpoint.preempt_notice)
    notice = read_notice(cfg.checkpoint.preempt_notice)
    ev = Event("preempted", t=time.time(), attempt=1, detail={"global_step": 17, "notice": notice}).to_dict()
    Path(cfg.train.events_path).write_text(json.dumps(ev) + "\n")
    result = SimpleNamespace(checkpoint=SimpleNamespace(path=str(tmp_path / "checkpoint_000003")),
                             metrics={"preempted": True, "global_step": 17, "epoch": 2, "epochs_completed": 1})
    res = finish_preempted(cfg, tmp_path, result, wall_s=3.0)
    assert res.metrics["global_step"] == 17 and res.metrics["wall_s"] == 3.0
    assert res.metrics["preempted"]["reason"] == "Kubernetes preStop: pod w-1 is being deleted"
    assert json.loads((tmp_path / "metrics.json").read_text())["global_step"] == 17
    # the epoch it stopped in, numbered as the log lines do, and the completed count beside it
    assert (res.metrics["epoch"], res.metrics["epochs_completed"]) == (2, 1)
    handled = read_notice(cfg.checkpoint.preempt_notice)["handled"]
    assert handled["global_step"] == 17 and handled["checkpoint"] == str(tmp_path / "checkpoint_000003")
    assert not active_path(cfg.checkpoint.preempt_notice).exists()


def test_stale_decision_boundaries():
    """Pure: an active marker unrefreshed for the stale bound means its driver is gone; handled wins."""
    pending, handled = {"reason": "x"}, {"reason": "x", "handled": {"global_step": 1}}
    assert wait_outcome(pending, True, 0, 60, unrefreshed_s=20.0, stale_s=20.0) == "stale"
    assert wait_outcome(pending, True, 0, 60, unrefreshed_s=19.9, stale_s=20.0) is None
    assert wait_outcome(pending, True, 61, 60, unrefreshed_s=19.9, stale_s=20.0) == "timeout"
    assert wait_outcome(handled, True, 0, 60, unrefreshed_s=99, stale_s=20.0) == "handled"
    assert wait_outcome(pending, False, 0, 60, unrefreshed_s=99, stale_s=20.0) == "no_run"
    with pytest.raises(ValueError, match="stale bound"):
        wait_outcome(pending, True, 0, 60, unrefreshed_s=0, stale_s=0)


def test_a_marker_left_by_a_killed_driver_is_stale_and_the_wait_ends_early(tmp_path, monkeypatch, capsys):
    """A driver killed outright leaves its active marker with no heartbeat: the waiter gives up after the
    stale bound instead of waiting out --wait (the preStop hook's whole grace period)."""
    from gemray import preemption

    p = tmp_path / NOTICE_NAME
    mark_active(p, heartbeat_s=None)  # the marker as a SIGKILLed driver leaves it
    t0 = time.monotonic()
    assert wait_until_handled(p, 30, poll_s=0.05, stale_s=0.4)[0] == "stale"
    assert 0.4 <= time.monotonic() - t0 < 10
    monkeypatch.setattr(preemption, "ACTIVE_STALE_S", 0.5)  # the CLI reads the bound at call time
    t0 = time.monotonic()
    assert main(["preempt", "--notice", str(p), "--wait", "60"]) == 0
    assert time.monotonic() - t0 < 15
    assert "has not been refreshed for 0.5 s or more" in capsys.readouterr().out


def test_a_marker_of_a_dead_local_process_ends_the_wait_at_once(tmp_path, capsys):
    """A fresh marker (no time to go stale) written on this host by a process that no longer exists: the wait
    ends at the first poll, and the CLI says why; a marker naming another host still waits for staleness."""
    import json

    from gemray.preemption import marker_owner_gone

    p = tmp_path / NOTICE_NAME
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    marker = mark_active(p, heartbeat_s=None)
    marker.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "t": time.time()}))
    assert marker_owner_gone(p)
    t0 = time.monotonic()
    assert main(["preempt", "--notice", str(p), "--wait", "60"]) == 0
    assert time.monotonic() - t0 < 5
    out = capsys.readouterr().out
    assert "no run is active there now (its PREEMPT.active names a process that no longer exists)" in out
    assert "names a process of this host that no longer exists, so its driver was killed" in out
    marker.write_text(json.dumps({"pid": int(dead.stdout), "host": "another-host", "t": time.time()}))
    assert not marker_owner_gone(p)
    marker.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "t": time.time()}))
    assert not marker_owner_gone(p)


def test_a_heartbeated_marker_keeps_the_waiter_waiting(tmp_path):
    """A live driver refreshes its marker, so the same stale bound never fires: the wait runs to its timeout
    (or to the handled mark)."""
    p = tmp_path / NOTICE_NAME
    mark_active(p, heartbeat_s=0.05)
    try:
        t0 = time.monotonic()
        assert wait_until_handled(p, 1.2, poll_s=0.05, stale_s=0.4)[0] == "timeout"
        assert time.monotonic() - t0 >= 1.2
    finally:
        clear_active(p)


def test_heartbeat_refreshes_the_marker_and_stops_with_it(tmp_path):
    import threading

    from gemray import preemption

    p = tmp_path / NOTICE_NAME
    before = set(threading.enumerate())
    marker = mark_active(p, heartbeat_s=0.05)
    (beat,) = [t for t in set(threading.enumerate()) - before if t.name == "gemray-active-heartbeat"]
    assert beat.daemon  # never keeps the driver process alive
    first = marker.stat().st_mtime_ns
    t0 = time.monotonic()
    while marker.stat().st_mtime_ns == first and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert marker.stat().st_mtime_ns != first  # refreshed
    assert clear_active(p) and str(marker) not in preemption._HEARTBEATS
    beat.join(2)
    assert not beat.is_alive()
    time.sleep(0.2)
    assert not marker.exists()  # the stopped heartbeat does not bring it back
    with pytest.raises(ValueError, match="heartbeat"):
        mark_active(p, heartbeat_s=0)


def test_preempt_output_without_an_active_run_says_so(tmp_path, capsys):
    """`gemray preempt --output` on a folder with no active run (finished, not started yet) still writes the
    notice, says that no run is active, and the next run there removes it at start."""
    assert main(["preempt", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no run is active there now (no PREEMPT.active)" in out and "removes it at start" in out
    assert read_notice(tmp_path / NOTICE_NAME) is not None
    # a folder no run can use (a prepared data folder: a notice there made a later `gemray prepare` refuse it for
    # a file its manifest does not list) is refused, nothing written; with a run active there it is written
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    assert main(["preempt", "--output", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"--output {data}: not a gemray run's output folder (it holds manifest.json, which no run writes)" in err
    assert sorted(p.name for p in data.iterdir()) == ["manifest.json"]
    mark_active(data / NOTICE_NAME, heartbeat_s=None)
    assert main(["preempt", "--output", str(data)]) == 0 and read_notice(data / NOTICE_NAME) is not None


def test_marker_is_stale_boundaries():
    """Pure: stale exactly at the bound, not a hair before; a marker from the future (skew) is never stale."""
    from gemray.preemption import marker_is_stale

    assert marker_is_stale(100.0, 120.0, 20.0)
    assert not marker_is_stale(100.0, 119.999, 20.0)
    assert not marker_is_stale(130.0, 120.0, 20.0)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="stale bound"):
            marker_is_stale(0.0, 1.0, bad)


def test_an_old_marker_is_recognised_at_the_first_poll(tmp_path, capsys):
    """A marker whose mtime is far behind the just-written notice's (a driver SIGKILLed long ago) ends the wait
    at once with the default 20 s bound, not after watching it stand still for 20 s; the CLI says no run is
    active and why."""
    p = tmp_path / NOTICE_NAME
    marker = mark_active(p, heartbeat_s=None)
    old = time.time() - 3600
    os.utime(marker, (old, old))
    t0 = time.monotonic()
    assert main(["preempt", "--notice", str(p), "--wait", "60"]) == 0
    assert time.monotonic() - t0 < 5
    out = capsys.readouterr().out
    assert "no run is active there now (its PREEMPT.active is stale)" in out  # the notice line knows it
    assert "no run is active for" in out and "has not been refreshed for 20 s or more" in out


def test_a_fresh_marker_waits_for_the_handled_mark(tmp_path):
    """A heartbeated marker keeps the waiter until the driver marks the notice handled."""
    import threading

    p = tmp_path / NOTICE_NAME
    mark_active(p, heartbeat_s=0.05)
    write_notice(p, "test")
    try:
        threading.Timer(0.8, lambda: mark_handled(p, 5, "ckpt")).start()
        t0 = time.monotonic()
        outcome, notice = wait_until_handled(p, 10, poll_s=0.05, stale_s=0.4)
        assert outcome == "handled" and notice["handled"]["global_step"] == 5
        assert 0.7 <= time.monotonic() - t0 < 5
    finally:
        clear_active(p)


def test_driver_sigterm_first_writes_the_notice_second_says_it_exits(tmp_path, caplog):
    """The driver's SIGTERM handler: the first SIGTERM writes the notice (the run checkpoints and stops); the
    second logs that it exits without the emergency checkpoint, then hands the signal to the previous handler;
    restore() puts the previous handler back."""
    import logging
    import signal

    from gemray.preemption import install_driver_sigterm, log, read_notice

    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        before = signal.getsignal(signal.SIGTERM)
        restore = install_driver_sigterm(tmp_path / NOTICE_NAME)
        with caplog.at_level(logging.WARNING, logger=log.name):
            os.kill(os.getpid(), signal.SIGTERM)
            assert read_notice(tmp_path / NOTICE_NAME)["reason"] == "SIGTERM to the driver" and calls == []
            time.sleep(SIGTERM_REPEAT_S)
            os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert "second SIGTERM: exiting at once, without waiting for the emergency checkpoint" in caplog.text
        restore()
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_driver_sigterm_twice_at_once_is_one_notice(tmp_path, monkeypatch):
    """GNU ``timeout`` sends SIGTERM to the command and then to its process group: the driver gets two within
    milliseconds. They are one notice (written whole, no temp file left, the run goes on to its emergency
    checkpoint); a second SIGTERM that arrives while the notice is being written exits only once it is written."""
    import signal

    import gemray.preemption as pre

    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        restore = pre.install_driver_sigterm(tmp_path / NOTICE_NAME)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # as timeout's second signal: within SIGTERM_REPEAT_S
        assert calls == [] and pre.read_notice(tmp_path / NOTICE_NAME)["reason"] == "SIGTERM to the driver"
        assert sorted(p.name for p in tmp_path.iterdir()) == [NOTICE_NAME]
        restore()
        (tmp_path / NOTICE_NAME).unlink()

        # a second signal during the write (after the repeat window): deferred until the notice is complete
        write = pre.write_notice

        def slow_write(path, reason):
            monkeypatch.setattr(pre, "SIGTERM_REPEAT_S", 0.0)
            os.kill(os.getpid(), signal.SIGTERM)  # delivered while this handler is still writing
            assert calls == []
            return write(path, reason)

        monkeypatch.setattr(pre, "write_notice", slow_write)
        restore = pre.install_driver_sigterm(tmp_path / NOTICE_NAME)
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert pre.read_notice(tmp_path / NOTICE_NAME)["reason"] == "SIGTERM to the driver"
        assert sorted(p.name for p in tmp_path.iterdir()) == [NOTICE_NAME]
        restore()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_notice_pointing_at_a_folder_is_a_clear_error(tmp_path, capsys):
    """`gemray preempt --notice DIR` (a folder, not the notice file): exit 2, one line naming the file it meant,
    and no temp file left behind."""
    assert main(["preempt", "--notice", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a folder: give the notice file's path" in err[0], err
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}*")) and not list(tmp_path.iterdir())


def test_ctrl_c_in_the_driver_first_is_a_notice_second_stops_at_once(tmp_path, caplog):
    """What tests/test_ctrl_c.py (``make test-slow``) shows on a real ``gemray train``, without Ray: with
    ``trainer.fit()`` on the helper thread (``_fit_off_main_thread``, as ``fit`` runs it) the main thread keeps
    the driver's SIGINT handler; the first Ctrl-C writes the notice and training goes on, the second raises
    KeyboardInterrupt out of the wait at once; the previous handler is back afterwards."""
    import logging
    import signal

    from gemray.controller.run import _fit_off_main_thread
    from gemray.preemption import install_driver_sigint, log

    notice = tmp_path / NOTICE_NAME
    before = signal.getsignal(signal.SIGINT)
    release = threading.Event()

    class Trainer:  # the first Ctrl-C comes during fit; fit ends once the notice is there (the checkpoint)
        def fit(self):
            os.kill(os.getpid(), signal.SIGINT)
            t0 = time.monotonic()
            while read_notice(notice) is None and time.monotonic() - t0 < 20:
                time.sleep(0.02)
            return "preempted" if read_notice(notice) else "no notice"

    class Stuck:  # the second Ctrl-C: fit would not end by itself
        def fit(self):
            os.kill(os.getpid(), signal.SIGINT)
            release.wait(60)

    restore = install_driver_sigint(notice)
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            assert _fit_off_main_thread(Trainer(), poll_s=0.05) == "preempted"
            assert read_notice(notice)["reason"] == "Ctrl-C (SIGINT) to the driver"
            assert "Ctrl-C: taking an emergency checkpoint at the next poll step" in caplog.text
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                _fit_off_main_thread(Stuck(), poll_s=0.05)
            assert time.monotonic() - t0 < 10
        assert "second Ctrl-C: stopping at once, without the emergency checkpoint" in caplog.text
        assert signal.getsignal(signal.SIGINT) is before  # the second put the previous handler back
        restore()
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        release.set()
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("outcome", ["preempted", "interrupted"])
def test_gemray_train_exits_75_when_preempted_and_130_on_a_second_ctrl_c(outcome, tmp_path, monkeypatch, capsys):
    """`gemray train`'s exit statuses for the two Ctrl-C outcomes (tests/test_ctrl_c.py runs them for real):
    a preempted result is 75 with the step to resume from; a KeyboardInterrupt out of fit is 130."""
    import gemray.controller.run as run

    def fake_fit(cfg, output_dir=None, **kw):
        if outcome == "interrupted":
            raise KeyboardInterrupt
        return SimpleNamespace(metrics={"preempted": True, "global_step": 7}, checkpoint_path="ckpt",
                               output_dir=output_dir)

    monkeypatch.setattr(run, "fit", fake_fit)
    rc = main(["train", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--output",
               str(tmp_path / "out")])
    cap = capsys.readouterr()
    if outcome == "preempted":
        assert rc == 75 and "re-run the same command to resume from step 7" in cap.out, cap
    else:
        assert rc == 130 and "gemray: error: interrupted" in cap.err, cap
