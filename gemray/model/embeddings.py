"""The sparse part of the model: one TorchRec EmbeddingCollection (``gemray.parallel.parallelize`` shards
it in place with DistributedModelParallel, which also materialises a meta-built one).

Tables (all ``cfg.embedding_dim`` wide: an EmbeddingCollection needs one width):
    "item"      num_items + 1 rows (row 0 = padding id, never looked up), features item_id, neg_item_id
    "rating"    11 rows (half stars 0..10), feature rating    (if cfg.use_rating_feature)
    "time_gap"  cfg.num_time_buckets rows, feature time_gap   (if cfg.use_time_feature)
Weights start uniform in +-0.02*sqrt(3) (std 0.02, as generative-recommenders' truncated normal 0.02), set
through ``weight_init_min/max`` so unsharded (``init_fn``) and sharded (FBGEMM kernels) builds agree.

Storage (``cfg.table_dtype``, :func:`table_config_kwargs`): float32, or float16 with the same initial draws
rounded to nearest (:func:`uniform_init`: float32 draws, then a cast), so an fp16 model starts from the fp32
model's rows rounded and the RNG stream after the tables is the fp32 build's.
"""

from __future__ import annotations

import functools
import math

import torch
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.modules.embedding_configs import DataType, data_type_to_dtype

from gemray.config import ModelConfig
from gemray.jagged import ITEM_FEATURE, RATING_FEATURE, TIME_FEATURE
from gemray.model.features import NEG_ITEM_FEATURE, NUM_RATINGS

INIT_STD = 0.02
#: ``model.table_dtype`` -> TorchRec's DataType of every table (FBGEMM's TBE ``weights_precision``).
TABLE_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}
#: Elements of one float32 draw of :func:`uniform_init` on the CPU (16 MiB of scratch); exact in chunks there.
INIT_CHUNK = 1 << 22


@torch.no_grad()
def uniform_init(weight: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """Fill ``weight`` (a table [rows, dim], float32 or float16, or a shard of one) with U(a, b) drawn in float32
    from the global RNG of its device, then rounded to nearest into ``weight.dtype``: the ``init_fn`` of every
    gemray table (:func:`table_config_kwargs`). Returns ``weight``.

    float32: ``nn.init.uniform_`` itself. float16: the same float32 draws (float16's own ``uniform_`` is not
    bit-equal to them rounded: on the CPU ~1 element in 10,000 differs; CUDA has its own half kernel), so a
    float16 table is exactly the float32 table of the same seed, rounded, and the RNG advances as far.

    Memory: on the CPU the draws go through a float32 scratch of :data:`INIT_CHUNK` elements (CPU ``uniform_``
    takes one 32-bit word per element in order, so chunks draw what one call draws); on CUDA one launch on a
    float32 scratch of the whole ``weight`` (Philox's values depend on the launch's size, so it cannot be chunked
    exactly): 4 bytes per element, transient -- 12.8 GB for the 50M-row item table of configs/gem-h200.toml on
    one GPU, less than its float32 table holds for good -- freed and handed back to the driver at once.
    """
    if weight.dtype == torch.float32:
        return torch.nn.init.uniform_(weight, a, b)
    flat = weight.view(-1)
    n = flat.numel()
    if weight.device.type == "cpu":
        buf = torch.empty(min(n, INIT_CHUNK), dtype=torch.float32)
        for start in range(0, n, INIT_CHUNK):
            part = buf[:min(INIT_CHUNK, n - start)].uniform_(a, b)
            flat[start:start + part.numel()].copy_(part)
        return weight
    draws = torch.empty(weight.shape, dtype=torch.float32, device=weight.device).uniform_(a, b)
    weight.copy_(draws)
    del draws
    if weight.device.type == "cuda":
        torch.cuda.empty_cache()  # the scratch is the table's size in float32: not kept in the caching allocator
    return weight


def table_config_kwargs(cfg: ModelConfig) -> dict:
    """The EmbeddingConfig arguments every gemray table shares: ``embedding_dim`` (E), ``data_type`` (from
    ``cfg.table_dtype``), ``weight_init_min/max`` (+-0.02*sqrt(3): what FBGEMM's sharded kernels draw first) and
    ``init_fn`` (:func:`uniform_init` with those bounds: what TorchRec draws last, unsharded and sharded).
    Raises ValueError for an unknown ``cfg.table_dtype``."""
    if cfg.table_dtype not in TABLE_DATA_TYPES:
        raise ValueError(f"model.table_dtype: expected one of {tuple(TABLE_DATA_TYPES)}, got {cfg.table_dtype!r}")
    bound = INIT_STD * math.sqrt(3.0)
    return dict(embedding_dim=cfg.embedding_dim, data_type=TABLE_DATA_TYPES[cfg.table_dtype],
                weight_init_min=-bound, weight_init_max=bound,
                init_fn=functools.partial(uniform_init, a=-bound, b=bound))


def table_dtype(config: EmbeddingConfig) -> torch.dtype:
    """The torch dtype a table of ``config`` is stored in (TorchRec's ``data_type_to_dtype``)."""
    return data_type_to_dtype(config.data_type)


def table_bytes(configs: list[EmbeddingConfig]) -> int:
    """Bytes the weights of ``configs``' tables take: sum of rows x dim x the element size of each table's dtype
    (4 for float32, 2 for float16), whole tables (all shards together), without the fused optimizer's state."""
    return sum(int(c.num_embeddings) * int(c.embedding_dim) * table_dtype(c).itemsize for c in configs)


def describe_tables(configs: list[EmbeddingConfig]) -> str:
    """One line on the tables' size, e.g. ``8 tables, 100,000,105 rows x 64, float16: 12.80 GB of weights``
    (:func:`table_bytes`; GB = 1e9 bytes, MB = 1e6 under 1 GB); the dtypes joined by '/' if they differ."""
    rows = sum(int(c.num_embeddings) for c in configs)
    dims = sorted({int(c.embedding_dim) for c in configs})
    dtypes = sorted({str(table_dtype(c)).removeprefix("torch.") for c in configs})
    n = table_bytes(configs)
    size = f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"
    return f"{len(configs)} tables, {rows:,} rows x {'/'.join(map(str, dims))}, {'/'.join(dtypes)}: {size} of weights"


def make_embedding_collection(cfg: ModelConfig, num_items: int,
                              device: torch.device | str = "cpu") -> EmbeddingCollection:
    """EmbeddingCollection for ``cfg`` on ``device`` ("cpu", "cuda" or "meta" for sharding later), tables stored
    in ``cfg.table_dtype`` (float32 / float16 weights; lookups return float32 rows when sharded).

    Raises ValueError when num_items < 1.
    """
    if num_items < 1:
        raise ValueError(f"num_items: expected >= 1, got {num_items}")
    kw = table_config_kwargs(cfg)
    tables = [EmbeddingConfig(name="item", num_embeddings=num_items + 1,
                              feature_names=[ITEM_FEATURE, NEG_ITEM_FEATURE], **kw)]
    if cfg.use_rating_feature:
        tables.append(EmbeddingConfig(name="rating", num_embeddings=NUM_RATINGS,
                                      feature_names=[RATING_FEATURE], **kw))
    if cfg.use_time_feature:
        tables.append(EmbeddingConfig(name="time_gap", num_embeddings=cfg.num_time_buckets,
                                      feature_names=[TIME_FEATURE], **kw))
    return build_embedding_collection(tables, device)


#: Scratch elements for skipping the construction draws of a table left on meta (4 MiB of float32).
SKIP_CHUNK = 1 << 20
#: Largest table (elements) whose construction draws are replayed on CUDA, one launch per draw as a real-device
#: build makes them (a 64 MiB float32 scratch buffer at most); larger tables are not replayed there.
CUDA_REPLAY_MAX = 1 << 24


def _chunk_sizes(n: int, chunk: int) -> list[int]:
    """Chunk sizes summing to n: full chunks, the remainder as a last chunk, or merged into the last full one
    when it is under 16. CPU ``normal_`` draws one word per element plus 16 more when the size is not a
    multiple of 16 (sizes >= 16), so these chunks (chunk a multiple of 16) draw what one call on n draws."""
    full, rem = divmod(n, chunk)
    if full == 0:
        return [n] if n else []
    sizes = [chunk] * full
    if rem >= 16:
        sizes.append(rem)
    elif rem:
        sizes[-1] += rem
    return sizes


def _draw_sizes(config: EmbeddingConfig, device: torch.device | str) -> list[int]:
    """The launches (elements each) that replay a table's draws on ``device``: on CUDA one of the table's size, on
    the CPU chunks of :data:`SKIP_CHUNK` (``_chunk_sizes``); [] for an empty table."""
    n_all = int(config.num_embeddings) * int(config.embedding_dim)
    return [n_all] if torch.device(device).type == "cuda" and n_all else _chunk_sizes(n_all, SKIP_CHUNK)


@torch.no_grad()
def _normal_draws(config: EmbeddingConfig, device: torch.device | str) -> None:
    """The draws of ``nn.Embedding``'s normal reset of a float32 table of ``config``'s size on ``device``, made
    on a float32 scratch buffer (:func:`_draw_sizes`); nothing is kept."""
    sizes = _draw_sizes(config, device)
    if sizes:
        buf = torch.empty(max(sizes), dtype=torch.float32, device=device)
        for n in sizes:
            buf[:n].normal_()


@torch.no_grad()
def skip_table_draws(config: EmbeddingConfig, device: torch.device | str) -> None:
    """Advance ``device``'s global RNG by exactly the draws a real-device build makes for the table of ``config``
    (``nn.Embedding``'s normal reset of a float32 table, then ``config.init_fn``), without allocating the
    table: the same kernels on a float32 scratch buffer of at most ``SKIP_CHUNK`` (+15) elements. Costs the
    table's draws in time (rows x dim twice), not in memory.

    Float32 whatever ``config.data_type``: a float16 table is built as the float32 one rounded
    (:func:`build_embedding_collection`, :func:`init_embedding_tables`), so its draws are the float32 ones --
    CPU ``normal_`` on float16 would take another count of words (a multiple of 16, not n + 16), and the
    dense weights drawn after the tables would differ between an fp16 and an fp32 run.

    Exact on CPU for gemray's tables (uniform ``init_fn`` :func:`uniform_init`: one float32 word per element;
    the normal kernel's per-call rule is kept by ``_chunk_sizes``), which tests/test_model.py and
    tests/test_table_dtype.py check against a real construction. On CUDA the Philox offset advances per kernel
    launch by an amount that depends on the launch's size, so the draws are replayed as one launch each on a
    scratch buffer of the table's size -- exact, and what :func:`init_embedding_tables` does only up to
    :data:`CUDA_REPLAY_MAX` elements (the GPU test in tests/test_model.py checks it against a real construction).
    """
    _normal_draws(config, device)
    sizes = _draw_sizes(config, device)
    if sizes:
        buf = torch.empty(max(sizes), dtype=torch.float32, device=device)
        for n in sizes:
            config.init_fn(buf[:n])


def _replayed(config: EmbeddingConfig, device: torch.device) -> bool:
    """Pure: whether :func:`init_embedding_tables` replays a meta table's draws on ``device`` (CPU always, CUDA up
    to :data:`CUDA_REPLAY_MAX` elements, nothing elsewhere)."""
    n = int(config.num_embeddings) * int(config.embedding_dim)
    return device.type == "cpu" or (device.type == "cuda" and n <= CUDA_REPLAY_MAX)


@torch.no_grad()
def init_embedding_tables(ec: EmbeddingCollection, device: torch.device | str | None = None) -> None:
    """Draw the tables of an unsharded ``ec`` anew, exactly as a float32 ``EmbeddingCollection(...)`` on a real
    device does: table by table in config order, ``nn.Embedding``'s own reset (normal) and then the table's
    ``init_fn`` (:func:`uniform_init` in +-weight_init bounds). Both draws, so that ``torch.manual_seed(s)``
    before either gives equal tables and leaves the global RNG in the same state for what is initialised next.
    A float16 table takes a float32 table's draws (its normal reset on a float32 scratch, :func:`_normal_draws`;
    ``uniform_init`` draws in float32 and rounds): the float32 table of the same seed, rounded to nearest.

    A table whose weight is still on the meta device waits for TorchRec's sharding (whose FBGEMM kernels
    initialise each shard from ``weight_init_min/max`` and TorchRec then calls ``init_fn`` on it): it is not
    allocated, but with ``device`` (the device the rest of the model is initialised on; None or "meta" =
    nothing to skip) its draws are skipped on that device's RNG (:func:`skip_table_draws`), so what is
    initialised next gets the values it gets in a real-device build, wherever the tables end up. Raises
    ValueError for anything but a plain (unsharded) EmbeddingCollection.
    """
    if not isinstance(ec, EmbeddingCollection):
        raise ValueError(f"init_embedding_tables: expected an unsharded torchrec EmbeddingCollection, got "
                         f"{type(ec).__name__} (a sharded collection is initialised by TorchRec)")
    # Replayed on CPU (the test machine's baselines) and on CUDA for tables of up to CUDA_REPLAY_MAX elements:
    # one launch per draw there, which leaves Philox's offset where a real-device build does. Until 2026-12-04
    # CUDA replayed nothing, so a GPU run's dense weights (drawn after the tables) were another sample than a
    # direct GPU build's: ML-1M's curve on the H200 moved from 4.7911 to 4.8127 at epoch 1 (test HR@10 .3724
    # on 2026-11-30, .3659 / .3639 after). GEM-scale tables are not replayed on CUDA (rows x dim draws per
    # start for nothing but the sample): deterministic, the same on every rank.
    skip_on = None if device is None else torch.device(device)
    for config in ec.embedding_configs():
        table = ec.embeddings[config.name]
        if table.weight.is_meta:
            if skip_on is not None and _replayed(config, skip_on):
                skip_table_draws(config, skip_on)
            continue
        if table.weight.dtype == torch.float32:
            table.reset_parameters()
        else:
            _normal_draws(config, table.weight.device)
        config.init_fn(table.weight)


def _rng_state(device: torch.device) -> torch.Tensor | None:
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def build_embedding_collection(tables: list[EmbeddingConfig], device: torch.device | str) -> EmbeddingCollection:
    """``EmbeddingCollection(tables=tables, device=device)``, with float16 tables drawn as float32 ones rounded.

    TorchRec's constructor draws a float16 table's normal reset in float16 (on the CPU another count of RNG words
    than float32: a multiple of 16 rather than n + 16), so the RNG position after it -- and every weight drawn
    next -- would depend on ``model.table_dtype``. With any non-float32 table on a CPU / CUDA device the global RNG
    of that device is put back after construction and :func:`init_embedding_tables` draws the tables again, as a
    float32 build does (bit-equal to the float32 build's tables rounded; the RNG left where the float32 build
    leaves it). A float32 or meta build is TorchRec's construction unchanged.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    state = None if all(t.data_type == DataType.FP32 for t in tables) else _rng_state(dev)
    ec = EmbeddingCollection(tables=tables, device=dev)
    if state is not None:
        if dev.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, dev)
        init_embedding_tables(ec)
    return ec
