"""A trained model back in one process: find the checkpoint, read its config, load the weights.

``gemray evaluate`` / ``recommend`` / ``export`` all start here (:func:`load_trained`):

1. :func:`locate_checkpoint` turns what the user names into a committed checkpoint folder and the run's
   config: a run's output folder (``config.toml``, ``metrics.json``, ``ray/<name>/checkpoint_*``: the newest
   committed checkpoint that verifies, as a restarted training picks it: ``committed_checkpoints`` +
   ``choose_checkpoint``), a Ray Train run folder (``ray/<name>``) or one ``checkpoint_*`` folder.
   :func:`find_config` finds the config alone, without reading any checkpoint (:func:`run_config`: what
   ``recommend`` / ``export`` check before loading a model they cannot serve).
2. The model is built as training builds it (``GEM`` on the meta device, ``gemray.parallel.parallelize`` on a
   one-process group: TorchRec shards every table onto this one rank) and the checkpoint's model weights are
   DCP-loaded into it (``gemray.checkpoint.load_model_state``: verified against its manifests, resharded
   from the world size it was saved by, no optimizer state needed).

No Ray cluster is started: the process group is a single-rank one over an in-memory store
(``torch.distributed.HashStore``; gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gemray.checkpoint import (MANIFEST_GLOB, checkpoint_data, choose_checkpoint, committed_checkpoints,
                               load_model_state)
from gemray.config import JobConfig, apply_overrides, load_config, shape_changes

log = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"


def _is_checkpoint(path: Path) -> bool:
    return path.is_dir() and any(path.glob(MANIFEST_GLOB))


def find_config(path: str | Path, config: str | Path | None = None) -> Path:
    """The run's config file for ``--checkpoint path``, found without reading any checkpoint: ``config`` when
    given; else ``config.toml`` in a ``gemray train`` output folder, two levels above a Ray Train run folder
    (``<out>/ray/<name>``) or three above a checkpoint folder (``<out>/ray/<name>/checkpoint_*``).

    Raises FileNotFoundError when ``path`` does not exist or no config file is there (give ``--config``); the
    message says which folder it looked in: ``path`` itself for a folder that is neither a checkpoint nor a Ray
    Train run folder ("not a gemray run folder"), else the output folder above it."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise FileNotFoundError(f"--checkpoint {path}: no such folder")
    if not p.is_dir():
        raise FileNotFoundError(f"--checkpoint {path} is a file, not a folder: give a `gemray train --output` folder, "
                                "its ray/<name> run or a checkpoint_* folder")
    if config is not None:
        return Path(config).expanduser().resolve()  # load_config names it if it is missing
    up = 3 if _is_checkpoint(p) else 0 if (p / CONFIG_FILE).is_file() else 2
    found = [p, *p.parents][up] / CONFIG_FILE if len(p.parents) >= up else None
    if found is not None and found.is_file():
        return found
    if up == 3:
        what = "checkpoint folder (<output>/ray/<name>/checkpoint_*)"
    elif _is_ray_run(p):
        what = "Ray Train run folder (<output>/ray/<name>)"
    else:
        raise FileNotFoundError(f"--checkpoint {path} is not a gemray run folder: no {CONFIG_FILE} in it "
                                "(or pass --config)")
    whose = (f"its `gemray train --output` folder, {found.parent}, holds no {CONFIG_FILE}" if found is not None
             else f"it has no `gemray train --output` folder {up} levels above it")
    raise FileNotFoundError(f"--checkpoint {path} is a {what}, but {whose} (pass the training config with --config)")


def _is_ray_run(path: Path) -> bool:
    """Whether ``path`` looks like a Ray Train run folder (``<output>/ray/<name>``): Ray's record of the run's
    checkpoints, or a checkpoint_* folder in it."""
    return path.is_dir() and ((path / "checkpoint_manager_snapshot.json").is_file()
                              or any(c.is_dir() for c in path.glob("checkpoint_*")))


def run_config(checkpoint: str | Path, *, config: str | Path | None = None,
               overrides: list[str] | None = None) -> JobConfig:
    """The run's config (:func:`find_config`) with ``overrides`` applied, read without touching the checkpoint:
    what ``gemray recommend`` / ``export`` check before loading a model they cannot serve."""
    return apply_overrides(load_config(find_config(checkpoint, config)), list(overrides or []))


def locate_checkpoint(path: str | Path, config: str | Path | None = None) -> tuple[Path, Path]:
    """``(checkpoint folder, config file)`` for a run folder, a Ray Train run folder or a checkpoint folder.

    Output folder of ``gemray train`` (holds ``config.toml``, or a ``ray`` folder when ``config`` is given): its
    Ray Train run is ``ray.storage_path`` (or ``<folder>/ray``) ``/<name>``. Ray Train run folder: its
    ``config.toml`` two levels up. Checkpoint folder (``manifest_rank*.json``): taken as is; its ``config.toml``
    three levels up (``<out>/ray/<name>/ckpt``). ``config``: use this file instead of the one found (:func:`find_config`). Among a run's committed
    checkpoints the newest one that verifies is chosen (a corrupt one is skipped with a warning, as a restarted
    training does).

    Raises FileNotFoundError when ``path`` does not exist, no config is found (give ``--config``) or it holds no
    committed checkpoint; ValueError when no committed checkpoint verifies.
    """
    p = Path(path).expanduser().resolve()
    cfg_file = find_config(path, config)
    if _is_checkpoint(p):
        return p, cfg_file
    # an output folder: its config.toml, or (copied without it) the --config given and the Ray run inside it
    if (p / CONFIG_FILE).is_file() or (config is not None and (p / "ray").is_dir()):
        cfg = load_config(cfg_file)
        storage = Path(cfg.ray.storage_path).expanduser().resolve() if cfg.ray.storage_path else p / "ray"
        run_dir = storage / cfg.name
    else:
        run_dir = p
    candidates = committed_checkpoints(run_dir)
    if not candidates:
        raise FileNotFoundError(f"--checkpoint {path}: no committed checkpoint in {run_dir} (give a "
                                "`gemray train --output` folder, its ray/<name> run or a checkpoint_* folder)")
    ckpt, skipped = choose_checkpoint(candidates)
    if ckpt is not None:  # (none verifies: the error below names each one and why, once)
        for c, why in skipped:
            log.warning("checkpoint %s is unusable (%s); taking the previous committed one", c, why)
    if ckpt is None:
        raise ValueError(f"--checkpoint {path}: no committed checkpoint of {run_dir} verifies: "
                         + "; ".join(f"{c.name}: {w}" for c, w in skipped))
    return ckpt, cfg_file


def init_single_process_group(device: torch.device) -> None:
    """A one-rank default process group (gloo on CPU, NCCL on CUDA) over an in-memory store, unless one is
    initialised already. Raises ValueError when an initialised group has more than one rank."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(f"gemray.serve runs in one process; the process group has {dist.get_world_size()} "
                             "ranks")
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@dataclass
class TrainedModel:
    """A checkpoint loaded for inference.

    model: the ``GEM`` (``dmp.module``, eval mode) whose ``user_embeddings`` / ``item_embeddings`` the
    evaluators call; dmp: its ``DistributedModelParallel`` (one rank); cfg: the run's config (overrides
    applied); checkpoint: the folder loaded; num_items: N (item table rows N+1); device; state: the trainer
    dict saved with it (``epoch``, ``global_step``, ``world_size``, ``history``); data: the checkpoint's
    record of the prepared data it was trained on (``gemray.checkpoint.data_record``; None for old ones);
    config_file: the config.toml it was read from (in a run's output folder).
    """

    model: Any
    dmp: Any
    cfg: JobConfig
    checkpoint: Path
    num_items: int
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    config_file: Path | None = None


def check_device(device: str | None) -> None:
    """Refuse a ``--device`` this process cannot use, before anything is loaded: not a CPU / CUDA device string,
    CUDA where ``torch.cuda.is_available()`` is False (the load ended in a traceback from the NCCL process group),
    or a ``cuda:N`` beyond the visible devices. None (the default) passes. Raises ValueError naming --device."""
    if not device:
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu (or leave "
                             "--device out)")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")


def pick_device(cfg: JobConfig, device: str | None = None) -> torch.device:
    """``device`` when given ("cpu", "cuda", "cuda:1"; :func:`check_device` refuses one not usable here), else
    CUDA when the run trained on GPUs (``ray.use_gpu``) and one is visible, else CPU: the same device as training
    reproduces its figures."""
    if device:
        check_device(device)
        return torch.device(device)
    return torch.device("cuda") if cfg.ray.use_gpu and torch.cuda.is_available() else torch.device("cpu")


def _model_data(cfg: JobConfig) -> dict[str, Any]:
    """GEM's data-given arguments (side-feature cardinalities, users, candidate item tables) from the run's
    prepared folder, as the Trainer builds them (``gemray.train.model_data_args``); {} for the ML-1M family."""
    from gemray.train import model_data_args

    m = cfg.model
    if not (m.token_features or m.candidate_features or m.context_features):
        return {}
    from gemray.pipelines.movielens import load_manifest

    return model_data_args(cfg, load_manifest(cfg.data.prepared_dir))


def load_trained(checkpoint: str | Path, *, config: str | Path | None = None, overrides: list[str] | None = None,
                 device: str | None = None, data_manifest: dict[str, Any] | None = None) -> TrainedModel:
    """Load a ``gemray train`` checkpoint into one process (see the module docstring).

    checkpoint / config: as :func:`locate_checkpoint`; overrides: ``section.key=value`` applied to the run's
    config (e.g. ``model.attention_backend=reference``); one that changes the model's shape (``shape_changes``)
    raises ValueError before anything is loaded.
    data_manifest: the manifest (:func:`prepared_manifest`) of the prepared folder the model is to be used on
    (``gemray evaluate`` / ``recommend --data``); its item count is checked against the checkpoint's record
    before the model's code is imported (TorchRec: seconds), the model built or any weight read
    (:func:`check_item_count`), its side features and user ids once the run's own data-given sizes are known
    (:func:`check_feature_sizes`).
    Raises FileNotFoundError / ValueError as :func:`locate_checkpoint`, ValueError for a corrupt checkpoint, one
    whose tables do not fit the config's model or one whose item count is not ``data_manifest``'s.
    """
    ckpt, cfg_file = locate_checkpoint(checkpoint, config)
    run_cfg = load_config(cfg_file)
    cfg = apply_overrides(copy.deepcopy(run_cfg), list(overrides or []))
    changed = shape_changes(run_cfg, cfg)
    if changed:  # the checkpoint restores only into the run's shape (a missing block's weights would stay random)
        raise ValueError(f"--set changes the shape of the model the checkpoint holds ({', '.join(changed)}); the "
                         f"checkpoint {ckpt} is used as it was trained: leave the model's shape settings out of --set")
    # the optimizer is never used here; "auto" keeps a CUDA-trained run (FBGEMM Adam) loadable on CPU
    cfg.train.sparse_optimizer = "auto"
    info = checkpoint_data(ckpt)
    record = info["record"]
    if record is not None:
        num_items = int(record["num_items"])
    elif info["item_table_rows"]:
        num_items = int(info["item_table_rows"]) - 1
    else:
        raise ValueError(f"checkpoint {ckpt}: neither a data record nor an item table in its DCP metadata")
    if data_manifest is not None:  # from the manifests, before the model code (TorchRec) is even imported
        check_item_count(data_manifest["prepared_dir"], data_manifest, ckpt, num_items, record)
    run_data = _model_data(cfg)
    if data_manifest is not None:  # before the model is built and the weights read
        check_feature_sizes(data_manifest["prepared_dir"], data_manifest, cfg, run_data, ckpt)
    from gemray.model.gem import GEM
    from gemray.parallel import parallelize, plan_layout

    dev = pick_device(cfg, device)
    init_single_process_group(dev)
    model = GEM(cfg.model, num_items, "meta", max_seq_len=cfg.data.max_seq_len, **run_data)
    dmp = parallelize(model, layout=plan_layout(1, dev.type), cfg=cfg, device=dev)
    state = load_model_state(ckpt, dmp)
    dmp.eval()
    log.info("loaded %s (epoch %s, global step %s, saved by %s ranks) on %s", ckpt, state.get("epoch"),
             state.get("global_step"), state.get("world_size"), dev)
    return TrainedModel(model=dmp.module, dmp=dmp, cfg=cfg, checkpoint=ckpt, num_items=num_items, device=dev,
                        state=state, data=record, config_file=cfg_file)


def prepared_manifest(prepared_dir: str | Path, option: str = "--data") -> dict[str, Any]:
    """The manifest of the prepared folder ``prepared_dir`` (the value of ``option``), read without any model:
    ``gemray evaluate`` / ``recommend`` check their ``--data`` with it before the checkpoint is loaded. A folder
    of raw MovieLens ratings (ratings.dat, u.data or ratings.csv and no manifest.json) raises FileNotFoundError
    giving the ``gemray prepare movielens`` command that prepares it into a folder of its own
    (:func:`gemray.pipelines.movielens.raw_folder_error`, which ``gemray train`` uses for data.prepared_dir); any
    other unprepared folder raises as ``load_manifest`` does (FileNotFoundError / ValueError naming it)."""
    from gemray.pipelines.movielens import load_manifest, raw_folder_error

    why = raw_folder_error(prepared_dir, option)
    if why:
        raise FileNotFoundError(why)
    return load_manifest(Path(prepared_dir).expanduser())


def check_item_count(prepared_dir: str | Path, manifest: dict[str, Any], checkpoint: str | Path, num_items: int,
                     trained_on: dict[str, Any] | None = None) -> None:
    """Pure: refuse the prepared folder ``prepared_dir`` (its ``manifest``) for a checkpoint whose item table is
    for ``num_items`` items when the data has another item count: its item ids would not mean the checkpoint's
    items. ``trained_on``: the checkpoint's record of its data (``gemray.checkpoint.data_record``; None for old
    checkpoints), whose folder the message names. Raises ValueError naming both counts and both folders."""
    from gemray.checkpoint import data_record

    n = data_record(manifest)["num_items"]
    if n != num_items:
        raise ValueError(f"--data {prepared_dir}: {n} items, but the checkpoint {checkpoint} has an item table for "
                         f"{num_items} (trained on {(trained_on or {}).get('prepared_dir', 'unknown data')}): item "
                         "ids would not match; use data prepared with the same item vocabulary")


def check_feature_sizes(prepared_dir: str | Path, manifest: dict[str, Any], cfg: JobConfig,
                        run_data: dict[str, Any], checkpoint: str | Path) -> None:
    """Refuse the prepared folder ``prepared_dir`` (its ``manifest``) for a model of ``cfg`` built from
    ``run_data`` (its data-given sizes, :func:`_model_data` of the run's own prepared folder) when the folder's
    side features or user ids do not fit the model's tables: a feature the model reads with a larger cardinality
    there, or more users with ``user_id`` as a context feature. FBGEMM would map such ids to row 0 with a warning
    and the metrics would be of another input (a new user evaluated the same item count with other feature
    cardinalities: exit 0, wrong figures). Models without side features ({} run_data) pass. Raises ValueError
    naming each entry, its two sizes and both folders."""
    if not run_data:
        return
    m = cfg.model
    used = set(m.token_features) | set(m.candidate_features) | {c for c in m.context_features
                                                                   if c != m.USER_ID_FEATURE}
    have = run_data.get("cardinalities", {})
    want = {k: int(v["cardinality"]) for k, v in (manifest.get("features") or {}).items()}
    bad = [f"feature {f!r}: " + (f"cardinality {want[f]} > {have[f]}" if f in want else "not in the data")
           for f in sorted(used) if f in have and (f not in want or want[f] > have[f])]
    if "num_users" in run_data:
        users = int(manifest.get("vocab", {}).get("max_user_id", manifest["counts"]["users"]))
        if users > run_data["num_users"]:
            bad.append(f"user ids up to {users} > {run_data['num_users']}")
    if bad:
        raise ValueError(f"--data {prepared_dir}: its ids do not fit the tables of the checkpoint {checkpoint} "
                         f"(trained on {cfg.data.prepared_dir}): {'; '.join(bad)}; use data prepared with the "
                         "run's feature vocabularies")


def check_data(trained: TrainedModel, prepared_dir: str | Path, manifest: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """The manifest of ``prepared_dir`` after checking that it fits the model: the same item count as the
    checkpoint's item table (else ValueError naming both: :func:`check_item_count`). Another fingerprint with the
    same count (a re-prepared or newer version of the data) is allowed with a warning: item ids are taken to mean
    the same items. ``manifest``: that folder's manifest when the caller has read it already (``gemray evaluate``
    reads it before loading the model); else it is read here. Raises FileNotFoundError when the folder is not
    prepared (:func:`prepared_manifest`)."""
    from gemray.checkpoint import data_record

    if manifest is None:
        manifest = prepared_manifest(prepared_dir)
    check_item_count(prepared_dir, manifest, trained.checkpoint, trained.num_items, trained.data)
    check_feature_sizes(prepared_dir, manifest, trained.cfg, _model_data(trained.cfg), trained.checkpoint)
    rec = data_record(manifest)
    if trained.data is not None and rec["fingerprint"] != trained.data.get("fingerprint"):
        log.warning("--data %s is another dataset version than the checkpoint was trained on (%s): same item "
                    "count (%d), item ids taken to mean the same items", prepared_dir,
                    trained.data.get("prepared_dir"), rec["num_items"])
    return manifest
