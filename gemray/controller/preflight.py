"""Checks ``fit`` runs before Ray starts, so that a job that could only fail (or hang) inside the workers is
refused at once, in one line naming the field or folder, before anything is written.

* :func:`preflight_resources`: GPUs, optimizer and attention backend against the device, CPUs per worker
  (needs no data: run before the data is prepared);
* :func:`preflight_layout`: the ``[parallel]`` degrees of a fixed-size job against its world size;
* :func:`preflight_catalogue`: cut-offs and negatives against a synthetic config's catalogue, before the data is
  generated;
* :func:`preflight_data`: cut-offs and negatives against the catalogue, the prepared data's source files, users in its
  splits, the model shape against the previous run in the output folder;
* :func:`preflight_resume`: the checkpoint a resume would restore was trained on this data
  (:func:`resume_mismatch` is the pure comparison); :func:`preflight_resume_source` checks the raw ratings file
  before the data is prepared;
* :func:`preflight_output`: the output folder is (or can be made) a folder this process can write;
  :func:`preflight_output_contents`: an existing one holds only what a run writes (an earlier run's files);
* :func:`preflight_active`: no other run is active in the output folder
  (:mod:`gemray.controller.output_lock` claims it).

Every check raises (ValueError, or FileExistsError for a folder in use) and returns nothing otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from gemray.checkpoint import checkpoint_data, committed_checkpoints, data_record, file_sha256
from gemray.config import JobConfig, cutoff_advice, shape_changes, usable_cpus
from gemray.controller.session import embedded_num_cpus
from gemray.preemption import (ACTIVE_HEARTBEAT_S, ACTIVE_STALE_S, NOTICE_NAME, active_path, marker_is_stale,
                               pid_alive)

log = logging.getLogger(__name__)

def preflight_output(out: str | Path, *, what: str = "--output") -> None:
    """Refuse an output folder this process cannot write, before Ray starts: ``out`` if it exists, else its
    nearest existing parent (where ``mkdir`` would create it), must be a folder in which a file can be
    created (probed with a temporary file that is removed at once; ``os.access`` alone is not enough for
    root or read-only mounts). Raises NotADirectoryError when ``out`` or that parent is not a folder and
    ValueError ``--output DIR is not writable: ...`` otherwise."""
    import tempfile

    out = Path(out)
    probe = out
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"{what} {out}: {probe} exists and is not a folder")
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".gemray-write-probe-"):
            pass
    except OSError as e:
        where = "" if probe == out else f" (its parent {probe} is not writable, so it cannot be created)"
        raise ValueError(f"{what} {out} is not writable{where}: {e.strerror or e}; give a folder you can "
                         "write to") from e


def preflight_output_outside_data(out: str | Path, prepared_dir: str | Path, *, what: str = "--output") -> None:
    """Refuse an output folder that is the prepared data folder (``data.prepared_dir``) or inside it, before anything
    is written there (the run's log included): the run's files would mix with the data's, and a later ``gemray
    prepare`` into that folder refuses it for the files its manifest does not list. Both paths as given (relative to
    the working directory). Raises ValueError naming the option and both folders."""
    o, d = Path(out).expanduser().resolve(), Path(prepared_dir).expanduser().resolve()
    if o == d or d in o.parents:
        where = "is" if o == d else "is inside"
        raise ValueError(f"{what} {out} {where} the prepared data folder {prepared_dir} (data.prepared_dir): the run's "
                         f"files would mix with the data's; give another folder, e.g. runs/<name>")


#: What ``gemray train`` writes into its output folder, and nothing else (:func:`preflight_output_contents`).
RUN_FOLDER_ENTRIES = frozenset({"config.toml", "metrics.json", "curves.png", "events.jsonl", "logs", "ray",
                                "tensorboard", NOTICE_NAME, active_path(NOTICE_NAME).name})


#: What ``gemray evaluate`` writes into a run's folder by default (``gemray.serve.evaluate.result_path``:
#: ``evaluate_<split>.json``, ``evaluate_<split>.<data folder>.json``): a run folder's own files too.
EVALUATE_RESULT = re.compile(r"evaluate_[A-Za-z0-9_-]+(\.[^/]+)?\.json")


def foreign_entries(out: Path) -> list[str]:
    """Pure over the folder's listing: the names in folder ``out`` that no gemray command writes there (not in
    :data:`RUN_FOLDER_ENTRIES`, not an :data:`EVALUATE_RESULT`), sorted. Was: after ``gemray evaluate --checkpoint
    RUN`` (its default --json lands in RUN), re-running the job to train further and ``gemray preempt --output RUN``
    refused the folder for evaluate_test.json (a new user's finding)."""
    return sorted(p.name for p in out.iterdir()
                  if p.name not in RUN_FOLDER_ENTRIES and not EVALUATE_RESULT.fullmatch(p.name))


def written_by_gemray(config_toml: str) -> bool:
    """Pure: whether the text of a run folder's config.toml is one :func:`gemray.config.to_toml` wrote: it begins
    with ``name = `` and holds no comment line (every config a person writes, and every one in configs/, has
    them; the dump never does)."""
    lines = config_toml.splitlines()
    return bool(lines) and lines[0].startswith("name = ") and not any(ln.lstrip().startswith("#") for ln in lines)


def preflight_output_contents(out: str | Path, *, what: str = "--output") -> None:
    """Refuse an existing, non-empty output folder that is not a gemray run folder, before anything is written
    there: a run writes config.toml (its resolved config), metrics.json, curves.png, events.jsonl, logs/, ray/,
    tensorboard/ and its preemption notice into the folder, over files of those names. So the folder may hold
    only those entries (:data:`RUN_FOLDER_ENTRIES`: an earlier run's, which the run resumes), and a config.toml
    there must be one a run wrote (:func:`written_by_gemray`), not the user's own (e.g. the ``--config`` file
    itself). Was: ``--output`` a folder of one's own files wrote over its config.toml and metrics.json without a
    word, and ``--output /`` wrote into the filesystem's root. Raises ValueError naming ``what``, the folder and
    the entries in the way."""
    out = Path(out)
    if not out.is_dir():
        return
    extra = foreign_entries(out)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ValueError(f"{what} {out}: holds files a gemray run does not write ({', '.join(extra[:5])}{more}); a "
                         "run writes config.toml, metrics.json, logs/ and ray/ there: give a new or empty folder "
                         "(e.g. runs/<name>), or an earlier run's folder to resume it")
    cfg_file = out / "config.toml"
    if cfg_file.is_file():
        try:
            ours = written_by_gemray(cfg_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            ours = False
        if not ours:
            raise ValueError(f"{what} {out}: its config.toml was not written by a gemray run (a run writes its "
                             "resolved config there, over what is there): keep your config outside the output "
                             "folder (e.g. configs/), or give another folder")


def preflight_run_name(cfg: JobConfig, previous: JobConfig | None, out: str | Path, *,
                       what: str = "--output") -> None:
    """Refuse a job whose ``name`` differs from that of the earlier run in its output folder ``out``
    (``previous``: that run's config.toml, beside its Ray Train storage): a run resumes only its own name's
    checkpoints, so the job would start afresh and write its metrics.json, config.toml and curves.png over the
    earlier run's (was: done, under a warning that said it continued that run). Raises ValueError naming both
    names and how to continue the earlier run."""
    if previous is not None and previous.name != cfg.name:
        raise ValueError(f"{what} {out}: holds the run named {previous.name!r} (its config.toml and checkpoints); this "
                         f"job is named {cfg.name!r} and would start afresh over that run's metrics.json and "
                         f"config.toml: give another folder, or --set name={previous.name} to continue that run")


#: the most CPU training workers per usable core an embedded cluster is asked to start (every worker is a
#: process with its own model replica and loader: ~2 GB each in the ML-1M demo)
MAX_CPU_WORKERS_PER_CORE = 4


def preflight_kernel_tiles(cfg: JobConfig) -> None:
    """Refuse a ``model.kernel_tiles`` naming an unknown regime, tile kind, head-dim bucket or mode, or a malformed
    tile (loading the config checks only that it is a JSON object): ``gemray train`` (through
    :func:`preflight_resources`) and ``gemray bench train`` call it before the data is prepared or anything
    starts. Raises ValueError naming model.kernel_tiles (``gemray.model.hstu.kernel_config_of``)."""
    if cfg.model.kernel_tiles:
        from gemray.model.hstu import kernel_config_of

        kernel_config_of(cfg.model.kernel_tiles)


def preflight_resources(cfg: JobConfig, *, embedded: bool, num_gpus: int | None = None,
                        cores: int | None = None) -> None:
    """Refuse a job the device or the embedded cluster cannot run: ``ray.use_gpu`` on an embedded cluster
    with fewer GPUs than workers (``num_gpus``: GPUs this machine has; default ``torch.cuda.device_count()``),
    Adam kinds of sparse optimizer, forced Triton without a GPU outside Triton's interpreter (``TRITON_INTERPRET=1``
    runs the kernels on CPU tensors, for tests): the attention, and the retrieval kernel where it is read
    (``ModelConfig.retrieval_kernel_in_use``; elsewhere it is only warned about as idle), a ``model.kernel_tiles``
    naming an unknown regime, tile kind or mode, a worker asking more CPUs than the embedded cluster advertises,
    more CPU workers than ``MAX_CPU_WORKERS_PER_CORE`` per usable core of this machine on an embedded cluster (``cores``:
    default ``gemray.config.usable_cpus()``; the cluster advertises 2 CPUs per worker whatever the machine has, so a
    mistyped ``ray.num_workers=1000`` started hundreds of processes and ran the machine out of memory).
    embedded: whether fit will start its own Ray cluster (an external one may have the GPUs and CPUs). Raises
    ValueError naming the field."""
    gpu = cfg.ray.use_gpu
    if embedded and not gpu:
        cores = usable_cpus() if cores is None else cores
        most = max(cfg.ray.num_workers, cfg.ray.max_workers)
        if most > MAX_CPU_WORKERS_PER_CORE * cores:
            field = "ray.max_workers" if cfg.ray.max_workers > cfg.ray.num_workers else "ray.num_workers"
            raise ValueError(f"{field}={most} CPU workers on the embedded Ray cluster of a machine with {cores} usable "
                             f"core(s): at most {MAX_CPU_WORKERS_PER_CORE * cores} ({MAX_CPU_WORKERS_PER_CORE} per "
                             "core; each worker is a training process with its own model replica, ~2 GB in the ML-1M "
                             "demo); use fewer workers, or ray.address for a cluster")
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
    if not gpu and cfg.model.attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("model.attention_backend='triton' needs ray.use_gpu=true (the attention kernels run on "
                         "CUDA; on CPU only in Triton's interpreter, TRITON_INTERPRET=1, for tests); use 'auto' or "
                         "'reference' on CPU")
    m = cfg.model
    if (not gpu and m.retrieval_kernel == "triton" and m.retrieval_kernel_in_use
            and os.environ.get("TRITON_INTERPRET") != "1"):
        raise ValueError("model.retrieval_kernel='triton' needs ray.use_gpu=true (the fused sampled softmax runs on "
                         "CUDA; on CPU only in Triton's interpreter, TRITON_INTERPRET=1, for tests); use 'auto' or "
                         "'reference' on CPU")
    if not gpu and m.uvqk_kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("model.uvqk_kernel='triton' needs ray.use_gpu=true (the fused uvqk activation runs on CUDA; "
                         "on CPU only in Triton's interpreter, TRITON_INTERPRET=1, for tests); use 'auto' or "
                         "'reference' on CPU")
    preflight_kernel_tiles(cfg)  # here, not in every worker after Ray starts
    if embedded and cfg.ray.cpus_per_worker > embedded_num_cpus(cfg):
        raise ValueError(f"ray.cpus_per_worker={cfg.ray.cpus_per_worker} exceeds the {embedded_num_cpus(cfg)} CPUs "
                         "the embedded Ray cluster advertises (ray.num_cpus): the workers would never start")
    workers = cfg.ray.min_workers or cfg.ray.num_workers  # an elastic run starts with at least min_workers
    if embedded and workers * cfg.ray.cpus_per_worker > embedded_num_cpus(cfg):
        raise ValueError(f"{workers} worker(s) x ray.cpus_per_worker={cfg.ray.cpus_per_worker} exceed the "
                         f"{embedded_num_cpus(cfg)} CPUs the embedded Ray cluster advertises (ray.num_cpus): the "
                         "worker group would never start; ask fewer CPUs per worker, fewer workers or more "
                         "ray.num_cpus")


def preflight_layout(cfg: JobConfig) -> None:
    """Refuse a fixed-size job (no ``ray.min_workers`` / ``ray.max_workers``) whose ``[parallel]`` degrees do not
    fit ``ray.num_workers`` ranks -- ``parallel.dp_shard``, ``expert_parallel`` or ``sparse_2d_group`` not
    dividing it, 2D sparse without GPUs, ... -- with the workers' own decision
    (``gemray.parallel.dims.from_config``), so the job fails in one line before Ray starts instead of in every
    worker's setup after it (Ray Train then restarted the group ``ray.max_failures`` times). An elastic job is
    left to its workers: every attempt takes the nearest valid layout for its world size. HSDP on GPUs with
    ``dp_shard = 0`` (the GPUs of a node) and no ``parallel.gpus_per_node`` is left to the workers too: only their
    node knows its GPU count. Raises ValueError naming the sizes."""
    from gemray.parallel.dims import from_config

    if cfg.ray.min_workers or cfg.ray.max_workers:
        return
    p = cfg.parallel
    device = "cuda" if cfg.ray.use_gpu else "cpu"
    if device == "cuda" and p.dense == "hsdp" and not p.dp_shard and not p.gpus_per_node:
        return
    from_config(p, int(cfg.ray.num_workers), device, int(p.gpus_per_node or 1), int(cfg.model.moe_experts))


def check_cutoffs(eval_ks: list[int], n_items: int, where: str = "") -> None:
    """Pure: refuse HR@K / NDCG@K cut-offs ``eval_ks`` (``train.eval_ks``) at or above the catalogue's ``n_items``
    items (``where``: how the size is known, for the message). Raises ValueError naming train.eval_ks, the
    catalogue's size, the cut-offs at or above it, the largest allowed and a value that would pass
    (:func:`gemray.config.cutoff_advice`)."""
    above = [int(k) for k in eval_ks if int(k) >= n_items]
    if above:
        advice = cutoff_advice(eval_ks, n_items, lambda ks: f"train.eval_ks=[{','.join(map(str, ks))}]")
        raise ValueError(f"train.eval_ks={eval_ks}: a cut-off at or above the {n_items} items of the catalogue{where} "
                         f"makes HR@K trivially 1 (every target ranks below N, a history-excluded one at N-1); too "
                         f"large: {', '.join(map(str, above))}; {advice}")


def check_negatives(cfg: JobConfig, n_items: int, where: str = "") -> None:
    """Pure: refuse a ``model.num_negatives`` above the catalogue's ``n_items`` items when the retrieval task samples
    negatives (``where``: how the size is known, for the message). No exact bound exists: every mode draws with
    replacement (``gemray.model.heads``: "uniform" and "uniform_shared" ``torch.randint`` over 1..num_items,
    "in_batch" over the batch's targets), so any count is valid, and num_negatives = num_items is allowed. But
    draws beyond the catalogue's size only repeat items while the per-batch cost grows with them ("uniform":
    [positions, num_negatives] ids, embeddings and logits: 100000 on a catalogue of 5,605 items asked for 34 GB
    inside the Ray worker), so more negatives than items is refused as a mistake. Raises ValueError naming
    model.num_negatives, the value and the catalogue's size."""
    R = int(cfg.model.num_negatives)
    if "retrieval" in cfg.model.tasks and R > n_items:
        raise ValueError(f"model.num_negatives={R}: more negatives than the {n_items} items of the catalogue{where}; "
                         "they are drawn with replacement, so draws beyond the catalogue only repeat items while "
                         "the memory of every batch grows with them (a [positions x num_negatives] block): use at "
                         f"most {n_items}")


def preflight_catalogue(cfg: JobConfig) -> None:
    """Before the data is prepared: the cut-offs and ``model.num_negatives`` (:func:`check_negatives`) against a
    synthetic config's catalogue, whose size (``data.synthetic``'s ``items``) is known without generating the
    data, which at scale takes minutes (:func:`preflight_data` checks every config against the prepared manifest
    after). Raises ValueError for a cut-off at or above it, more negatives than it, or for ``data.synthetic``
    parameters the generator refuses."""
    if not cfg.data.synthetic:
        return
    from gemray.pipelines.synthetic import spec_from_params

    items = spec_from_params(cfg.data.synthetic_params()).items
    check_cutoffs(cfg.train.eval_ks, items, " (data.synthetic: items)")
    check_negatives(cfg, items, " (data.synthetic: items)")


def check_split_users(manifest: dict[str, Any], prepared_dir: str | Path) -> None:
    """Pure: refuse prepared data (``manifest``, of ``prepared_dir``) with no user in the leave-one-out splits, i.e.
    every user shorter than ``splits.min_history`` (3) interactions: no training sequence and no test user, so a
    run trained 0 steps, saved a checkpoint and exited 0 with hr@K 0.0 over ``num_test_users`` 0 (a new user's
    finding). A manifest without ``splits`` passes. Raises ValueError naming data.prepared_dir, why and what to do
    (``gemray.pipelines.schema.no_split_users_message``)."""
    from gemray.pipelines.schema import MIN_HISTORY_FOR_SPLITS, no_split_users_message

    splits = manifest.get("splits")
    why = no_split_users_message(splits) if splits else None
    if why:
        need = int(splits.get("min_history", MIN_HISTORY_FOR_SPLITS))
        raise ValueError(f"data.prepared_dir {prepared_dir} has no training or test users: {why}; training would "
                         f"run 0 steps and test on 0 users: give each user at least {need} interactions in the "
                         "source and prepare it again (gemray prepare, or a new data.prepared_dir)")


def check_feature_names(manifest: dict[str, Any], prepared_dir: str | Path) -> None:
    """Pure: refuse prepared data whose declared features (manifest ``features``: name -> {"level", ...}) the model
    cannot read (``gemray.pipelines.schema.feature_column``'s rule: lowercase letters, digits and _, starting with a
    letter). ``gemray prepare interactions`` took any letters until 2026-12-07, and such a folder failed a minute
    into training, in the workers (a new user's finding). Raises ValueError naming data.prepared_dir, the feature
    and what to do."""
    from gemray.pipelines.schema import feature_column

    for name, spec in (manifest.get("features") or {}).items():
        try:
            feature_column(name, (spec or {}).get("level", "token"))
        except ValueError as e:
            raise ValueError(f"data.prepared_dir {prepared_dir}: {e}; rename that column in the source and prepare "
                             "it again (gemray prepare interactions --feature-cols ...)") from None


def preflight_data(cfg: JobConfig, manifest: dict[str, Any], *, previous: JobConfig | None = None) -> None:
    """Refuse a job its data or output folder cannot serve: a cut-off K at or above the size of the catalogue of ``manifest``
    (the prepared data's), more ``model.num_negatives`` than its items (:func:`check_negatives`), prepared data made from other raw files than ``data.raw_dir`` holds, prepared data with
    no user in the splits (:func:`check_split_users`) or a feature the model cannot read
    (:func:`check_feature_names`), an output folder holding a model of another shape
    (``previous``: the config.toml of an earlier run there that left checkpoints). Raises ValueError naming the
    field."""
    n_items = int(manifest["vocab"]["num_items"])
    check_cutoffs(cfg.train.eval_ks, n_items)
    _check_source(cfg, manifest)
    check_split_users(manifest, cfg.data.prepared_dir)  # after the source check: stale data is refused as such
    check_feature_names(manifest, cfg.data.prepared_dir)
    check_negatives(cfg, n_items)  # after it: data with no users is the first thing to fix
    if previous is not None:
        changed = shape_changes(previous, cfg)
        if changed:
            raise ValueError("the output folder holds checkpoints of a model of another shape ("
                             + ", ".join(changed) + "); use a new --output (re-running the same command "
                             "resumes; a different model needs its own folder)")


def _check_source(cfg: JobConfig, manifest: dict[str, Any]) -> None:
    """The prepared data must come from the raw files in ``data.raw_dir`` when that folder exists -- for MovieLens
    data only, the one kind ``gemray train`` prepares from ``data.raw_dir`` itself: data of ``gemray prepare
    interactions`` / ``synthetic`` (manifest ``format`` another than a MovieLens release) is never re-made from it,
    so its raw source may be anywhere, or nowhere (the k8s layout ships prepared data alone; such a folder with an
    empty raw/ beside it was refused with advice to let training prepare it, which it cannot)."""
    from gemray.pipelines.movielens import FORMATS

    made_as = manifest.get("format")  # (not the name of the loop variables below)
    if made_as is not None and made_as not in FORMATS:
        return
    raw = Path(cfg.data.raw_dir)
    src = manifest.get("source", {})
    if not raw.is_dir() or Path(src.get("dir", "")).resolve() == raw.resolve():
        return
    for f in src.get("files", []):
        p = raw / f["name"]
        if not p.is_file():  # say what the folder holds instead (an ML-1M folder for data prepared from ML-100K)
            names = [release.filename for release in FORMATS.values()]
            held = [n for n in names if (raw / n).is_file()]
            holds = (" and ".join(held) if held
                     else f"no MovieLens ratings file: {', '.join(names[:-1])} or {names[-1]}")
            raise ValueError(f"data.prepared_dir {cfg.data.prepared_dir} was prepared from {src.get('dir')}'s "
                             f"{f['name']}, which data.raw_dir {raw} does not hold (it holds {holds}): point "
                             "data.prepared_dir at a new folder (it is prepared there) or set data.raw_dir to the "
                             "source it was made from")
        if p.stat().st_size != f["bytes"] or file_sha256(p) != f["sha256"]:
            raise ValueError(f"data.prepared_dir {cfg.data.prepared_dir} was prepared from {src.get('dir')}, whose "
                             f"{f['name']} is not the one in data.raw_dir {raw}: point data.prepared_dir at a new "
                             "folder (it is prepared there) or set data.raw_dir to the source it was made from")


def resume_mismatch(saved: dict[str, Any], now: dict[str, Any], prepared_dir: str) -> tuple[str, str] | None:
    """Pure: why a checkpoint may not resume on the prepared data, as ``(what differs, why not)``, or None.

    saved: :func:`gemray.checkpoint.checkpoint_data` of the checkpoint (its data record and item table rows);
    now: :func:`gemray.checkpoint.data_record` of the prepared data in ``prepared_dir``. The item table's
    rows must be the catalogue's num_items + 1 (else the checkpoint cannot load), and a recorded fingerprint
    must be the data's (else its item rows mean other items). A checkpoint without a record passes on its
    table rows alone."""
    rec = saved["record"]
    rows = saved["item_table_rows"] or (rec or {}).get("item_table_rows")
    if rows is not None and rows != now["item_table_rows"]:
        return (f"its item embedding table has {rows} rows ({rows - 1} items), the data in data.prepared_dir "
                f"{prepared_dir} has {now['num_items']} items ({now['item_table_rows']} rows)",
                "it cannot be loaded into a model for this data")
    if rec is not None and rec.get("fingerprint") != now["fingerprint"]:
        return (f"same number of items ({now['num_items']}) but other data (fingerprint {rec.get('fingerprint')}"
                f" -> {now['fingerprint']}: " + "; ".join(_data_diff(rec, now)) + ")",
                "resuming would go on training its item rows on ids that mean other items")
    return None


def _data_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two data records, in words (format, source files, counts, folder)."""
    out = []
    if old.get("format") != new.get("format"):
        out.append(f"format {old.get('format')} -> {new.get('format')}")
    a, b = dict(map(tuple, old.get("source_files", []))), dict(map(tuple, new.get("source_files", [])))
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(f"{name} (sha256 {str(a[name])[:12]}..) no longer a source file")
        elif name not in a:
            out.append(f"{name} (sha256 {str(b[name])[:12]}..) a new source file")
        elif a[name] != b[name]:
            out.append(f"{name} sha256 {str(a[name])[:12]}.. -> {str(b[name])[:12]}..")
    for k in ("users", "items", "interactions"):
        x, y = (old.get("counts") or {}).get(k), (new.get("counts") or {}).get(k)
        if x != y:
            out.append(f"{k} {x} -> {y}")
    if old.get("params_sha256") != new.get("params_sha256"):
        a_p, b_p = (f"{p[:12]}.." if p else "none (not generated)" for p in (old.get("params_sha256"),
                                                                           new.get("params_sha256")))
        out.append(f"generator parameters (params_sha256) {a_p} -> {b_p}")
    return out or ["source files and counts recorded differently"]


def preflight_resume(cfg: JobConfig, manifest: dict[str, Any], run_dir: str | Path, *, output_dir: str | Path,
                     previous: JobConfig | None = None) -> Path | None:
    """Refuse, before Ray starts, to resume a checkpoint that was trained on other data.

    run_dir: the Ray Train run folder a resume restores from (``<storage>/<name>``); its newest committed
    checkpoint (what Ray Train hands back) is compared with the prepared data ``manifest``
    (:func:`resume_mismatch`). Otherwise Ray Train would start the workers, fail to load the checkpoint
    ("size mismatch for ... item.weight") and retry ``ray.max_failures`` times, or train on with item ids that
    mean other movies. A checkpoint written before gemray recorded its data (no record) resumes when its table
    rows match, with a warning. previous: the output folder's config.toml (names the old data when the
    checkpoint has no record). Returns the checkpoint a resume will start from (None: fresh run). Raises
    ValueError naming the output folder, the checkpoint, what differs and how to go on.
    """
    latest = next(iter(committed_checkpoints(run_dir)), None)
    if latest is None:
        return None
    saved = checkpoint_data(latest)
    now = data_record(manifest, item_table_rows=cfg.model.table_rows_map().get("item"))
    rec = saved["record"]
    mismatch = resume_mismatch(saved, now, cfg.data.prepared_dir)
    if mismatch is None:
        if rec is None:
            log.warning("checkpoint %s records no data fingerprint (written before gemray recorded one): its item "
                        "table matches the %d items of %s, but whether it was trained on this data cannot be "
                        "checked; resuming it", latest, now["num_items"], cfg.data.prepared_dir)
        return latest
    raise _other_data(latest, *mismatch, rec, run_dir, output_dir=output_dir, previous=previous)


def preflight_resume_source(cfg: JobConfig, run_dir: str | Path, *, output_dir: str | Path,
                            previous: JobConfig | None = None) -> None:
    """Refuse, before ``data.raw_dir`` is prepared into ``data.prepared_dir``, to resume a checkpoint trained on
    another raw ratings file: :func:`preflight_resume` can only compare once the data is prepared (it needs the
    prepared counts), and preparing a large release just to be refused wastes minutes. Checks only what tells
    without preparing: the MovieLens format and the sha256 of the ratings file in ``data.raw_dir`` against the
    newest committed checkpoint's data record. Either differing makes that record's fingerprint differ from the
    prepared data's, so :func:`preflight_resume` would refuse it anyway; the same file goes on to be prepared and
    checked in full. Does nothing when no preparation is due (``data.prepared_dir`` has a manifest), for
    synthetic data, without a committed checkpoint or its record, or when ``data.raw_dir`` holds no single
    ratings file (the preparation step reports that). Raises ValueError worded as :func:`preflight_resume`."""
    from gemray.pipelines.movielens import detect_format, raw_folder_error
    from gemray.pipelines.schema import MANIFEST_FILE

    prepared = Path(cfg.data.prepared_dir)
    if cfg.data.synthetic or (prepared / MANIFEST_FILE).exists() or raw_folder_error(prepared, ""):
        return  # nothing to prepare, or a raw folder as data.prepared_dir (refused as such when it is loaded)
    latest = next(iter(committed_checkpoints(run_dir)), None)
    rec = checkpoint_data(latest)["record"] if latest is not None else None
    if not rec or not rec.get("source_files"):
        return
    try:
        fmt, ratings = detect_format(cfg.data.raw_dir)
    except (FileNotFoundError, ValueError):
        return
    now = {**rec, "format": fmt.name, "source_files": [[ratings.name, file_sha256(ratings)]]}
    if now["format"] == rec.get("format") and now["source_files"] == sorted(map(list, rec["source_files"])):
        return
    differs = (f"data.raw_dir {cfg.data.raw_dir} is other data (" + "; ".join(_data_diff(rec, now)) + "), found "
               "before preparing it into data.prepared_dir")
    raise _other_data(latest, differs, "resuming would go on training its item rows on ids that mean other items",
                      rec, run_dir, output_dir=output_dir, previous=previous)


def _other_data(latest: Path, differs: str, why: str, rec: dict[str, Any] | None, run_dir: str | Path, *,
                output_dir: str | Path, previous: JobConfig | None) -> ValueError:
    """The error of :func:`preflight_resume` / :func:`preflight_resume_source`: the output folder, the checkpoint,
    what differs, where its data came from and how to go on."""
    out, run_dir = Path(output_dir), Path(run_dir)
    if rec is not None:
        origin = f"it was trained on {rec.get('prepared_dir')} (prepared from {rec.get('source_dir')})"
    elif previous is not None:
        origin = (f"the folder's config.toml names data.prepared_dir {previous.data.prepared_dir} (raw "
                  f"{previous.data.raw_dir})")
    else:
        origin = "it records no data path (written by an older gemray)"
    remove = out if run_dir.resolve().is_relative_to(out.resolve()) else run_dir
    return ValueError(f"output folder {out} holds checkpoint {latest} of other data: {differs}; {origin}. Not "
                      f"resuming ({why}): use a new --output (output_dir) for this data, or remove {remove} to start "
                      "over there (its checkpoints are lost); re-running with the data it was trained on resumes it")


def preflight_active(notice_path: str | Path, *, clock=time.time, sleep=time.sleep) -> None:
    """Refuse, before anything is written, to start a run in an output folder where another run is active.

    The active marker (``<notice>.active``, :func:`gemray.preemption.mark_active`: pid and host, its
    modification time refreshed every ACTIVE_HEARTBEAT_S seconds by the running driver) says a run is using
    the folder; two runs there would train from the same checkpoints, interleave their events and exceed
    ``checkpoint.keep``. No marker, an unreadable one, or one that has gone ACTIVE_STALE_S seconds without a
    heartbeat: go ahead. A fresh one written on this host: refused if its pid is alive, else (its driver was
    killed outright) go ahead. A fresh one from another host (e.g. a RayJob's previous driver pod): watched
    until it is refreshed (refused) or goes stale (go ahead), at most ACTIVE_STALE_S seconds. ``clock`` /
    ``sleep``: time sources. Raises FileExistsError naming the marker, the pid and host, and what to do."""
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
