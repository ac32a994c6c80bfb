"""parallel.train_pipeline = "sparse_dist" on gloo at world 2: the same losses and weights as without it.

Two builds of the same layout (dense FSDP2, row-wise tables; a ranking GEM with retrieval and a 4-expert MoE
tower, so every sparse lookup kind and the MoE dispatch run) train the same 4 steps, once step by step and
once with batch i+1 prefetched (copy, negatives, KJT, TorchRec input_dist) during step i
(``gemray.train.pipeline.SparseDistPipeline`` through ``forward_backward_step``, as the Trainer calls it).
Also: TorchRec's own TrainPipelineSparseDist cannot trace GEM's forward (the reason the pipeline is ours).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from proc_utils import free_port, spawn_ranks
from test_parallel_gloo import MOE, NUM_ITEMS, _batch, _cfg

STEPS = 4


def _run(rank: int, world: int, cfg, pipelined: bool, device: torch.device
         ) -> tuple[list[float], dict[str, torch.Tensor]]:
    from gemray.model import GEM
    from gemray.parallel import build_optimizer, from_config, parallelize, plan_layout
    from gemray.train.pipeline import SparseDistPipeline
    from gemray.train.trainer import forward_backward_step, step_seed

    dims = from_config(cfg.parallel, world, device.type, 1, cfg.model.moe_experts)
    dmp = parallelize(GEM(cfg.model, NUM_ITEMS, "meta", max_seq_len=cfg.data.max_seq_len),
                      layout=plan_layout(world, device.type, dims), cfg=cfg, device=device)
    opt = build_optimizer(dmp, cfg)
    pipe = SparseDistPipeline(dmp, device) if pipelined else None
    gen = torch.Generator().manual_seed(11 + rank)
    batches = [_batch([4, 2, 5][: 2 + (s + rank) % 2], gen, [3, 5, 1][: 2 + (s + rank) % 2]) for s in range(STEPS)]
    losses = []
    for s, batch in enumerate(batches):
        torch.manual_seed(step_seed(cfg.train.seed, s, rank))
        dmp.module.seed_sampling(step_seed(cfg.train.seed + 1, s, rank))
        loss, _ = forward_backward_step(
            dmp, opt, batch, device, pipeline=pipe,
            sampling_seed=step_seed(cfg.train.seed + 1, s, rank),
            next_batch=batches[s + 1] if s + 1 < STEPS else None,
            next_sampling_seed=step_seed(cfg.train.seed + 1, s + 1, rank))
        losses.append(loss)
    if pipe is not None:
        assert pipe.served_ahead == STEPS - 1, pipe.served_ahead  # every step after the first was prefetched
    state = {}
    for k, v in dmp.state_dict().items():
        if hasattr(v, "full_tensor"):
            state[k] = v.full_tensor().detach().clone()
        elif hasattr(v, "local_shards"):
            state[k] = torch.cat([sh.tensor.detach().flatten() for sh in v.local_shards()] or [torch.zeros(0)])
        elif isinstance(v, torch.Tensor):
            state[k] = v.detach().clone()
    return losses, state


def _worker(rank: int, world: int, port: int, out: str, gpu: bool = False) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if gpu:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)
    extra = [e if e != "model.tasks=ctr" else "model.tasks=retrieval,ctr" for e in MOE]
    if world > 1:
        extra = extra + [f"parallel.expert_parallel={world}"]
    cfg = _cfg("fsdp", "row_wise", extra)
    if gpu:
        cfg.model.attention_backend = "reference"  # the pipeline is what is checked, not the kernels
    plain, s0 = _run(rank, world, cfg, False, device)
    piped, s1 = _run(rank, world, cfg, True, device)
    torch.testing.assert_close(piped, plain, rtol=1e-6, atol=1e-7)
    assert plain[0] != plain[-1]  # it trained
    assert s0.keys() == s1.keys()
    for k in s0:
        torch.testing.assert_close(s1[k], s0[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    (Path(out) / f"done{rank}").write_text(" ".join(f"{x:.6f}" for x in plain))
    dist.barrier()
    dist.destroy_process_group()


def test_sparse_dist_pipeline_same_losses_on_two_ranks(tmp_path):
    spawn_ranks(_worker, (2, free_port(), str(tmp_path)), 2, [tmp_path / f"done{r}" for r in range(2)])
    assert len((tmp_path / "done0").read_text().split()) == STEPS


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_sparse_dist_pipeline_same_losses_on_gpus(world, tmp_path):
    """The CUDA side stream (copy + input_dist of batch i+1 under batch i), NCCL, experts over the ranks."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    spawn_ranks(_worker, (world, free_port(), str(tmp_path), True), world,
                [tmp_path / f"done{r}" for r in range(world)])
    assert len((tmp_path / "done0").read_text().split()) == STEPS


def test_torchrec_pipeline_cannot_trace_gem():
    """The reason ``gemray.train.pipeline`` exists: TorchRec's fx tracing of GEM.forward stops at its first
    branch on the batch."""
    import torch.fx

    from gemray.config import load_config
    from gemray.model import GEM

    cfg = load_config(None, ["model.embedding_dim=8", "model.num_blocks=1", "data.max_seq_len=8"])
    with pytest.raises(torch.fx.proxy.TraceError, match="control flow"):
        torch.fx.Tracer().trace(GEM(cfg.model, NUM_ITEMS, "meta", max_seq_len=8))


def test_config_choices():
    from gemray.config import load_config

    assert load_config(None).parallel.train_pipeline == "none"
    assert load_config(None, ["parallel.train_pipeline=sparse_dist"]).parallel.train_pipeline == "sparse_dist"
    with pytest.raises(ValueError, match="parallel.train_pipeline"):
        load_config(None, ["parallel.train_pipeline=torchrec"])
