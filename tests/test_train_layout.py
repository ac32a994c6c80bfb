"""gemray.parallel.plan_layout: the pure decision (no process group needed)."""

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
