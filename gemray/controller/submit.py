"""Submit a gemray job to a running Ray cluster as a Ray job; follow it through a :class:`JobHandle`.

``gemray.submit(config, address=...)`` is the remote twin of ``gemray.fit(config)``: it ships the
validated config (as TOML in the job's ``runtime_env`` environment) to the cluster's job server through
:class:`ray.job_submission.JobSubmissionClient` and returns at once. On the cluster the job runs
``python -m gemray.controller.submit`` (this module), which rebuilds the config and runs the task:

* ``"train"``: ``gemray.fit(config)`` on that cluster (RAY_ADDRESS is set by Ray's job supervisor);
* ``"prepare"``: MovieLens raw files -> Parquet (``data.raw_dir`` -> ``data.prepared_dir``) on the
  cluster's file system, which is how a shared volume gets its data.

The job prints one line ``GEMRAY_RESULT {json}`` at the end; :meth:`JobHandle.result` finds it in the
job's logs, so results come back even when the storage path is not visible from the client.

Authentication: Ray 2.60 clusters run with token authentication. The client uses Ray's own lookup
(``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, then ``~/.ray/auth_token``, when ``RAY_AUTH_MODE=token``);
pass ``token=`` to send one explicitly (it is put in a header, never in the job or its logs).

Example::

    handle = gemray.submit("configs/ml-latest-small.toml", address="http://127.0.0.1:8265",
                           overrides=["train.epochs=1"])
    handle.wait(timeout_s=600)   # "SUCCEEDED"
    handle.result()              # {"task": "train", "metrics": {...}, ...}
"""

from __future__ import annotations

import json
import logging
import os
import time
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gemray.config import JobConfig, apply_overrides, from_dict, load_config, to_toml
from gemray.preemption import EXIT_PREEMPTED

logger = logging.getLogger(__name__)

CONFIG_ENV = "GEMRAY_CONFIG_TOML"
TASK_ENV = "GEMRAY_TASK"
OUTPUT_ENV = "GEMRAY_OUTPUT_DIR"
RESULT_MARKER = "GEMRAY_RESULT "
TASKS = ("train", "prepare")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
AUTH_HEADER = "authorization"


def _resolve_config(config: JobConfig | str | os.PathLike, overrides: list[str] | None) -> JobConfig:
    if isinstance(config, JobConfig):
        # Round-trip through TOML: validates, copies, and is exactly what the job will see.
        cfg = from_dict(tomllib.loads(to_toml(config)))
        return apply_overrides(cfg, list(overrides or []))
    if isinstance(config, (str, os.PathLike)):
        return load_config(config, list(overrides or []))
    raise TypeError(f"config: expected a JobConfig or a TOML path, got {type(config).__name__}")


def _resolve_address(address: str | None, cfg: JobConfig) -> str | None:
    """``address`` or, if empty, ``cfg.ray.address`` when it is an http(s) URL, else None (Ray then reads
    ``RAY_ADDRESS``)."""
    if address:
        return address
    if cfg.ray.address.startswith(("http://", "https://")):
        return cfg.ray.address
    return None


@dataclass
class JobHandle:
    """A submitted gemray job. ``status()`` / ``logs()`` / ``wait()`` / ``result()`` / ``stop()``.

    submission_id: the Ray job submission id (``ray job status <id>`` works with it too).
    client: the :class:`ray.job_submission.JobSubmissionClient` it was submitted with.
    """

    submission_id: str
    client: Any = field(repr=False)
    task: str = "train"

    def status(self) -> str:
        """The Ray job status as a string: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
        st = self.client.get_job_status(self.submission_id)
        return str(getattr(st, "value", st))

    def logs(self) -> str:
        """The job's driver log so far (stdout + stderr of the entrypoint), as text."""
        return self.client.get_job_logs(self.submission_id)

    def info(self) -> Any:
        """Ray's JobDetails (status, message, start/end times in ms, entrypoint, metadata)."""
        return self.client.get_job_info(self.submission_id)

    def wait(self, timeout_s: float = 3600.0, poll_s: float = 1.0) -> str:
        """Block until the job is SUCCEEDED, FAILED or STOPPED and return that status.

        Raises TimeoutError (naming the job and its last status) after ``timeout_s`` seconds.
        """
        if timeout_s <= 0 or poll_s <= 0:
            raise ValueError(f"wait: timeout_s ({timeout_s}) and poll_s ({poll_s}) must be > 0")
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if st in TERMINAL:
                return st
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.submission_id}: still {st} after {timeout_s:.0f} s")
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())) or poll_s)

    def result(self, timeout_s: float = 3600.0) -> dict[str, Any]:
        """Wait for the job and return its result dict (the ``GEMRAY_RESULT`` line of its logs).

        For "train": ``{"task", "metrics", "path", "checkpoint"}`` as gemray.fit reported them; for
        "prepare": ``{"task", "prepared_dir", "manifest"}``. Raises RuntimeError with the job's message
        and the tail of its logs if it did not succeed, or if it succeeded without a result line.
        """
        st = self.wait(timeout_s)
        logs = self.logs()
        if st != "SUCCEEDED":
            msg = getattr(self.info(), "message", "") or ""
            tail = "\n".join(logs.splitlines()[-30:])
            raise RuntimeError(f"job {self.submission_id} {st}: {msg}\n--- last log lines ---\n{tail}")
        return parse_result(logs, self.submission_id)

    def stop(self) -> bool:
        """Ask Ray to stop the job; True if a stop was requested (False if it had already ended)."""
        return bool(self.client.stop_job(self.submission_id))


def parse_result(logs: str, where: str = "job") -> dict[str, Any]:
    """The JSON object on the last ``GEMRAY_RESULT {...}`` line of ``logs``.

    Raises RuntimeError if there is none, ValueError if it is not valid JSON.
    """
    for line in reversed(logs.splitlines()):
        i = line.find(RESULT_MARKER)
        if i >= 0:
            payload = line[i + len(RESULT_MARKER):]
            try:
                return json.loads(payload)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: bad {RESULT_MARKER.strip()} line: {e}") from None
    raise RuntimeError(f"{where}: finished but printed no {RESULT_MARKER.strip()} line")


class JobServerRefused(ConnectionError):
    """The Ray job server answered but refused this client's token (Ray's ``AuthenticationError``, HTTP 401 or 403):
    a ConnectionError, so that callers handling an unreachable server handle it too; ``gemray submit`` prints its
    message as it is (exit 1)."""


def address_tried(address: str | None, environ: Any = os.environ) -> str:
    """Pure: which job server a JobSubmissionClient for ``address`` talks to, in words ("at URL", "of the Ray
    cluster running on this machine ..."): Ray's lookup
    (``ray.dashboard.utils.get_address_for_submission_client``) takes ``RAY_API_SERVER_ADDRESS``, else
    ``RAY_ADDRESS``, over ``address``; with none of them it joins the Ray cluster it finds running on this machine."""
    for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        if environ.get(var):
            return f"at {environ[var]} (from ${var}, which Ray takes over --address)"
    if address:
        return f"at {address}"
    return ("of the Ray cluster running on this machine, which Ray joins when given no address (no --address, "
            "ray.address not an http:// URL, RAY_ADDRESS unset)")


def refused_message(address: str | None, token: str | None, reason: str, environ: Any = os.environ) -> str:
    """Pure: the one-line error of a job server that refused this client (``reason``: Ray's message, of which its
    first line is kept): the address tried (:func:`address_tried`) and how to give the right address or token."""
    first = reason.strip().splitlines()[0] if reason.strip() else "authentication failed"
    token_how = ("the token given was refused: pass that cluster's token" if token else
                 "if it is, give it its token (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
                 "~/.ray/auth_token)")
    return (f"the Ray job server {address_tried(address, environ)} refused this client: {first}; if that is not "
            "your cluster, pass your job server's address: --address http://HOST:8265 (or "
            f"RAY_ADDRESS=http://HOST:8265); {token_how}")


def make_client(address: str | None = None, token: str | None = None, headers: dict | None = None) -> Any:
    """A JobSubmissionClient for ``address`` (``http://host:8265``; None = ``RAY_ADDRESS``, else the Ray cluster
    running on this machine: Ray's own lookup).

    ``token`` adds ``Authorization: Bearer <token>``; without it Ray's own token lookup applies. Raises
    :class:`JobServerRefused` naming the address tried when the job server refuses the token (or the lack of one:
    was Ray's bare ``AuthenticationError`` traceback, e.g. from a cluster of someone else's found on this machine),
    ConnectionError when none answers.
    """
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    hdrs = dict(headers or {})
    if token:
        hdrs[AUTH_HEADER] = f"Bearer {token}"
    try:
        return JobSubmissionClient(address, headers=hdrs or None)
    except AuthenticationError as e:
        raise JobServerRefused(refused_message(address, token, getattr(e, "message", "") or str(e))) from None


def submit(config: JobConfig | str | os.PathLike, address: str | None = None, *,
           overrides: list[str] | None = None, task: str = "train", working_dir: str | None = None,
           runtime_env: dict[str, Any] | None = None, submission_id: str | None = None,
           output_dir: str | None = None, python: str = "python",
           entrypoint_num_cpus: float | None = None,
           token: str | None = None, client: Any = None) -> JobHandle:
    """Submit ``config`` as a Ray job to the cluster at ``address``; returns a :class:`JobHandle` at once.

    config: a JobConfig or a TOML path; ``overrides`` (``section.key=value``) are applied and the result
        is validated here, so bad input fails before anything is sent (ValueError naming the field).
    address: the job server, ``http://host:8265``; None: ``cfg.ray.address`` if it is an http URL, else
        ``RAY_ADDRESS``. task: "train" or "prepare". working_dir: a local folder Ray uploads and runs the
        job in (e.g. the repo, for code not installed on the cluster; it is put first on PYTHONPATH).
    output_dir: for "train", where gemray.fit writes metrics.json/curves/config on the cluster (default:
        fit's own, ``runs/<name>`` under the job's working dir); an absolute path on the cluster (a relative one
        is refused: it would land in the job's working directory, with ``working_dir`` Ray's temporary copy).
    runtime_env: extra Ray runtime_env entries (env_vars are merged). python: interpreter on the
        cluster. token: Ray auth token sent as a header (default: Ray's own lookup). client: an existing
        JobSubmissionClient (tests). Paths in the config (storage, data) are read on the cluster.
    Raises ValueError for a bad config/task (for "train", also bad ``data.synthetic`` parameters and cut-offs at or
    above that catalogue: :func:`~gemray.controller.preflight.preflight_catalogue`), :class:`JobServerRefused` (a
    ConnectionError) for a missing/wrong token, and Ray's errors (ConnectionError) from the job server.
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    if output_dir and not PurePosixPath(str(output_dir)).is_absolute():  # a path on the cluster's (Linux) nodes
        raise ValueError(f"output_dir (--output) {output_dir}: give an absolute path on the cluster's shared storage; "
                         "a relative one lands in the job's working directory (with --working-dir, Ray's temporary "
                         "copy of it), which does not outlive the job")
    cfg = _resolve_config(config, overrides)
    if task == "train":  # data.synthetic's parameters and the cut-offs against its catalogue, as gemray train does
        from gemray.controller.preflight import preflight_catalogue  # (imports torch: not at `gemray --help`)

        preflight_catalogue(cfg)
    env = dict(runtime_env or {})
    env_vars = {str(k): str(v) for k, v in (env.pop("env_vars", None) or {}).items()}
    env_vars[CONFIG_ENV] = to_toml(cfg)
    env_vars[TASK_ENV] = task
    if output_dir:
        env_vars[OUTPUT_ENV] = str(output_dir)
    if working_dir:
        wd = Path(working_dir).resolve()
        if not wd.is_dir():
            raise ValueError(f"working_dir: {wd} is not a folder")
        env["working_dir"] = str(wd)
    env["env_vars"] = env_vars
    if client is None:
        client = make_client(_resolve_address(address, cfg), token=token)
    sid = submission_id or f"gemray-{task}-{cfg.name}-{uuid.uuid4().hex[:8]}"
    kwargs: dict[str, Any] = {}
    if entrypoint_num_cpus is not None:
        kwargs["entrypoint_num_cpus"] = entrypoint_num_cpus
    sid = _submit_job(
        client,
        entrypoint=f"{python} -m gemray.controller.submit",
        runtime_env=env,
        submission_id=sid,
        metadata={"gemray_task": task, "gemray_config": cfg.name},
        **kwargs,
    )
    logger.info("submitted %s job %s (config %s)", task, sid, cfg.name)
    return JobHandle(submission_id=sid, client=client, task=task)


AGENT_WAIT_S = 60.0


def _submit_job(client: Any, wait_s: float | None = None, **kwargs: Any) -> str:
    """``client.submit_job(**kwargs)``, retried (backoff 0.5 s doubling to 5 s, for up to ``wait_s``, default
    AGENT_WAIT_S) while the head answers HTTP 500 "No available agent to submit job, please try again later": its
    job agent registers some seconds after the head starts (longer on a loaded machine), and no job was created, so
    the same submission id is sent again. Other errors, and this one past the deadline, are raised as they come."""
    deadline = time.monotonic() + (AGENT_WAIT_S if wait_s is None else wait_s)
    delay = 0.5
    while True:
        try:
            return client.submit_job(**kwargs)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() + delay > deadline:
                raise
            logger.info("the Ray head has no job agent yet; submitting again in %.1f s", delay)
            time.sleep(delay)
            delay = min(2 * delay, 5.0)


# ------------------------------------------------------------------------------------------------
# The job side: `python -m gemray.controller.submit` inside the Ray job.


def _summarize_fit(result: Any) -> dict[str, Any]:
    """JSON-ready view of what gemray.fit returned (a :class:`gemray.controller.results.Result`)."""
    return {"task": "train", "metrics": dict(result.metrics), "path": result.output_dir,
            "checkpoint": result.checkpoint_path}


def run_task(cfg: JobConfig, task: str) -> dict[str, Any]:
    """Run ``task`` for ``cfg`` in this process (the job's entrypoint) and return its result dict."""
    if task == "prepare":
        from gemray.pipelines.movielens import prepare_movielens

        if cfg.data.synthetic:  # generated (or checked against data.synthetic when already there)
            from gemray.pipelines.synthetic import ensure_synthetic

            manifest = ensure_synthetic(cfg.data)
        else:
            manifest = prepare_movielens(cfg.data.raw_dir, cfg.data.prepared_dir,
                                         on_bad_rows=cfg.data.on_bad_rows, num_files=cfg.data.num_files,
                                         num_files_name="data.num_files")
        return {"task": "prepare", "prepared_dir": str(Path(cfg.data.prepared_dir).resolve()),
                "manifest": manifest}
    if task == "train":
        import gemray

        output_dir = os.environ.get(OUTPUT_ENV) or None
        result = gemray.fit(cfg, output_dir=output_dir) if output_dir else gemray.fit(cfg)
        return _summarize_fit(result)
    raise ValueError(f"{TASK_ENV}: expected one of {TASKS}, got {task!r}")


def job_main() -> int:
    """Entrypoint of the Ray job: config from ``$GEMRAY_CONFIG_TOML``, task from ``$GEMRAY_TASK``;
    prints ``GEMRAY_RESULT {json}``. Returns 0, or 75 (``EXIT_PREEMPTED``) when the run stopped on a preemption
    notice after its emergency checkpoint, so that the job is not SUCCEEDED (a RayJob / retry loop then
    re-submits it and it resumes); errors propagate and fail the job."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    text = os.environ.get(CONFIG_ENV)
    if not text:
        raise ValueError(f"${CONFIG_ENV} is empty: start this module through gemray.submit")
    try:
        cfg = from_dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"${CONFIG_ENV}: invalid TOML: {e}") from None
    out = run_task(cfg, os.environ.get(TASK_ENV, "train"))
    print(RESULT_MARKER + json.dumps(out, default=str, sort_keys=True), flush=True)
    return EXIT_PREEMPTED if _preempted(out) else 0


def _preempted(out: dict[str, Any]) -> bool:
    """Whether a task result dict (``GEMRAY_RESULT``) is a train run stopped on a preemption notice."""
    metrics = out.get("metrics")
    return isinstance(metrics, dict) and bool(metrics.get("preempted"))


# ------------------------------------------------------------------------------------------------
# `gemray submit` (registered in gemray/cli.py).


def add_submit_arguments(p: Any) -> None:
    """Add the ``gemray submit`` options to an argparse parser."""
    p.add_argument("--config", required=True, help="gemray TOML config")
    p.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE",
                   help="override config values, e.g. train.epochs=2 (several after one --set, as gemray train)")
    p.add_argument("--address", default=None,
                   help="Ray job server, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS)")
    p.add_argument("--task", choices=TASKS, default="train",
                   help="train (default): `gemray train` on the cluster; prepare: convert the config's MovieLens "
                   "raw files (data.raw_dir) to Parquet (data.prepared_dir) on the cluster")
    p.add_argument("--working-dir", default=None, help="folder to upload and run in (e.g. .)")
    p.add_argument("--python", default="python", help="interpreter on the cluster")
    p.add_argument("--output", default=None, help="train: output folder on the cluster (absolute)")
    p.add_argument("--no-wait", action="store_true", help="print the submission id and return")
    p.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds to wait (default 1 day)")


def cli_submit(ns: Any) -> int:
    """Run ``gemray submit``: submit, then (unless --no-wait) wait, print the logs and the result JSON.
    Returns the exit status: 0 on SUCCEEDED, 75 when the job stopped on a preemption notice (its
    emergency checkpoint is committed: submit the same command again to resume), 1 otherwise."""
    handle = submit(ns.config, ns.address, overrides=ns.overrides, task=ns.task,
                    working_dir=ns.working_dir, output_dir=ns.output, python=ns.python)
    print(f"submitted: {handle.submission_id}")
    if ns.no_wait:
        return 0
    st = handle.wait(timeout_s=ns.timeout)
    logs = handle.logs()
    print(logs, end="")
    try:
        preempted = _preempted(parse_result(logs, handle.submission_id))
    except (RuntimeError, ValueError):
        preempted = False
    if preempted:
        print(f"status: PREEMPTED (Ray job {st}; emergency checkpoint committed: submit the same command "
              f"again to resume)")
        return EXIT_PREEMPTED
    print(f"status: {st}")
    return 0 if st == "SUCCEEDED" else 1


if __name__ == "__main__":
    raise SystemExit(job_main())
