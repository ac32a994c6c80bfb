"""DCP checkpoints across layouts: saved by 2 gloo ranks with FSDP2 dense + row-wise tables, restored at
world size 1 into FSDP2 and into DDP (the elastic 2 -> 1 resize, and a change of dense layout): every dense
parameter, embedding table and optimizer state comes back whole and exact (FSDP's DTensor shards and
TorchRec's sharded tables are resharded by DCP). The same for a ranking GEM with a 4-expert MoE tower saved
under expert parallelism over the 2 ranks (each holding 2 experts): restored at 1 rank, EP off, the experts
and their AdamW moments come back as the full [4, ...] tensors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from proc_utils import free_port, spawn_ranks
from test_parallel_gloo import MOE, NUM_ITEMS, _batch, _cfg, _full

# (name, dense layout saved at 2 ranks, overrides); restored at 1 rank into FSDP2 and into DDP
SAVED = [("plain", "fsdp", []), ("moe_ep", "fsdp", MOE + ["parallel.expert_parallel=2"])]


def _build(cfg, world: int):
    from gemray.model import GEM
    from gemray.parallel import build_optimizer, from_config, parallelize, plan_layout

    dims = from_config(cfg.parallel, world, "cpu", 1, cfg.model.moe_experts)
    model = GEM(cfg.model, NUM_ITEMS, "meta", max_seq_len=cfg.data.max_seq_len)
    dmp = parallelize(model, layout=plan_layout(world, "cpu", dims), cfg=cfg, device=torch.device("cpu"))
    return dmp, build_optimizer(dmp, cfg)


def _whole(v) -> torch.Tensor:
    """Collective: the whole value of a plain tensor, FSDP DTensor or TorchRec ShardedTensor."""
    if hasattr(v, "full_tensor") or hasattr(v, "local_shards"):
        return _full(v, 1)
    return v.detach().clone()


def _state(dmp, opt) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": _whole(v) for k, v in dmp.state_dict().items() if isinstance(v, torch.Tensor)}
    for k, st in opt.state_dict()["state"].items():
        for kk, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"optim.{k}.{kk}"] = _whole(v)
    return out


def _save_one_layout(rank: int, root: Path, cfg) -> None:
    import torch.distributed as dist

    from gemray.checkpoint import save_checkpoint

    dmp, opt = _build(cfg, 2)
    assert any(hasattr(p, "full_tensor") for p in dmp.module.encoder.parameters()), "dense part is not FSDP"
    ranking = bool(cfg.model.ranking_tasks)
    if cfg.model.moe_experts:
        assert dmp.module.tower.moe.w1.to_local().shape[0] == cfg.model.moe_experts // 2, "experts not sharded"
    gen = torch.Generator().manual_seed(5 + rank)
    for lengths in ([3, 5], [4, 2, 6]):
        loss, _ = dmp(_batch(lengths, gen, [3] * len(lengths) if ranking else None))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    want = _state(dmp, opt)
    save_checkpoint(root / f"rank{rank}", dmp, opt, {"epoch": 1, "global_step": 2},
                    data={"num_items": NUM_ITEMS})
    if rank == 0:
        torch.save(want, root / "expected.pt")
    dist.barrier()
    if rank == 0:  # Ray Train V2 merges the ranks' directories
        merged = root / "merged"
        merged.mkdir()
        for r in range(2):
            for f in (root / f"rank{r}").iterdir():
                shutil.copy(f, merged / f.name)
    dist.barrier()


def _save_two(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for name, dense, extra in SAVED:
        _save_one_layout(rank, Path(root) / name, _cfg(dense, "row_wise", extra))
    (Path(root) / f"saved{rank}").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()


def _load_one(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from gemray.checkpoint import load_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    for name, _, extra in SAVED:
        want = torch.load(Path(root) / name / "expected.pt")
        for dense in ("fsdp", "ddp"):
            cfg = _cfg(dense, "row_wise", [e for e in extra if not e.startswith("parallel.")])
            cfg.train.seed = 999  # a different initialisation, overwritten by the load
            dmp, opt = _build(cfg, 1)
            got = load_checkpoint(Path(root) / name / "merged", dmp, opt)
            assert got["world_size"] == 2 and got["global_step"] == 2
            have = _state(dmp, opt)
            # DDP names no differently from FSDP in DMP's state dict (DMP strips DDP's "module.")
            assert have.keys() == want.keys(), (name, dense, sorted(set(have) ^ set(want)))
            bad = [k for k in want if not torch.equal(have[k], want[k])]
            assert not bad, f"{name} -> {dense}: restored values differ: {bad}"
            if cfg.model.moe_experts:
                assert have["model.tower.mlp.0.w1"].shape[0] == cfg.model.moe_experts
            ranking = bool(cfg.model.ranking_tasks)
            loss, _ = dmp(_batch([2, 3], torch.Generator().manual_seed(1), [2, 2] if ranking else None))
            loss.backward()  # and training goes on
            opt.step()
    (Path(root) / "loaded").write_text("ok")
    dist.destroy_process_group()


def test_fsdp_two_ranks_restore_at_one_rank_fsdp_and_ddp(tmp_path):
    spawn_ranks(_save_two, (free_port(), str(tmp_path)), 2, [tmp_path / "saved0", tmp_path / "saved1"])
    spawn_ranks(_load_one, (free_port(), str(tmp_path)), 1, [tmp_path / "loaded"])
    assert (tmp_path / "loaded").exists()
