"""``fit``: run one gemray job on Ray Train (an existing cluster or an embedded local one).

Steps: load/override/validate the config -> resolve data paths to absolute -> prepare the data if its
manifest is missing -> connect to Ray ($RAY_ADDRESS / ``ray.address``) or start an embedded cluster ->
``TorchTrainer(train_loop_per_worker, ...)`` with FailureConfig/CheckpointConfig -> write
``metrics.json``, ``curves.png``, ``config.toml`` into the output folder and print a comparison table.

Re-running with the same output folder and job name resumes from its latest committed checkpoint (Ray
Train V2 restores a run by ``RunConfig(name, storage_path)``); a checkpoint trained on other data is refused
before Ray starts (:func:`preflight_resume`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemray.checkpoint import checkpoint_data, committed_checkpoints, data_record, file_sha256
from gemray.config import JobConfig, apply_overrides, load_config, to_toml
from gemray.events import epoch_fields, read_events, summarize_recovery
from gemray.parallel.sharding import check_shardable
from gemray.preemption import (ACTIVE_HEARTBEAT_S, ACTIVE_STALE_S, NOTICE_NAME, active_path, claim_active,
                               clear_active, clear_notice, install_driver_sigterm, mark_handled, marker_is_stale,
                               pid_alive, read_notice)

log = logging.getLogger(__name__)

#: Published ML-1M results (HR@10, NDCG@10), Zhai et al. 2024 (HSTU) table 2.
PUBLISHED_ML1M = {"SASRec": (0.2853, 0.1603), "HSTU": (0.3097, 0.1720), "HSTU-large": (0.3294, 0.1893)}
FINAL_KEYS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200")


@dataclass
class Result:
    """What ``fit`` returns: final metrics (test split + throughput), the last committed checkpoint's
    path (None if none was committed) and the output folder (absolute)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint_path: str | None = None
    output_dir: str = ""


def _resolve(cfg: JobConfig, config_path: Path | None) -> JobConfig:
    """Make the data paths and the set ``train.events_path`` / ``train.ledger_dir`` absolute (relative to the
    current directory): the workers run in folders of Ray's, where a relative path would land elsewhere (and
    the driver reads the events back from its own directory)."""
    for section, name in (("data", "raw_dir"), ("data", "prepared_dir"), ("train", "events_path"),
                          ("train", "ledger_dir")):
        sec = getattr(cfg, section)
        value = getattr(sec, name)
        if section == "train" and not value:  # "" = default (events: <output>/events.jsonl) or off (ledger)
            continue
        p = Path(value).expanduser()
        setattr(sec, name, str(p if p.is_absolute() else (Path.cwd() / p).resolve()))
    return cfg


def _ensure_prepared(cfg: JobConfig) -> dict[str, Any]:
    from gemray.pipelines.movielens import format_summary, load_manifest, prepare_movielens

    try:
        manifest = load_manifest(cfg.data.prepared_dir, verify=True)  # a damaged folder: refused before Ray starts
        if any("sha256" not in f for f in manifest["files"]):
            log.warning("%s was prepared by an older gemray that recorded no checksums: only its Parquet footers "
                        "and row counts are checked; prepare it again to have every byte checked",
                        cfg.data.prepared_dir)
        return manifest
    except FileNotFoundError:
        log.info("prepared data missing at %s: preparing it from %s", cfg.data.prepared_dir, cfg.data.raw_dir)
        if not Path(cfg.data.raw_dir).exists():
            raise FileNotFoundError(f"data.raw_dir {cfg.data.raw_dir} does not exist and data.prepared_dir "
                                    f"{cfg.data.prepared_dir} is not prepared") from None
        manifest = prepare_movielens(cfg.data.raw_dir, cfg.data.prepared_dir, on_bad_rows=cfg.data.on_bad_rows,
                                     num_files=cfg.data.num_files)
        print(format_summary(manifest, cfg.data.prepared_dir))
        return manifest


def embedded_num_cpus(cfg: JobConfig) -> int:
    """CPUs an embedded local cluster advertises: ``ray.num_cpus``, or 2 per worker (at least 4), since 2
    workers + Ray Data read tasks starve on 2 real CPUs."""
    return cfg.ray.num_cpus or max(4, 2 * max(cfg.ray.num_workers, cfg.ray.max_workers))


#: Model fields that fix parameter shapes: a checkpoint made with other values cannot be restored.
SHAPE_FIELDS = ("embedding_dim", "num_blocks", "num_heads", "attention_dim", "linear_dim", "use_rating_feature",
                "use_time_feature", "num_time_buckets", "num_position_buckets")


def preflight_resources(cfg: JobConfig, *, embedded: bool, num_gpus: int | None = None) -> None:
    """The checks of :func:`preflight` that need no prepared data (GPUs, optimizer and attention backend
    against the device, CPUs per worker): fit runs them before it prepares the data, so a job that cannot
    run is refused at once. Raises ValueError naming the field; arguments as for :func:`preflight`."""
    gpu = cfg.ray.use_gpu
    if embedded and gpu:
        if num_gpus is None:
            import torch

            num_gpus = torch.cuda.device_count()
        need = cfg.ray.min_workers or cfg.ray.num_workers
        if num_gpus < need:
            raise ValueError(f"ray.use_gpu=true needs {need} GPU(s) (one per worker) but this machine has "
                             f"{num_gpus}: Ray Train would wait for them forever; set ray.use_gpu=false, fewer "
                             f"ray.num_workers, or ray.address to a cluster with GPUs")
    if not gpu and cfg.train.sparse_optimizer in ("adam", "rowwise_adam"):
        raise ValueError(f"train.sparse_optimizer={cfg.train.sparse_optimizer!r} needs ray.use_gpu=true (FBGEMM's "
                         "CPU kernels have no Adam); use 'rowwise_adagrad' or 'auto' on CPU")
    if not gpu and cfg.model.attention_backend == "triton":
        raise ValueError("model.attention_backend='triton' needs ray.use_gpu=true (the kernels run on CUDA); "
                         "use 'auto' or 'reference' on CPU")
    if embedded and cfg.ray.cpus_per_worker > embedded_num_cpus(cfg):
        raise ValueError(f"ray.cpus_per_worker={cfg.ray.cpus_per_worker} exceeds the {embedded_num_cpus(cfg)} CPUs "
                         "the embedded Ray cluster advertises (ray.num_cpus): the workers would never start")


def preflight(cfg: JobConfig, manifest: dict[str, Any], *, embedded: bool,
              previous: JobConfig | None = None, num_gpus: int | None = None) -> None:
    """Refuse, before Ray starts, a job that would only fail (or hang) inside the workers.

    cfg: resolved config; manifest: the prepared data's; embedded: whether fit will start its own Ray
    cluster; previous: the config.toml of an earlier run in the same output folder that left checkpoints.
    Raises ValueError naming the field: Adam kinds or forced Triton without a GPU, a worker asking more
    CPUs than the embedded cluster has, a cut-off K above the catalogue, prepared data made from other
    raw files than ``data.raw_dir`` holds, an output folder holding a model of another shape, or
    ``ray.use_gpu`` on an embedded cluster with fewer GPUs than workers (``num_gpus``: GPUs this machine
    has; default ``torch.cuda.device_count()``). :func:`fit` runs the two halves,
    :func:`preflight_resources` and :func:`preflight_data`, on each side of preparing the data.
    """
    preflight_resources(cfg, embedded=embedded, num_gpus=num_gpus)
    preflight_data(cfg, manifest, previous=previous)


def preflight_data(cfg: JobConfig, manifest: dict[str, Any], *, previous: JobConfig | None = None) -> None:
    """The checks of :func:`preflight` that need the prepared data's manifest or the previous run's config
    (cut-offs against the catalogue, the data's source files, the model shape in the output folder). Raises
    ValueError naming the field."""
    n_items = int(manifest["vocab"]["num_items"])
    if max(int(k) for k in cfg.train.eval_ks) > n_items:
        raise ValueError(f"train.eval_ks={cfg.train.eval_ks}: a cut-off above the {n_items} items of the "
                         "catalogue makes HR@K trivially 1")
    _check_source(cfg, manifest)
    if previous is not None:
        changed = [f"model.{f}: {getattr(previous.model, f)} -> {getattr(cfg.model, f)}" for f in SHAPE_FIELDS
                   if getattr(previous.model, f) != getattr(cfg.model, f)]
        if previous.data.max_seq_len != cfg.data.max_seq_len:
            changed.append(f"data.max_seq_len: {previous.data.max_seq_len} -> {cfg.data.max_seq_len}")
        if changed:
            raise ValueError("the output folder holds checkpoints of a model of another shape ("
                             + ", ".join(changed) + "); use a new --output (re-running the same command "
                             "resumes; a different model needs its own folder)")


def preflight_active(notice_path: str | Path, *, clock=time.time, sleep=time.sleep) -> None:
    """Refuse, before anything is written, to start a run in an output folder where another run is active.

    The active marker (``<notice>.active``, :func:`gemray.preemption.mark_active`: pid and host, its
    modification time refreshed every ACTIVE_HEARTBEAT_S seconds by the running driver) says a run is using
    the folder; two runs there would train from the same checkpoints, interleave their events and exceed
    ``checkpoint.keep``. No marker, an unreadable one, or one that has gone ACTIVE_STALE_S seconds without a
    heartbeat: go ahead. A fresh one written on this host: refused if its pid is alive, else (its driver was
    killed outright) go ahead. A fresh one from another host (e.g. a RayJob's previous driver pod): watched
    until it is refreshed (refused) or goes stale (go ahead), at most ACTIVE_STALE_S seconds. ``clock`` /
    ``sleep``: time sources (tests). Raises FileExistsError naming the marker, the pid and host, and what to
    do."""
    marker = active_path(notice_path)
    try:
        mtime = marker.stat().st_mtime
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(info, dict) or marker_is_stale(mtime, clock()):
        return
    pid, host = info.get("pid"), info.get("host")
    if host == socket.gethostname():
        if not pid_alive(pid):
            return
    else:
        log.info("output folder in use by pid %s on %s (%s)? waiting up to %.0f s for its heartbeat", pid, host,
                 marker, ACTIVE_STALE_S)
        while True:
            sleep(1.0)
            try:
                now_mtime = marker.stat().st_mtime
            except OSError:
                return  # removed: that run ended
            if now_mtime != mtime:
                break  # refreshed: alive
            if marker_is_stale(mtime, clock()):
                return
    raise FileExistsError(
        f"another gemray run is active in this output folder: pid {pid} on {host}, marker {marker} (refreshed "
        f"every {ACTIVE_HEARTBEAT_S:.0f} s while it runs). Wait for it to end, stop it (`gemray preempt --output "
        f"{marker.parent}`), or use another --output.")


def claim_output(notice_path: str | Path) -> bool:
    """Make this driver the output folder's one active run before Ray starts: create the active marker beside
    ``notice_path`` atomically (:func:`gemray.preemption.claim_active`); where one is there already,
    :func:`preflight_active` refuses (a live run) or the marker is dropped as abandoned and the claim
    retried. Returns False (with a warning) when the marker cannot be written at all: the run goes on
    without it, and `gemray preempt --wait` returns at once. Raises FileExistsError for a folder in use."""
    for _ in range(3):
        try:
            if claim_active(notice_path):
                return True
        except OSError as e:
            log.warning("could not write the run's active marker beside %s (%s): another run into this folder "
                        "will not be refused and `gemray preempt --wait` will return at once", notice_path, e)
            return False
        preflight_active(notice_path)  # raises while that run is alive
        active_path(notice_path).unlink(missing_ok=True)
    raise FileExistsError(f"could not claim the output folder of {notice_path}: other runs are starting in it "
                          "at the same time")


def preflight_resume(cfg: JobConfig, manifest: dict[str, Any], run_dir: str | Path, *, output_dir: str | Path,
                     previous: JobConfig | None = None) -> Path | None:
    """Refuse, before Ray starts, to resume a checkpoint that was trained on other data.

    run_dir: the Ray Train run folder a resume restores from (``<storage>/<name>``); its newest committed
    checkpoint (what Ray Train hands back) is compared with the prepared data ``manifest``: the item
    table's rows (from the checkpoint's DCP metadata, or its data record) must be the catalogue's
    num_items + 1, and the data fingerprint it records (:func:`gemray.checkpoint.data_record`) must be the
    data's. Otherwise Ray Train would start the workers, fail to load the checkpoint ("size mismatch for
    ... item.weight") and retry ``ray.max_failures`` times, or train on with item ids that mean other
    movies. A checkpoint written before gemray recorded its data (no record) resumes when its table rows
    match, with a warning. previous: the output folder's config.toml (names the old data when the
    checkpoint has no record). Returns the checkpoint a resume will start from (None: fresh run). Raises
    ValueError naming the output folder, the checkpoint, what differs and how to go on.
    """
    latest = next(iter(committed_checkpoints(run_dir)), None)
    if latest is None:
        return None
    saved, now = checkpoint_data(latest), data_record(manifest)
    rec = saved["record"]
    rows = saved["item_table_rows"] or (rec or {}).get("item_table_rows")
    differs = why = ""
    if rows is not None and rows != now["item_table_rows"]:
        differs = (f"its item embedding table has {rows} rows ({rows - 1} items), the data in data.prepared_dir "
                   f"{cfg.data.prepared_dir} has {now['num_items']} items ({now['item_table_rows']} rows)")
        why = "it cannot be loaded into a model for this data"
    elif rec is not None and rec.get("fingerprint") != now["fingerprint"]:
        differs = (f"same number of items ({now['num_items']}) but other data (fingerprint {rec.get('fingerprint')}"
                   f" -> {now['fingerprint']}: " + "; ".join(_data_diff(rec, now)) + ")")
        why = "resuming would go on training its item rows on ids that mean other items"
    if not differs:
        if rec is None:
            log.warning("checkpoint %s records no data fingerprint (written before gemray recorded one): its item "
                        "table matches the %d items of %s, but whether it was trained on this data cannot be "
                        "checked; resuming it", latest, now["num_items"], cfg.data.prepared_dir)
        return latest
    out, run_dir = Path(output_dir), Path(run_dir)
    if rec is not None:
        origin = f"it was trained on {rec.get('prepared_dir')} (prepared from {rec.get('source_dir')})"
    elif previous is not None:
        origin = (f"the folder's config.toml names data.prepared_dir {previous.data.prepared_dir} (raw "
                  f"{previous.data.raw_dir})")
    else:
        origin = "it records no data path (written by an older gemray)"
    remove = out if run_dir.resolve().is_relative_to(out.resolve()) else run_dir
    raise ValueError(f"output folder {out} holds checkpoint {latest} of other data: {differs}; {origin}. Not "
                     f"resuming ({why}): use a new --output (output_dir) for this data, or remove {remove} to start "
                     "over there (its checkpoints are lost); re-running with the data it was trained on resumes it")


def _data_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two data records, in words (format, source files, counts, folder)."""
    out = []
    if old.get("format") != new.get("format"):
        out.append(f"format {old.get('format')} -> {new.get('format')}")
    a, b = dict(map(tuple, old.get("source_files", []))), dict(map(tuple, new.get("source_files", [])))
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            out.append(f"{name} sha256 {str(a.get(name))[:12]}.. -> {str(b.get(name))[:12]}..")
    for k in ("users", "items", "interactions"):
        x, y = (old.get("counts") or {}).get(k), (new.get("counts") or {}).get(k)
        if x != y:
            out.append(f"{k} {x} -> {y}")
    return out or ["source files and counts recorded differently"]


def _check_source(cfg: JobConfig, manifest: dict[str, Any]) -> None:
    """The prepared data must come from the raw files in ``data.raw_dir`` when that folder exists."""
    raw = Path(cfg.data.raw_dir)
    src = manifest.get("source", {})
    if not raw.is_dir() or Path(src.get("dir", "")).resolve() == raw.resolve():
        return
    for f in src.get("files", []):
        p = raw / f["name"]
        if not p.is_file() or p.stat().st_size != f["bytes"] or file_sha256(p) != f["sha256"]:
            raise ValueError(f"data.prepared_dir {cfg.data.prepared_dir} was prepared from {src.get('dir')}, whose "
                             f"{f['name']} is not the one in data.raw_dir {raw}: point data.prepared_dir at a new "
                             "folder (it is prepared there) or set data.raw_dir to the source it was made from")


def _ray_address(cfg: JobConfig) -> str:
    """The cluster to join: ``ray.address``, else $RAY_ADDRESS; "" = start an embedded local cluster."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS", "")


def _check_gcs_reachable(address: str, timeout_s: float = 10.0) -> None:
    """For a ``host:port`` Ray address, refuse at once when nothing accepts a TCP connection there: ray.init
    would retry that address indefinitely (a new user's run hung for 400 s on ``ray.address=127.0.0.1:1``).
    Other forms ("auto", "local", "ray://...") are left to Ray. Raises ValueError naming the address."""
    import socket

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


def _connect_ray(cfg: JobConfig) -> bool:
    """Connect to the configured cluster or start an embedded one; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = _ray_address(cfg)
    if address:
        _check_gcs_reachable(address)
        ray.init(address=address)
        return False
    num_cpus = embedded_num_cpus(cfg)
    # address="local": always a new cluster, never one that `ray start` left running on this machine.
    # Ray 2.60 gives a new raylet a fixed 30 s to register with the GCS; on an overloaded machine (seen at
    # load average 22 on 2 cores) that can run out, so try a second time before giving up.
    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
            break
        except Exception as e:  # Ray raises a bare Exception for this
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            log.warning("the embedded Ray cluster did not start in time (%s); starting it once more", e)
            ray.shutdown()
    log.info("started an embedded Ray cluster advertising %d CPUs", num_cpus)
    return True


#: Per-step / per-write markers: kept in events.jsonl, left out of metrics.json.
QUIET_KINDS = ("step", "checkpoint_begin")


def _ray_train_env(cfg: JobConfig) -> dict[str, str]:
    """Ray Train environment knobs from ``[ray]`` (an explicit environment variable wins)."""
    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(cfg.ray.health_check_interval_s)}
    if cfg.ray.worker_start_timeout_s:
        env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(cfg.ray.worker_start_timeout_s)
    return {k: v for k, v in env.items() if k not in os.environ}


class _ResourceViewRefresher:
    """Elastic runs: keep Ray Train's view of the cluster fresh.

    Ray Train 2.60's elastic policy sizes the worker group from the cluster-wide AutoscalingCoordinator
    actor (shared with Ray Data), which re-reads the node list only every 20 s (its TICK_INTERVAL_S, not
    configurable). So a node that joined or left was seen up to 20 s late: a group restarted after a node
    loss first retried the old size until the worker-group start timeout, and growing waited for the
    tick. This driver thread asks the coordinator to re-read the node list (its public
    ``get_reserved_resources(recompute=True)``, a no-op reservation for an unknown requester) every
    ``interval_s``. Best effort: any error stops the thread with one log line; training is unaffected.
    """

    def __init__(self, interval_s: float):
        import threading

        self.interval_s = max(0.5, float(interval_s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gemray-resource-view", daemon=True)

    def start(self) -> "_ResourceViewRefresher":
        self._thread.start()
        return self

    def stop(self) -> None:
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


def _previous_wall(metrics_path: Path) -> tuple[float, int]:
    """(wall_s, invocations) recorded by the previous invocation of a resumed run; (0.0, 0) when it wrote no
    metrics.json (killed) or the file cannot be read."""
    try:
        m = json.loads(metrics_path.read_text())
        return float(m.get("wall_s", 0.0)), int(m.get("invocations", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0, 0


def _preempted_result(cfg: JobConfig, out: Path, result: Any, reported: dict[str, Any], events_from: int,
                      t0: float, wall_before: float = 0.0, invocations: int = 1) -> Result:
    """The run stopped on a preemption notice after its emergency checkpoint: write metrics.json with
    ``preempted`` (the notice), the checkpoint's ``global_step``, ``epoch`` (1-based, the epoch it stopped in,
    as the log lines number it) and ``epochs_completed`` (see gemray.events), and the events; no test metrics.
    Then mark the notice handled (``"handled": {"global_step", "checkpoint", "t"}``) and drop the run's active
    marker, which ends a ``gemray preempt --wait``."""
    events = read_events(cfg.train.events_path)[events_from:]
    stop = next((e["detail"] for e in reversed(events) if e["kind"] == "preempted"), {})
    ckpt = result.checkpoint.path if result.checkpoint is not None else None
    # the emergency checkpoint's report; before epochs_completed was reported, its "epoch" counted them
    done = int(reported.get("epochs_completed", reported.get("epoch", 0)))
    metrics: dict[str, Any] = {
        "preempted": stop.get("notice") or True, "global_step": int(reported.get("global_step", 0)),
        **epoch_fields(done, in_progress=True), "wall_s": wall_before + time.perf_counter() - t0,
        "invocations": invocations,
        "events": [e for e in events if e["kind"] not in QUIET_KINDS], "recovery": summarize_recovery(events)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    notice = cfg.checkpoint.preempt_notice
    try:  # tells `gemray preempt --wait` (a Kubernetes preStop hook) that the checkpoint is committed
        mark_handled(notice, metrics["global_step"], ckpt)
    except OSError as e:
        log.warning("could not mark the preemption notice %s handled: %s", notice, e)
    finally:
        clear_active(notice)
    log.warning("preempted: emergency checkpoint of global step %d committed (%s); re-run the same command "
                "to resume there", metrics["global_step"], ckpt)
    return Result(metrics=metrics, checkpoint_path=ckpt, output_dir=str(out))


def comparison_table(metrics: dict[str, Any]) -> str:
    """Plain-text table of this run's HR@10/NDCG@10 next to the published ML-1M numbers.

    The published numbers rank each target against the items outside the user's history
    (generative-recommenders' evaluation); a run with ``train.eval_exclude_history=false`` ranks against all
    items and says so in its row. The all-items figures of a filtered run get a row of their own.
    """
    if "hr@10" not in metrics:
        return "(no HR@10 / NDCG@10 to compare with the published ML-1M numbers: 10 is not in train.eval_ks)"
    label = "this run" if metrics.get("eval_exclude_history", True) else "this run (all items)"
    rows = [(label, metrics.get("hr@10", float("nan")), metrics.get("ndcg@10", float("nan")))]
    if "hr@10_unfiltered" in metrics:
        rows.append(("this run (all items)", metrics["hr@10_unfiltered"], metrics.get("ndcg@10_unfiltered",
                                                                                     float("nan"))))
    rows += [(name, hr, nd) for name, (hr, nd) in PUBLISHED_ML1M.items()]
    lines = [f"{'model':<22}{'HR@10':>8}{'NDCG@10':>9}", "-" * 39]
    lines += [f"{n:<22}{hr:>8.4f}{nd:>9.4f}" for n, hr, nd in rows]
    lines.append("(published rows: ML-1M, Zhai et al. 2024; compare only against an ML-1M run)")
    return "\n".join(lines)


def fit(config: JobConfig | str | Path, *, output_dir: str | Path | None = None,
        overrides: list[str] | None = None) -> Result:
    """Train ``config`` with Ray Train and write results; returns :class:`Result`.

    config: a JobConfig or a TOML path; overrides: ``section.key=value`` strings applied on top.
    output_dir: where ``metrics.json``, ``curves.png``, ``config.toml`` and ``ray/`` (Ray Train storage:
        checkpoints) go; default ``runs/<name>``.
    metrics.json: test-split ``hr@K``/``ndcg@K`` (K in train.eval_ks; history items excluded from the
    ranking unless ``train.eval_exclude_history`` is false), with ``eval_exclude_history``, the all-items
    ``hr@K_unfiltered``/``ndcg@K_unfiltered`` and ``targets_in_history``, ``samples_per_s`` (mean over
    epochs, global), ``wall_s`` (seconds; a run resumed in the same output folder adds the wall_s its
    previous metrics.json recorded), ``invocations`` (fits of this run that wrote metrics.json, this one
    included), ``epochs``, ``world_size``, ``bbs_imbalance`` (mean measured token imbalance max/mean across
    ranks), ``history`` (per-epoch dicts), ``events`` (controller events of every invocation:
    failure_detected, resize, checkpoint_restored/_fallback/_saved, first_step, ...; also in
    ``events.jsonl`` with per-step heartbeats) and ``recovery`` (per restart after a failure and per resume
    after a preemption, told apart by ``kind``: steps_lost, seconds_to_first_step; see
    gemray.events.summarize_recovery).
    Raises FileNotFoundError / ValueError for a bad config or data path, or for an output folder whose
    checkpoint was trained on other data (:func:`preflight_resume`), FileExistsError for an output folder in
    which another run is active (:func:`claim_output`), all before any worker starts, and Ray's
    TrainingFailedError when training fails beyond ``ray.max_failures``.
    """
    t0 = time.perf_counter()
    if isinstance(overrides, str):  # one "section.key=value" given without a list
        overrides = [overrides]
    if isinstance(config, JobConfig):
        cfg = apply_overrides(copy.deepcopy(config), overrides or [])
        config_path = None
    else:
        config_path = Path(config)
        cfg = load_config(config_path, overrides)
    cfg = _resolve(cfg, config_path)
    check_shardable(cfg.model)  # fail here, in one line, not in every worker after Ray started
    out = Path(output_dir or Path("runs") / cfg.name).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output folder {out} exists and is not a folder (--output / output_dir)")
    preflight_resources(cfg, embedded=not _ray_address(cfg))  # before preparing: no GPU, no wait for the data
    manifest = _ensure_prepared(cfg)  # bad data paths fail before anything is written to the output folder
    previous = None
    if (out / "config.toml").is_file() and (out / "ray").is_dir():
        try:
            previous = load_config(out / "config.toml")
        except (ValueError, OSError) as e:
            log.warning("could not read the previous run's %s (%s): not comparing model shapes",
                        out / "config.toml", e)
    preflight_data(cfg, manifest, previous=previous)
    storage = Path(cfg.ray.storage_path).resolve() if cfg.ray.storage_path else out / "ray"
    preflight_resume(cfg, manifest, storage / cfg.name, output_dir=out, previous=previous)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg.checkpoint.preempt_notice:
        cfg.checkpoint.preempt_notice = str(out / NOTICE_NAME)
    # The folder is this run's from here (a second run into it is refused until this one ends); released below
    # when the run ends, or at once if anything fails before Ray Train starts.
    claimed = claim_output(cfg.checkpoint.preempt_notice)
    try:
        return _fit_claimed(cfg, out, storage, previous, config_path, t0)
    finally:
        # after _fit_claimed returned: a preempted run has already marked its notice handled (and dropped the
        # marker), so a `gemray preempt --wait` never sees the marker go before the notice is handled
        if claimed:
            clear_active(cfg.checkpoint.preempt_notice)


def _fit_claimed(cfg: JobConfig, out: Path, storage: Path, previous: JobConfig | None, config_path: Path | None,
                 t0: float) -> Result:
    """fit, once the output folder is claimed (see fit)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from gemray.plots import plot_curves
    from gemray.train_loop import train_loop_per_worker

    if not cfg.train.events_path:
        cfg.train.events_path = str(out / "events.jsonl")
    # A run resumed in its own output folder (Ray storage and config.toml there) keeps its record: events of
    # every invocation, and wall_s summed over the invocations that wrote metrics.json. A fresh run starts both.
    events_from, wall_before, invocations = len(read_events(cfg.train.events_path)), 0.0, 1
    if previous is not None and previous.name == cfg.name:
        events_from = 0
        wall_before, invocations = _previous_wall(out / "metrics.json")
        invocations += 1
    if clear_notice(cfg.checkpoint.preempt_notice):
        log.info("removed the preemption notice %s left by a previous run", cfg.checkpoint.preempt_notice)
    (out / "config.toml").write_text(to_toml(cfg))
    if cfg.data.train_includes_valid:
        log.warning("data.train_includes_valid: training uses each validation item, so validation HR/NDCG "
                    "score trained targets; only the test split is held out")

    started = _connect_ray(cfg)
    # After ray.init (which installs its own SIGTERM handler in the driver): SIGTERM -> preemption notice.
    restore_sigterm = install_driver_sigterm(cfg.checkpoint.preempt_notice)
    env = _ray_train_env(cfg)
    saved_env = {k: os.environ.get(k) for k in env}
    result = None
    try:
        os.environ.update(env)  # read by TorchTrainer.fit and handed to the Train controller and workers
        workers: Any = cfg.ray.num_workers
        elastic: dict[str, Any] = {}
        if cfg.ray.min_workers and cfg.ray.max_workers:
            # Elastic: Ray Train V2 restarts the group at min(available, max) workers after a failure
            # (gemray.controller.policy.decide_world_size states the rule) and grows it when room appears.
            workers = (cfg.ray.min_workers, cfg.ray.max_workers)
            elastic["elastic_resize_monitor_interval_s"] = cfg.ray.resize_interval_s
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config=cfg.to_dict(),
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=cfg.ray.use_gpu,
                                         resources_per_worker={"CPU": cfg.ray.cpus_per_worker}, **elastic),
            run_config=RunConfig(name=cfg.name, storage_path=str(storage),
                                 failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep)),
            torch_config=TorchConfig(backend="nccl" if cfg.ray.use_gpu else "gloo"),
        )
        refresher = _ResourceViewRefresher(min(cfg.ray.resize_interval_s, 1.0)).start() if elastic else None
        try:
            result = trainer.fit()
        finally:
            if refresher is not None:
                refresher.stop()
    finally:
        restore_sigterm()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if started:
            ray.shutdown()

    reported = dict(result.metrics or {})
    if reported.get("preempted"):
        return _preempted_result(cfg, out, result, reported, events_from, t0, wall_before, invocations)
    history = list(reported.pop("history", []))
    metrics: dict[str, Any] = {k: reported[f"test_{k}"] for k in
                               [f"{m}@{k}{s}" for s in ("", "_unfiltered") for k in cfg.train.eval_ks
                                for m in ("hr", "ndcg")] + ["targets_in_history"]
                               if f"test_{k}" in reported}
    metrics["eval_exclude_history"] = cfg.train.eval_exclude_history
    metrics["num_test_users"] = reported.get("test_num_users")
    tput = [h["samples_per_s"] for h in history if "samples_per_s" in h]
    imb = [h["token_imbalance"] for h in history if "token_imbalance" in h]
    metrics.update({
        "samples_per_s": sum(tput) / len(tput) if tput else 0.0,
        "wall_s": wall_before + time.perf_counter() - t0,
        "invocations": invocations,
        "epochs": int(reported.get("epoch", len(history))),
        "world_size": int(reported.get("world_size", cfg.ray.num_workers)),
        "bbs": cfg.data.bbs,
        "bbs_imbalance": sum(imb) / len(imb) if imb else 1.0,
        "history": history,
    })
    events = read_events(cfg.train.events_path)[events_from:]
    metrics["events"] = [e for e in events if e["kind"] not in QUIET_KINDS]  # heartbeats stay in events.jsonl
    metrics["recovery"] = summarize_recovery(events)
    for r in metrics["recovery"]:
        log.info("recovery (%s): attempt %s -> %s, world %s -> %s, %s step(s) lost, %.1f s from the last step "
                 "before the %s to the first resumed step", r["kind"], r["failed_attempt"], r["attempt"],
                 r["world_size_before"], r["world_size_after"], r["steps_lost"],
                 r["seconds_to_first_step"] if r["seconds_to_first_step"] is not None else float("nan"),
                 "stop (the time the job was stopped included)" if r["kind"] == "preemption" else "failure")
    ckpt = result.checkpoint.path if result.checkpoint is not None else None
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    if history:
        plot_curves(history, out / "curves.png")
    print(comparison_table(metrics))
    log.info("results in %s (checkpoint %s)", out, ckpt)
    _late_notice(cfg.checkpoint.preempt_notice, metrics, ckpt)
    return Result(metrics=metrics, checkpoint_path=ckpt, output_dir=str(out))


def _late_notice(notice: str, metrics: dict[str, Any], ckpt: str | None) -> None:
    """A preemption notice that arrived after the workers' last vote (the final step) found the run finishing:
    say so, and mark it handled with the final checkpoint so that a `gemray preempt --wait` returns."""
    if read_notice(notice) is None:
        return
    step = int((metrics.get("history") or [{}])[-1].get("global_step", 0))
    log.warning("the preemption notice %s came after the last step's vote: the run finished instead (final "
                "checkpoint %s; nothing to resume)", notice, ckpt)
    try:
        mark_handled(notice, step, ckpt, finished=True)
    except OSError as e:
        log.warning("could not mark the preemption notice %s handled: %s", notice, e)
