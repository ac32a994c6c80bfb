"""One config tree for a gemray job: dataclasses, loaded from TOML, overridden by ``section.key=value``.

Every section is a plain dataclass with defaults; ``JobConfig`` holds them all. Bad input raises
``ValueError`` naming the offending field (``train.lr: expected float, got 'abc'``).

Example::

    cfg = load_config("configs/ml-1m.toml", overrides=["train.epochs=2", "ray.num_workers=2"])
    cfg.model.num_blocks  # 8
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DataConfig:
    """Where the data lives and how batches are formed.

    raw_dir: folder with MovieLens raw files (ratings.dat / u.data / ratings.csv), read by path.
    prepared_dir: Parquet output of ``gemray prepare movielens`` (created by ``gemray train`` if missing).
    max_seq_len: longest history (items) fed to the model; longer histories keep the most recent items.
    batch_size: samples per rank per step.
    bbs: base batch shuffling on/off; sub_batch_size: samples per BBS sub-batch;
    bbs_window_batches: how many rank batches one BBS window forms at once.
    on_bad_rows: "error" (stop with file:line) or "quarantine" (write bad rows aside, count them).
    reader: how a worker reads its Parquet shards: "ray_data" (``ray.data.read_parquet`` tasks) or "arrow"
    (pyarrow in the worker process itself: no Ray tasks, so a worker group restarted on a fresh node does
    not wait for cold Ray Data worker processes there, ~11 s on the 2-core test box; same files, same
    table, same shared-path requirement).
    train_includes_valid: train on each history up to and including the validation item (h[:-1]), as
    generative-recommenders' ML-1M training data does; the test item stays held out, but validation
    metrics then score items the model was trained on. Default False: train on h[:-2].
    """

    raw_dir: str = "../shared/data/ml-1m"
    prepared_dir: str = "data/ml-1m"
    max_seq_len: int = 200
    batch_size: int = 128
    eval_batch_size: int = 256
    bbs: bool = True
    sub_batch_size: int = 16
    bbs_window_batches: int = 8
    shuffle: bool = True
    on_bad_rows: str = "error"
    num_files: int = 8
    reader: str = "ray_data"
    train_includes_valid: bool = False

    def validate(self) -> None:
        _positive(self, "max_seq_len", "batch_size", "eval_batch_size", "sub_batch_size",
                  "bbs_window_batches", "num_files")
        if self.reader not in ("ray_data", "arrow"):
            raise ValueError(f"data.reader: expected 'ray_data' or 'arrow', got {self.reader!r}")
        if self.on_bad_rows not in ("error", "quarantine"):
            raise ValueError(f"data.on_bad_rows: expected 'error' or 'quarantine', got {self.on_bad_rows!r}")
        if self.batch_size % self.sub_batch_size:
            raise ValueError(
                f"data.batch_size ({self.batch_size}) must be a multiple of data.sub_batch_size "
                f"({self.sub_batch_size})")


@dataclass
class ModelConfig:
    """GEM-like model shape (defaults: HSTU-large for ML-1M, generative-recommenders configs).

    embedding_dim: item embedding width (also the residual stream width).
    num_blocks / num_heads / attention_dim (per-head q,k width) / linear_dim (per-head v,u width).
    attn_activation: "silu" (HSTU: silu(qk + bias)/N) or "softmax".
    num_negatives / temperature: sampled softmax; negatives: "uniform" (R uniform ids per position, as
    generative-recommenders' LocalNegativesSampler), "uniform_shared" (R ids per sequence, shared by its
    positions: cheaper) or "in_batch" (the batch's own targets).
    attention_backend: "auto" (Triton on CUDA, reference elsewhere), "triton" or "reference".
    time_bias_query: query time of the relative time bias: "next" (the time of the item a position
    predicts, at evaluation the target's time = the request time; as generative-recommenders' HSTU) or
    "self" (the position's own timestamp).
    """

    embedding_dim: int = 52  # HSTU's ML-1M uses 50; FBGEMM's sharded tables need a multiple of 4
    num_blocks: int = 8
    num_heads: int = 2
    attention_dim: int = 25
    linear_dim: int = 25
    dropout: float = 0.2
    attn_dropout: float = 0.0
    attn_activation: str = "silu"
    use_rating_feature: bool = True
    use_time_feature: bool = True
    num_time_buckets: int = 64
    num_position_buckets: int = 128
    negatives: str = "uniform"
    num_negatives: int = 128
    temperature: float = 0.05
    attention_backend: str = "auto"
    time_bias_query: str = "next"

    def validate(self) -> None:
        _positive(self, "embedding_dim", "num_blocks", "num_heads", "attention_dim", "linear_dim",
                  "num_negatives", "num_time_buckets", "num_position_buckets")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout: expected 0 <= dropout < 1, got {self.dropout}")
        if self.temperature <= 0:
            raise ValueError(f"model.temperature: expected > 0, got {self.temperature}")
        if self.attn_dropout != 0.0:  # refused here, not in every worker after Ray started (and retried)
            raise ValueError(f"model.attn_dropout: attention dropout is not implemented (use 0.0), got "
                             f"{self.attn_dropout}")
        _choice(self, "attn_activation", ("silu", "softmax", "gelu", "none"))
        _choice(self, "negatives", ("uniform", "uniform_shared", "in_batch"))
        _choice(self, "attention_backend", ("auto", "triton", "reference"))
        _choice(self, "time_bias_query", ("next", "self"))


@dataclass
class TrainConfig:
    """Optimisation and evaluation.

    epochs: passes over the training split; lr / weight_decay: dense AdamW; sparse_lr: learning rate of the
    embedding tables' optimizer (``sparse_optimizer``, fused into FBGEMM's backward); eval_every: evaluate
    the validation split every N epochs (test split always at the end); eval_ks: cut-offs for HR@K / NDCG@K; seed: everything.
    eval_exclude_history: rank each target against the items outside the user's (max_seq_len) history, as
    generative-recommenders' evaluation that produced the published ML-1M numbers; the metrics over all
    items are reported beside them with the suffix ``_unfiltered``.
    """

    epochs: int = 100
    lr: float = 1e-3
    sparse_lr: float = 1e-3
    weight_decay: float = 0.0
    # Adam(W) (beta1, beta2) for the dense part and the Adam kinds of sparse optimizer; (0.9, 0.98) as
    # generative-recommenders' ML-1M recipe.
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eval_every: int = 5
    eval_ks: list[int] = field(default_factory=lambda: [10, 50, 200])
    eval_exclude_history: bool = True
    seed: int = 42
    log_every: int = 10
    max_steps_per_epoch: int = 0  # 0 = whole epoch; >0 caps steps (smoke tests only)
    # Embedding-table optimizer, fused into the FBGEMM backward: "auto" = rowwise_adam on CUDA,
    # rowwise_adagrad on CPU (FBGEMM's CPU kernels have no Adam); "adam"/"rowwise_adam" need CUDA.
    sparse_optimizer: str = "auto"
    # Per-sample ledger (gemray.ledger): JSONL of the sample ids each rank trained per step; "" = off.
    ledger_dir: str = ""
    # Controller events (gemray.events), JSONL written by rank 0; "" = fit uses <output_dir>/events.jsonl.
    events_path: str = ""

    def validate(self) -> None:
        _positive(self, "epochs", "lr", "sparse_lr", "eval_every", "log_every")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay: expected >= 0, got {self.weight_decay}")
        if not self.eval_ks or any(int(k) <= 0 for k in self.eval_ks):
            raise ValueError(f"train.eval_ks: expected positive cut-offs, got {self.eval_ks}")
        if len(self.adam_betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in self.adam_betas):
            raise ValueError(f"train.adam_betas: expected [beta1, beta2] each in [0, 1), got {self.adam_betas}")
        if self.max_steps_per_epoch < 0:
            raise ValueError("train.max_steps_per_epoch: expected >= 0")
        _choice(self, "sparse_optimizer", ("auto", "rowwise_adam", "adam", "rowwise_adagrad", "adagrad"))


@dataclass
class RayConfig:
    """Ray Train placement.

    address: Ray cluster address; "" means $RAY_ADDRESS or, if unset, an embedded local cluster started
    and stopped for the run. num_workers: Ray Train workers (= world size). min_workers/max_workers:
    elastic bounds (0 = fixed at num_workers). use_gpu: one GPU per worker, NCCL; else gloo on CPU.
    cpus_per_worker: CPU resource each worker asks for; num_cpus: CPUs the embedded cluster advertises
    (0 = detect).
    """

    address: str = ""
    num_workers: int = 2
    min_workers: int = 0
    max_workers: int = 0
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    num_cpus: int = 0
    max_failures: int = 3
    storage_path: str = ""
    # Elastic runs (min_workers/max_workers set): how often Ray Train looks for room to grow, in seconds
    # (ScalingConfig.elastic_resize_monitor_interval_s; growing restarts the group from the last checkpoint).
    resize_interval_s: float = 60.0
    # How often the Ray Train controller polls the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, Ray's default
    # 2 s): a failure is seen, and a reported checkpoint committed, within one interval; a report waits for
    # the previous one to be consumed, so this also bounds how often checkpoints can go out.
    health_check_interval_s: float = 0.5
    # How long Ray Train waits for a new worker group to start before it retries (possibly at a smaller
    # size after a node loss): RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, Ray's default 60 s. 0 = Ray's.
    worker_start_timeout_s: float = 0.0

    def validate(self) -> None:
        _positive(self, "num_workers", "cpus_per_worker")
        if self.num_cpus < 0:
            raise ValueError(f"ray.num_cpus: expected >= 0 (0 = detect), got {self.num_cpus}")
        if self.max_failures < -1:
            raise ValueError(f"ray.max_failures: expected >= 0 or -1 (retry forever), got {self.max_failures}")
        if self.min_workers < 0 or self.max_workers < 0:
            raise ValueError("ray.min_workers / ray.max_workers: expected >= 0")
        for name in ("resize_interval_s", "worker_start_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ray.{name}: expected >= 0, got {getattr(self, name)}")
        if self.health_check_interval_s <= 0:
            raise ValueError(f"ray.health_check_interval_s: expected > 0, got {self.health_check_interval_s}")
        if self.min_workers and self.max_workers and self.min_workers > self.max_workers:
            raise ValueError(
                f"ray.min_workers ({self.min_workers}) > ray.max_workers ({self.max_workers})")


@dataclass
class CheckpointConfig:
    """Checkpointing: every_epochs (DCP via ray.train.report), every_steps (global steps, 0 = off),
    keep (latest N committed).

    preempt_poll_steps: every N global steps, and at each epoch's last step, the workers look for a
    preemption notice (the notice file, Ray Train's node-drain info, SIGTERM where a worker can catch it)
    and vote on it with one all-reduce; a job notice -> emergency checkpoint and stop, a node drain ->
    emergency checkpoint and go on (see gemray.preemption); 0 = off. preempt_notice: the notice file
    ("" = ``<output>/PREEMPT``, set by fit; ``gemray preempt`` and the driver's SIGTERM handler write it).
    """

    every_epochs: int = 1
    every_steps: int = 0
    keep: int = 2
    preempt_poll_steps: int = 5
    preempt_notice: str = ""

    def validate(self) -> None:
        _positive(self, "every_epochs", "keep")
        if self.every_steps < 0 or self.preempt_poll_steps < 0:
            raise ValueError("checkpoint.every_steps / checkpoint.preempt_poll_steps: expected >= 0")


@dataclass
class JobConfig:
    """The whole job: one TOML file, one section per dataclass above."""

    name: str = "gemray"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> "JobConfig":
        if not str(self.name).strip():
            raise ValueError("name: expected a non-empty job name (it names the Ray Train run; resume finds "
                             "the run by it)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(self.name)):
            raise ValueError(f"name: {self.name!r} must be letters, digits, '.', '_' or '-' (it names the Ray "
                             "Train run's folder and the default output folder runs/<name>)")
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                for sf in dataclasses.fields(sub):  # nan / inf pass every '> 0' check: refuse them first
                    v = getattr(sub, sf.name)
                    vals = v if isinstance(v, list) else [v]
                    if any(isinstance(x, float) and not math.isfinite(x) for x in vals):
                        raise ValueError(f"{f.name}.{sf.name}: expected a finite number, got {v}")
                sub.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _positive(obj: Any, *names: str) -> None:
    section = _section_name(obj)
    for n in names:
        v = getattr(obj, n)
        if v <= 0:
            raise ValueError(f"{section}.{n}: expected > 0, got {v}")


def _choice(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
    v = getattr(obj, name)
    if v not in allowed:
        raise ValueError(f"{_section_name(obj)}.{name}: expected one of {allowed}, got {v!r}")


def _section_name(obj: Any) -> str:
    for f in dataclasses.fields(JobConfig):
        if f.type in (type(obj).__name__, type(obj)):
            return f.name
    return type(obj).__name__


def _split_list(text: str, where: str) -> list[str]:
    """A --set list: ``[a, b]`` or ``a,b`` (a trailing comma allowed, ``[]`` empty). Unbalanced or nested
    brackets and empty elements raise ValueError naming the field (``[10,`` was read as ``[10]``)."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    items = [v.strip() for v in body.split(",")]
    if len(items) > 1 and items[-1] == "":
        items.pop()
    if items == [""]:
        return []
    if "[" in body or "]" in body or "" in items:
        raise ValueError(f"{where}: malformed list {text!r} (write e.g. [5,10] or 5,10)")
    return items


def _coerce(value: Any, typ: Any, where: str, strict: bool = False) -> Any:
    """Convert a TOML value or a --set string to the field's declared type; ValueError names the field.

    ``strict`` (values from a TOML file, which has its own types): a string is accepted for str fields
    only (``batch_size = "64"`` is an error, not 64); ints still widen to float. Without it (--set, whose
    values are all strings) strings are parsed."""
    origin = typing.get_origin(typ)
    if origin is list:
        (inner,) = typing.get_args(typ)
        if isinstance(value, str) and not strict:
            value = _split_list(value, where)
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, inner, where, strict) for v in value]
    if strict and (isinstance(value, str) != (typ is str)):
        raise ValueError(f"{where}: expected {getattr(typ, '__name__', typ)}, got {value!r} "
                         f"({type(value).__name__}; in TOML, {'quote it' if typ is str else 'write it unquoted'})")
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected {getattr(typ, '__name__', typ)}, got {value!r}") from None
    return value


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(raw: dict[str, Any]) -> JobConfig:
    """Build a validated JobConfig from a nested dict (TOML layout, TOML types: a string where a number or
    a bool belongs is an error). Unknown keys raise ValueError."""
    cfg = JobConfig()
    top_types = _field_types(JobConfig)
    for key, val in raw.items():
        if key not in top_types:
            raise ValueError(f"unknown config section or key {key!r} (known: {sorted(top_types)})")
        sub = getattr(cfg, key)
        if dataclasses.is_dataclass(sub):
            if not isinstance(val, dict):
                raise ValueError(f"{key}: expected a table, got {val!r}")
            types = _field_types(type(sub))
            for k, v in val.items():
                if k not in types:
                    raise ValueError(f"unknown key {key}.{k} (known: {sorted(types)})")
                setattr(sub, k, _coerce(v, types[k], f"{key}.{k}", strict=True))
        else:
            setattr(cfg, key, _coerce(val, top_types[key], key, strict=True))
    return cfg.validate()


def apply_overrides(cfg: JobConfig, overrides: list[str]) -> JobConfig:
    """Apply ``section.key=value`` strings (the CLI's ``--set``) and re-validate."""
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        path, value = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) == 1:
            types = _field_types(JobConfig)
            if parts[0] not in types or dataclasses.is_dataclass(getattr(cfg, parts[0])):
                raise ValueError(f"--set {item!r}: unknown key {parts[0]!r}")
            setattr(cfg, parts[0], _coerce(value, types[parts[0]], parts[0]))
            continue
        if len(parts) != 2:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        section, key = parts
        sub = getattr(cfg, section, None)
        if not dataclasses.is_dataclass(sub):
            raise ValueError(f"--set {item!r}: unknown section {section!r}")
        types = _field_types(type(sub))
        if key not in types:
            raise ValueError(f"--set {item!r}: unknown key {section}.{key} (known: {sorted(types)})")
        setattr(sub, key, _coerce(value, types[key], f"{section}.{key}"))
    return cfg.validate()


def load_config(path: str | Path | None = None, overrides: list[str] | str | None = None) -> JobConfig:
    """Read a TOML config (or defaults if ``path`` is None), apply overrides (``section.key=value`` strings, or
    one such string), validate.

    Raises FileNotFoundError for a missing file and ValueError naming the field for bad values.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{p}: invalid TOML: {e}") from None
    cfg = from_dict(raw)
    if isinstance(overrides, str):  # one override, not its characters
        overrides = [overrides]
    return apply_overrides(cfg, overrides or [])


def to_toml(cfg: JobConfig) -> str:
    """Serialise a JobConfig back to TOML text (round-trips through load_config)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    lines = [f"name = {fmt(cfg.name)}"]
    for f in dataclasses.fields(cfg):
        sub = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sub):
            lines.append(f"\n[{f.name}]")
            for sf in dataclasses.fields(sub):
                lines.append(f"{sf.name} = {fmt(getattr(sub, sf.name))}")
    return "\n".join(lines) + "\n"
