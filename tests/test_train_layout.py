"""gemray.parallel.plan_layout: the pure decision (no process group needed); parallelize's checks and logging."""

import logging
from contextlib import contextmanager

import pytest

from gemray.parallel import plan_layout


def test_cpu_and_cuda_layouts():
    cpu = plan_layout(2, "cpu")
    assert (cpu.world_size, cpu.device_type, cpu.backend) == (2, "cpu", "gloo")
    assert "row_wise" in cpu.sharding_types and "data_parallel" not in cpu.sharding_types
    gpu = plan_layout(8, "cuda")
    assert (gpu.backend, gpu.world_size) == ("nccl", 8)
    assert set(cpu.sharding_types) <= set(gpu.sharding_types)
    assert plan_layout(1, "cpu").world_size == 1


@pytest.mark.parametrize("world, dev, msg", [(0, "cpu", "world_size"), (2, "tpu", "device_type")])
def test_bad_layout(world, dev, msg):
    with pytest.raises(ValueError, match=msg):
        plan_layout(world, dev)


def test_parallelize_needs_process_group():
    import torch

    from gemray.config import load_config
    from gemray.parallel import parallelize

    cfg = load_config(None, ["model.embedding_dim=8"])
    with pytest.raises(ValueError, match="not initialised"):
        parallelize(torch.nn.Linear(2, 2), layout=plan_layout(1, "cpu"), cfg=cfg,
                    device=torch.device("cpu"))


def test_embedding_dim_must_be_multiple_of_4(capsys):
    from gemray.cli import main
    from gemray.config import ModelConfig
    from gemray.parallel import check_shardable

    check_shardable(ModelConfig(embedding_dim=52))
    with pytest.raises(ValueError, match="model.embedding_dim=50.*multiple of 4 \\(try 48 or 52\\)"):
        check_shardable(ModelConfig(embedding_dim=50))
    # the CLI refuses it before starting Ray: one line, exit status 2
    assert main(["train", "--config", "configs/ml-latest-small.toml", "--set", "model.embedding_dim=30"]) == 2
    assert "multiple of 4" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["rowwise_adam", "adam", "rowwise_adagrad", "adagrad"])
def test_sparse_optimizer_kwargs_fit_both_consumers(name):
    """TorchRec builds ``cls([param], **kwargs)`` AND hands the same kwargs to FBGEMM's TBE as fused params
    (``lr`` renamed ``learning_rate``). torch.optim.Adam with beta1/beta2 failed the first; this checks both
    consumers for every choice, on CPU, although the Adam kinds only shard on CUDA."""
    import inspect

    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    from gemray.config import JobConfig
    from gemray.parallel.sharding import _sparse_optimizer, sparse_optimizer_kwargs

    cfg = JobConfig()
    cfg.train.adam_betas = [0.8, 0.97]
    cls, _ = _sparse_optimizer(plan_layout(1, "cuda"), name)
    kwargs = sparse_optimizer_kwargs(cls, cfg)
    cls([torch.nn.Parameter(torch.randn(4, 4))], **dict(kwargs))
    tbe = set(inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters)
    fused = {("learning_rate" if k == "lr" else k) for k in kwargs}
    assert fused <= tbe, fused - tbe
    assert kwargs["lr"] == cfg.train.sparse_lr
    if "adam" in name:
        assert (kwargs["beta1"], kwargs["beta2"]) == (0.8, 0.97)
    else:
        assert "beta1" not in kwargs


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextmanager
def _listening(*names: str, level: int = logging.INFO):
    """Records reaching the loggers ``names`` (set to ``level``; restored after), as a handler on each sees them."""
    h = _Records()
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(h)
        lg.setLevel(level)
    try:
        yield h.records
    finally:
        for lg, lvl in zip(loggers, saved):
            lg.removeHandler(h)
            lg.setLevel(lvl)


def test_torchrec_info_is_demoted_to_debug_and_its_warnings_pass():
    """torchrec_logs_at_debug: with the root at DEBUG (a Ray worker's is at INFO), TorchRec's records below WARNING
    (the planner's) reach no handler; with gemray's DEBUG on they come back on gemray.parallel.sharding at DEBUG,
    a message its logger repeats once with the count (the planner interleaves two per proposal), the statistics
    table's rows as they came; warnings reach the root as before; TorchRec's logger's level and propagation are
    restored."""
    from gemray.parallel.sharding import torchrec_logs_at_debug

    partitioners, stats = (logging.getLogger(f"torchrec.distributed.planner.{n}") for n in ("partitioners", "stats"))
    planner = logging.getLogger("torchrec")
    before = (planner.level, planner.propagate, list(planner.handlers))
    for gemray_level in (logging.INFO, logging.DEBUG):
        with _listening("", level=logging.DEBUG) as root, \
                _listening("gemray.parallel.sharding", level=gemray_level) as ours:
            with torchrec_logs_at_debug():
                partitioners.info("Total 0 feature processor.")
                for _ in range(3):
                    partitioners.info("GreedyPerfPartitioner - sort_by: SortBy.STORAGE, balance_modules: False")
                    partitioners.debug("param_count is {'embeddings': 8}")
                stats.info("# Total Variation: 0.000")
                stats.info("# DDR Imbalance Statistics")
                stats.info("# Total Variation: 0.000")  # a table's row: kept where it is
                partitioners.warning("a planner warning")
        assert [(r.name, r.levelname, r.getMessage()) for r in root if r.name.startswith("torchrec")] == [
            ("torchrec.distributed.planner.partitioners", "WARNING", "a planner warning")]
        debug = [r.getMessage() for r in ours]
        if gemray_level == logging.DEBUG:
            assert debug == ["torchrec: Total 0 feature processor.",
                             "torchrec: GreedyPerfPartitioner - sort_by: SortBy.STORAGE, balance_modules: False (x3)",
                             "torchrec: param_count is {'embeddings': 8} (x3)",
                             "torchrec: # Total Variation: 0.000", "torchrec: # DDR Imbalance Statistics",
                             "torchrec: # Total Variation: 0.000"]
            assert all(r.levelno == logging.DEBUG for r in ours)
        else:
            assert debug == []
        assert (planner.level, planner.propagate, list(planner.handlers)) == before


def test_parallelize_keeps_torchrec_planner_info_off_the_console():
    """parallelize on the CPU with the root logger at INFO (a Ray worker's setting, under which gemray.fit printed
    TorchRec's 'GreedyPerfPartitioner - sort_by: ...' once per proposal, 'EmbeddingPerfEstimatorFactory is creating
    ...', 'Total 0 feature processor.', the planner's statistics table and DMP's 'EC index dedup enabled: ...'): no
    TorchRec record below WARNING reaches the root; gemray's own sharding-plan line does."""
    import torch

    from gemray.bench.train import _init_process_group
    from gemray.config import load_config
    from gemray.model import GEM
    from gemray.parallel import parallelize

    cfg = load_config(None, ["model.embedding_dim=8", "model.num_blocks=1", "model.num_heads=2",
                             "model.attention_dim=4", "model.linear_dim=4", "model.num_negatives=4",
                             "data.max_seq_len=8"])
    import torch.distributed as dist

    made = _init_process_group(torch.device("cpu"))
    try:
        with _listening("", level=logging.INFO) as root, _listening("gemray.parallel.sharding") as ours:
            parallelize(GEM(cfg.model, 50, "meta", max_seq_len=8), layout=plan_layout(1, "cpu"), cfg=cfg,
                        device=torch.device("cpu"))
    finally:
        if made:
            dist.destroy_process_group()
    chatter = [r.getMessage() for r in root if r.name.startswith("torchrec") and r.levelno < logging.WARNING]
    assert chatter == [], chatter[:5]
    assert any(r.getMessage().startswith("layout world 1: ") and "sharding plan" in r.getMessage() for r in ours)


def _fresh_recat(monkeypatch):
    """TorchRec's own _get_recat in dist_data (restored after the test), wrapped in a call counter."""
    from torchrec.distributed import dist_data

    original = getattr(dist_data._get_recat, "__wrapped__", dist_data._get_recat)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(dist_data, "_get_recat", counted)
    return dist_data, original, calls


def test_recat_cache_returns_torchrec_values_once_per_shape(monkeypatch):
    """cache_torchrec_recat: each distinct call of TorchRec's _get_recat (its host-int arguments) runs once and its
    tensor is served again (the same object: no per-step host-to-device copy and stream wait); the values are
    TorchRec's own for fixed and variable batch sizes per rank; None (an empty local split) is cached too; the
    cache is bounded; installing twice is a no-op."""
    import torch

    from gemray.parallel import sharding

    dist_data, original, calls = _fresh_recat(monkeypatch)
    assert sharding.cache_torchrec_recat() is True
    assert sharding.cache_torchrec_recat() is False
    get = dist_data._get_recat
    for args in ((2, 4, 1, torch.device("cpu"), None), (3, 2, 1, torch.device("cpu"), [5, 5]),
                 (2, 4, 2, torch.device("cpu"), [3, 1, 4, 1]), (1, 1, 1, torch.device("cpu"), [128])):
        first = get(*args)
        n = len(calls)
        again = get(*args[:2], stagger=args[2], device=args[3], batch_size_per_rank=args[4])
        assert again is first and len(calls) == n  # served from the cache, TorchRec not called again
        assert torch.equal(first, original(*args))
    assert get(0, 4, 1, torch.device("cpu"), None) is None and get(0, 4, 1, torch.device("cpu"), None) is None
    assert calls.count((0, 4, 1, torch.device("cpu"), None)) == 1
    assert not torch.equal(get(2, 4, 2, torch.device("cpu"), None), get(2, 4, 1, torch.device("cpu"), None))
    for b in range(sharding._RECAT_CACHE_SIZE + 5):
        get(1, 2, 1, torch.device("cpu"), [b, b + 1])
    assert len(get.cache) == sharding._RECAT_CACHE_SIZE


def test_training_steps_build_the_recat_once(monkeypatch):
    """Through parallelize and DMP: three training steps of a GEM (an input distribution per sharding type a step)
    call TorchRec's _get_recat once per distinct shape, not once per step and input distribution; the losses
    equal those of the same steps without the cache."""
    import torch
    import torch.distributed as dist

    from gemray.bench.train import _init_process_group
    from gemray.config import load_config
    from gemray.model import GEM
    from gemray.parallel import build_optimizer, parallelize
    from model_utils import random_batch

    cfg = load_config(None, ["model.embedding_dim=8", "model.num_blocks=1", "model.num_heads=2",
                             "model.attention_dim=4", "model.linear_dim=4", "model.num_negatives=4",
                             "data.max_seq_len=8"])

    def losses(cached: bool) -> list[float]:
        torch.manual_seed(0)
        dmp = parallelize(GEM(cfg.model, 50, "meta", max_seq_len=8), layout=plan_layout(1, "cpu"), cfg=cfg,
                          device=torch.device("cpu"))
        if not cached:  # undo what parallelize installed
            monkeypatch.setattr(dist_data, "_get_recat", counted)
        opt = build_optimizer(dmp, cfg)
        out = []
        for s in range(3):
            batch = random_batch([3, 5, 1, 8], num_items=49, seed=s)
            dmp.module.seed_sampling(s)
            opt.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            opt.step()
            out.append(float(loss.detach()))
        return out

    dist_data, _, calls = _fresh_recat(monkeypatch)
    counted = dist_data._get_recat
    made = _init_process_group(torch.device("cpu"))
    try:
        with_cache = losses(True)
        cached_calls = len(calls)
        assert dist_data._get_recat is not counted and dist_data._get_recat.__wrapped__ is counted
        served = len(dist_data._get_recat.cache)
        calls.clear()
        without = losses(False)
    finally:
        if made:
            dist.destroy_process_group()
    assert 1 <= cached_calls == served  # one call per distinct shape
    assert len(calls) >= 3 * cached_calls and len(calls) % 3 == 0  # uncached: every step, every input dist
    assert with_cache == without


def test_world_size_1_leaves_the_dense_part_unwrapped_with_the_same_state_dict():
    """Dense "ddp" at world size 1: no DDP around the dense part (SingleRankWrapper: DDP over one rank costs host time
    and changes nothing), the same state dict keys and values as with DDP (parallel.ddp_at_world_size_1), so
    checkpoints move between the two."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gemray.bench.train import _init_process_group
    from gemray.config import load_config
    from gemray.model import GEM
    from gemray.parallel import parallelize

    base = ["model.embedding_dim=8", "model.num_blocks=1", "model.num_heads=2", "model.attention_dim=4",
            "model.linear_dim=4", "model.num_negatives=4", "data.max_seq_len=8"]
    made = _init_process_group(torch.device("cpu"))
    try:
        built = {}
        for ddp in (False, True):
            cfg = load_config(None, base + [f"parallel.ddp_at_world_size_1={str(ddp).lower()}"])
            built[ddp] = parallelize(GEM(cfg.model, 50, "meta", max_seq_len=8), layout=plan_layout(1, "cpu"),
                                     cfg=cfg, device=torch.device("cpu"))
    finally:
        if made:
            dist.destroy_process_group()
    assert not isinstance(built[False]._dmp_wrapped_module, DistributedDataParallel)
    assert isinstance(built[True]._dmp_wrapped_module, DistributedDataParallel)
    plain, ddp = built[False].state_dict(), built[True].state_dict()
    assert sorted(plain) == sorted(ddp)
    dense = [k for k in plain if "embeddings" not in k]
    assert dense and all(torch.equal(plain[k], ddp[k]) for k in dense)  # same seeded init either way


@pytest.mark.parametrize("impl", ["auto", "fused", "foreach"])
def test_dense_optimizer_impl_sets_adamw_and_updates_alike(impl):
    """train.dense_optimizer_impl: "auto" is foreach on the CPU (fused needs the parameters on CUDA to be chosen),
    "fused" / "foreach" as asked; one AdamW step from the same gradients moves the dense weights alike (fused and
    foreach differ by float rounding only)."""
    import torch
    import torch.distributed as dist

    from gemray.bench.train import _init_process_group
    from gemray.config import load_config
    from gemray.model import GEM
    from gemray.parallel import build_optimizer, parallelize

    base = ["model.embedding_dim=8", "model.num_blocks=1", "model.num_heads=2", "model.attention_dim=4",
            "model.linear_dim=4", "model.num_negatives=4", "data.max_seq_len=8", "train.lr=1e-2"]
    made = _init_process_group(torch.device("cpu"))
    after = {}
    try:
        for which in (impl, "foreach"):
            cfg = load_config(None, base + [f"train.dense_optimizer_impl={which}"])
            dmp = parallelize(GEM(cfg.model, 50, "meta", max_seq_len=8), layout=plan_layout(1, "cpu"), cfg=cfg,
                              device=torch.device("cpu"))
            opt = build_optimizer(dmp, cfg)
            groups = [g for name, o in opt.optimizers if name == "dense" for g in o.param_groups]
            want_fused = which == "fused"
            assert groups and all(bool(g["fused"]) == want_fused and bool(g["foreach"]) != want_fused
                                  for g in groups)
            dense = {n: p for n, p in dmp.named_parameters() if "embeddings" not in n}
            gen = torch.Generator().manual_seed(1)
            for p in dense.values():
                p.grad = torch.randn(p.shape, generator=gen)
            before = {n: p.detach().clone() for n, p in dense.items()}
            opt.step()
            after[which] = {n: p.detach().clone() for n, p in dense.items()}
            assert all(not torch.equal(before[n], after[which][n]) for n in dense)  # every dense weight stepped
    finally:
        if made:
            dist.destroy_process_group()
    a, b = after[impl], after["foreach"]
    assert sorted(a) == sorted(b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=n)
