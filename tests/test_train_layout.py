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
