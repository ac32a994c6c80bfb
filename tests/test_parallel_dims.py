"""gemray.parallel.dims: the pure layout decisions (no process group), and the [parallel] config section."""

import pytest

from gemray.config import ParallelConfig, load_config
from gemray.parallel.dims import (ParallelDims, from_config, largest_valid_world, nearest_valid, resolve)


def _pc(**kw) -> ParallelConfig:
    pc = ParallelConfig(**kw)
    pc.validate()
    return pc


@pytest.mark.parametrize("kw, world, gpn, want", [
    (dict(), 4, 1, (4, 1, 1, 0)),                                     # ddp: replicate = world
    (dict(dense="fsdp"), 4, 1, (1, 4, 1, 0)),
    (dict(dense="fsdp"), 1, 1, (1, 1, 1, 0)),
    (dict(dense="hsdp"), 8, 4, (2, 4, 1, 0)),                          # shard inside a node
    (dict(dense="hsdp"), 2, 4, (1, 2, 1, 0)),                          # node bigger than the world: capped
    (dict(dense="hsdp", dp_shard=2), 4, 8, (2, 2, 1, 0)),
    (dict(dense="fsdp", expert_parallel=2), 4, 1, (1, 4, 2, 0)),
    (dict(dense="hsdp", dp_shard=4, expert_parallel=4), 8, 1, (2, 4, 4, 0)),
    (dict(sparse_2d_group=2), 4, 1, (4, 1, 1, 2)),
    (dict(sparse_2d_group=4), 4, 1, (4, 1, 1, 0)),                     # a group of the whole world: plain
])
def test_from_config(kw, world, gpn, want):
    d = from_config(_pc(**kw), world, "cuda", gpn)
    assert (d.dp_replicate, d.dp_shard, d.ep, d.sparse_group) == want
    assert d.dp_replicate * d.dp_shard == world
    assert d.sparse_group_size * d.sparse_replicas == world


@pytest.mark.parametrize("kw, world, msg", [
    (dict(dense="hsdp", dp_shard=3), 4, "dp_shard=3 does not divide world size 4"),
    (dict(dense="fsdp", expert_parallel=3), 4, "expert_parallel=3 does not divide dp_shard=4"),
    (dict(sparse_2d_group=3), 4, "sparse_2d_group=3 does not divide world size 4"),
])
def test_sizes_that_do_not_divide_name_them(kw, world, msg):
    with pytest.raises(ValueError, match=msg):
        from_config(_pc(**kw), world, "cuda", 1)


def test_cpu_limits():
    with pytest.raises(ValueError, match="not supported on cpu"):
        from_config(_pc(sparse_sharding="table_row_wise"), 2, "cpu", 1)
    with pytest.raises(ValueError, match="sparse_2d_group=2 needs CUDA"):
        from_config(_pc(sparse_2d_group=2), 4, "cpu", 1)
    assert from_config(_pc(sparse_2d_group=2), 2, "cpu", 1).sparse_group == 0  # a group of the world: plain


def test_direct_construction_and_fill():
    assert ParallelDims(6, dp_replicate=2, dp_shard=-1, dense="hsdp").dp_shard == 3
    assert ParallelDims(6, dp_replicate=-1, dp_shard=3, dense="hsdp").dp_replicate == 2
    for kw, msg in [(dict(dp_replicate=-1, dp_shard=-1), "at most one"),
                    (dict(dp_replicate=2, dp_shard=2), "!= world size 6"),
                    (dict(dp_replicate=0), ">= 1 or -1"),
                    (dict(dense="ddp", dp_replicate=3, dp_shard=2), "dp_shard must be 1"),
                    (dict(dense="fsdp", dp_replicate=2, dp_shard=3), "dp_replicate must be 1"),
                    (dict(dense="zero"), "parallel.dense")]:
        with pytest.raises(ValueError, match=msg):
            ParallelDims(6, **kw)
    with pytest.raises(ValueError, match="world_size"):
        ParallelDims(0)
    with pytest.raises(ValueError, match="device_type"):
        ParallelDims(1, device_type="tpu")
    with pytest.raises(Exception):  # frozen
        ParallelDims(2).world_size = 3


def test_derived_facts():
    d = from_config(_pc(dense="hsdp", dp_shard=2, expert_parallel=2, sparse_2d_group=2), 4, "cuda")
    assert d.fsdp_enabled and d.ep_enabled and d.sparse_2d and d.backend == "nccl"
    assert d.mesh_shape() == ((2, 1, 2), ("dp_replicate", "dp_shard_out_ep", "ep"))
    assert d.sharding_types == ("row_wise", "table_wise", "column_wise", "table_row_wise")
    plain = from_config(_pc(sparse_sharding="column_wise"), 2, "cpu")
    assert plain.mesh_shape() == ((2, 1), ("dp_replicate", "dp_shard"))
    assert plain.sharding_types == ("column_wise",) and not plain.fsdp_enabled and plain.backend == "gloo"
    assert "table_row_wise" not in from_config(_pc(), 2, "cpu").sharding_types
    assert "2D (groups of 2, 2 replicas)" in d.describe()


def test_elastic_4_to_3_nearest_valid():
    """4 -> 3 workers: HSDP shard 2 and a 2D group of 2 do not divide 3; each goes to the smallest divisor
    >= the configured degree (no rank holds more than before); logged changes name both."""
    pc = _pc(dense="hsdp", dp_shard=2, sparse_2d_group=2)
    assert nearest_valid(pc, 4, "cuda") == (from_config(pc, 4, "cuda"), [])
    d, changes = nearest_valid(pc, 3, "cuda")
    assert (d.dp_replicate, d.dp_shard, d.sparse_group) == (1, 3, 0)
    assert len(changes) == 2 and "dp_shard 2 -> 3" in changes[0] and "sparse_2d_group 2 -> 3" in changes[1]
    assert largest_valid_world(pc, 3, "cuda") == 2
    assert largest_valid_world(pc, 4, "cuda") == 4
    # fill-only layouts hold at every size
    for kw in (dict(), dict(dense="fsdp")):
        for w in (1, 2, 3, 5):
            assert nearest_valid(_pc(**kw), w, "cpu")[1] == []
    # EP: re-fitted inside the new dp_shard
    d, changes = nearest_valid(_pc(dense="fsdp", expert_parallel=2), 3, "cpu")
    assert (d.dp_shard, d.ep) == (3, 3) and "expert_parallel 2 -> 3" in changes[0]


def test_elastic_2_to_1_to_2():
    pc = _pc(dense="hsdp", dp_shard=2, sparse_2d_group=2)
    d1 = resolve(pc, 1, "cuda", elastic=True, gpus_per_node=1)
    assert (d1.dp_replicate, d1.dp_shard, d1.sparse_group) == (1, 1, 0)
    d2 = resolve(pc, 2, "cuda", elastic=True, gpus_per_node=1)
    assert d2 == from_config(pc, 2, "cuda", 1)


def test_resolve_fixed_size_raises_elastic_logs(caplog):
    pc = _pc(dense="hsdp", dp_shard=2)
    with pytest.raises(ValueError, match="dp_shard=2 does not divide world size 3"):
        resolve(pc, 3, "cpu", elastic=False, gpus_per_node=1)
    with caplog.at_level("WARNING", logger="gemray.parallel.dims"):
        d = resolve(pc, 3, "cpu", elastic=True, gpus_per_node=1)
    assert d.dp_shard == 3
    assert "nearest valid layout" in caplog.text and "holds at 2 ranks" in caplog.text


def test_config_section():
    cfg = load_config(None, ["parallel.dense=hsdp", "parallel.dp_shard=2", "parallel.sparse_sharding=row_wise"])
    assert (cfg.parallel.dense, cfg.parallel.dp_shard, cfg.parallel.sparse_sharding) == ("hsdp", 2, "row_wise")
    assert load_config(None).parallel.dense == "ddp"
    for bad, msg in [("parallel.dense=zero3", "parallel.dense"), ("parallel.sparse_sharding=grid", "sparse_sharding"),
                     ("parallel.dp_shard=-2", "parallel.dp_shard"), ("parallel.sparse_2d_group=-1", "sparse_2d_group")]:
        with pytest.raises(ValueError, match=msg):
            load_config(None, [bad])
    with pytest.raises(ValueError, match="applies to parallel.dense='hsdp' only"):
        load_config(None, ["parallel.dp_shard=2"])
    with pytest.raises(ValueError, match="use parallel.dense='fsdp' or 'hsdp'"):
        load_config(None, ["parallel.expert_parallel=2"])


def test_expert_parallel_must_divide_the_experts():
    assert from_config(_pc(dense="fsdp", expert_parallel=2), 4, "cpu", 1, num_experts=4).ep == 2
    with pytest.raises(ValueError, match="expert_parallel=4 does not divide model.moe_experts=6"):
        from_config(_pc(dense="fsdp", expert_parallel=4), 4, "cpu", 1, num_experts=6)
    with pytest.raises(ValueError, match="expert_parallel=2 does not divide model.moe_experts=3"):
        resolve(_pc(dense="fsdp", expert_parallel=2), 2, "cpu", elastic=False, gpus_per_node=1, num_experts=3)


def test_elastic_4_to_3_with_experts_logs_the_nearest_layout(caplog):
    """FSDP with ep 2 over 4 experts: at 3 ranks dp_shard is 3 and no ep > 1 divides both 3 and the 4 experts:
    ep goes to 1 (every rank holds every expert), logged; HSDP shard 2 x ep 2 at 3 ranks likewise; 8 experts
    with ep 2 at 6 ranks keep ep 2 (it divides 6 and 8); 2 -> 1 -> 2 returns to the configured layout."""
    pc = _pc(dense="fsdp", expert_parallel=2)
    assert nearest_valid(pc, 4, "cpu", 1, num_experts=4)[1] == []
    with caplog.at_level("WARNING", logger="gemray.parallel.dims"):
        d = resolve(pc, 3, "cpu", elastic=True, gpus_per_node=1, num_experts=4)
    assert (d.dp_shard, d.ep, d.num_experts) == (3, 1, 4)
    assert "expert_parallel 2 -> 1 (must divide dp_shard 3 and model.moe_experts 4)" in caplog.text
    assert "holds at 2 ranks" in caplog.text
    d, changes = nearest_valid(_pc(dense="hsdp", dp_shard=2, expert_parallel=2), 3, "cpu", 1, num_experts=4)
    assert (d.dp_replicate, d.dp_shard, d.ep) == (1, 3, 1) and len(changes) == 2
    d, changes = nearest_valid(_pc(dense="fsdp", expert_parallel=4), 6, "cpu", 1, num_experts=8)
    assert d.ep == 2 and "expert_parallel 4 -> 2" in changes[0]  # none >= 4 divides 6 and 8: the largest below
    d1 = resolve(pc, 1, "cpu", elastic=True, gpus_per_node=1, num_experts=4)
    assert (d1.dp_shard, d1.ep) == (1, 1)
    assert resolve(pc, 2, "cpu", elastic=True, gpus_per_node=1, num_experts=4).ep == 2
