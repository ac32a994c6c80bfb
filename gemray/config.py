"""One config tree for a gemray job: dataclasses, loaded from TOML, overridden by ``section.key=value``.

Every section is a plain dataclass with defaults; ``JobConfig`` holds them all. Bad input raises
``ValueError`` naming the offending field (``train.lr: expected float, got 'abc'``).

Example::

    cfg = load_config("configs/ml-1m.toml", overrides=["train.epochs=2", "ray.num_workers=2"])
    cfg.model.num_blocks  # 8
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DataConfig:
    """Where the data lives and how batches are formed.

    raw_dir: folder with MovieLens raw files (ratings.dat / u.data / ratings.csv), read by path. Like every path
    of a config, one starting with ``../shared/`` is read under ``$GEMRAY_SHARED`` when that is set
    (:func:`shared_path`).
    prepared_dir: Parquet output of ``gemray prepare movielens`` (created by ``gemray train`` if missing).
    max_seq_len: longest history (items) fed to the model; longer histories keep the most recent items.
    batch_size: samples per rank per step.
    bbs: base batch shuffling on/off; sub_batch_size: samples per BBS sub-batch.
    bbs_window_batches: no effect on training. Training plans each step from that step's ``world_size *
    batch_size`` samples of one global epoch order (``gemray.pipelines.stream.ElasticTrainStream``,
    ``gemray.pipelines.bbs.plan_global_step``), with no window; the key only sizes the windows of
    ``HistoryStream``'s own per-rank train plan (``plan_epoch``), which training does not use. Kept so that
    configs which set it, and the config.toml of every earlier run (which lists every key), still load.
    on_bad_rows: "error" (stop with file:line) or "quarantine" (write bad rows aside, count them).
    reader: how a worker reads its Parquet shards: "ray_data" (``ray.data.read_parquet`` tasks) or "arrow"
    (pyarrow in the worker process itself: no Ray tasks, so a worker group restarted on a fresh node does
    not wait for cold Ray Data worker processes there, ~11 s on the 2-core test box; same files, same
    table, same shared-path requirement).
    train_includes_valid: train on each history up to and including the validation item (h[:-1]), as
    generative-recommenders' ML-1M training data does; the test item stays held out, but validation
    metrics then score items the model was trained on. Default False: train on h[:-2].
    synthetic: ``gemray prepare synthetic`` parameters as "name=value" entries (the flags' names without
    ``--``, e.g. ["users=20000", "items=1000000", "max_len=4096", "features=category=64,author=2048"]); [] =
    not synthetic. When set, ``gemray train`` generates the data into ``prepared_dir`` if that folder holds none
    (logged), and refuses a prepared folder whose manifest parameters differ (``raw_dir`` is then unused).
    loader_workers: background processes that make the training batches (BBS plan, collation and, on CUDA,
    pinning in the loader's thread) while the training thread runs the step (``gemray.pipelines.loader``: a
    ``torch.utils.data.DataLoader``; worker w collates steps i with i % N == w, so the batches and the data
    position are exactly the in-process ones). 0 = in the training process, as before; "auto" (default) = 1 on
    a CUDA device, 0 on the CPU (whose cores the CPU step uses for compute).
    prefetch_batches: batches each loader worker keeps ready ahead of the step (DataLoader's prefetch_factor;
    unused with 0 workers).
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
    synthetic: list[str] = field(default_factory=list)
    loader_workers: int | str = "auto"
    prefetch_batches: int = 2

    def synthetic_params(self) -> dict[str, str]:
        """``synthetic`` parsed: {parameter: value text}. Raises ValueError naming the bad entry."""
        out: dict[str, str] = {}
        for entry in self.synthetic:
            key, sep, value = str(entry).partition("=")
            key = key.strip().replace("-", "_")
            if not sep or not re.fullmatch(r"[a-z][a-z0-9_]*", key) or not value.strip():
                raise ValueError(f"data.synthetic: expected 'parameter=value', got {entry!r}")
            if key in out:
                raise ValueError(f"data.synthetic: parameter {key!r} given twice")
            out[key] = value.strip()
        if out and ("users" not in out or "items" not in out):
            raise ValueError(f"data.synthetic: 'users=U' and 'items=N' are required, got {self.synthetic}")
        return out

    def validate(self) -> None:
        self.synthetic_params()
        _positive(self, "max_seq_len", "batch_size", "eval_batch_size", "sub_batch_size",
                  "bbs_window_batches")
        check_num_files(self.num_files, "data.num_files")
        if self.reader not in ("ray_data", "arrow"):
            raise ValueError(f"data.reader: expected 'ray_data' or 'arrow', got {self.reader!r}")
        if self.on_bad_rows not in ("error", "quarantine"):
            raise ValueError(f"data.on_bad_rows: expected 'error' or 'quarantine', got {self.on_bad_rows!r}")
        if self.batch_size % self.sub_batch_size:
            raise ValueError(
                f"data.batch_size ({self.batch_size}) must be a multiple of data.sub_batch_size "
                f"({self.sub_batch_size})")
        w = self.loader_workers
        if w != "auto" and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ValueError(f"data.loader_workers: expected an integer >= 0 or 'auto', got {w!r}")
        _positive(self, "prefetch_batches")

    def resolved_loader_workers(self, device_type: str) -> int:
        """``loader_workers`` as a number for a trainer on ``device_type`` ("cuda", "cpu", ...): "auto" is 1 on
        CUDA, 0 elsewhere."""
        if self.loader_workers == "auto":
            return 1 if device_type == "cuda" else 0
        return int(self.loader_workers)


def kernel_tiles_spec(kernel_tiles: str) -> dict:
    """The JSON object of a ``model.kernel_tiles`` value: inline JSON (starting with "{" once stripped) or the
    path of a JSON file (``~`` expanded; {} for ""). Raises ValueError naming model.kernel_tiles for a value that
    is neither (naming the value and both accepted forms), an unreadable file, malformed JSON (with the error's
    line and column) or JSON that is not an object (its regimes / kinds are checked by
    ``gemray.model.hstu.kernel_config_of``)."""
    if not kernel_tiles:
        return {}
    if kernel_tiles.lstrip().startswith("{"):
        text, where = kernel_tiles, "inline JSON"
    else:
        path = Path(kernel_tiles).expanduser()
        if not path.is_file():
            what = ("it is a folder" if path.is_dir() else "no such file" if path.is_absolute()
                    else f"no such file in {Path.cwd()}")
            raise ValueError(f"model.kernel_tiles = {kernel_tiles!r} is neither a JSON file ({what}) nor an inline "
                             "JSON object (it does not start with '{'); expected the path of a JSON file or an "
                             'inline JSON object such as \'{"medium": {"mode": {"ds_store": true}}}\'')
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"model.kernel_tiles: cannot read {kernel_tiles!r}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
        where = f"JSON file {kernel_tiles!r}"
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"model.kernel_tiles: malformed {where}: {e}") from None  # "...: line L column C (char N)"
    if not isinstance(spec, dict):
        raise ValueError(f"model.kernel_tiles: expected a JSON object {{regime: {{kind: ...}}}}, got "
                         f"{type(spec).__name__} ({where})")
    return spec


@dataclass
class ModelConfig:
    """GEM-like model shape (defaults: HSTU-large for ML-1M, generative-recommenders configs).

    The defaults build today's ML-1M retrieval model exactly; the fields from ``model_dim`` on describe the
    GEM-at-scale model (side features, candidate tower, multi-task heads) as a configuration of the same model.

    Retrieval model (HSTU, Zhai et al. 2024, arXiv:2402.17152):
    embedding_dim: E, the width of every embedding table (one width: an EmbeddingCollection requirement; FBGEMM's
    sharded tables need a multiple of 4); also the residual stream width when ``model_dim`` is 0.
    num_blocks: HSTU layers. num_heads: H. attention_dim: per-head q,k width. linear_dim: per-head v,u width.
    dropout: after the input embedding and before each block's output projection. attn_dropout: must be 0.
    attn_activation: "silu" (HSTU: silu(qk + bias)/N), "softmax", "gelu" or "none".
    use_rating_feature / use_time_feature: add the rating / time-gap embeddings to each history token.
    num_time_buckets / num_position_buckets: buckets of the time-gap table and of the relative attention bias.
    num_negatives / temperature: sampled softmax (num_negatives at most the catalogue's items: drawn with
    replacement, more would only repeat items; ``gemray train`` refuses more before Ray starts); negatives: "uniform"
    (R uniform ids per position, as generative-recommenders' LocalNegativesSampler), "uniform_shared" (R ids per
    sequence, shared by its positions: cheaper) or "in_batch" (the batch's own targets).
    attention_backend: "auto" (Triton on CUDA, reference elsewhere), "triton" or "reference". "triton" without a
    GPU (``ray.use_gpu = false``) only in Triton's CPU interpreter, ``TRITON_INTERPRET=1`` (tests; slow: ~20 s a
    training step of configs/gem-tiny.toml on 2 cores), as ``retrieval_kernel``; refused before Ray starts
    otherwise.
    retrieval_kernel: the "uniform_shared" sampled softmax's implementation: "auto" (the fused Triton kernel on
    CUDA, the padded reference elsewhere), "triton" or "reference" (``gemray.model.heads``). Default "reference"
    until the fused kernel has run on a GPU (written and CPU-tested 2026-12-05; its GPU tests and
    benchmarks/sampled_softmax_h200.py are in the next device session's plan).
    uvqk_kernel: the HSTU blocks' uvqk activation ``split(silu(x_norm @ W + b))`` after the projection's GEMM: "auto"
    (the fused Triton kernels on CUDA: the bias, the SiLU and the split in one pass forward, the SiLU derivative, the
    concatenation of the four gradients and the bias gradient in one pass backward; ``gemray.kernels.bias_silu``),
    "triton" or "reference" (PyTorch, fused by ``train.compile``); default "reference" until measured on a GPU.
    The FP8 projections (``train.precision = "fp8"``) keep their own bias and ignore it.
    kernel_tiles: "" (the kernels' defaults) or the Triton attention kernels' tiles / launch modes for this
    machine, as inline JSON (a value starting with "{", e.g. ``--set 'model.kernel_tiles={"long": {...}}'``) or
    the path of a JSON file (any other value; absolute, or relative to the working directory of every process
    that builds the model): the "chosen tiles" format the sweeps print (``gemray bench kernels --sweep``,
    benchmarks/attn_sweep_d256.py; ``gemray.kernels.config.apply_tiles``), e.g.
    ``{"medium": {"fwd_silu": {"256": [64, 64, 4, 2]}, "mode": {"ds_store": true}}}``. Used by the HSTU blocks'
    self-attention; the reference backend ignores it.
    time_bias_query: query time of the relative time bias: "next" (the time of the item a position
    predicts, at evaluation the target's time = the request time; as generative-recommenders' HSTU) or
    "self" (the position's own timestamp).

    GEM at scale (``gemray.model.inputs``, ``gemray.model.ranking``, ``gemray.model.flops``):
    model_dim: d, the width of the HSTU residual stream and of the candidate tower; 0 = embedding_dim (no input
    projection when the combined embedding is already d wide). ``width`` gives the resolved d.
    token_features: per-token side features of the history (``JaggedBatch.features`` keys, e.g. "category",
    "author"), each with its own table; combined with the item (and rating / time-gap) embeddings.
    candidate_features: item-level side features of each candidate (a subset of ``token_features``: the
    candidate looks up the same tables, under the KJT key ``cand_<name>``).
    context_features: request features combined into one [B, d] context vector: names of
    ``JaggedBatch.context`` (KJT key ``ctx_<name>``) and/or "user_id" (``JaggedBatch.user_ids``, table "user").
    combiner: how the embeddings of one token (and of one candidate, one request) combine: "sum" (today's
    item + rating + time_gap, exactly) or "concat" (then a Linear to d).
    tasks: training objectives, any of "retrieval" (next-item sampled softmax), "ctr" (BCE on the click
    label of each candidate) and "cvr" (BCE on the convert label); "ctr" / "cvr" add the candidate tower.
    task_weights: one weight >= 0 per entry of ``tasks`` (the loss is their weighted sum); [] = all 1.0.
    cvr_population: candidates CVR is trained and evaluated on: "clicked" (post-click conversion
    p(convert | click), the standard definition; 0 clicked candidates give loss 0) or "all" (every
    candidate, i.e. p(click and convert), ESMM's pCTCVR target: no sample-selection bias, sparser positives).
    task_base_rates: [] (default) or one rate in (0, 1) per ranking task (``ranking_tasks`` order: the click rate
        for "ctr", the conversion rate of its ``cvr_population`` for "cvr"): the tower's output bias of each task
        starts at logit(rate), so the first predictions are calibrated (a zero bias predicts 0.5, and Adam moves a
        bias about ``train.lr`` per step: ~3,000 steps from 0 to logit(0.05) at lr 1e-3).
    pma_seeds: S, learned seed queries per head of the tower's PMA pooling of the history (Set Transformer).
    mlp_dims: hidden widths of the tower's per-candidate interaction MLP ([] = one Linear to the task logits).
    tower_activation: activation of the tower's cross-attention and PMA ("softmax", "silu", "gelu", "none").
    attention_window: > 0: HSTU self-attention sees only keys with i - window < j <= i (sliding window).
    attention_block: > 0: HSTU self-attention sees only keys of the query's own block of that many positions.
    (Both 0 = full causal attention. For the longest histories. Not wired into the HSTU blocks yet: validate
    refuses any non-zero value, so at most one of the two is checked only once they are wired.)
    relative_bias: the HSTU blocks' learned relative position / time bias (rab^{p,t}) on or off.
    fp32_residual: the residual stream between the HSTU blocks (and its gradient) in float32 (default: the fp32
    positional table promotes the input to float32, as generative-recommenders) or, when false, in the
    autocast dtype (bf16 under ``train.precision`` "bf16" / "fp8"; Megatron-LM's ``fp32_residual_connection``
    off): half the bytes of every residual read / write and of the block inputs saved for backward (~15 GB of
    traffic and ~2 GB of saved activations a step at configs/gem-h200.toml's batch 128, by count). Each block's
    LayerNorm still computes in float32 (autocast), the encoder's output is normalised from the bf16 stream. No
    effect without autocast (``train.precision = "fp32"``, the ML-1M config).
    table_rows: row-count overrides "table=rows" (e.g. ["user=200000000", "item=100000000"]) so that tables can
    be sized by configuration (capacity beyond the data's ids); a table's default is what the data needs
    (item: num_items + 1; a side feature: its cardinality + 1; user: num_users). Tables: "item", "rating",
    "time_gap", each token / context feature name, and "user".
    table_dtype: storage of every embedding table: "fp32" (default) or "fp16": half the table bytes (12.8 of the
    25.6 GB of configs/gem-h200.toml) and half the row bytes lookups read and updates write (TorchRec
    ``EmbeddingConfig.data_type``, FBGEMM's TBE ``weights_precision``). Lookups still return float32 rows and the
    fused optimizer's state stays float32 (row-wise Adagrad: one value per row); each update is computed in
    float32 and rounded into the float16 row: stochastically on CUDA (FBGEMM's ``stochastic_rounding``, requested
    for every fp16 table by ``gemray.parallel.parallelize``: to nearest, every update under half an ulp -- 2^-12
    to 2^-11 of the weight -- would be dropped and rows with small updates would stop learning), to nearest on
    the CPU (FBGEMM's CPU kernels have no stochastic rounding; ``parallelize`` logs a warning: fine for tests, not
    for a CPU training run). The initial rows are the fp32 draws rounded to nearest, with the RNG stream (hence
    the dense weights) of the fp32 build (``gemray.model.embeddings``). A checkpoint of the other dtype loads with
    a cast and a warning naming both dtypes (``gemray.checkpoint``), so an output folder's run may be resumed
    under the other dtype. One dtype for all tables: the small ones weigh nothing next to item / user.

    Mixture of experts in the candidate tower (``gemray.model.moe``; Switch Transformer / GShard routing):
    moe_experts: E > 0 replaces the first two layers of the interaction MLP (in -> mlp_dims[0] -> mlp_dims[1])
    by E such two-layer SiLU FFN experts under token-choice top-k routing of each candidate (needs a ranking
    task and at least two ``mlp_dims``); 0 = the dense MLP. Spread over ranks by ``parallel.expert_parallel``.
    moe_top_k: experts per candidate, 1..E (1 = Switch, 2 = GShard). moe_capacity_factor: assignments an
    expert takes from one rank's C candidates, ceil(factor * C * k / E) (Switch's 1.0-1.25), in training (evaluation
    drops nothing); the overflow is dropped and reported (epoch metric ``train_moe_dropped``); 0 = no limit. moe_aux_weight: weight of Switch's
    load-balancing loss E * sum_e f_e P_e added to the training loss (Switch's 0.01; 0 = off).
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
    retrieval_kernel: str = "reference"
    uvqk_kernel: str = "reference"
    kernel_tiles: str = ""
    time_bias_query: str = "next"
    # GEM at scale (see the docstring); the defaults keep the ML-1M retrieval model exactly
    model_dim: int = 0
    token_features: list[str] = field(default_factory=list)
    candidate_features: list[str] = field(default_factory=list)
    context_features: list[str] = field(default_factory=list)
    combiner: str = "sum"
    tasks: list[str] = field(default_factory=lambda: ["retrieval"])
    task_weights: list[float] = field(default_factory=list)
    cvr_population: str = "clicked"
    task_base_rates: list[float] = field(default_factory=list)
    pma_seeds: int = 4
    mlp_dims: list[int] = field(default_factory=lambda: [256, 64])
    tower_activation: str = "softmax"
    attention_window: int = 0
    attention_block: int = 0
    relative_bias: bool = True
    fp32_residual: bool = True
    table_rows: list[str] = field(default_factory=list)
    table_dtype: str = "fp32"
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.25
    moe_aux_weight: float = 0.01

    TASKS = ("retrieval", "ctr", "cvr")
    TABLE_DTYPES = ("fp32", "fp16")
    RANKING_TASKS = ("ctr", "cvr")
    USER_ID_FEATURE = "user_id"
    # table / KJT names the side features may not take (fixed tables of the model)
    RESERVED_NAMES = ("item", "item_id", "neg_item_id", "rating", "time_gap", "user", "user_id")

    @property
    def width(self) -> int:
        """d, the residual / tower width: ``model_dim`` or, when 0, ``embedding_dim``."""
        return self.model_dim or self.embedding_dim

    @property
    def ranking_tasks(self) -> list[str]:
        """The entries of ``tasks`` the candidate tower predicts ("ctr", "cvr"), in ``tasks`` order."""
        return [t for t in self.tasks if t in self.RANKING_TASKS]

    @property
    def retrieval_kernel_in_use(self) -> bool:
        """Whether ``retrieval_kernel`` is read: only the retrieval head's "uniform_shared" sampled softmax has the
        fused kernel (the preflight's refusal and the idle warning both ask this)."""
        return self.negatives == "uniform_shared" and "retrieval" in self.tasks

    def task_weight(self, task: str) -> float:
        """The loss weight of ``task`` (1.0 when ``task_weights`` is empty). Raises ValueError if not in tasks."""
        if task not in self.tasks:
            raise ValueError(f"model.tasks: {task!r} is not one of {self.tasks}")
        return float(self.task_weights[self.tasks.index(task)]) if self.task_weights else 1.0

    def table_rows_map(self) -> dict[str, int]:
        """``table_rows`` parsed: {table name: rows}. Raises ValueError naming the bad entry."""
        out: dict[str, int] = {}
        for entry in self.table_rows:
            name, sep, rows = str(entry).partition("=")
            name = name.strip()
            try:
                n = int(rows.strip()) if sep else 0
            except ValueError:
                n = 0
            if not name or n < 1:
                raise ValueError(f"model.table_rows: expected 'table=rows' with rows >= 1, got {entry!r}")
            if name in out:
                raise ValueError(f"model.table_rows: table {name!r} given twice")
            out[name] = n
        return out

    def validate(self) -> None:
        _positive(self, "embedding_dim", "num_blocks", "num_heads", "attention_dim", "linear_dim",
                  "num_negatives", "num_time_buckets", "num_position_buckets", "pma_seeds")
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
        _choice(self, "retrieval_kernel", ("auto", "triton", "reference"))
        _choice(self, "uvqk_kernel", ("auto", "triton", "reference"))
        _choice(self, "time_bias_query", ("next", "self"))
        if self.kernel_tiles:
            kernel_tiles_spec(self.kernel_tiles)  # ValueError naming model.kernel_tiles before any worker starts
        self._validate_gem()

    def _validate_moe(self) -> None:
        if self.moe_experts < 0:
            raise ValueError(f"model.moe_experts: expected >= 0 (0 = no experts), got {self.moe_experts}")
        if self.moe_capacity_factor < 0 or self.moe_aux_weight < 0:
            raise ValueError(f"model.moe_capacity_factor ({self.moe_capacity_factor}) and model.moe_aux_weight "
                             f"({self.moe_aux_weight}): expected >= 0")
        if not self.moe_experts:
            return
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"model.moe_top_k: expected 1..moe_experts={self.moe_experts}, got {self.moe_top_k}")
        if not self.ranking_tasks:
            raise ValueError(f"model.moe_experts={self.moe_experts}: the experts replace the candidate tower's "
                             f"interaction MLP, which needs a ranking task in model.tasks (got {self.tasks})")
        if len(self.mlp_dims) < 2:
            raise ValueError(f"model.moe_experts={self.moe_experts}: each expert is the interaction MLP's first two "
                             f"layers (in -> mlp_dims[0] -> mlp_dims[1]): model.mlp_dims needs at least two widths, "
                             f"got {self.mlp_dims}")

    def _validate_gem(self) -> None:
        for name in ("model_dim", "attention_window", "attention_block"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name}: expected >= 0, got {getattr(self, name)}")
        if self.attention_window or self.attention_block:
            # the FLOP counter knows their pairs and the Triton kernels have window / block masks, but
            # ops.attention and the HSTU blocks do not pass them yet: refuse rather than train full attention
            raise ValueError(f"model.attention_window ({self.attention_window}) / model.attention_block "
                             f"({self.attention_block}): windowed and block attention are not wired into the HSTU "
                             "blocks yet; use 0 (full causal attention)")
        _choice(self, "combiner", ("sum", "concat"))
        _choice(self, "cvr_population", ("clicked", "all"))
        _choice(self, "tower_activation", ("softmax", "silu", "gelu", "none"))
        _choice(self, "table_dtype", self.TABLE_DTYPES)
        if not self.tasks or len(set(self.tasks)) != len(self.tasks) or \
                any(t not in self.TASKS for t in self.tasks):
            raise ValueError(f"model.tasks: expected distinct entries of {self.TASKS}, got {self.tasks}")
        if self.task_weights:
            if len(self.task_weights) != len(self.tasks):
                raise ValueError(f"model.task_weights: expected one weight per task ({len(self.tasks)}: "
                                 f"{self.tasks}) or [], got {self.task_weights}")
            if any(float(w) < 0 for w in self.task_weights) or not any(float(w) > 0 for w in self.task_weights):
                raise ValueError(f"model.task_weights: expected weights >= 0, at least one > 0, got "
                                 f"{self.task_weights}")
        if any(int(m) <= 0 for m in self.mlp_dims):
            raise ValueError(f"model.mlp_dims: expected positive widths, got {self.mlp_dims}")
        if self.task_base_rates and not self.ranking_tasks:
            raise ValueError(f"model.task_base_rates {self.task_base_rates}: model.tasks {self.tasks} has no ranking "
                             f"task ({', '.join(self.RANKING_TASKS)}) to start at a rate; use []")
        if self.task_base_rates and (len(self.task_base_rates) != len(self.ranking_tasks)
                                     or not all(0.0 < float(r) < 1.0 for r in self.task_base_rates)):
            raise ValueError(f"model.task_base_rates: expected [] or one rate in (0, 1) per ranking task "
                             f"{self.ranking_tasks}, got {self.task_base_rates}")
        self._validate_moe()
        for group in ("token_features", "candidate_features", "context_features"):
            names = getattr(self, group)
            if len(set(names)) != len(names):
                raise ValueError(f"model.{group}: names repeat in {names}")
            for n in names:
                if group == "context_features" and n == self.USER_ID_FEATURE:
                    continue
                if not isinstance(n, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", n) or \
                        n in self.RESERVED_NAMES:
                    raise ValueError(f"model.{group}: {n!r} must be lowercase letters, digits and '_' starting "
                                     f"with a letter, and none of {self.RESERVED_NAMES}")
        extra = [n for n in self.candidate_features if n not in self.token_features]
        if extra:
            raise ValueError(f"model.candidate_features: {extra} not in model.token_features "
                             f"{self.token_features} (a candidate looks up the token features' tables)")
        both = sorted(set(self.token_features) & set(self.context_features))
        if both:
            raise ValueError(f"model.context_features: {both} are also token features (one table per name)")
        rows = self.table_rows_map()
        known = {"item"} | set(self.token_features) | {n for n in self.context_features
                                                        if n != self.USER_ID_FEATURE}
        if self.use_rating_feature:
            known.add("rating")
        if self.use_time_feature:
            known.add("time_gap")
        if self.USER_ID_FEATURE in self.context_features:
            known.add("user")
        unknown = sorted(set(rows) - known)
        if unknown:
            raise ValueError(f"model.table_rows: no table {unknown} in this model (tables: {sorted(known)})")


@dataclass
class TrainConfig:
    """Optimisation and evaluation.

    epochs: passes over the training split; lr / weight_decay: dense AdamW; sparse_lr: learning rate of the
    embedding tables' optimizer (``sparse_optimizer``, fused into FBGEMM's backward). lr_base_fan_in: width
    scaling of the dense learning rate (muP's Adam rule, ``gemray.model.lr_scaling``): a weight matrix with
    fan-in K > lr_base_fan_in learns at ``lr x lr_base_fan_in / K`` (the HSTU blocks' projections, the tower's
    Linears, the MoE experts), everything else at ``lr``; 0 = off (default). lr_warmup_steps: the dense learning
    rates rise linearly over the first N global steps, ``(step + 1) / N`` of their value (0 = off, default; a
    function of the global step, so resuming continues it; the embedding tables' fused optimizer keeps
    ``sparse_lr``). eval_every: evaluate
    the validation split every N epochs (test split always at the end); eval_ks: cut-offs for HR@K / NDCG@K; seed: everything.
    eval_exclude_history: rank each target against the items outside the user's (max_seq_len) history, as
    generative-recommenders' evaluation that produced the published ML-1M numbers; the metrics over all
    items are reported beside them with the suffix ``_unfiltered``.
    precision: "fp32" (default), "bf16" or "fp8": the forward pass (training and evaluation) under torch.autocast
    bfloat16 on CUDA and CPU, master weights and optimizer state float32, embedding tables as TorchRec holds
    them (``gemray.train.precision.autocast``, the one place a mode is dispatched); "fp8" = bf16 autocast plus
    FP8 e4m3 GEMMs for the HSTU projections and the MLP Linears (``gemray.model.fp8``, a model converter applied
    before parallelize; with rowwise scales the HSTU pre-norm emits the FP8 activations itself).
    mfu_warmup_steps: the first N steps of each attempt (kernel compiles, allocator growth) are left out of
    the run's ``local_mfu`` (gemray.train.throughput); their FLOPs still count in ``model_tflops_per_s``.
    scaling_reference: "" or the path of a single-GPU reference run's metrics.json (``gemray train``) or JSON
    (``gemray bench train --json``) with the same per-GPU batch: its ``tokens_per_s`` / ``local_mfu`` give a
    multi-GPU run's ``scaling_ratio`` and ``e2e_mfu`` (null at world size > 1 without one).
    fp8_recipe: how the FP8 GEMMs scale their operands (torchao's two ``Float8Linear`` recipes): "rowwise"
    (default; one scale per row along each GEMM's contraction: the backward quantizes the gradient twice and x
    once more, column-wise, for the weight gradient) or "tensorwise" (one scale per tensor: x, the weight and the
    gradient are quantized once each and their FP8 bytes, transposed, serve the backward GEMMs; the forward saves
    x's FP8 copy for the backward instead of x; the pre-norm's FP8 output is not fused). On the H200 at GEM
    scale rowwise measured 0.79x the bf16 step; tensorwise is not measured on a GPU yet (``gemray.model.fp8``).
    fp8_grad: format of the backward GEMMs under fp8: "e4m3" (FP8 dgrad/wgrad, e4m3
    gradients scaled as fp8_recipe says, as torchao's recipes; default), "e5m2" (e5m2 gradients) or "bf16" (bf16
    GEMMs on the high-precision x and weight, which the forward then saves under either recipe).
    fp8_min_dim: GEMMs with K or N below it stay high precision (so do dims that are
    not multiples of 16). fp8_attention_inputs: FP8 q/k/v into the attention kernels -- NOT implemented
    (true is refused; the attention kernels take bf16/fp32). fp8_stats: log per-layer amax / overflow /
    underflow of the FP8 quantizations every ``log_every`` steps (eager steps only: not under ``compile``).
    activation_checkpointing: "none", "full" (recompute every HSTU block and the tower), "selective"
    (op-level selective checkpointing of every HSTU block and the tower: the outputs of the GEMMs and of the
    attention custom ops are kept, the LayerNorms, SiLU, products, dropout and casts recomputed in the
    backward), "auto" (the planner of ``gemray.parallel.activation_checkpoint`` picks a level -- none,
    selective or full -- per module, cheapest recompute per byte saved first, until the predicted peak fits
    ``activation_memory_budget``) or "torch" (torch.compile each HSTU block with
    ``torch._functorch.config.activation_memory_budget`` = the budget, a fraction).
    activation_memory_budget: bytes (at least 1 MiB; a number between 1 and that is refused: 2 is no budget of
    2 bytes) or a fraction 0 < f <= 1 of the no-checkpointing peak; "auto" plans
    for a batch of 1.25x (``gemray.jagged.TOKEN_HEADROOM``) the tokens of the batch it measured, and the peak a
    fraction refers to is that batch's; 0 = off ("auto" then checkpoints nothing).
    compile: torch.compile the dense per-token modules -- every HSTU block, the encoder's input scaling and output
    L2 norm, the retrieval head (with the states' projection to E; its float32 [T, E] normalisations, gathers and
    their backward, ~1-1.5 ms of eager kernels on the GEM-scale step), and the candidate tower -- one by one,
    after parallelize, with dynamic shapes (the token count changes every step: one graph per module kind, not one
    per batch); their elementwise work (casts, LayerNorms, SiLU, the residual) fuses and the launches drop. The
    attention stays the Triton custom ops. Default false; the first steps compile (``gemray bench train``'s
    warm-up covers them). Shares ``gemray.parallel.compile`` with activation_checkpointing "torch" (which
    compiles the blocks whatever this says). compile_backend: the torch._dynamo backend, "inductor" (default;
    on CUDA), "aot_eager" or "eager" (both for debugging: no codegen). compile_tower: also compile the
    candidate tower (default true). compile_dynamic: "auto" (default; ``dynamic=None``: dynamo's automatic
    dynamic shapes: the sizes seen changing between calls -- T, B, C -- become symbolic at the second call, the
    rest stays static; one more compile per module kind) or "all" (``dynamic=True``: every size symbolic from the
    first call). Under FSDP2 "all" also makes the blocks' own integer attributes (heads, head widths) symbolic --
    dynamo does not guard FSDP modules, so it cannot specialise them -- and inductor then emits the blocks'
    kernels for unknown widths (the GEM block's fused SiLU / LayerNorm backward 3.8x slower, bias gradients as a
    separate column reduction: benchmarks/reports/gem_h200_2026-12-04.md). compile_optimize_ddp: dynamo's
    DDPOptimizer (``torch._dynamo.config.optimize_ddp``) for the blocks compiled inside DDP's forward
    (``parallel.dense = "ddp"``): false (default) keeps one graph per block, whose gradients fill DDP's buckets
    block by block; true (torch's default) splits each compiled block at DDP's 25 MB bucket boundaries (a GEM
    block holds 20 MB of parameters: its graphs came out cut in two, and 2 blocks under DDP ran 4% slower on
    the H200). Both also apply to the blocks that activation_checkpointing "torch" compiles.
    compile_mode: torch.compile's ``mode`` for those modules: "default" or "max-autotune-no-cudagraphs" (inductor
    also times Triton GEMM templates against cuBLAS at compile time and may fuse a GEMM's elementwise epilogue, e.g.
    the block's SiLU after its uvqk projection, into it; longer compiles). CUDA graphs ("reduce-overhead") are not
    offered: the token count changes every step.
    compile_options: inductor config options for those modules, "name=value" strings (e.g. ["cpp_wrapper=true",
    "triton.enable_pdl=true", "coordinate_descent_tuning=true"]; names as in ``torch._inductor.config``, dotted for
    its sub-configs; each value read as its option's type: :func:`compile_options`), passed as torch.compile's
    ``options`` (merged over ``compile_mode``'s own, ``torch._inductor.list_mode_options``); for trying inductor's
    knobs on a config without code changes. An unknown name or a value of the wrong type is refused when the config
    is validated (``cpp_wrapper=true`` validates but failed with a device-side assert in the GEM-scale config's
    kernel warm-up on an H100, 2026-12-06). Inductor only
    (another ``compile_backend`` ignores them, with the warning below).
    With ``compile = false`` a non-default compile_backend / compile_dynamic / compile_optimize_ddp / compile_mode /
    compile_options (unless
    activation_checkpointing is "torch", which compiles the blocks with them) and compile_tower do nothing:
    they are still validated, and kept (a config may hold them for toggling ``compile``); ``fit`` logs one
    warning (:meth:`JobConfig.ineffective_settings_warning`).
    deterministic: bit-reproducible training (default true): ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` in every worker before the model is built (``gemray.train.trainer.apply_determinism``). Without
    it the same seed gives runs that drift apart from the first steps: FBGEMM's TBE backward on CUDA splits an
    embedding row that occurs more than 1024 times in a batch (the rating / time-gap features, popular items)
    over several thread blocks and adds their partial gradients with atomics, and on CPU the multi-threaded
    index backward (the position embedding) adds in thread order. The drift starts at ~1e-9 in the tables and
    can grow through training until the epoch loss differs in the 4th decimal (ML-1M on an H200: from epoch 6 of
    12). False: FBGEMM's split long rows and PyTorch's default kernels (faster where they differ).
    """

    PRECISIONS = ("fp32", "bf16", "fp8")
    #: activation_checkpointing's modes (``gemray.parallel.activation_checkpoint.MODES``)
    CHECKPOINTING = ("none", "full", "selective", "auto", "torch")
    #: the smallest activation_memory_budget taken as bytes (1 MiB); a number in (1, this) is refused
    MIN_BUDGET_BYTES = 2 ** 20

    epochs: int = 100
    lr: float = 1e-3
    sparse_lr: float = 1e-3
    lr_base_fan_in: int = 0
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    # Adam(W) (beta1, beta2) for the dense part and the Adam kinds of sparse optimizer; (0.9, 0.98) as
    # generative-recommenders' ML-1M recipe.
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    # How the dense AdamW steps (torch.optim.AdamW's implementations, as torchtitan's optimizer.implementation):
    # "auto" = "fused" on CUDA (one multi-tensor kernel: the least host time a step), "foreach" elsewhere;
    # "fused" (CPU too) or "foreach". Same update up to float rounding.
    dense_optimizer_impl: str = "auto"
    # Python's garbage collector (torchtitan's GarbageCollection, its gc_freq 50): N > 0 = automatic collection off
    # while training, a generation-1 collection before every N-th global step and a full one before each evaluation
    # (gemray.train.gc); 0 = automatic (Python's thresholds: a full collection, 1.1-1.2 s at the GEM-scale config on
    # an H100, can fall inside any step)
    gc_every_steps: int = 50
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
    precision: str = "fp32"
    fp8_recipe: str = "rowwise"
    fp8_grad: str = "e4m3"
    fp8_min_dim: int = 128
    fp8_attention_inputs: bool = False
    fp8_stats: bool = True
    activation_checkpointing: str = "auto"
    activation_memory_budget: float = 0.0
    mfu_warmup_steps: int = 10
    scaling_reference: str = ""
    compile: bool = False
    compile_backend: str = "inductor"
    compile_tower: bool = True
    compile_dynamic: str = "auto"
    compile_optimize_ddp: bool = False
    compile_mode: str = "default"
    compile_options: list[str] = field(default_factory=list)
    deterministic: bool = True

    def validate(self) -> None:
        _positive(self, "epochs", "lr", "sparse_lr", "eval_every", "log_every")
        if self.gc_every_steps < 0:
            raise ValueError(f"train.gc_every_steps: expected >= 0 (0 = Python's automatic collection), got "
                             f"{self.gc_every_steps}")
        _choice(self, "precision", self.PRECISIONS)
        for name in ("mfu_warmup_steps", "lr_base_fan_in", "lr_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}: expected >= 0, got {getattr(self, name)}")
        _choice(self, "fp8_recipe", ("rowwise", "tensorwise"))
        _choice(self, "fp8_grad", ("e4m3", "e5m2", "bf16"))
        if self.fp8_min_dim < 16:
            raise ValueError(f"train.fp8_min_dim: expected >= 16, got {self.fp8_min_dim}")
        if self.fp8_attention_inputs:
            raise ValueError("train.fp8_attention_inputs: FP8 attention inputs are not implemented (the jagged "
                             "attention kernels take bf16/fp32 q/k/v); use false")
        _choice(self, "activation_checkpointing", self.CHECKPOINTING)
        _choice(self, "compile_backend", ("inductor", "aot_eager", "eager"))
        _choice(self, "compile_dynamic", ("all", "auto"))
        _choice(self, "compile_mode", ("default", "max-autotune-no-cudagraphs"))
        compile_options(self.compile_options)  # ValueError naming train.compile_options
        b = self.activation_memory_budget
        if 1 < b < self.MIN_BUDGET_BYTES:  # e.g. 2 meant as 2 GB or 200%: as bytes, no plan can reach it
            raise ValueError(f"train.activation_memory_budget = {int(b) if b == int(b) else b} is read as bytes, "
                             "and below 1 MiB that is no usable budget: give a fraction 0 < f <= 1 of the "
                             "no-checkpointing peak (e.g. 0.5) or bytes (e.g. 40e9)")
        if b < 0 or (1 < b and b != int(b)):
            raise ValueError(f"train.activation_memory_budget: expected bytes (an integer >= 1 MiB), a fraction "
                             f"0 < f <= 1 of the no-checkpointing peak, or 0 (off), got {b}")
        if self.activation_checkpointing == "torch" and not 0 < b <= 1:
            raise ValueError("train.activation_memory_budget: activation_checkpointing = 'torch' takes a fraction "
                             f"0 < f <= 1 (torch._functorch.config.activation_memory_budget), got {b}")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay: expected >= 0, got {self.weight_decay}")
        if not self.eval_ks:
            raise ValueError("train.eval_ks: give at least one cut-off K for HR@K / NDCG@K, e.g. [10, 50, 200]")
        if any(int(k) <= 0 for k in self.eval_ks):
            raise ValueError(f"train.eval_ks: expected positive cut-offs, got {self.eval_ks}")
        if len(set(int(k) for k in self.eval_ks)) != len(self.eval_ks):  # metrics.json has one hr@K per K
            raise ValueError(f"train.eval_ks: a cut-off given twice in {self.eval_ks}; give each once")
        if len(self.adam_betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in self.adam_betas):
            raise ValueError(f"train.adam_betas: expected [beta1, beta2] each in [0, 1), got {self.adam_betas}")
        if self.max_steps_per_epoch < 0:
            raise ValueError("train.max_steps_per_epoch: expected >= 0")
        _choice(self, "dense_optimizer_impl", ("auto", "fused", "foreach"))
        _choice(self, "sparse_optimizer", ("auto", "rowwise_adam", "adam", "rowwise_adagrad", "adagrad"))

    def ineffective_compile_settings(self) -> list[str]:
        """Pure: the ``compile_*`` settings at a non-default value that do nothing, as ``"train.<name> = <value>"``:
        with ``compile`` off all six, or under activation_checkpointing "torch" only ``compile_tower`` (it compiles
        the HSTU blocks with the other five, never the tower); with ``compile`` on, ``compile_mode`` /
        ``compile_options`` under a ``compile_backend`` other than inductor. Empty otherwise."""
        if self.compile:
            names = [] if self.compile_backend == "inductor" else ["compile_mode", "compile_options"]
        elif self.activation_checkpointing == "torch":
            names = ["compile_tower"]
        else:
            names = ["compile_backend", "compile_tower", "compile_dynamic", "compile_optimize_ddp", "compile_mode",
                     "compile_options"]
        defaults = type(self)()
        return [f"train.{n} = {_toml_value(getattr(self, n))}" for n in names
                if getattr(self, n) != getattr(defaults, n)]


def compile_options(entries: list[str]) -> dict[str, Any]:
    """``train.compile_options`` ("name=value" strings) as torch.compile's ``options`` dict, each value read as the
    option's own type: a bool option takes true / false / 1 / 0, an int one an integer, a float one a number, a
    string one the text; an option whose default is None takes true / false, a number or the text. Raises
    ValueError naming train.compile_options for an entry without "=", a repeated name, a name that is not one of
    ``torch._inductor.config``'s options (dotted names reach its sub-configs, e.g. "triton.enable_pdl"; the closest
    one is named), a value of another type, or an option of a type that cannot be written here (lists, dicts,
    callables). Parsed once per list of entries in a process (validation, the activation checkpointer and the
    trainer's compile all ask; the result depends on the entries and the installed torch's inductor options only,
    which gemray never changes); each call returns its own copy."""
    if not entries:
        return {}
    return dict(_parsed_compile_options(tuple(str(e) for e in entries)))


@functools.lru_cache(maxsize=16)
def _parsed_compile_options(entries: tuple[str, ...]) -> dict[str, Any]:
    """:func:`compile_options`' parse, cached per entries (errors are raised again, never cached)."""
    import torch._inductor.config as iconfig

    known = iconfig.get_config_copy()
    out: dict[str, Any] = {}
    for e in entries:
        name, eq, raw = str(e).partition("=")
        name, raw = name.strip(), raw.strip()
        if not eq or not name:
            raise ValueError(f"train.compile_options: expected \"name=value\" entries, got {e!r}")
        if name in out:
            raise ValueError(f"train.compile_options: {name} is given twice")
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            raise ValueError(f"train.compile_options: torch._inductor.config has no option {name!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))
        out[name] = _option_value(name, raw, known[name])
    return out


def _option_value(name: str, raw: str, default: Any) -> Any:
    """``raw`` read as the type of the inductor option ``name`` (its ``default``); ValueError otherwise."""
    low = raw.lower()
    as_bool = {"true": True, "1": True, "false": False, "0": False}.get(low)

    def bad(kind: str) -> ValueError:
        return ValueError(f"train.compile_options: {name} takes {kind} (its default is {default!r}), got {raw!r}")

    if isinstance(default, bool):
        if as_bool is None:
            raise bad("true or false")
        return as_bool
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise bad("an integer") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise bad("a number") from None
    if isinstance(default, str):
        return raw
    if default is None:
        if low in ("true", "false"):
            return low == "true"
        for kind in (int, float):
            try:
                return kind(raw)
            except ValueError:
                pass
        return raw
    raise bad(f"a {type(default).__name__}, which cannot be given here")


@dataclass
class RayConfig:
    """Ray Train placement.

    address: Ray cluster address; "" means $RAY_ADDRESS or, if unset, an embedded local cluster started
    and stopped for the run. num_workers: Ray Train workers (= world size). min_workers/max_workers:
    elastic bounds (0 = fixed at num_workers). use_gpu: one GPU per worker, NCCL; else gloo on CPU.
    cpus_per_worker: CPU resource each worker asks for; num_cpus: CPUs the embedded cluster advertises
    (0 = 2 per worker, at least 4: two workers and Ray Data's read tasks starve on 2 real CPUs).
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
            raise ValueError(f"ray.num_cpus: expected >= 0 (0 = 2 per worker, at least 4), got {self.num_cpus}")
        if self.max_failures < -1:
            raise ValueError(f"ray.max_failures: expected >= 0 or -1 (retry forever), got {self.max_failures}")
        if self.min_workers < 0 or self.max_workers < 0:
            raise ValueError("ray.min_workers / ray.max_workers: expected >= 0")
        for name in ("resize_interval_s", "worker_start_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ray.{name}: expected >= 0, got {getattr(self, name)}")
        if self.health_check_interval_s <= 0:
            raise ValueError(f"ray.health_check_interval_s: expected > 0, got {self.health_check_interval_s}")
        if bool(self.min_workers) != bool(self.max_workers):  # training, preflight and k8s read the pair alike
            raise ValueError(f"ray.min_workers / ray.max_workers: set both (an elastic run) or neither (fixed at "
                             f"ray.num_workers), got min_workers = {self.min_workers}, max_workers = "
                             f"{self.max_workers}")
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
class ParallelConfig:
    """How one job is laid out over its ranks (``gemray.parallel.dims.ParallelDims`` reads these).

    dense: the dense (non-embedding) part: "ddp" (replicated, DistributedDataParallel: the default),
    "fsdp" (FSDP2 ``fully_shard`` over every rank) or "hsdp" (FSDP2 on a 2D mesh: replicate across groups
    x shard inside a group of ``dp_shard`` ranks).
    dp_shard: hsdp only: ranks one dense shard group spans (0 = the GPUs of one node; must divide the
    world size, the replicate degree fills the rest).
    sparse_sharding: the TorchRec sharding type of every embedding table: "auto" (the planner chooses among
    those the device supports), "table_wise", "row_wise", "column_wise" or "table_row_wise" (CUDA only).
    sparse_2d_group: > 0: TorchRec 2D parallel (``DMPCollection``): tables sharded inside groups of this
    many ranks, replicated across groups (weights averaged across replicas after every step); 0 = every
    table sharded over the whole world. Must divide the world size.
    expert_parallel: ranks the experts of a mixture-of-experts layer are spread over (0 or 1 = off; borrows
    from the dp_shard dimension, as torchtitan's EP; ``gemray.parallel.expert``: all-to-all dispatch, expert
    gradients reduced over the other data-parallel ranks). Needs ``model.moe_experts`` > 0 divisible by it,
    and dense "fsdp" or "hsdp".
    reshard_after_forward: FSDP2: free the gathered parameters of each block after its forward (re-gathered
    in backward; less memory) or keep them until backward (less communication).
    prefetch: FSDP2 explicit prefetch: block i+1's all-gather issued during block i's forward, block i-1's
    during block i's backward.
    gpus_per_node: devices of one node (0 = detect: the node's visible CUDA devices, 1 on CPU).
    train_pipeline: "none" (each step copies its batch, then distributes its sparse input, then computes) or
    "sparse_dist" (``gemray.train.pipeline``: batch i+1's host-to-device copy, negatives, KJT and TorchRec
    input distribution run while batch i computes, on a CUDA side stream; TorchRec's own
    ``TrainPipelineSparseDist`` cannot trace GEM's forward, see there). Same losses either way.
    collectives: how the FSDP all-gather / reduce-scatter (and every NCCL collective of the job) use the GPU
    (``gemray.parallel.collectives``): "nccl" (NCCL's SM kernels, the default), "copy_engine" (NCCL >= 2.28
    copy-engine collectives on symmetric memory, ``NCCL_CTA_POLICY``=2 "zero-CTA"; SM-free where NCCL can),
    "symmetric_memory" (FSDP2's all-gather / reduce-scatter buffers in NCCL symmetric memory, no multicast);
    CUDA / NCCL only, refused on gloo.
    ddp_at_world_size_1: dense "ddp" at world size 1 wraps the dense part in DDP too (false, default: not
    wrapped, ``gemray.parallel.sharding.SingleRankWrapper``: DDP over one rank changes nothing but costs host
    time every step; the checkpoints are the same either way). For comparisons.
    """

    dense: str = "ddp"
    dp_shard: int = 0
    sparse_sharding: str = "auto"
    sparse_2d_group: int = 0
    expert_parallel: int = 0
    reshard_after_forward: bool = True
    prefetch: bool = True
    gpus_per_node: int = 0
    train_pipeline: str = "none"
    collectives: str = "nccl"
    ddp_at_world_size_1: bool = False

    def validate(self) -> None:
        _choice(self, "dense", ("ddp", "fsdp", "hsdp"))
        _choice(self, "train_pipeline", ("none", "sparse_dist"))
        _choice(self, "collectives", ("nccl", "copy_engine", "symmetric_memory"))
        _choice(self, "sparse_sharding", ("auto", "table_wise", "row_wise", "column_wise", "table_row_wise"))
        for name in ("dp_shard", "sparse_2d_group", "expert_parallel", "gpus_per_node"):
            if getattr(self, name) < 0:
                raise ValueError(f"parallel.{name}: expected >= 0, got {getattr(self, name)}")
        if self.dp_shard and self.dense != "hsdp":
            raise ValueError(f"parallel.dp_shard={self.dp_shard} applies to parallel.dense='hsdp' only "
                             f"(got dense={self.dense!r}; 'fsdp' shards over every rank)")
        if self.expert_parallel > 1 and self.dense == "ddp":
            raise ValueError(f"parallel.expert_parallel={self.expert_parallel} borrows ranks from the dense "
                             f"shard dimension: use parallel.dense='fsdp' or 'hsdp'")


@dataclass
class JobConfig:
    """The whole job: one TOML file, one section per dataclass above."""

    name: str = "gemray"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> "JobConfig":
        """Raise ValueError naming the first bad field; return self."""
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
        if self.parallel.collectives != "nccl" and not self.ray.use_gpu:
            raise ValueError(f"parallel.collectives={self.parallel.collectives!r} needs NCCL on CUDA GPUs "
                             f"(ray.use_gpu=true): gloo on CPU has no copy-engine / symmetric-memory collectives; "
                             f"use parallel.collectives='nccl'")
        return self

    def ineffective_settings_warning(self) -> str | None:
        """Pure: the warning for settings that are valid but have no effect in this config, or None. ``fit`` logs
        it once per run. Covered: the ``compile_*`` settings without anything compiled
        (:meth:`TrainConfig.ineffective_compile_settings`); ``fp8_recipe`` / ``fp8_grad`` / ``fp8_min_dim`` off
        their defaults without ``precision = "fp8"``; a ``model.retrieval_kernel`` off its default without
        "uniform_shared" retrieval negatives; a ``model.uvqk_kernel`` off its default under ``precision = "fp8"``;
        ``model.kernel_tiles`` where the attention is not the Triton kernels'
        (backend "reference", or "auto" without a GPU); ``model.fp32_residual = false`` without autocast;
        ``data.bbs_window_batches`` off its default (training has no BBS window); an
        ``activation_memory_budget`` with a checkpointing mode that does not read it (only "auto" and "torch" do)."""
        t = self.train
        parts = []
        idle = t.ineffective_compile_settings()
        if idle:
            why = ("activation_checkpointing = 'torch' compiles the HSTU blocks only, never the tower"
                   if t.activation_checkpointing == "torch" else
                   "nothing is torch.compile'd: neither train.compile nor activation_checkpointing = 'torch' is on")
            parts.append(f"{', '.join(idle)} {'has' if len(idle) == 1 else 'have'} no effect without train.compile = "
                         f"true ({why}); kept for when train.compile is turned on")
        defaults = TrainConfig()
        fp8 = [f"train.{k} = {_toml_value(getattr(t, k))}" for k in ("fp8_recipe", "fp8_grad", "fp8_min_dim")
               if getattr(t, k) != getattr(defaults, k)]
        if fp8 and t.precision != "fp8":
            parts.append(f"{', '.join(fp8)} {'has' if len(fp8) == 1 else 'have'} no effect without train.precision = "
                         f"\"fp8\" (it is {_toml_value(t.precision)})")
        m = self.model
        if m.retrieval_kernel != ModelConfig().retrieval_kernel and not m.retrieval_kernel_in_use:
            parts.append(f"model.retrieval_kernel = {_toml_value(m.retrieval_kernel)} has no effect with "
                         + (f"model.negatives = {_toml_value(m.negatives)} (only \"uniform_shared\" reads it)"
                            if "retrieval" in m.tasks else "no retrieval task"))
        if m.uvqk_kernel != ModelConfig().uvqk_kernel and t.precision == "fp8":
            parts.append(f"model.uvqk_kernel = {_toml_value(m.uvqk_kernel)} has no effect with train.precision = "
                         "\"fp8\" (the FP8 projections add their own bias)")
        if m.kernel_tiles and (m.attention_backend == "reference"
                               or (m.attention_backend == "auto" and not self.ray.use_gpu)):
            parts.append(f"model.kernel_tiles has no effect with model.attention_backend = "
                         f"{_toml_value(m.attention_backend)}" + ("" if m.attention_backend == "reference" else
                                                                  " and ray.use_gpu = false (the reference attention "
                                                                  "runs; the tiles are the Triton kernels')"))
        if not m.fp32_residual and t.precision == "fp32":
            parts.append("model.fp32_residual = false has no effect with train.precision = \"fp32\" (no autocast: the "
                         "residual stream is float32)")
        if self.data.bbs_window_batches != DataConfig().bbs_window_batches:
            parts.append(f"data.bbs_window_batches = {self.data.bbs_window_batches} has no effect: training balances "
                         "each global step's world_size x batch_size samples (plan_global_step), with no window; the "
                         "key is still read so that earlier configs load")
        if t.activation_memory_budget and t.activation_checkpointing not in ("auto", "torch"):
            parts.append(f"train.activation_memory_budget = {_toml_value(t.activation_memory_budget)} has no effect "
                         f"with train.activation_checkpointing = {_toml_value(t.activation_checkpointing)} (only "
                         "\"auto\" and \"torch\" read it)")
        return "; ".join(parts) or None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def cutoff_advice(ks: list[int], num_items: int, spell: typing.Callable[[list[int]], str]) -> str:
    """Pure: what to give instead of HR@K / NDCG@K cut-offs ``ks`` of which some reach the ``num_items`` items of a
    catalogue (K >= N makes HR@K trivially 1): the largest cut-off allowed, N - 1, and cut-offs that would be
    accepted, written by ``spell`` (e.g. ``[10, 50]`` -> ``"train.eval_ks=[10,50]"`` or ``"--k 10 50"``): ``ks``
    without those at or above N, in their order, or [N - 1] when none is left. The refusals of ``train.eval_ks``
    (gemray train, submit) and of ``gemray evaluate --k`` end with it; they named the catalogue's size but no value
    that would do."""
    n = int(num_items)
    if n < 2:
        return f"a catalogue of {n} item{'s' * (n != 1)} allows no cut-off (K must be at least 1 and below {n})"
    kept = [int(k) for k in ks if int(k) < n] or [n - 1]
    return f"the largest cut-off allowed is {n - 1}: e.g. {spell(kept)}"


def check_num_files(value: Any, name: str = "--num-files", *, auto: bool = False) -> None:
    """Raise ValueError for a count of history files below 1 (below 0 with ``auto``: 0 = chosen from the data), in
    one wording wherever it is given: ``name`` is the flag or config key it came from (``--num-files``,
    ``data.num_files``). (Was: three wordings across prepare movielens / synthetic / interactions and a fourth for
    data.num_files.)"""
    lo = 0 if auto else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}{' (0 = auto)' * auto}, got {value!r}")


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
    """A --set list: ``[a, b]`` or ``a,b`` (a trailing comma allowed, ``[]`` empty), or a TOML array as a
    config file writes it, ``["a", "b,c"]`` (read by tomllib when it holds quotes: its strings may contain
    commas, e.g. ``data.synthetic``'s ``"features=category=512,author=100000"``). Unbalanced or nested
    brackets and empty elements raise ValueError naming the field (``[10,`` was read as ``[10]``)."""
    body = text.strip()
    if body.startswith("[") and ('"' in body or "'" in body):
        try:
            parsed = tomllib.loads(f"v = {body}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{where}: malformed TOML array {text!r} ({e})") from None
        if any(isinstance(x, (list, dict)) for x in parsed):
            raise ValueError(f"{where}: malformed list {text!r} (nested arrays / tables are not a value here)")
        return [x if isinstance(x, str) else _toml_value(x) for x in parsed]
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


def _int_text(text: str) -> int | float:
    """A --set string for an int field as a number: ``int(text)`` when it is an integer literal, else
    ``float(text)`` (``16.0`` -> 16.0), which :func:`_coerce` accepts only when integral -- as it does the
    TOML float ``16.0``. ValueError when it is no number."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _coerce(value: Any, typ: Any, where: str, strict: bool = False) -> Any:
    """Convert a TOML value or a --set string to the field's declared type; ValueError names the field.

    ``strict`` (values from a TOML file, which has its own types): a string is accepted for str fields
    only (``batch_size = "64"`` is an error, not 64); ints still widen to float. Without it (--set, whose
    values are all strings) strings are parsed.

    An int field takes the same numbers from either path: an integer, or a float with an integral value
    (TOML ``16.0``, ``--set ...=16.0`` or ``1e3``) as that integer; a fractional or non-finite one (``16.5``,
    ``inf``) is refused with the field named. A union field (``int | str``: a count or "auto") takes the value as
    the first of its types that fits (``--set ...=2`` is 2, ``auto`` the string)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):  # e.g. ``int | str`` (a count or "auto"): the first type that fits
        for option in typing.get_args(typ):
            try:
                return _coerce(value, option, where, strict)
            except ValueError:
                continue
        names = " or ".join(getattr(t, "__name__", str(t)) for t in typing.get_args(typ))
        raise ValueError(f"{where}: expected {names}, got {value!r}")
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
            number = _int_text(value) if isinstance(value, str) else value
            if isinstance(number, bool) or (isinstance(number, float) and not number.is_integer()):
                raise ValueError
            return int(number)
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


def _did_you_mean(name: str, known: list[str] | set[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name by difflib, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _did_you_mean_top(name: str, cfg: "JobConfig") -> str:
    """:func:`_did_you_mean` for a top-level name: a key of a section first (``epochs`` -> ``train.epochs``; every
    such section named when several have it), else the closest top-level name."""
    owners = _owners(name, cfg)
    if owners:
        return f" (did you mean {' or '.join(repr(o) for o in owners)}?)"
    return _did_you_mean(name, _field_types(JobConfig))


def _did_you_mean_in(section: str, name: str, cfg: "JobConfig") -> str:
    """:func:`_did_you_mean` for a name unknown in ``section``: the same name elsewhere first, a top-level key
    (``train.name`` -> ``name``) or a key of another section (``data.lr`` -> ``train.lr``), else the closest key
    of ``section``."""
    owners = _owners(name, cfg, but=section)
    if owners:
        return f" (did you mean {' or '.join(repr(o) for o in owners)}?)"
    return _did_you_mean(name, _field_types(type(getattr(cfg, section))))


def _known(hint: str, types: typing.Mapping[str, Any]) -> str:
    """The tail of an unknown-key error: the section's keys when there is no suggestion (``hint`` empty), else
    nothing (a section's list runs to ~700 characters on one line and buries the "did you mean")."""
    return "" if hint else f" (known: {sorted(types)})"


def _owners(name: str, cfg: "JobConfig", but: str | None = None) -> list[str]:
    """Where the key ``name`` is known outside section ``but`` (None: the top level): ``"name"`` for a top-level
    key that is not a section, then ``"train.epochs"`` for each other section that has it."""
    top = [name] if but is not None and name in _field_types(JobConfig) and name not in _sections(cfg) else []
    return top + [f"{s}.{name}" for s in _sections(cfg)
                  if s != but and name in _field_types(type(getattr(cfg, s)))]


def _sections(cfg: "JobConfig") -> list[str]:
    return sorted(f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name)))


def from_dict(raw: dict[str, Any], headers: typing.Collection[str] = ()) -> JobConfig:
    """Build a validated JobConfig from a nested dict (TOML layout, TOML types: a string where a number or
    a bool belongs is an error). Unknown keys raise ValueError. ``headers``: the sections a TOML file opens with a
    ``[section]`` header (:func:`load_config`), for which an unknown key known elsewhere is said to belong to the
    section it was written after."""
    cfg = JobConfig()
    top_types = _field_types(JobConfig)
    for key, val in raw.items():
        if key not in top_types:
            raise ValueError(f"unknown config section or key {key!r}{_did_you_mean_top(key, cfg)} "
                             f"(known: {sorted(top_types)})")
        sub = getattr(cfg, key)
        if dataclasses.is_dataclass(sub):
            if not isinstance(val, dict):
                raise ValueError(f"{key}: expected a table, got {val!r}")
            types = _field_types(type(sub))
            for k, v in val.items():
                if k not in types:
                    hint = _did_you_mean_in(key, k, cfg)
                    if key in headers and _owners(k, cfg, but=key):  # e.g. name = "x" at the end of the file
                        hint += f"; a key written after [{key}] belongs to that section"
                    raise ValueError(f"unknown key {key}.{k}{hint}{_known(hint, types)}")
                setattr(sub, k, _coerce(v, types[k], f"{key}.{k}", strict=True))
        else:
            setattr(cfg, key, _coerce(val, top_types[key], key, strict=True))
    return cfg.validate()


SHARED_ENV = "GEMRAY_SHARED"  #: the shared inputs folder (MovieLens data, KubeRay CRDs), ../shared by default
SHARED_PREFIX = "../shared"  #: how the configs name it: the README's layout, ../shared beside the checkout


def shared_path(value: str, environ: typing.Mapping[str, str] = os.environ) -> str:
    """Pure: ``value`` with a leading ``../shared`` (the configs' name for the shared inputs folder beside the
    checkout) replaced by ``$GEMRAY_SHARED`` when that is set and not empty; any other value as it is.
    ``../shared/data/ml-1m`` with ``GEMRAY_SHARED=/mnt/shared`` -> ``/mnt/shared/data/ml-1m``."""
    shared = environ.get(SHARED_ENV, "")
    if not shared or not is_shared_path(value):
        return value
    return str(Path(shared).expanduser() / value[len(SHARED_PREFIX) + 1:])


def is_shared_path(value: str) -> bool:
    """Pure: whether ``value`` names the shared inputs folder as the configs do (``../shared`` or
    ``../shared/...``), the values :func:`shared_path` reads under ``$GEMRAY_SHARED``."""
    return value == SHARED_PREFIX or value.startswith(SHARED_PREFIX + "/")


#: The attribute of a JobConfig in which :func:`apply_overrides` records {"section.key": "../shared/..." value as
#: configured} of its shared paths (:func:`shared_origin`); not a config field (never written to TOML).
_SHARED_ORIGINS = "_shared_origins"


def shared_origin(cfg: JobConfig, key: str) -> str | None:
    """The ``../shared/...`` value the setting ``key`` ("section.key") of ``cfg`` was configured as, when its
    current value is still what that reads as (:func:`shared_path`; a relative one made absolute against the
    current directory, as ``fit`` does); None for a setting configured as any other path, or set since. Tells
    whether advice about ``$GEMRAY_SHARED`` applies to a path that does not exist."""
    origin = getattr(cfg, _SHARED_ORIGINS, {}).get(key)
    if origin is None:
        return None
    section, name = key.split(".")
    current = getattr(getattr(cfg, section), name)

    def absolute(value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else (Path.cwd() / p).resolve()

    return origin if absolute(current) == absolute(shared_path(origin)) else None


#: Model fields that fix parameter shapes: a checkpoint made with other values cannot be restored.
SHAPE_FIELDS = ("embedding_dim", "num_blocks", "num_heads", "attention_dim", "linear_dim", "use_rating_feature",
                "use_time_feature", "num_time_buckets", "num_position_buckets", "model_dim", "token_features",
                "candidate_features", "context_features", "combiner", "tasks", "pma_seeds", "mlp_dims", "table_rows")


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or taskset's share, not the
    machine's count); ``os.cpu_count()`` where the mask cannot be read (not Linux), at least 1. Here, the lowest
    layer, for the data pipelines, the benchmarks and evaluation alike."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def shape_changes(before: JobConfig, after: JobConfig) -> list[str]:
    """Pure: the settings that differ between two configs and fix the model's parameter shapes (``SHAPE_FIELDS``
    and ``data.max_seq_len``), one "model.num_blocks: 2 -> 3" line each; [] when a checkpoint of ``before``
    restores into a model of ``after``."""
    changed = [f"model.{f}: {getattr(before.model, f)} -> {getattr(after.model, f)}" for f in SHAPE_FIELDS
               if getattr(before.model, f) != getattr(after.model, f)]
    if before.data.max_seq_len != after.data.max_seq_len:
        changed.append(f"data.max_seq_len: {before.data.max_seq_len} -> {after.data.max_seq_len}")
    return changed


#: The example every refusal of an override that is not a string shows.
_OVERRIDES_EXAMPLE = "e.g. overrides=['train.epochs=3', 'ray.num_workers=2']"


def check_overrides(overrides: Any) -> list[str]:
    """Pure: ``overrides`` as the list of ``section.key=value`` strings the config functions take (None: [];
    one string: [it]; any other iterable of strings: a list of them). Raises TypeError naming the bad element
    (its index, value and type) and showing an example, for an element that is not a string (``fit(cfg,
    overrides=[1])`` failed deep inside with "argument of type 'int' is not iterable"), a dict (``{"train.epochs":
    3}``: the form ``gemray tune`` takes for its search space, not for overrides) or a value that is no list at
    all. Whether each string is a known ``section.key=value`` is :func:`apply_overrides`' to say."""
    if overrides is None:
        return []
    if isinstance(overrides, str):  # one "section.key=value" given without a list, not its characters
        return [overrides]
    expected = f"each override is a 'section.key=value' string, {_OVERRIDES_EXAMPLE}"
    if isinstance(overrides, dict):
        pairs = ", ".join(repr(f"{k}={v if isinstance(v, str) else _toml_value(v)}") for k, v in overrides.items())
        raise TypeError(f"overrides: a dict is not a list of strings; write it as [{pairs}] ({expected})")
    if isinstance(overrides, (bytes, bytearray)) or not hasattr(overrides, "__iter__"):
        raise TypeError(f"overrides: {overrides!r} ({type(overrides).__name__}) is not a list of strings; "
                        f"{expected}")
    items = list(overrides)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"overrides[{i}]: {item!r} ({type(item).__name__}) is not a string; {expected}")
    return items


def apply_overrides(cfg: JobConfig, overrides: list[str]) -> JobConfig:
    """Apply ``section.key=value`` strings (the CLI's ``--set``), read every ``../shared/...`` value under
    ``$GEMRAY_SHARED`` (:func:`shared_path`; the value as configured is kept for :func:`shared_origin`) and
    re-validate. Every config is finished here (``load_config``, ``fit`` of a JobConfig, tune, submit, serve), so
    this is the one place that maps shared paths. Raises TypeError for ``overrides`` that are not strings
    (:func:`check_overrides`), ValueError naming the field for a bad one."""
    for item in check_overrides(overrides):
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        path, value = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) == 1:
            types = _field_types(JobConfig)
            if parts[0] in types and dataclasses.is_dataclass(getattr(cfg, parts[0])):
                raise ValueError(f"--set {item!r}: {parts[0]!r} is a section; set one of its keys as "
                                 f"{parts[0]}.KEY=VALUE")
            if parts[0] not in types:
                raise ValueError(f"--set {item!r}: unknown key {parts[0]!r}{_did_you_mean_top(parts[0], cfg)} "
                                 f"(sections: {_sections(cfg)})")
            setattr(cfg, parts[0], _coerce(value, types[parts[0]], parts[0]))
            continue
        if len(parts) != 2:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        section, key = parts
        sub = getattr(cfg, section, None)
        if not dataclasses.is_dataclass(sub):
            raise ValueError(f"--set {item!r}: unknown section {section!r}"
                             f"{_did_you_mean(section, _sections(cfg))} (sections: {_sections(cfg)})")
        types = _field_types(type(sub))
        if key not in types:
            hint = _did_you_mean_in(section, key, cfg)
            raise ValueError(f"--set {item!r}: unknown key {section}.{key}{hint}{_known(hint, types)}")
        setattr(sub, key, _coerce(value, types[key], f"{section}.{key}"))
    origins = dict(getattr(cfg, _SHARED_ORIGINS, {}))
    for f in dataclasses.fields(cfg):
        sub = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sub):
            for sf in dataclasses.fields(sub):
                value = getattr(sub, sf.name)
                if isinstance(value, str) and is_shared_path(value):
                    origins[f"{f.name}.{sf.name}"] = value  # for the advice on a missing path (shared_origin)
                    setattr(sub, sf.name, shared_path(value))
    setattr(cfg, _SHARED_ORIGINS, origins)
    return cfg.validate()


def _sets_nothing(raw: dict[str, Any]) -> bool:
    """Pure: whether a parsed TOML file sets no key: empty, or only tables that set none (a file of bare section
    headers such as ``[train]``)."""
    return all(isinstance(v, dict) and _sets_nothing(v) for v in raw.values())


def load_config(path: str | Path | None = None, overrides: list[str] | str | None = None) -> JobConfig:
    """Read a TOML config (or defaults if ``path`` is None), apply overrides (``section.key=value`` strings, or
    one such string), map ``../shared/...`` paths under ``$GEMRAY_SHARED`` (:func:`apply_overrides`), validate.

    Raises TypeError for overrides that are not strings (:func:`check_overrides`, before the file is read),
    FileNotFoundError for a missing file and ValueError naming the field for bad values (and the file, for an
    unknown key or a mistyped value in it).
    """
    overrides = check_overrides(overrides)  # not strings: refused before the file is read
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise FileNotFoundError(f"config file {p} is a folder: give a .toml file (e.g. configs/ml-1m.toml)")
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}")
        try:
            text = p.read_text(encoding="utf-8-sig")  # a BOM (Windows Notepad writes one) is not content
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{p}: invalid TOML: {e}") from None
        except UnicodeDecodeError as e:  # e.g. saved as UTF-16 or Latin-1: name the file and the byte
            raise ValueError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
        headers = re.findall(r"^[ \t]*\[[ \t]*([\w-]+)[ \t]*\]", text, re.MULTILINE)  # the [section] lines
        try:  # an unknown key or a value of the wrong type in the file: say which file
            cfg = from_dict(raw, headers=headers)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
        if _sets_nothing(raw):  # an empty (or all-comment, or only "[train]") file: almost surely not the one meant
            logging.getLogger("gemray.config").warning(
                "%s sets nothing: the defaults are used (ML-1M's data paths and the HSTU-large model); start from "
                "one of configs/*.toml", p)
    else:
        cfg = from_dict(raw)
    return apply_overrides(cfg, overrides)


def _toml_value(v: Any) -> str:
    """A config value as TOML writes it (``true``, ``"all"``, ``[10, 50]``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    """Serialise a JobConfig back to TOML text (round-trips through load_config)."""
    fmt = _toml_value
    lines = [f"name = {fmt(cfg.name)}"]
    for f in dataclasses.fields(cfg):
        sub = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sub):
            lines.append(f"\n[{f.name}]")
            for sf in dataclasses.fields(sub):
                lines.append(f"{sf.name} = {fmt(getattr(sub, sf.name))}")
    return "\n".join(lines) + "\n"


#: The exceptions the command lines (``gemray``, ``python -m gemray.k8s``) report as one ``gemray: error:`` line, exit 2.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)


def writable_file(path: str | Path, option: str, *, make_parents: bool = False) -> Path:
    """Check, before any model is loaded, that ``path`` (the value of ``option``, e.g. ``--out``) names a file this
    process can create or replace: not a folder, in a folder that exists and in which a file can be created (probed
    with a temporary file removed at once; ``os.access`` alone says yes to root on a read-only mount). Writes nothing
    at ``path``. ``make_parents``: the command creates the missing folders above the file (``bench train --json``),
    so the nearest folder on the path that exists is the one probed. Returns it as a Path; raises ValueError
    (NotADirectoryError when a parent on the path is a file) naming the option and the path."""
    import tempfile

    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{option} {p} is a folder; give a file name in it")
    parent = p.parent
    while make_parents and not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.exists():
        raise ValueError(f"{option} {p}: the folder {parent} does not exist (create it first)")
    if not parent.is_dir():
        raise NotADirectoryError(f"{option} {p}: {parent} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=parent, prefix=".gemray-write-probe-"):
            pass
        if p.exists():
            with open(p, "ab"):  # replaceable in place (appends nothing)
                pass
    except OSError as e:
        raise ValueError(f"{option} {p} is not writable: {e.strerror or e}") from e
    return p
