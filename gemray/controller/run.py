"""``fit``: run one gemray job on Ray Train (an existing cluster or an embedded local one).

Steps: load/override/validate the config -> resolve data paths to absolute -> preflight checks
(:mod:`~gemray.controller.preflight`) around preparing the data if its manifest is missing -> claim the
output folder (:mod:`~gemray.controller.output_lock`) -> connect to Ray ($RAY_ADDRESS / ``ray.address``) or
start an embedded cluster (:mod:`~gemray.controller.session`) -> ``TorchTrainer(train_loop_per_worker, ...)``
with FailureConfig/CheckpointConfig -> write ``metrics.json``, ``curves.png``, ``config.toml`` into the output
folder and print a comparison table (:mod:`~gemray.controller.results`).

Re-running with the same output folder and job name resumes from its latest committed checkpoint (Ray
Train V2 restores a run by ``RunConfig(name, storage_path)``); a checkpoint trained on other data is refused
before Ray starts (:func:`~gemray.controller.preflight.preflight_resume`), one on another raw ratings file
before that file is prepared (:func:`~gemray.controller.preflight.preflight_resume_source`).
"""

from __future__ import annotations

import copy
import difflib
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from gemray.config import JobConfig, apply_overrides, check_overrides, load_config, shared_origin, to_toml
from gemray.controller import console, output_lock, preflight, results, session
from gemray.controller.results import Result
from gemray.events import read_events
from gemray.parallel.sharding import check_shardable
from gemray.preemption import NOTICE_NAME, clear_notice, install_driver_sigint, install_driver_sigterm

__all__ = ["Result", "fit"]

log = logging.getLogger(__name__)


def fit(config: JobConfig | str | Path, *, output_dir: str | Path | None = None,
        overrides: list[str] | None = None) -> Result:
    """Train ``config`` with Ray Train and write results; returns :class:`Result`.

    config: a JobConfig or a TOML path; overrides: ``section.key=value`` strings applied on top (a list, or one
        string; an element that is not a string is a TypeError naming it, before anything else is read).
    output_dir: where ``metrics.json``, ``curves.png``, ``config.toml`` and ``ray/`` (Ray Train storage:
        checkpoints) go; default ``runs/<name>``. The run's full log goes to ``<output>/logs/gemray.log`` as under
        ``gemray train`` (:func:`gemray.controller.console.run_log`; the console is left as it is).
    metrics.json: test-split ``hr@K``/``ndcg@K`` (K in train.eval_ks; history items excluded from the
    ranking unless ``train.eval_exclude_history`` is false), with ``eval_exclude_history``, the all-items
    ``hr@K_unfiltered``/``ndcg@K_unfiltered`` and ``targets_in_history`` (with a "retrieval" task), the
    ranking tasks' ``test_<task>_ne`` / ``_auc`` / ``_auc_error_bound`` / ``_logloss`` / ``_base_rate`` /
    ``_calibration`` / ``_num_examples`` (with "ctr" / "cvr"), ``samples_per_s`` (mean over
    epochs, global), ``tokens_per_s`` / ``model_tflops_per_s`` / ``local_mfu`` / ``scaling_ratio`` /
    ``e2e_mfu`` (:func:`gemray.controller.results.throughput_metrics`), ``wall_s`` (seconds; a run resumed in the same output folder adds the wall_s its
    previous metrics.json recorded), ``invocations`` (fits of this run that wrote metrics.json, this one
    included), ``epochs``, ``world_size``, ``bbs_imbalance`` (mean measured token imbalance max/mean across
    ranks), ``history`` (per-epoch dicts), ``events`` (controller events of every invocation:
    failure_detected, resize, checkpoint_restored/_fallback/_saved, first_step, ...; also in
    ``events.jsonl`` with per-step heartbeats) and ``recovery`` (per restart after a failure and per resume
    after a preemption, told apart by ``kind``: steps_lost, seconds_to_first_step; see
    gemray.events.summarize_recovery). A run stopped by a preemption notice writes ``preempted``,
    ``global_step``, ``epoch`` and ``epochs_completed`` instead of test metrics.
    Raises FileNotFoundError / ValueError for a bad config or data path (no prepared data and no MovieLens
    ratings file in ``data.raw_dir``: :func:`no_data_message`; raw MovieLens ratings in ``data.prepared_dir``),
    or for an output folder whose
    checkpoint was trained on other data (:func:`~gemray.controller.preflight.preflight_resume`),
    ValueError for an output folder this process cannot write
    (:func:`~gemray.controller.preflight.preflight_output`) or that holds files no run wrote
    (:func:`~gemray.controller.preflight.preflight_output_contents`), FileExistsError for an output folder in which
    another run is active
    (:func:`~gemray.controller.output_lock.claim_output`), all before any worker starts, and Ray's
    TrainingFailedError when training fails beyond ``ray.max_failures``.
    """
    t0 = time.perf_counter()
    cfg = _load(config, overrides)
    out = Path(output_dir or Path("runs") / cfg.name).expanduser().resolve()
    # before the run's log is opened there
    preflight.preflight_output_outside_data(out, cfg.data.prepared_dir, what="--output (output_dir)")
    preflight.preflight_output_contents(out, what="--output (output_dir)")  # nobody's files written over
    with console.run_log(out):  # <out>/logs/gemray.log, as under `gemray train` (whose session it then uses)
        return _fit(cfg, out, t0)


def _fit(cfg: JobConfig, out: Path, t0: float) -> Result:
    """:func:`fit`'s work once the config is loaded and the output folder named (inside its run log)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output folder {out} exists and is not a folder (--output / output_dir)")
    preflight.preflight_output(out)  # a read-only --output: one line, exit 2, before anything starts
    # resources before preparing the data: no GPU means no wait for the data
    preflight.preflight_resources(cfg, embedded=not session.ray_address(cfg))
    preflight.preflight_layout(cfg)  # [parallel] degrees that cannot fit ray.num_workers: one line, not N restarts
    idle = cfg.ineffective_settings_warning()
    if idle:  # valid but doing nothing here: said once per run (the run's log file is open by now), after the
        # refusals above (a "has no effect" line right before the refusal of the same setting read as a contradiction)
        logging.getLogger("gemray.config").warning("%s", idle)
    results.load_scaling_reference(cfg.train.scaling_reference)  # a bad reference path fails now, not at the end
    previous = _previous_config(out)
    preflight.preflight_run_name(cfg, previous, out, what="--output (output_dir)")  # one run per output folder
    storage = Path(cfg.ray.storage_path).resolve() if cfg.ray.storage_path else out / "ray"
    # a resume onto another raw ratings file: refused before preparing it (the full check follows preparation)
    preflight.preflight_resume_source(cfg, storage / cfg.name, output_dir=out, previous=previous)
    # another run active in this folder: refused before the data is prepared (the claim below checks it again)
    preflight.preflight_active(cfg.checkpoint.preempt_notice or out / NOTICE_NAME)
    preflight.preflight_catalogue(cfg)  # cut-offs against a synthetic catalogue: before minutes of generation
    manifest = _ensure_prepared(cfg)  # bad data paths fail before anything is written to the output folder
    preflight.preflight_data(cfg, manifest, previous=previous)
    preflight.preflight_resume(cfg, manifest, storage / cfg.name, output_dir=out, previous=previous)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg.checkpoint.preempt_notice:
        cfg.checkpoint.preempt_notice = str(out / NOTICE_NAME)
    # The folder is this run's from here (a second run into it is refused until this one ends), released when
    # the run ends, or at once if anything fails before Ray Train starts; a preempted run has marked its notice
    # handled (and dropped the claim) before, so `gemray preempt --wait` never sees the claim go first.
    with output_lock.output_claimed(cfg.checkpoint.preempt_notice):
        if not cfg.train.events_path:
            cfg.train.events_path = str(out / "events.jsonl")
        events_from, wall_before, invocations = results.run_record(cfg, out, previous)
        if clear_notice(cfg.checkpoint.preempt_notice):
            log.info("removed the preemption notice %s left by a previous run", cfg.checkpoint.preempt_notice)
        changed = changed_settings(previous, cfg)
        if changed:
            log.warning("%s holds a run with other settings (%s): it continues from that run's checkpoint with "
                        "these ones (a finished run trains nothing more and keeps its metrics.json), and "
                        "config.toml now records them; use another --output for a separate run",
                        out, "; ".join(changed))
        (out / "config.toml").write_text(to_toml(cfg))
        if cfg.data.train_includes_valid:
            log.warning("data.train_includes_valid: training uses each validation item, so validation HR/NDCG "
                        "score trained targets; only the test split is held out")
        result = _train(cfg, storage)
        wall_s = wall_before + time.perf_counter() - t0
        # the last attempt's own end decides, not the Result's report: that is the latest checkpoint's, still
        # "preempted" when an attempt restored an emergency checkpoint and had nothing to train (it finished)
        outcome = results.attempt_outcome(result.metrics or {}, read_events(cfg.train.events_path)[events_from:])
        if outcome == "preempted":
            return results.finish_preempted(cfg, out, result, events_from=events_from, wall_s=wall_s,
                                            invocations=invocations)
        return results.finish(cfg, out, result, events_from=events_from, wall_s=wall_s, invocations=invocations,
                              data_format=manifest.get("format"))


def _load(config: JobConfig | str | Path, overrides: list[str] | str | None) -> JobConfig:
    """The validated config with ``overrides`` applied (a JobConfig is copied, never changed) and its paths
    resolved (:func:`_resolve`)."""
    overrides = check_overrides(overrides)  # one string -> [it]; not strings: TypeError naming the element
    if isinstance(config, JobConfig):
        cfg = apply_overrides(copy.deepcopy(config), overrides)
    else:
        cfg = load_config(Path(config), overrides)
    cfg = _resolve(cfg)
    check_shardable(cfg.model)  # fail here, in one line, not in every worker after Ray started
    return cfg


def _resolve(cfg: JobConfig) -> JobConfig:
    """Make the data paths, the set ``train.events_path`` / ``train.ledger_dir`` and a ``model.kernel_tiles``
    file path absolute (relative to the current directory): the workers run in folders of Ray's, where a
    relative path would land elsewhere (and the driver reads the events back from its own directory)."""
    for section, name in (("data", "raw_dir"), ("data", "prepared_dir"), ("train", "events_path"),
                          ("train", "ledger_dir"), ("model", "kernel_tiles")):
        sec = getattr(cfg, section)
        value = getattr(sec, name)
        if section != "data" and not value:  # "" = default (events: <output>/events.jsonl) or off
            continue
        if name == "kernel_tiles" and value.lstrip().startswith("{"):  # inline JSON, not a path
            continue
        p = Path(value).expanduser()
        setattr(sec, name, str(p if p.is_absolute() else (Path.cwd() / p).resolve()))
    return cfg


def ensure_prepared(cfg: JobConfig) -> dict[str, Any]:
    """Public: what ``fit`` does with the data before Ray starts (:func:`_ensure_prepared`), for other entry
    points that train in-process (``gemray bench train``)."""
    return _ensure_prepared(cfg)


def _ensure_prepared(cfg: JobConfig) -> dict[str, Any]:
    """The prepared data's manifest (every file checked against it), preparing the data from
    ``data.raw_dir`` first when ``data.prepared_dir`` holds none. Raises FileNotFoundError when neither is
    there (:func:`no_data_message`) or ``data.prepared_dir`` holds raw MovieLens ratings (the command that prepares
    them: :func:`~gemray.pipelines.movielens.raw_folder_error`) or a folder of ``gemray prepare interactions`` /
    ``synthetic`` misses a file (never re-made from ``data.raw_dir``: the error names the command that made it),
    ValueError for a damaged prepared folder."""
    from gemray.pipelines.movielens import (FORMATS, detect_format, format_summary, load_manifest, prepare_movielens,
                                            prepared_format, raw_folder_error)

    out = Path(cfg.data.prepared_dir)
    if out.exists() and not out.is_dir():  # a mistyped path: refused before anything is said about preparing into it
        raise ValueError(f"data.prepared_dir {out}: exists and is not a folder; refusing to replace it")
    if cfg.data.synthetic:
        from gemray.pipelines.synthetic import ensure_synthetic

        return ensure_synthetic(cfg.data)
    try:
        manifest = load_manifest(cfg.data.prepared_dir, verify=True)  # a damaged folder: refused before Ray starts
        if any("sha256" not in f for f in manifest["files"]):
            log.warning("%s was prepared by an older gemray that recorded no checksums: only its Parquet footers "
                        "and row counts are checked; prepare it again to have every byte checked",
                        cfg.data.prepared_dir)
        return manifest
    except FileNotFoundError as unprepared:
        # a damaged folder of `gemray prepare interactions` / `synthetic` (a file or its manifest.json missing): the
        # error names the command that made it; preparing MovieLens from data.raw_dir would not remake it
        if prepared_format(cfg.data.prepared_dir) not in (None, *FORMATS):
            raise
        # raw MovieLens files where the prepared data belongs: say so and how to prepare them, rather than prepare
        # data.raw_dir into that folder (refused only once preparation starts, or "not prepared" when raw_dir is off)
        raw_here = raw_folder_error(cfg.data.prepared_dir, "data.prepared_dir", "--set data.prepared_dir={out} (or "
                                    "have it prepared on the way: --set data.raw_dir={src} data.prepared_dir={out})")
        if raw_here:
            raise FileNotFoundError(raw_here) from None
        try:
            detect_format(cfg.data.raw_dir)
        except FileNotFoundError:
            raw = Path(cfg.data.raw_dir)
            raise FileNotFoundError(no_data_message(cfg.data.prepared_dir, str(unprepared).split(";")[0], raw,
                                                    raw.is_dir(), shared=shared_origin(cfg, "data.raw_dir"),
                                                    close=None if raw.exists() else close_folder(raw))) from None
        log.info("prepared data missing at %s: preparing it from %s", cfg.data.prepared_dir, cfg.data.raw_dir)
        manifest = prepare_movielens(cfg.data.raw_dir, cfg.data.prepared_dir, on_bad_rows=cfg.data.on_bad_rows,
                                     num_files=cfg.data.num_files, num_files_name="data.num_files")
        print(format_summary(manifest, cfg.data.prepared_dir))
        return manifest


def close_folder(path: Path) -> Path | None:
    """The folder beside ``path`` (which does not exist) whose name is closest to its name by difflib
    (``/data/ml-1mm`` -> ``/data/ml-1m``), or None when none is close or the parent cannot be listed."""
    try:
        names = sorted(e.name for e in path.parent.iterdir() if e.is_dir())
    except OSError:
        return None
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return path.parent / close[0] if close else None


def no_data_message(prepared_dir: str, why: str, raw_dir: Path, raw_exists: bool, *, shared: str | None = None,
                    close: Path | None = None) -> str:
    """Pure: the error when ``data.prepared_dir`` is not prepared (``why``: load_manifest's reason) and
    ``data.raw_dir`` holds no MovieLens ratings file (``raw_exists``: the folder is there): both paths named, and
    how to point gemray at the user's MovieLens download (--set / overrides, make demo's DATA_SRC; and
    $GEMRAY_SHARED only when ``shared``, the ``../shared/...`` value raw_dir was configured as: it changes no
    other path). ``close``: an existing folder beside a missing raw_dir with a close name (:func:`close_folder`),
    suggested."""
    release = next((n for n in ((close.name if close else ""), raw_dir.name) if n.startswith("ml-")), "ml-1m")
    if raw_exists:
        raw_why = "holds no MovieLens ratings file (ratings.dat, u.data or ratings.csv)"
    else:
        raw_why = "does not exist" + (f" (did you mean {close}?)" if close else "")
    how = f"--set data.raw_dir=/path/to/{release} (Python: overrides=[\"data.raw_dir=/path/to/{release}\"]"
    if shared is None:
        how += "; make demo: DATA_SRC=/path/to/ml-1m)"
    else:
        how += (f"), or set GEMRAY_SHARED to the folder holding data/{release} for the configs' ../shared/... paths "
                f"(this config's data.raw_dir is {shared!r}; make demo: DATA_SRC=/path/to/ml-1m)")
    return (f"no data to train on: data.prepared_dir {prepared_dir} is not prepared "
            f"({why.removeprefix(f'{prepared_dir}: ')}) and data.raw_dir {raw_dir} {raw_why}; point data.raw_dir "
            f"at your MovieLens download: {how}")


def changed_settings(previous: JobConfig | None, cfg: JobConfig) -> list[str]:
    """Pure: ``"section.key: old -> new"`` for every setting of ``cfg`` that differs from ``previous`` (the config
    of the earlier run in the same output folder; [] when None), paths the run fills in itself left out
    (``train.events_path``, ``checkpoint.preempt_notice``)."""
    if previous is None:
        return []
    auto = {("train", "events_path"), ("checkpoint", "preempt_notice")}
    old, new = previous.to_dict(), cfg.to_dict()
    return [f"{sec}.{key}: {old[sec].get(key)!r} -> {val!r}" for sec, fields in new.items() if isinstance(fields, dict)
            for key, val in fields.items() if (sec, key) not in auto and old.get(sec, {}).get(key) != val]


def _previous_config(out: Path) -> JobConfig | None:
    """The config.toml of an earlier run in ``out`` that left Ray Train storage there (None: none, or one
    that cannot be read, with a warning)."""
    if not ((out / "config.toml").is_file() and (out / "ray").is_dir()):
        return None
    try:
        return load_config(out / "config.toml")
    except (ValueError, OSError) as e:
        log.warning("could not read the previous run's %s (%s): not comparing model shapes", out / "config.toml", e)
        return None


def scaling(cfg: JobConfig) -> dict[str, Any]:
    """Pure: the ``ScalingConfig`` arguments for ``cfg.ray``. Elastic (``ray.min_workers`` and
    ``ray.max_workers`` set): ``num_workers=(min, max)``; Ray Train V2 then (re)starts the group at
    min(available, max) workers after a failure and grows it when room appears, checking every
    ``ray.resize_interval_s`` seconds. Otherwise a fixed ``ray.num_workers``."""
    kw: dict[str, Any] = {"num_workers": cfg.ray.num_workers, "use_gpu": cfg.ray.use_gpu,
                          "resources_per_worker": {"CPU": cfg.ray.cpus_per_worker}}
    if cfg.ray.min_workers and cfg.ray.max_workers:
        kw["num_workers"] = (cfg.ray.min_workers, cfg.ray.max_workers)
        kw["elastic_resize_monitor_interval_s"] = cfg.ray.resize_interval_s
    return kw


def _train(cfg: JobConfig, storage: Path) -> Any:
    """Run the job on Ray Train and return its ``ray.train.Result``: connected to Ray for the run only, SIGTERM
    to this driver turned into a preemption notice, Ray Train's environment knobs set."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from gemray.train import train_loop_per_worker

    kw = scaling(cfg)
    with ExitStack() as stack:
        stack.enter_context(session.ray_session(cfg))
        # after ray.init, which installs its own SIGTERM handler in the driver: SIGTERM -> preemption notice
        stack.callback(install_driver_sigterm(cfg.checkpoint.preempt_notice))
        stack.callback(install_driver_sigint(cfg.checkpoint.preempt_notice))  # Ctrl-C: the same notice
        stack.enter_context(session.train_env(cfg))
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config=cfg.to_dict(),
            scaling_config=ScalingConfig(**kw),
            run_config=RunConfig(name=cfg.name, storage_path=str(storage),
                                 failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep)),
            torch_config=TorchConfig(backend="nccl" if cfg.ray.use_gpu else "gloo"),
        )
        if isinstance(kw["num_workers"], tuple):
            stack.enter_context(session.ResourceViewRefresher(min(cfg.ray.resize_interval_s, 1.0)))
        return _fit_off_main_thread(trainer)


def _fit_off_main_thread(trainer: Any, poll_s: float = 0.2) -> Any:
    """``trainer.fit()`` on a helper thread while the main thread waits, so that the main thread keeps the
    driver's signal handlers (Ray Train replaces SIGINT's with an abort that counts as a failure when fit runs
    on the main thread; it leaves it alone elsewhere, as under Ray Tune). Returns fit's result or re-raises
    its exception; a KeyboardInterrupt from a second Ctrl-C leaves the (daemon) thread behind."""
    import threading

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            box["error"] = e

    t = threading.Thread(target=target, name="gemray-train-fit", daemon=True)
    t.start()
    while t.is_alive():
        t.join(poll_s)
    if "error" in box:
        raise box["error"]
    return box["result"]
