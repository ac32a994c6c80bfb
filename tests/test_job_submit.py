"""Ray job submission against a real head node on loopback, with token authentication on.

The fixture starts ``ray start --head --block`` in its own session with its own temp dir, ports and
token file, and tears it down by signalling only that process group (plus any process still naming its
temp dir); it never runs ``ray stop``, which would kill every Ray process on the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from paths import DATA
from proc_utils import free_port, kill_marked

from gemray.config import load_config
from gemray.controller import submit as sub

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
RAW_SMALL = DATA / "ml-latest-small"
START_TIMEOUT_S = 90


class Head:
    """A local Ray head node: ``address`` (job server URL), ``token``, ``env`` (for clients)."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="grj", dir="/tmp"))  # short: Ray's socket paths
        self.token = secrets.token_hex(32)
        token_path = self.tmp / "auth_token"
        token_path.write_text(self.token)
        token_path.chmod(0o600)
        self.dash_port = free_port()
        self.gcs_port = free_port()
        self.address = f"http://127.0.0.1:{self.dash_port}"
        self.env = {**os.environ,
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
                    "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": ""}
        self.env.pop("RAY_AUTH_TOKEN", None)
        cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block",
               "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dash_port),
               "--include-dashboard", "true",
               "--dashboard-agent-listen-port", str(free_port()),
               "--dashboard-agent-grpc-port", str(free_port()),
               "--runtime-env-agent-port", str(free_port()),
               "--metrics-export-port", str(free_port()),
               "--node-manager-port", str(free_port()),
               "--object-manager-port", str(free_port()),
               "--ray-client-server-port", str(free_port()),
               "--num-cpus", "4", "--object-store-memory", str(300 * 1024**2),
               "--temp-dir", str(self.tmp / "ray"), "--disable-usage-stats"]
        self.log = open(self.tmp / "head.log", "wb")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.tmp)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # read its log before stop() removes the folder that holds it
                log = (self.tmp / "head.log").read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"ray start exited with {self.proc.returncode}: {log}")
            try:
                req = urllib.request.Request(f"{self.address}/api/version",
                                             headers={"Authorization": f"Bearer {self.token}"})
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        # The job agent comes up a little after the dashboard head.
                        client = sub.make_client(self.address, token=self.token)
                        client.list_jobs()
                        return
            except Exception:
                pass
            time.sleep(1.0)
        log = (self.tmp / "head.log").read_text()[-3000:]
        self.stop()
        raise RuntimeError(f"Ray head not ready after {START_TIMEOUT_S} s:\n{log}")

    def stop(self) -> None:
        """Stop only what this fixture started: its process group, then stragglers naming its dir."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=14)  # ray start --block rarely exits on SIGTERM alone: then SIGKILL
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        kill_marked(str(self.tmp))
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = Head()
    try:
        yield h
    finally:
        h.stop()


def _small_overrides(tmp: Path) -> list[str]:
    return [f"data.raw_dir={RAW_SMALL}", f"data.prepared_dir={tmp / 'prepared'}",
            f"ray.storage_path={tmp / 'runs'}", "data.num_files=2"]


# ---- against the live head -----------------------------------------------------------------

@pytest.mark.skipif(not RAW_SMALL.is_dir(), reason="ml-latest-small not found in shared/data")
def test_submit_prepare_job_succeeds_and_writes_outputs(head, tmp_path):
    """gemray.submit -> JobSubmissionClient -> job runs on the cluster -> SUCCEEDED, outputs on disk."""
    import gemray

    handle = gemray.submit(REPO / "configs/ml-latest-small.toml", head.address, task="prepare",
                           overrides=_small_overrides(tmp_path), token=head.token)
    assert handle.submission_id.startswith("gemray-prepare-")
    st = handle.wait(timeout_s=180, poll_s=1)
    assert st == "SUCCEEDED", handle.logs()[-3000:]
    res = handle.result(timeout_s=10)
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert res["task"] == "prepare" and res["prepared_dir"] == str(tmp_path / "prepared")
    assert res["manifest"] == json.loads(json.dumps(manifest, default=str))
    n_ratings = sum(1 for _ in open(RAW_SMALL / "ratings.csv")) - 1
    assert json.dumps(manifest).count(str(n_ratings)) >= 1  # every rating accounted for
    assert list((tmp_path / "prepared").glob("**/*.parquet"))
    assert handle.status() == "SUCCEEDED"
    assert "GEMRAY_RESULT" in handle.logs()


def test_failed_job_raises_with_log_tail(head, tmp_path):
    handle = sub.submit(REPO / "configs/ml-latest-small.toml", head.address, task="prepare",
                        overrides=[f"data.raw_dir={tmp_path / 'missing'}",
                                   f"data.prepared_dir={tmp_path / 'p'}"], token=head.token)
    assert handle.wait(timeout_s=120) == "FAILED"
    with pytest.raises(RuntimeError, match=r"FAILED[\s\S]*last log lines[\s\S]*missing"):
        handle.result(timeout_s=10)


def test_wrong_token_is_refused(head):
    with pytest.raises(Exception, match="403|401|[Ff]orbidden|[Uu]nauthori"):
        sub.submit(REPO / "configs/ml-latest-small.toml", head.address, task="prepare",
                   token="not-the-token")
    req = urllib.request.Request(f"{head.address}/api/jobs/")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401


@pytest.mark.slow  # a 2-worker train job on the `ray start` head: make test-slow; make test submits prepare jobs
@pytest.mark.skipif(not RAW_SMALL.is_dir(), reason="ml-latest-small not found in shared/data")
def test_submit_train_job_reports_metrics_and_checkpoints(head, tmp_path):
    import gemray

    overrides = _small_overrides(tmp_path) + ["train.epochs=1", "train.max_steps_per_epoch=5",
                                              "ray.num_workers=2", "ray.cpus_per_worker=0.5"]
    handle = gemray.submit(REPO / "configs/ml-latest-small.toml", head.address, overrides=overrides,
                           output_dir=str(tmp_path / "out"), token=head.token)
    st = handle.wait(timeout_s=300, poll_s=2)
    assert st == "SUCCEEDED", handle.logs()[-4000:]
    res = handle.result(timeout_s=10)
    assert res["task"] == "train" and res["metrics"], res
    assert any(k.lower().startswith(("hr", "ndcg", "test/", "val")) for k in _flat_keys(res["metrics"]))
    assert any((tmp_path / "runs").rglob("*")), "nothing written under ray.storage_path"
    assert res["path"] == str(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["hr@10"] == res["metrics"]["hr@10"]


def _flat_keys(d, prefix=""):
    for k, v in (d or {}).items():
        yield prefix + str(k)
        if isinstance(v, dict):
            yield from _flat_keys(v, f"{prefix}{k}/")


# The `ray job submit --working-dir . -- gemray train ...` flow is run by tests/test_deploy_readme.py
# (README "Cluster (ray job submit)"), so it is not repeated here.


# ---- JobHandle logic without a cluster (a recording fake of JobSubmissionClient) -------------

class FakeClient:
    def __init__(self, statuses, logs="", message=""):
        self.statuses = list(statuses)
        self._logs = logs
        self.message = message
        self.submitted = None
        self.stopped = []

    def submit_job(self, **kw):
        self.submitted = kw
        return kw["submission_id"]

    def get_job_status(self, sid):
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def get_job_logs(self, sid):
        return self._logs

    def get_job_info(self, sid):
        return type("Info", (), {"message": self.message})()

    def stop_job(self, sid):
        self.stopped.append(sid)
        return True


class NoAgentYet(FakeClient):
    """A head whose job agent is not registered yet: the first ``refusals`` submissions get Ray's HTTP 500."""

    def __init__(self, refusals, error="No available agent to submit job, please try again later."):
        super().__init__(["SUCCEEDED"])
        self.refusals, self.error, self.calls = refusals, error, []

    def submit_job(self, **kw):
        self.calls.append(kw["submission_id"])
        if len(self.calls) <= self.refusals:
            raise RuntimeError(f"Request failed with status code 500: {self.error}.")
        return super().submit_job(**kw)


def test_submit_retries_while_the_head_has_no_job_agent(monkeypatch):
    """The CI failure (a just-started head under load answered 'No available agent ... try again later'): submit
    sends the same submission again until the agent is up; other errors and a lasting refusal still raise."""
    monkeypatch.setattr(sub.time, "sleep", lambda s: None)
    fc = NoAgentYet(2)
    h = sub.submit(REPO / "configs/ml-latest-small.toml", client=fc, submission_id="s1")
    assert h.submission_id == "s1" and fc.calls == ["s1", "s1", "s1"]
    with pytest.raises(RuntimeError, match="No available agent"):
        sub._submit_job(NoAgentYet(10**6), wait_s=0.0, submission_id="s2")
    other = NoAgentYet(1, error="Job with submission_id s3 already exists")
    with pytest.raises(RuntimeError, match="already exists"):
        sub._submit_job(other, submission_id="s3")
    assert other.calls == ["s3"]


def test_submit_ships_validated_config_and_env(tmp_path):
    fc = FakeClient(["SUCCEEDED"])
    cfg = load_config(REPO / "configs/ml-latest-small.toml")
    h = sub.submit(cfg, overrides=["train.epochs=3"], client=fc, runtime_env={"env_vars": {"A": 1}},
                   working_dir=str(tmp_path), submission_id="abc")
    assert h.submission_id == "abc" and cfg.train.epochs == 2  # caller's config untouched
    env = fc.submitted["runtime_env"]
    assert env["working_dir"] == str(tmp_path) and env["env_vars"]["A"] == "1"
    shipped = load_config(None, [])  # defaults, then compare with what the job will rebuild
    import tomllib

    from gemray.config import from_dict
    shipped = from_dict(tomllib.loads(env["env_vars"][sub.CONFIG_ENV]))
    assert shipped.train.epochs == 3 and shipped.name == cfg.name
    assert env["env_vars"][sub.TASK_ENV] == "train"
    assert fc.submitted["entrypoint"] == "python -m gemray.controller.submit"


@pytest.mark.parametrize("kw, exc, match", [
    (dict(overrides=["train.lr=abc"]), ValueError, "train.lr"),
    (dict(task="evaluate"), ValueError, "task"),
    (dict(working_dir="/nonexistent/dir"), ValueError, "working_dir"),
    # a relative --output was sent and landed in the job's (temporary) working directory (a new user's finding)
    (dict(output_dir="runs/x"), ValueError, r"output_dir \(--output\) runs/x: give an absolute path"),
    # a synthetic config's generator parameters and cut-offs: checked here as gemray train does (were sent)
    (dict(config="configs/gem-tiny.toml", overrides=['data.synthetic=["users=10","items=0","seed=0"]']), ValueError,
     "data.synthetic: items: expected an integer >= 1"),
    (dict(config="configs/gem-tiny.toml", overrides=["train.eval_ks=[10,100000]"]), ValueError,
     r"train.eval_ks=\[10, 100000\]: a cut-off at or above the 400 items"),
])
def test_submit_rejects_bad_input_before_sending(kw, exc, match):
    fc = FakeClient(["SUCCEEDED"])
    config = REPO / kw.pop("config", "configs/ml-latest-small.toml")
    with pytest.raises(exc, match=match):
        sub.submit(config, client=fc, **kw)
    assert fc.submitted is None


def test_submit_rejects_wrong_config_type():
    with pytest.raises(TypeError, match="JobConfig or a TOML path"):
        sub.submit(42, client=FakeClient(["SUCCEEDED"]))


def test_handle_wait_result_and_errors():
    ok = sub.JobHandle("j1", FakeClient(["PENDING", "RUNNING", "SUCCEEDED"],
                                        logs='x\nGEMRAY_RESULT {"task": "train", "metrics": {"hr@10": 0.5}}\n'))
    assert ok.wait(timeout_s=5, poll_s=0.01) == "SUCCEEDED"
    assert ok.result(timeout_s=5)["metrics"] == {"hr@10": 0.5}
    assert ok.stop() and ok.client.stopped == ["j1"]
    slow = sub.JobHandle("j2", FakeClient(["RUNNING"]))
    with pytest.raises(TimeoutError, match="j2: still RUNNING"):
        slow.wait(timeout_s=0.05, poll_s=0.01)
    with pytest.raises(ValueError):
        slow.wait(timeout_s=0)
    bad = sub.JobHandle("j3", FakeClient(["FAILED"], logs="a\nboom\n", message="exit 1"))
    with pytest.raises(RuntimeError, match=r"j3 FAILED: exit 1[\s\S]*boom"):
        bad.result(timeout_s=1)
    silent = sub.JobHandle("j4", FakeClient(["SUCCEEDED"], logs="no marker\n"))
    with pytest.raises(RuntimeError, match="no GEMRAY_RESULT"):
        silent.result(timeout_s=1)


def test_parse_result_takes_last_line_and_checks_json():
    logs = 'GEMRAY_RESULT {"a": 1}\n(pid=3) GEMRAY_RESULT {"a": 2}\n'
    assert sub.parse_result(logs) == {"a": 2}
    with pytest.raises(ValueError, match="bad GEMRAY_RESULT"):
        sub.parse_result("GEMRAY_RESULT {not json")
    with pytest.raises(RuntimeError):
        sub.parse_result("")


def test_summarize_fit_gemray_result():
    from gemray.controller.results import Result

    metrics = {"hr@10": 0.2}
    out = sub._summarize_fit(Result(metrics, "/r/ckpt", "/r"))
    assert out == {"task": "train", "metrics": {"hr@10": 0.2}, "path": "/r", "checkpoint": "/r/ckpt"}


@pytest.mark.parametrize("status, metrics, rc, says", [
    ("SUCCEEDED", {"hr@10": 0.3}, 0, "status: SUCCEEDED"),
    ("FAILED", None, 1, "status: FAILED"),
    # a run stopped on a preemption notice: the job exits 75 (FAILED for Ray); submit says PREEMPTED
    ("FAILED", {"preempted": True, "global_step": 40}, 75, "status: PREEMPTED"),
])
def test_cli_submit_exit_status(monkeypatch, capsys, status, metrics, rc, says):
    import argparse
    import json as _json

    logs = "x\n" + ("" if metrics is None else "GEMRAY_RESULT " + _json.dumps({"task": "train", "metrics": metrics}))
    handle = sub.JobHandle("j9", FakeClient([status], logs=logs + "\n"))
    monkeypatch.setattr(sub, "submit", lambda *a, **k: handle)
    ns = argparse.Namespace(config="c.toml", address=None, overrides=[], task="train", working_dir=None,
                            output=None, python="python", no_wait=False, timeout=5.0)
    assert sub.cli_submit(ns) == rc
    assert says in capsys.readouterr().out


def test_job_main_exits_75_when_preempted(monkeypatch, capsys):
    cfg_text = (REPO / "configs/ml-latest-small.toml").read_text()
    monkeypatch.setenv(sub.CONFIG_ENV, cfg_text)
    monkeypatch.setattr(sub, "run_task", lambda cfg, task: {"task": "train", "metrics": {"preempted": True}})
    assert sub.job_main() == 75
    assert '"preempted": true' in capsys.readouterr().out
    monkeypatch.setattr(sub, "run_task", lambda cfg, task: {"task": "train", "metrics": {"hr@10": 0.1}})
    assert sub.job_main() == 0


def test_submit_cli_unreachable_server_is_one_line_and_set_takes_several_values(capsys, monkeypatch):
    """`gemray submit --set a=1 b=2` accepts several values after one --set (as `gemray train`), and an
    address with no job server gives one `gemray: error:` line and exit 1, not a traceback."""
    from gemray.cli import build_parser, main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "ml-latest-small.toml")
    ns = build_parser().parse_args(["submit", "--config", config, "--set", "train.epochs=1", "data.batch_size=16",
                                    "--set", "train.lr=0.01"])
    assert ns.overrides == ["train.epochs=1", "data.batch_size=16", "train.lr=0.01"]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc = main(["submit", "--config", config, "--address", f"http://127.0.0.1:{free_port()}", "--set",
               "train.epochs=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("gemray: error: cannot reach the Ray job server"), err


def test_submit_cli_refused_by_a_cluster_found_on_this_machine_is_one_line(capsys, monkeypatch):
    """`gemray submit` with no --address and RAY_ADDRESS unset joined another local Ray cluster (Ray's lookup) whose
    job server refused it, and died with a raw ray.exceptions.AuthenticationError traceback from make_client (a new
    user's finding). Now one `gemray: error:` line, exit 1 as for an unreachable server, saying which address was
    tried and how to pass --address / RAY_ADDRESS (the client constructor faked: no cluster)."""
    import ray.job_submission
    from ray.exceptions import AuthenticationError

    from gemray.cli import main

    tried = []

    def refusing(address=None, **kw):
        tried.append(address)
        raise AuthenticationError("Authentication required: Unauthorized: Missing authentication token\n\nmore")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", refusing)
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    rc = main(["submit", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--no-wait"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and tried == [None], err
    assert err[0].startswith("gemray: error: the Ray job server of the Ray cluster running on this machine, which "
                             "Ray joins when given no address (no --address, ray.address not an http:// URL, "
                             "RAY_ADDRESS unset) refused this client: Authentication required: Unauthorized: Missing "
                             "authentication token; "), err
    assert "--address http://HOST:8265 (or RAY_ADDRESS=http://HOST:8265)" in err[0], err
    # the API raises it as a ConnectionError, naming the address it was given, or the variable Ray took over it
    with pytest.raises(ConnectionError, match=r"at http://10.0.0.5:8265 refused .*the token given was refused"):
        sub.make_client("http://10.0.0.5:8265", token="t")
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.7:8265")
    with pytest.raises(sub.JobServerRefused, match=r"at http://10.0.0.7:8265 \(from \$RAY_ADDRESS, which Ray takes "
                                                   r"over --address\) refused"):
        sub.make_client("http://10.0.0.5:8265")
