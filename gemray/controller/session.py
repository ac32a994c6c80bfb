"""The driver's Ray session: which cluster to join, whether anything answers there, an embedded local cluster
otherwise, the environment knobs Ray Train reads when ``TorchTrainer.fit`` starts, and (elastic runs) a fresh
view of the cluster's resources.

Decisions (:func:`ray_address`, :func:`embedded_num_cpus`, :func:`ray_train_env`, :func:`isolates_cluster`) are
pure; :func:`connect`, :func:`ray_session`, :func:`train_env` and :class:`ResourceViewRefresher` act on them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from gemray.config import JobConfig, usable_cpus

log = logging.getLogger(__name__)


def ray_address(cfg: JobConfig, environ: Mapping[str, str] = os.environ) -> str:
    """The cluster to join: ``ray.address``, else $RAY_ADDRESS; "" = start an embedded local cluster."""
    return cfg.ray.address or environ.get("RAY_ADDRESS", "")


def embedded_num_cpus(cfg: JobConfig) -> int:
    """CPUs an embedded local cluster advertises: ``ray.num_cpus``, or 2 per worker (at least 4), since 2
    workers + Ray Data read tasks starve on 2 real CPUs."""
    return cfg.ray.num_cpus or max(4, 2 * max(cfg.ray.num_workers, cfg.ray.max_workers))


def oversubscription_warning(cfg: JobConfig, cores: int) -> str | None:
    """The warning for a CPU run on an embedded cluster whose workers ask for more CPUs than the machine has
    (``ray.num_workers`` x ``ray.cpus_per_worker`` > ``cores``): the embedded cluster advertises
    :func:`embedded_num_cpus` CPUs whatever the machine has, so Ray places every worker and their training steps
    share the real cores (a new user's 8 workers on 2 cores trained with no word of it). None when they fit, on a GPU
    run (the step is the GPU's) or on a cluster (``ray.address``)."""
    workers = max(cfg.ray.num_workers, cfg.ray.max_workers)
    wanted = workers * cfg.ray.cpus_per_worker
    if cfg.ray.use_gpu or ray_address(cfg) or wanted <= cores:
        return None
    fit = max(1, int(cores // max(cfg.ray.cpus_per_worker, 1e-9)))
    return (f"ray.num_workers={workers} x ray.cpus_per_worker={cfg.ray.cpus_per_worker:g} = {wanted:g} CPUs of "
            f"training workers on this machine's {cores} core{'' if cores == 1 else 's'}: their steps share the cores, "
            f"each about {wanted / cores:.1f}x slower; ray.num_workers={fit} fits here, or give ray.address a cluster")


def check_gcs_reachable(address: str, timeout_s: float = 10.0) -> None:
    """For a ``host:port`` Ray address, refuse at once when nothing accepts a TCP connection there: ray.init
    would retry that address indefinitely (a new user's run hung for 400 s on ``ray.address=127.0.0.1:1``).
    Other forms ("auto", "local", "ray://...") are left to Ray. Raises ValueError naming the address."""
    if "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"ray.address / RAY_ADDRESS {address!r}: no Ray cluster answers there ({e}); start "
                         f"one with `ray start --head` or leave ray.address empty for an embedded cluster") from None


def isolates_cluster(pid: int, pgid: int) -> bool:
    """Pure: whether a driver of process id ``pid`` in process group ``pgid`` starts its embedded cluster's
    processes in a process group of their own (:func:`_cluster_process_group`): only when it is not the leader of
    its group (a leader cannot start a new group and come back). That is the case under ``timeout`` (coreutils),
    which sends SIGTERM to the command and then to its whole group: in the driver's group the GCS and raylet died
    of it, and the driver, taking its emergency checkpoint, waited ~60 s for the GCS and exited 1."""
    return pid != pgid


@contextmanager
def _cluster_process_group() -> Iterator[None]:
    """While an embedded cluster starts: the driver in a new process group, so that the processes it spawns (GCS,
    raylet, and through the raylet the workers) stay in that group when the driver returns to its own on the way
    out; a signal to the driver's group (``timeout``, ``kill -- -PGID``) then reaches the driver, whose SIGTERM
    handling checkpoints and shuts the cluster down, and not the cluster under it. They still die with the driver
    (Ray's parent-death signal, and :mod:`gemray.controller.watchdog`). Ray blocks SIGINT in them either way, so
    Ctrl-C is unchanged. Does nothing where :func:`isolates_cluster` says no or process groups are not POSIX's."""
    if not hasattr(os, "setpgid") or not isolates_cluster(os.getpid(), os.getpgrp()):
        yield
        return
    own = os.getpgrp()
    try:
        os.setpgid(0, 0)
    except OSError as e:  # e.g. a seccomp sandbox: the cluster shares the driver's group, as before
        log.debug("embedded cluster in the driver's process group: setpgid failed (%s)", e)
        yield
        return
    try:
        yield
    finally:
        try:
            os.setpgid(0, own)
        except OSError as e:  # the old group is gone (its other members exited): stay with the cluster
            log.warning("could not return the driver to its process group %d (%s): a signal to that group no "
                        "longer reaches it", own, e)


def connect(cfg: JobConfig) -> bool:
    """Connect to the configured cluster or start an embedded one; True if this call started it (the caller
    shuts it down). A driver already connected (``ray.is_initialized()``) is left as it is."""
    import ray

    if ray.is_initialized():
        return False
    from gemray.parallel.collectives import collectives_env

    # parallel.collectives: NCCL's variables in every worker from its start (before any communicator)
    env = collectives_env(cfg.parallel.collectives)
    kw = {"runtime_env": {"env_vars": env}} if env else {}
    address = ray_address(cfg)
    if address:
        check_gcs_reachable(address)
        ray.init(address=address, **kw)
        return False
    num_cpus = embedded_num_cpus(cfg)
    warning = oversubscription_warning(cfg, usable_cpus())
    if warning:
        log.warning("%s", warning)
    # address="local": always a new cluster, never one that `ray start` left running on this machine.
    # Ray 2.60 gives a new raylet a fixed 30 s to register with the GCS; on an overloaded machine (seen at
    # load average 22 on 2 cores) that can run out, so try a second time before giving up.
    for attempt in (1, 2):
        try:
            with _cluster_process_group():
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, **kw)
            break
        except Exception as e:  # Ray raises a bare Exception for this
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            log.warning("the embedded Ray cluster did not start in time (%s); starting it once more", e)
            ray.shutdown()
    log.info("started an embedded Ray cluster advertising %d CPUs", num_cpus)
    _start_watchdog()
    return True


def _start_watchdog() -> None:
    """Reap this embedded cluster if the driver dies without ``ray.shutdown()`` (:mod:`gemray.controller.watchdog`)."""
    from gemray.controller import watchdog

    try:
        import ray._private.worker as ray_worker  # the session folder: no public API names it

        watchdog.start(ray_worker._global_node.get_session_dir_path())
    except Exception as e:  # noqa: BLE001 - a missing watchdog only means slower cleanup after a SIGKILL
        log.debug("no watchdog for the embedded cluster: %s", e)


@contextmanager
def ray_session(cfg: JobConfig) -> Iterator[None]:
    """``with ray_session(cfg):`` connected to Ray (:func:`connect`); an embedded cluster it started is shut
    down on the way out, whatever happened inside."""
    import ray

    from gemray.controller import watchdog

    started = connect(cfg)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
            watchdog.stop()


def ray_train_env(cfg: JobConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Pure: the Ray Train environment knobs from ``[ray]`` that are not already set in ``environ`` (an
    explicit environment variable wins). Ray Train 2.60 reads these from the environment only."""
    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(cfg.ray.health_check_interval_s)}
    if cfg.ray.worker_start_timeout_s:
        env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(cfg.ray.worker_start_timeout_s)
    return {k: v for k, v in env.items() if k not in environ}


@contextmanager
def train_env(cfg: JobConfig) -> Iterator[dict[str, str]]:
    """``with train_env(cfg):`` the :func:`ray_train_env` variables set in ``os.environ`` (read by
    ``TorchTrainer.fit`` and handed to the Train controller and workers), restored on the way out."""
    env = ray_train_env(cfg)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ResourceViewRefresher:
    """Elastic runs: keep Ray Train's view of the cluster fresh (``with ResourceViewRefresher(interval_s):``).

    Ray Train 2.60's elastic policy sizes the worker group from the cluster-wide AutoscalingCoordinator
    actor (shared with Ray Data), which re-reads the node list only every 20 s (its TICK_INTERVAL_S, not
    configurable). So a node that joined or left was seen up to 20 s late: a group restarted after a node
    loss first retried the old size until the worker-group start timeout, and growing waited for the
    tick. This driver thread asks the coordinator to re-read the node list (its
    ``get_reserved_resources(recompute=True)``, a no-op reservation for an unknown requester) every
    ``interval_s``. Best effort: any error stops the thread with one log line; training is unaffected.

    Ray internals: Ray 2.60 has no public API to refresh (or configure the refresh period of) the resource
    view behind ``ScalingConfig(num_workers=(min, max))``; the coordinator is reached through
    ``ray.data._internal.cluster_autoscaler``. Delete this class once Ray exposes one.
    """

    def __init__(self, interval_s: float):
        self.interval_s = max(0.5, float(interval_s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gemray-resource-view", daemon=True)

    def __enter__(self) -> "ResourceViewRefresher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import ray

        try:
            from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
                get_or_create_autoscaling_coordinator)

            coordinator = get_or_create_autoscaling_coordinator()
            while not self._stop.wait(self.interval_s):
                ray.get(coordinator.get_reserved_resources.remote("gemray-resource-view", recompute=True),
                        timeout=10)
        except Exception as e:  # an internal Ray API: never let it break training
            if not self._stop.is_set():
                log.info("not refreshing Ray Train's cluster view any more (%s: %s); resizes may be seen "
                         "up to 20 s late", type(e).__name__, e)
