"""Checkpoints: torch.distributed.checkpoint (DCP) through Ray Train V2, verified on load.

Layout of one committed checkpoint (Ray Train V2 merges every rank's reported directory into one)::

    checkpoint_<timestamp>/
        .metadata              DCP global metadata (written by rank 0, the DCP coordinator)
        __<r>_<i>_0.distcp     rank r's i-th write item (one tensor shard -- a TorchRec ShardedTensor's local
                               shard, a deduplicated dense tensor, an optimizer state -- or one pickled object)
        manifest_rank<r>.json  {"rank", "world_size", "files": {name: sha256}, "data": {...}} of what rank r
                               wrote; "data" (:func:`data_record`) names the prepared data it was trained on

State saved: ``{"model": dmp.state_dict(), "optimizer": combined.state_dict(), "trainer": {"json":
<epoch, step, global_step, world_size, history as JSON>, "rng_rank<r>": torch RNG state}}``. ``epoch`` counts completed
epochs, so a restart continues at ``epoch``. The per-rank RNG state is keyed by rank (DCP deduplicates
same-named entries); it is restored only when the rank existed in the saved run.

Data: a checkpoint only loads into a model built for the same catalogue (the item table has num_items + 1
rows), and its item ids only mean the same movies on the same prepared data. ``fit`` checks both before Ray
starts (:func:`checkpoint_data` reads the record and the DCP metadata's table rows; see
``gemray.controller.preflight.preflight_resume``). Checkpoints written before the record existed still carry
the table rows in their DCP metadata.

World size: DCP reshards on load (row-wise TorchRec ShardedTensors are read back by offset), so a
checkpoint saved by N ranks loads on M ranks as long as the new sharding plan is also row-/table-/
column-wise (see pytorch/torchrec#2534 for the DTensor/ShardedTensor caveats). Tested in
tests/test_checkpoint.py: same world size (exact parameters and optimizer state) and 2 -> 1 (the
row-wise tables and row-wise optimizer state come back as the concatenation of the two ranks' rows).

Host memory: a save stages one write item in host memory at a time (:class:`_OneItemWriter`), so its host
peak is about the largest tensor shard of a rank, not the rank's whole state; ``save_checkpoint`` measures it
(seconds, bytes, current and peak RSS) and logs it. Checkpoints written before (one ``__<r>_0.distcp`` per
rank) load as before: DCP's ``.metadata`` records which file and offset holds each item.

Follows torch.distributed.checkpoint docs ("Getting started with DCP") and Ray Train's
"distributed checkpointing" guide (every rank reports its own directory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MANIFEST_GLOB = "manifest_rank*.json"


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in chunks by ``hashlib.file_digest``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_state(model: torch.nn.Module, optimizer: Any, trainer: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The DCP state dict: ``{"model", "optimizer", "trainer"}`` (tensors are live views for loading).

    ``optimizer`` is a TorchRec ``KeyedOptimizer``/``CombinedOptimizer``; its lazy state (dense AdamW
    moments) is materialised with ``init_state()`` first so that loading has tensors to fill.
    """
    if hasattr(optimizer, "init_state") and not _state_initialised(optimizer):
        optimizer.init_state()  # a zero-gradient step; parameters are overwritten by the load anyway
        optimizer.zero_grad(set_to_none=True)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "trainer": dict(trainer or {})}


def _state_initialised(optimizer: Any) -> bool:
    """True when every parameter key of a KeyedOptimizer has optimizer state."""
    st = optimizer.state_dict().get("state", {})
    return set(st) == set(getattr(optimizer, "params", st)) and all(len(v) > 0 for v in st.values())


def _rss_bytes() -> int | None:
    """This process's current resident set size (``/proc/self/statm``, Linux), None where unreadable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: ``VmHWM`` of ``/proc/self/status`` (Linux: the high-water mark
    of this process's own address space), else ``getrusage``'s ``ru_maxrss`` (KiB on Linux). Not ``ru_maxrss`` first:
    Linux carries the parent's high-water mark into a child started by vfork + exec (Python's subprocess), so a
    process spawned by a large one reported the parent's peak as its own (a 1.5 GB parent's child: ru_maxrss 1.5 GB,
    VmHWM 13 MB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class _RssSampler:
    """Samples :func:`_rss_bytes` every ``interval_s`` in a daemon thread: ``peak`` is the highest RSS seen
    while it ran (a save's own host peak, which the high-water mark cannot show once training peaked higher)."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gemray-ckpt-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        rss = _rss_bytes()
        if rss is not None and (self.peak is None or rss > self.peak):
            self.peak = rss

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


_WRITER_CLASS: type | None = None


def _one_item_writer_class() -> type:
    """:class:`_OneItemWriter`, defined on first use (``torch.distributed.checkpoint`` is imported lazily)."""
    global _WRITER_CLASS
    if _WRITER_CLASS is None:
        import dataclasses

        import torch.distributed.checkpoint as dcp
        from torch.futures import Future

        class _OneItemWriter(dcp.FileSystemWriter):
            """DCP's ``FileSystemWriter`` that writes one file per write item and stages one item at a time.

            Why (torch/distributed/checkpoint/filesystem.py as of torch 2.13; the loader choice, one-file-per-rank
            buckets and ``single_file_per_rank=False`` file-per-item are the same in older releases): the default writer
            (``single_file_per_rank=True, thread_count=1``) puts all of a rank's items into one file, and
            ``_write_files_from_queue`` keeps every staged CPU tensor of a file in ``tensor_dict`` until the
            file is closed (it needs them only for the SAFETENSORS format) -- on a GPU the whole rank state in
            host memory at once. On a GPU with ``thread_count == 1`` it also stages through
            ``_OverlappingCpuLoader``: ``tensor.to("cpu", non_blocking=True)``, pinned memory from CUDA's
            caching host allocator, which rounds each block up to a power of two and keeps freed blocks
            cached. A 26 GB GEM state took a worker on an H200 box to 114.7 GB and Ray's memory monitor
            killed it.

            Here: ``single_file_per_rank=False`` (a file per item, so ``tensor_dict`` holds one item), and
            ``per_thread_copy_ahead=0`` with ``thread_count=1``, which makes ``_write_files_from_queue``
            choose ``_SerialCpuLoader`` (its test is ``thread_count == 1 and <accelerator available> and
            inflight_threshhold > 0`` for the overlapping loader): a plain synchronous ``tensor.cpu()``,
            pageable memory that goes back to the allocator when the item's file is closed. One thread, not
            ``thread_count >= 2`` (which also selects the serial loader): each thread stages its own item, so
            N threads hold N items, e.g. the item table and its optimizer state together. Last,
            :meth:`write_data` hands the items to torch one per call: within one call
            ``_write_files_from_queue``'s loop variable ``tensor`` still holds the previous file's staged
            tensor while the next one is copied (two items at a time); a call per item ends that frame.
            ``sync_files=True`` as before: every file is fsynced before ``.metadata`` is written.

            Files: ``__<rank>_<i>_0.distcp`` (torch's prefix ``__<rank>_`` plus the item's index). The
            reader takes file names and offsets from ``.metadata``, so old single-file checkpoints still load.
            """

            def __init__(self, path: str | os.PathLike) -> None:
                super().__init__(path, single_file_per_rank=False, sync_files=True, thread_count=1,
                                 per_thread_copy_ahead=0)

            def write_data(self, plan, planner):  # noqa: ANN001 - DCP's SavePlan, SavePlanner
                prefix = plan.storage_data.prefix  # torch's _StoragePrefix("__<rank>_")
                results = []
                for i, item in enumerate(plan.items):
                    one = dataclasses.replace(
                        plan, items=[item],
                        storage_data=dataclasses.replace(plan.storage_data, prefix=f"{prefix}{i}_"))
                    results.extend(super().write_data(one, planner).wait())
                fut = Future()
                fut.set_result(results)
                return fut

        _WRITER_CLASS = _OneItemWriter
    return _WRITER_CLASS


def checkpoint_writer(directory: str | Path):
    """The DCP storage writer :func:`save_checkpoint` uses: see ``_OneItemWriter`` (one file per write item,
    one item staged in host memory at a time, files fsynced)."""
    return _one_item_writer_class()(str(directory))


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: Any,
                    trainer: dict[str, Any], *, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save with DCP into ``directory`` (this rank's own, fresh, local dir) and write its manifest.

    Every rank of the default process group must call this (DCP is collective). Writes
    ``manifest_rank<r>.json`` listing the sha256 of every file this rank wrote. ``trainer`` holds plain
    Python values (epoch, step, global_step, history) and must be identical on every rank: DCP
    deduplicates same-named entries and keeps rank 0's copy. This rank's RNG state is added under
    ``rng_rank<r>``. ``data``: what the model was trained on (:func:`data_record`), stored in the manifest as
    ``"data"`` so that a resume on other data can be refused before any worker starts.

    Writes through :func:`checkpoint_writer` (one item staged in host memory at a time) and logs, per rank,
    what the save took (INFO, ``gemray.checkpoint``). Returns those figures: ``{"directory", "rank", "files",
    "bytes" (this rank's files, ``.metadata`` included), "seconds" (DCP save + fsync + sha256 + manifest),
    "rss_before", "rss_after" (current RSS), "rss_peak" (highest RSS sampled every 50 ms during the save),
    "maxrss_before", "maxrss_after" (the process's high-water mark, :func:`peak_rss_bytes`)}``, bytes; an RSS figure is
    None where ``/proc/self/statm`` cannot be read.
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rank, world = _rank_world()
    plain = dict(trainer)
    plain["world_size"] = world
    try:
        text = json.dumps(plain, sort_keys=True)
    except TypeError as e:
        raise ValueError(f"save_checkpoint: trainer state must be JSON-serialisable: {e}") from None
    # Plain values travel as one JSON string (DCP would flatten lists of dicts into many keys).
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "trainer": {"json": text, f"rng_rank{rank}": torch.get_rng_state()}}
    before = {p.name for p in directory.iterdir()}
    t0, rss0, maxrss0 = time.perf_counter(), _rss_bytes(), peak_rss_bytes()
    with _RssSampler() as sampler:
        dcp.save(state, checkpoint_id=str(directory), storage_writer=checkpoint_writer(directory))
        written = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in before)
        for name in written:  # durable before the manifest that vouches for them
            _fsync(directory / name)
        manifest = {"rank": rank, "world_size": world,
                    "files": {name: file_sha256(directory / name) for name in written}}
        if data is not None:
            manifest["data"] = data
        # Atomic manifest: temp file, fsync, rename, fsync the directory. A checkpoint killed mid-write has
        # no manifest for this rank and fails verify_checkpoint.
        tmp = directory / f".manifest_rank{rank}.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync(tmp)
        os.replace(tmp, directory / f"manifest_rank{rank}.json")
        _fsync(directory)
    stats = {"directory": str(directory), "rank": rank, "files": len(written),
             "bytes": sum((directory / n).stat().st_size for n in written),
             "seconds": time.perf_counter() - t0, "rss_before": rss0, "rss_after": _rss_bytes(),
             "rss_peak": sampler.peak, "maxrss_before": maxrss0, "maxrss_after": peak_rss_bytes()}
    log.info("rank %d/%d checkpoint save: %s", rank, world, save_summary(stats))
    return stats


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f}"


def save_summary(stats: dict[str, Any]) -> str:
    """One line of :func:`save_checkpoint`'s figures, e.g. ``26.10 GB in 41.3 s (632 MB/s, 212 files); host RSS
    30.12 -> 30.15 GB, peak 43.01 GB during the save; process peak (VmHWM) 44.20 -> 44.20 GB``."""
    secs = max(float(stats["seconds"]), 1e-9)
    n = stats["bytes"]
    size = f"{_gb(n)} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"  # a small state (ML-1M's: 4 MB) reads 0.00 GB
    return (f"{size} in {stats['seconds']:.1f} s ({n / secs / 1e6:.1f} MB/s, "
            f"{stats['files']} files); host RSS {_gb(stats['rss_before'])} -> {_gb(stats['rss_after'])} GB, "
            f"peak {_gb(stats['rss_peak'])} GB during the save; process peak (VmHWM) "
            f"{_gb(stats['maxrss_before'])} -> {_gb(stats['maxrss_after'])} GB")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def data_record(manifest: dict[str, Any], *, item_table_rows: int | None = None) -> dict[str, Any]:
    """What a checkpoint records about the prepared data it was trained on, from that data's manifest.

    ``{"num_items", "item_table_rows" (num_items + 1: row 0 is padding; ``item_table_rows`` when the model's
    ``table_rows`` sizes the item table beyond the data), "fingerprint", "format", "source_files" ([[name,
    sha256]] of the raw ratings files), "counts" ({"users", "items", "interactions"}), "prepared_dir",
    "source_dir"}``, plus ``"params_sha256"`` for generated data (``gemray prepare synthetic``: the manifest's
    ``source.params_sha256``, the generator parameters). ``fingerprint`` is a short sha256 of format, source
    files, counts and (generated data) params_sha256 only: preparing the same raw file again (elsewhere, with
    another ``num_files``) gives the same fingerprint; another dataset, an edited ratings file or synthetic data
    of other parameters (same counts, other seed) gives another.
    """
    vocab, counts, src = manifest.get("vocab", {}), manifest.get("counts", {}), manifest.get("source", {})
    n = int(vocab.get("num_items", counts.get("items", 0)))
    ident = {"format": manifest.get("format"),
             "source_files": sorted([str(f.get("name")), str(f.get("sha256"))] for f in src.get("files", [])),
             "counts": {k: counts.get(k) for k in ("users", "items", "interactions")}}
    if src.get("params_sha256"):  # generated data: its parameters identify it (MovieLens fingerprints unchanged)
        ident["params_sha256"] = str(src["params_sha256"])
    fingerprint = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    rows = int(item_table_rows) if item_table_rows else n + 1
    return {"num_items": n, "item_table_rows": rows, "fingerprint": fingerprint, **ident,
            "prepared_dir": manifest.get("prepared_dir"), "source_dir": src.get("dir")}


def checkpoint_data(directory: str | Path) -> dict[str, Any]:
    """What a committed checkpoint tells about its data without loading it: ``{"record", "item_table_rows"}``.

    ``record``: the :func:`data_record` its manifests carry (None for a checkpoint written before gemray
    recorded it, or with no readable manifest); ``item_table_rows``: rows of the item embedding table in
    its DCP ``.metadata`` (None when that cannot be read). Never raises for a bad checkpoint: the workers'
    verification deals with those.
    """
    directory = Path(directory)
    record = None
    for m in sorted(directory.glob(MANIFEST_GLOB)):
        try:
            record = json.loads(m.read_text()).get("data")
        except (OSError, ValueError, AttributeError):
            continue
        if record is not None:
            break
    rows = None
    try:
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(str(directory)).read_metadata()
        for key, md in meta.state_dict_metadata.items():
            size = getattr(md, "size", None)
            if key.startswith("model.") and key.endswith(".item.weight") and size is not None and len(size) == 2:
                rows = int(size[0])
                break
    except Exception:  # noqa: BLE001 - missing or unreadable .metadata: nothing to compare
        rows = None
    return {"record": record if isinstance(record, dict) else None, "item_table_rows": rows}


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Check a committed checkpoint against its manifests; returns ``{"world_size", "files"}``.

    Raises ValueError naming the checkpoint and the offending file when: no manifest exists, the
    manifests disagree on world size or one rank's manifest is missing, a listed file is missing, or a
    file's sha256 differs from the one its rank recorded. Also requires DCP's ``.metadata``.
    """
    directory = Path(directory)
    manifests = sorted(directory.glob(MANIFEST_GLOB))
    if not manifests:
        raise ValueError(f"checkpoint {directory}: no {MANIFEST_GLOB} found (not a gemray checkpoint)")
    files: dict[str, str] = {}
    worlds = set()
    ranks = set()
    for m in manifests:
        try:
            data = json.loads(m.read_text())
            worlds.add(int(data["world_size"]))
            ranks.add(int(data["rank"]))
            entries = dict(data["files"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"checkpoint {directory}: unreadable manifest {m.name}: {e}") from None
        for name, digest in entries.items():
            files[name] = digest
    if len(worlds) != 1:
        raise ValueError(f"checkpoint {directory}: manifests disagree on world size {sorted(worlds)}")
    (world,) = worlds
    missing_ranks = sorted(set(range(world)) - ranks)
    if missing_ranks:
        raise ValueError(f"checkpoint {directory}: missing manifest for rank(s) {missing_ranks} "
                         f"of world size {world}")
    if ".metadata" not in files:
        raise ValueError(f"checkpoint {directory}: DCP .metadata not listed in any manifest")
    for name, digest in sorted(files.items()):
        p = directory / name
        if not p.is_file():
            raise ValueError(f"checkpoint {directory}: file {name} listed in a manifest is missing")
        got = file_sha256(p)
        if got != digest:
            raise ValueError(f"checkpoint {directory}: file {name} is corrupted "
                             f"(sha256 {got[:12]}.. != recorded {digest[:12]}..)")
    return {"world_size": world, "files": files}


def _tensor_dtype(v: Any) -> torch.dtype | None:
    """The dtype of a state-dict value: a plain tensor / DTensor's, a TorchRec ShardedTensor's (its global
    metadata: a rank may hold no shard), None for anything else."""
    meta = getattr(v, "metadata", None)
    if callable(meta) and hasattr(v, "local_shards"):
        return meta().tensor_properties.dtype
    return v.dtype if isinstance(v, torch.Tensor) else None


def dtype_changes(saved: Any, model_state: dict[str, Any], prefix: str = "model.") -> list[tuple[str, str, str]]:
    """Pure: ``[(key, saved dtype, model dtype)]`` for every tensor of ``model_state`` (a model's
    ``state_dict()``) that the checkpoint holds in another dtype, e.g. an embedding table saved under
    ``model.table_dtype = "fp32"`` loaded into an fp16 model. ``saved``: the checkpoint's DCP ``Metadata``
    (``FileSystemReader(...).read_metadata()``); its keys are ``prefix`` + the model's keys. Dtypes as torch
    names without "torch." ("float32"); keys the checkpoint lacks are not listed (DCP refuses those)."""
    out = []
    for key, value in model_state.items():
        md = saved.state_dict_metadata.get(prefix + key)
        props = getattr(md, "properties", None)
        have = _tensor_dtype(value)
        if props is None or have is None or props.dtype == have:
            continue
        out.append((key, str(props.dtype).removeprefix("torch."), str(have).removeprefix("torch.")))
    return out


def dtype_change_message(directory: str | Path, changes: list[tuple[str, str, str]]) -> str | None:
    """Pure: the warning for :func:`dtype_changes`' list (None when empty), naming the checkpoint, the tensors
    and both dtypes, e.g. ``checkpoint C: 3 model tensor(s) load with a cast, float32 -> float16 (rounded to
    nearest): embeddings.embeddings.item.weight, ... (an embedding table's dtype is model.table_dtype)``."""
    if not changes:
        return None
    pairs = sorted({(a, b) for _, a, b in changes})
    casts = ", ".join(f"{a} -> {b} ({'rounded to nearest' if b in ('float16', 'bfloat16') else 'exact'})"
                      for a, b in pairs)
    names = ", ".join(k for k, _, _ in changes[:4]) + (", ..." if len(changes) > 4 else "")
    return (f"checkpoint {directory}: {len(changes)} model tensor(s) load with a cast, {casts}: {names} (an "
            "embedding table's dtype is model.table_dtype; the fused optimizer's state is float32 either way)")


def _warn_dtype_changes(directory: Path, changes: list[tuple[str, str, str]]) -> None:
    """Log :func:`dtype_change_message` once (rank 0). DCP copies each saved tensor into the model's own, so a
    float32 table lands in a float16 model rounded to nearest, a float16 one in a float32 model exactly."""
    msg = dtype_change_message(directory, changes)
    if msg and _rank_world()[0] == 0:
        log.warning("%s", msg)


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: Any,
                    *, verify: bool = True) -> dict[str, Any]:
    """Verify (see :func:`verify_checkpoint`) then DCP-load into ``model``/``optimizer`` in place.

    Collective: every rank calls it. Returns the trainer dict (epoch, step, global_step, world_size,
    history). Restores this rank's RNG state if the saved run had this rank, else leaves it alone.
    Model tensors saved in another dtype (embedding tables of another ``model.table_dtype``) load with a cast --
    float32 -> float16 rounded to nearest, float16 -> float32 exact -- and a WARNING naming both dtypes
    (:func:`dtype_changes`). Raises ValueError for a corrupt checkpoint (see verify_checkpoint).
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    if verify:
        info = verify_checkpoint(directory)
    else:
        info = {"world_size": None}
    rank, world = _rank_world()
    meta = dcp.FileSystemReader(str(directory)).read_metadata()
    saved_keys = set(meta.state_dict_metadata)
    state = build_state(model, optimizer)
    _warn_dtype_changes(directory, dtype_changes(meta, state["model"]))
    # "trainer.json" is one object entry; this rank's RNG state loads in place if it was saved.
    rng_key = f"rng_rank{rank}"
    if "trainer.json" not in saved_keys:
        raise ValueError(f"checkpoint {directory}: no trainer state (trainer.json) in DCP metadata")
    template: dict[str, Any] = {"json": None}
    if f"trainer.{rng_key}" in saved_keys:
        template[rng_key] = torch.get_rng_state().clone()
    state["trainer"] = template
    dcp.load(state, checkpoint_id=str(directory))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    out = json.loads(state["trainer"]["json"])
    if rng_key in state["trainer"]:
        torch.set_rng_state(state["trainer"][rng_key])
    log.info("rank %d/%d restored checkpoint %s (saved by %s ranks, %s epoch(s) completed)", rank, world,
             directory, info["world_size"] or out.get("world_size"), out.get("epoch"))
    return out


def load_model_state(directory: str | Path, model: torch.nn.Module, *, verify: bool = True) -> dict[str, Any]:
    """Verify (:func:`verify_checkpoint`) then DCP-load only the model's weights into ``model`` in place: the
    inference path (``gemray evaluate`` / ``recommend`` / ``export``), which needs no optimizer (so a CPU
    process can read a checkpoint whose fused optimizer was CUDA's partial row-wise Adam). DCP reshards to
    this process group's world size as :func:`load_checkpoint` does.

    Collective when ``model`` is sharded. Returns the trainer dict (epoch, global_step, world_size, history).
    Tables of another ``model.table_dtype`` load with a cast and a warning, as in :func:`load_checkpoint`.
    Raises ValueError for a corrupt checkpoint or one without trainer state.
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    if verify:
        verify_checkpoint(directory)
    meta = dcp.FileSystemReader(str(directory)).read_metadata()
    if "trainer.json" not in meta.state_dict_metadata:
        raise ValueError(f"checkpoint {directory}: no trainer state (trainer.json) in DCP metadata")
    state = {"model": model.state_dict(), "trainer": {"json": None}}
    _warn_dtype_changes(directory, dtype_changes(meta, state["model"]))
    dcp.load(state, checkpoint_id=str(directory))
    model.load_state_dict(state["model"])
    return json.loads(state["trainer"]["json"])


def report_with_checkpoint(metrics: dict[str, Any], model: torch.nn.Module, optimizer: Any,
                           trainer: dict[str, Any], *, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save this rank's DCP shards to a fresh local temp dir and ``ray.train.report`` them.

    Every rank must call it (DCP and ``ray.train.report`` are both collective); Ray Train V2 merges the
    ranks' directories into one committed checkpoint. The temp dir is removed after the upload. ``data``:
    see :func:`save_checkpoint`. Returns :func:`save_checkpoint`'s figures of this rank's save.
    """
    import ray.train

    tmp = Path(tempfile.mkdtemp(prefix="gemray-ckpt-"))
    try:
        stats = save_checkpoint(tmp, model, optimizer, trainer, data=data)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(tmp)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats




def committed_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders of a Ray Train V2 run (``<storage_path>/<name>``, local or shared file system) that
    Ray committed, newest first: ``ray.train.Result.from_path(run_dir).best_checkpoints`` (the run's kept
    checkpoints, in the order they were reported). Returns [] when the folder holds no Ray Train run yet, and
    (with a warning) when Ray cannot load its record of the run (e.g. written by another Ray version)."""
    from ray.train import Result

    train_log = logging.getLogger("ray.train")
    level = train_log.level
    train_log.setLevel(max(level, logging.WARNING))  # not Ray's "A run snapshot was found ... will be loaded"
    try:
        result = Result.from_path(Path(run_dir).resolve())
    except RuntimeError:  # no run folder, or no checkpoint was ever committed in it
        return []
    except Exception as e:  # noqa: BLE001 - a record Ray itself refuses (Ray Train raises RayTrainError)
        log.warning("cannot read the committed checkpoints of %s: %s: %s", run_dir, type(e).__name__, e)
        return []
    finally:
        train_log.setLevel(level)
    return [Path(ckpt.path) for ckpt, _ in reversed(result.best_checkpoints or [])]


#: Ray Train V2's default checkpoint folder name (``checkpoint_<YYYY-MM-DD_HH-MM-SS.ffffff>``).
_CKPT_NAME = re.compile(r"checkpoint_[0-9A-Za-z_.:-]+")


def uncommitted_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders of a Ray Train V2 run that Ray never committed (a report interrupted by a
    failure, e.g. a worker killed while uploading), newest first. Ray's record of the run is what counts:
    these are never restored. Returns [] when Ray has committed nothing in ``run_dir`` (nothing can be told
    apart then).

    Ray internals: Ray 2.60 has no public API that lists the checkpoint folders a report left without
    committing them; this takes the folders named as Ray names checkpoints (``checkpoint_<timestamp>``)
    minus :func:`committed_checkpoints`.
    """
    run_dir = Path(run_dir).resolve()
    committed = set(committed_checkpoints(run_dir))
    if not committed:
        return []
    # newest first: Ray's names are timestamps, so name order is time order
    return sorted((p for p in run_dir.glob("checkpoint_*") if p.is_dir() and _CKPT_NAME.fullmatch(p.name)
                   and p not in committed), key=lambda p: p.name, reverse=True)


def choose_checkpoint(candidates: list[Path], verify=None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """Pure decision: the first of ``candidates`` (newest first) that verifies; skipped ones with why.

    verify: callable(path) raising ValueError for a bad checkpoint (default :func:`verify_checkpoint`).
    Returns (chosen path or None, [(skipped path, reason)]).
    """
    verify = verify or verify_checkpoint
    skipped: list[tuple[Path, str]] = []
    seen = set()
    for c in candidates:
        c = Path(c)
        if c in seen:
            continue
        seen.add(c)
        try:
            verify(c)
            return c, skipped
        except ValueError as e:
            skipped.append((c, str(e)))
    return None, skipped


def restore_from_ray(model: torch.nn.Module, optimizer: Any) -> dict[str, Any] | None:
    """Restore the newest good checkpoint Ray Train committed; None on a fresh start. Call it in a Ray Train
    worker.

    Starts from ``ray.train.get_checkpoint()`` (the latest committed). If it fails verification
    (corrupt or partial: see :func:`verify_checkpoint`), logs a WARNING naming it and the reason and
    falls back to older committed checkpoints of the same run (``ray.train.get_all_reported_checkpoints``,
    newest first; local or shared-filesystem storage). The returned trainer dict gains ``restored_from``
    (path) and ``skipped_checkpoints`` ([[path, reason]]). Raises ValueError when no committed checkpoint
    verifies.
    """
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return None
    latest = Path(ckpt.path)
    if not latest.is_dir():  # remote storage: no siblings to fall back to; verify what Ray hands us
        with ckpt.as_directory() as d:
            return load_checkpoint(d, model, optimizer)
    # every checkpoint the controller holds as committed, in report order (nothing is in flight at a restore)
    reported = ray.train.get_all_reported_checkpoints(
        consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=60)
    older = [Path(r.checkpoint.path) for r in reversed(reported)]
    chosen, skipped = choose_checkpoint([latest] + older)
    for path, why in skipped:
        log.warning("checkpoint %s is unusable (%s); falling back to the previous committed checkpoint",
                    path.name, why)
    if chosen is None:
        raise ValueError(f"no committed checkpoint of {latest.parent} verifies: "
                         + "; ".join(f"{p.name}: {w}" for p, w in skipped))
    if skipped:
        log.warning("restoring from %s instead of the latest %s", chosen.name, latest.name)
    out = load_checkpoint(chosen, model, optimizer, verify=False)
    out["restored_from"] = str(chosen)
    out["skipped_checkpoints"] = [[str(p), w] for p, w in skipped]
    return out
