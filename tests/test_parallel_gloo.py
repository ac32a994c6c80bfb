"""Layouts on gloo at world sizes 1, 2 and 4: loss, dense gradients and embedding updates equal the
single-process model's.

Every combination (sparse TW / RW / CW / TorchRec 2D x dense DDP / FSDP2 / HSDP x expert parallelism on /
off, the EP combos on a ranking GEM whose candidate tower is a 4-expert top-2 MoE with a capacity that drops
assignments; at world 1 FSDP2 also with train.compile) is built as the Trainer
builds (GEM on meta -> parallelize -> [compile] -> optimizer) inside one spawned process group per world size (start-up
dominates). Rank r trains sub-batch r of one global batch with its negatives drawn from seed + r. The
reference is one unsharded GEM in each process with the same dense initialisation and the sharded run's
tables (gathered), trained on the same sub-batches one after the other:

- loss: the mean over ranks of the per-rank losses;
- dense gradients: the mean over ranks of the per-sub-batch gradients (what DDP all-reduces and FSDP
  reduce-scatters; FSDP's ``grad.full_tensor()``; the experts' too: under EP each expert's gradient sums
  its ep group's tokens and is reduced over the other data-parallel ranks, ``gemray.parallel.expert``);
- embedding tables after the step: FBGEMM's fused row-wise Adagrad applied to the SUM over ranks of the
  per-sub-batch gradients (TorchRec sums embedding gradients over ranks); for 2D, per replica group (the
  sum over the group's ranks), then averaged across the groups (``DMPCollection.sync``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from proc_utils import free_port, spawn_ranks

NUM_ITEMS = 40
LR, SPARSE_LR, EPS = 0.01, 0.05, 1e-8

# a ranking GEM (CTR) whose interaction MLP is 4 experts, top-2, capacity factor 1 (some assignments drop)
MOE = ["model.tasks=ctr", "model.mlp_dims=8,6", "model.pma_seeds=2", "model.moe_experts=4", "model.moe_top_k=2",
       "model.moe_capacity_factor=1.0", "model.moe_aux_weight=0.1"]
# (dense, sparse_sharding, extra overrides) per world size; each combo runs in the same process group.
COMBOS = {
    # the second: train.compile after FSDP2's wrapping (the Trainer's order), aot_eager (no codegen on CPU)
    1: [("fsdp", "table_wise", []), ("fsdp", "table_wise", ["train.compile=true", "train.compile_backend=aot_eager"]),
        ("ddp", "row_wise", MOE)],
    2: [("ddp", "table_wise", []), ("ddp", "row_wise", []), ("fsdp", "column_wise", []),
        ("hsdp", "row_wise", ["parallel.dp_shard=1"]), ("ddp", "table_wise", MOE), ("fsdp", "column_wise", MOE),
        # torch's fused AdamW (the CUDA default) over DTensors of two meshes (dp_shard and ep)
        ("fsdp", "row_wise", MOE + ["parallel.expert_parallel=2", "train.dense_optimizer_impl=fused"]),
        # HSDP x EP (world 4's third combo, make test-slow) at world 2, so that make test runs it too
        ("hsdp", "table_wise", MOE + ["parallel.dp_shard=2", "parallel.expert_parallel=2"])],
    4: [("hsdp", "row_wise", ["parallel.dp_shard=2"]), ("ddp", "column_wise", []),
        ("hsdp", "table_wise", MOE + ["parallel.dp_shard=2", "parallel.expert_parallel=2"]),
        ("fsdp", "column_wise", MOE + ["parallel.expert_parallel=2"]),
        ("fsdp", "row_wise", MOE + ["parallel.expert_parallel=4"])],
    # TorchRec 2D (DMPCollection) is CUDA-only: the GPU test below, on NCCL
    "gpu2": [("ddp", "row_wise", ["parallel.sparse_2d_group=1"]),
             ("hsdp", "table_wise", ["parallel.dp_shard=2", "parallel.sparse_2d_group=1"]),
             ("fsdp", "row_wise", MOE + ["parallel.expert_parallel=2"]),  # EP's all-to-all on NCCL
             ("fsdp", "table_wise", MOE + ["parallel.expert_parallel=2", "parallel.sparse_2d_group=1"])],
    # SM-free collectives (parallel.collectives): FSDP2 / HSDP with symmetric-memory all-gather buffers, NCCL's
    # zero-CTA policy in the environment before the process group (gemray.parallel.collectives)
    "gpu2_copy_engine": [("fsdp", "row_wise", ["ray.use_gpu=true", "parallel.collectives=copy_engine"]),
                         ("fsdp", "table_wise", MOE + ["ray.use_gpu=true", "parallel.collectives=copy_engine",
                                                       "parallel.expert_parallel=2"])],
    "gpu2_symmetric_memory": [("fsdp", "row_wise", ["ray.use_gpu=true", "parallel.collectives=symmetric_memory"])],
}


def _cfg(dense: str, sparse: str, extra: list[str]):
    from gemray.config import load_config

    return load_config(None, ["model.embedding_dim=8", "model.num_blocks=2", "model.num_heads=2",
                              "model.attention_dim=4", "model.linear_dim=4", "model.num_negatives=4",
                              "model.dropout=0.0", "data.max_seq_len=8", f"train.lr={LR}",
                              f"train.sparse_lr={SPARSE_LR}", f"parallel.dense={dense}",
                              f"parallel.sparse_sharding={sparse}", *extra])


def _batch(lengths: list[int], gen: torch.Generator, candidates: list[int] | None = None):
    """A JaggedBatch of these history lengths; with ``candidates`` (counts per row) also candidates and
    click / convert labels (ranking)."""
    from gemray.jagged import JaggedBatch, lengths_to_offsets

    lens = torch.tensor(lengths, dtype=torch.int64)
    t = int(lens.sum())
    ts = torch.cumsum(torch.randint(1, 1000, (t,), generator=gen), 0)
    extra = {}
    if candidates is not None:
        coff = lengths_to_offsets(torch.tensor(candidates, dtype=torch.int64))
        c = int(coff[-1])
        click = (torch.rand(c, generator=gen) < 0.5).float()
        extra = dict(candidate_offsets=coff, candidate_ids=torch.randint(1, NUM_ITEMS + 1, (c,), generator=gen),
                     labels=torch.stack([click, click * (torch.rand(c, generator=gen) < 0.5).float()], 1))
    return JaggedBatch(user_ids=torch.arange(len(lengths), dtype=torch.int64), offsets=lengths_to_offsets(lens),
                       item_ids=torch.randint(1, NUM_ITEMS + 1, (t,), generator=gen),
                       ratings=torch.randint(1, 11, (t,), generator=gen), timestamps=ts, **extra)


def _full(v, replicas: int) -> torch.Tensor:
    """Collective: the whole tensor of a TorchRec ShardedTensor / DTensor (every rank gets it)."""
    import torch.distributed as dist

    if hasattr(v, "full_tensor"):
        return v.full_tensor().detach().clone()
    shards = v.local_shards()
    out = torch.zeros(v.size(), dtype=v.dtype, device=shards[0].tensor.device if shards else "cpu")
    for s in shards:
        idx = tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
        out[idx] = s.tensor.detach()
    dist.all_reduce(out)
    return out / replicas  # 2D: every shard exists once per replica group


def _tables(dmp, replicas: int) -> dict[str, torch.Tensor]:
    return {k: _full(v, replicas) for k, v in dmp.state_dict().items()
            if k.startswith("embeddings.") and (hasattr(v, "local_shards") or hasattr(v, "full_tensor"))}


def _adagrad(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """FBGEMM's row-wise Adagrad, one step from a zero accumulator."""
    state = (g * g).mean(dim=1, keepdim=True)
    return w - SPARSE_LR * g / (state.sqrt() + EPS)


def _check_combo(rank: int, world: int, device: torch.device, dense: str, sparse: str, extra: list[str]) -> str:
    import torch.distributed as dist

    from gemray.model import GEM
    from gemray.parallel import build_optimizer, from_config, parallelize, plan_layout

    cfg = _cfg(dense, sparse, extra)
    dims = from_config(cfg.parallel, world, device.type, 1)
    model = GEM(cfg.model, NUM_ITEMS, "meta", max_seq_len=cfg.data.max_seq_len)
    dmp = parallelize(model, layout=plan_layout(world, device.type, dims), cfg=cfg, device=device)
    if cfg.train.compile:  # as Trainer.build: after parallelize, per module
        from gemray.parallel.compile import compile_dense_modules

        assert compile_dense_modules(dmp, backend=cfg.train.compile_backend), "nothing compiled"
    opt = build_optimizer(dmp, cfg)
    replicas = dims.sparse_replicas
    tables0 = _tables(dmp, replicas)
    plan_types = {ps.sharding_type for params in dmp.plan.plan.values() for ps in params.values()}
    assert plan_types == {sparse}, (plan_types, sparse)

    # reference: the same dense init (a real-device build with train.seed), the run's tables
    torch.manual_seed(cfg.train.seed)
    ref = GEM(cfg.model, NUM_ITEMS, device, max_seq_len=cfg.data.max_seq_len)
    ref_sd = ref.state_dict()
    for k, v in tables0.items():
        ref_sd[k].copy_(v)

    gen = torch.Generator().manual_seed(7)
    ranking = bool(cfg.model.ranking_tasks)
    batches = [_batch([5, 3, 6][: 2 + (r % 2)], gen, [4, 7, 2][: 2 + (r % 2)] if ranking else None).to(device)
               for r in range(world)]  # ragged, different B per rank

    # the run: rank r's step (its fused embedding optimizer steps inside backward)
    dmp.module.seed_sampling(1000 + rank)
    loss, _ = dmp(batches[rank])
    loss.backward()
    grads = {}
    for n, p in dmp.module.named_parameters():
        if p.grad is not None and not n.startswith("embeddings."):
            g = p.grad
            grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    opt.step()
    opt.zero_grad(set_to_none=True)
    from gemray.parallel import sync_sparse_replicas

    sync_sparse_replicas(dmp)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    tables1 = _tables(dmp, replicas)

    # the single-process reference, sub-batch by sub-batch
    ref_losses, dense_g, table_g = [], {}, []
    emb_params = {k: p for k, p in ref.named_parameters() if k.startswith("embeddings.")}
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        ref.seed_sampling(1000 + r)
        lr_, _ = ref(batches[r])
        lr_.backward()
        ref_losses.append(float(lr_.detach()))
        for n, p in ref.named_parameters():
            if n in emb_params:
                continue
            dense_g[n] = dense_g.get(n, 0) + p.grad / world
        table_g.append({k: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                        for k, p in emb_params.items()})
    torch.testing.assert_close(float(mean_loss), sum(ref_losses) / world, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(dense_g), (sorted(grads), sorted(dense_g))
    for n, g in dense_g.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    groups = [[r for r in range(world) if r % replicas == k] for k in range(replicas)]  # DMPCollection's
    for k, w0 in tables0.items():
        want = sum(_adagrad(w0, sum(table_g[r][k] for r in grp)) for grp in groups) / replicas
        # Adagrad divides by the row's gradient norm, so a row whose gradient cancels to fp32 noise (~1e-8)
        # still takes a full step in a noise direction: compare the rows with a real gradient (rms > 1e-5,
        # in every group) to 2% of a step; rows no rank looked up stay exactly as they were
        rms = torch.stack([sum(table_g[r][k] for r in grp).pow(2).mean(1).sqrt() for grp in groups])
        real = (rms > 1e-5).all(0)
        untouched = (rms == 0).all(0)
        assert not k.endswith(".item.weight") or int(real.sum()) > 0
        torch.testing.assert_close(tables1[k][real], want[real], rtol=0, atol=1e-3, msg=lambda m: f"{k}: {m}")
        assert torch.equal(tables1[k][untouched], w0[untouched]), f"{k}: rows no rank looked up moved"
        if k.endswith(".item.weight"):
            assert not torch.equal(tables1[k], w0), "the item table did not move"
    if cfg.model.moe_experts:  # the experts are sharded over "ep" exactly when EP is on, and were trained
        w1 = dmp.module.tower.moe.w1
        names = tuple(getattr(getattr(w1, "device_mesh", None), "mesh_dim_names", None) or ())
        assert ("ep" in names) == dims.ep_enabled, (names, dims.ep)
        if dims.ep_enabled:
            assert w1.to_local().shape[0] == cfg.model.moe_experts // dims.ep, (tuple(w1.to_local().shape), dims.ep)
        assert "tower.mlp.0.w1" in grads, sorted(grads)
    return f"{dims.describe()} plan={sorted(plan_types)} loss={float(mean_loss):.6f}"


def _worker(rank: int, world: int, port: int, out: str, key) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    gpu = str(key).startswith("gpu2")
    if gpu:
        torch.cuda.set_device(rank)
    if str(key).startswith("gpu2_"):  # parallel.collectives: NCCL's environment before its communicators
        from gemray.parallel.collectives import apply_collectives_env

        apply_collectives_env(str(key)[len("gpu2_"):])
    device = torch.device(f"cuda:{rank}") if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)
    lines = []
    for combo in COMBOS[key]:
        try:
            lines.append(_check_combo(rank, world, device, *combo))
        except AssertionError as e:
            raise AssertionError(f"{combo} at world {world}: {e}") from None
    if rank == 0:
        (Path(out) / "combos.txt").write_text("\n".join(lines))
    (Path(out) / f"done{rank}").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks on 2 cores: ~35-70 s
def test_layouts_match_single_process(world, tmp_path):
    spawn_ranks(_worker, (world, free_port(), str(tmp_path), world), world,
                [tmp_path / f"done{r}" for r in range(world)])
    lines = (tmp_path / "combos.txt").read_text().splitlines()
    assert len(lines) == len(COMBOS[world])


@pytest.mark.gpu
def test_sparse_2d_matches_single_process_on_two_gpus(tmp_path):
    """TorchRec 2D (DMPCollection: groups of 1 rank, 2 replicas, weights averaged by sync()) x DDP / FSDP2,
    and expert parallelism over the 2 GPUs (NCCL all-to-all), on 2 GPUs with NCCL."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn_ranks(_worker, (2, free_port(), str(tmp_path), "gpu2"), 2, [tmp_path / f"done{r}" for r in range(2)])
    assert len((tmp_path / "combos.txt").read_text().splitlines()) == len(COMBOS["gpu2"])


@pytest.mark.gpu
@pytest.mark.parametrize("collectives", ["copy_engine", "symmetric_memory"])
def test_sm_free_collectives_match_single_process_on_two_gpus(collectives, tmp_path):
    """parallel.collectives on 2 GPUs: the same loss / gradients / tables as one process (what changes is
    where the all-gather runs, not what it computes). Run with NCCL_DEBUG=INFO to see NCCL's choice:
    "CTA policy flags set to 2" and "AllGather [Copy Engine]" for copy_engine."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    key = f"gpu2_{collectives}"
    spawn_ranks(_worker, (2, free_port(), str(tmp_path), key), 2, [tmp_path / f"done{r}" for r in range(2)])
    assert len((tmp_path / "combos.txt").read_text().splitlines()) == len(COMBOS[key])
