"""gemray.checkpoint: DCP save -> merge (as Ray Train V2 does) -> verify -> load, on 2 gloo ranks.

Runs the real GEM sharded with TorchRec (row-wise EC on CPU) in two spawned processes: a few training
steps (one rank takes an empty B=0 batch and a batch with a length-1 sequence), save each rank into its
own directory, merge the directories like Ray Train does, then load into a freshly built model and check
that parameters and optimizer state equal the saved ones exactly. Corruption is detected by sha256.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from proc_utils import free_port, spawn_ranks

from gemray.checkpoint import verify_checkpoint

NUM_ITEMS = 50


def _cfg():
    from gemray.config import load_config

    return load_config(None, ["model.embedding_dim=8", "model.num_blocks=1", "model.num_heads=2",
                              "model.attention_dim=4", "model.linear_dim=4", "model.num_negatives=4",
                              "model.dropout=0.0", "data.max_seq_len=8", "train.lr=0.01",
                              "train.sparse_lr=0.05",
                              "train.lr_base_fan_in=4"])  # two dense AdamW groups (lr x 1, x 0.5) round-trip


def _batch(lengths: list[int], gen: torch.Generator):
    from gemray.jagged import JaggedBatch, lengths_to_offsets

    lens = torch.tensor(lengths, dtype=torch.int64)
    t = int(lens.sum())
    off = lengths_to_offsets(lens)
    ts = torch.cumsum(torch.randint(1, 1000, (t,), generator=gen), 0)
    return JaggedBatch(user_ids=torch.arange(len(lengths), dtype=torch.int64), offsets=off,
                       item_ids=torch.randint(1, NUM_ITEMS + 1, (t,), generator=gen),
                       ratings=torch.randint(1, 11, (t,), generator=gen), timestamps=ts)


def _local(v) -> torch.Tensor:
    """This rank's values of a tensor or a TorchRec ShardedTensor, flattened."""
    if hasattr(v, "local_shards"):
        shards = v.local_shards()
        return torch.cat([s.tensor.detach().flatten() for s in shards]) if shards else torch.zeros(0)
    return v.detach().flatten().clone()


def _snapshot(dmp, opt) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": _local(v) for k, v in dmp.state_dict().items() if isinstance(v, torch.Tensor)}
    for k, st in opt.state_dict()["state"].items():
        for kk, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{k}.{kk}"] = _local(v)
    return out


def _build(cfg, world):
    """As the Trainer builds: the whole GEM on meta -> parallelize (shard + materialise) -> optimizer."""
    from gemray.model import GEM
    from gemray.parallel import build_optimizer, parallelize, plan_layout

    model = GEM(cfg.model, NUM_ITEMS, "meta", max_seq_len=cfg.data.max_seq_len)
    dmp = parallelize(model, layout=plan_layout(world, "cpu"), cfg=cfg, device=torch.device("cpu"))
    return dmp, build_optimizer(dmp, cfg)


def _check_materialised(dmp, cfg, world: int) -> None:
    """parallelize left nothing on meta; the dense part is identical on every rank and is exactly the one of
    a direct (unsharded, real-device) build with the same seed (init_weights draws as construction does);
    a model with real parameters is refused."""
    import torch.distributed as dist

    from gemray.model import GEM
    from gemray.parallel import parallelize, plan_layout

    assert not [n for n, p in dmp.named_parameters() if p.is_meta]
    enc = dmp.module.encoder
    torch.manual_seed(cfg.train.seed)
    direct = dict(GEM(cfg.model, NUM_ITEMS, "cpu", max_seq_len=cfg.data.max_seq_len).encoder.named_parameters())
    got = dict(enc.named_parameters())
    assert got.keys() == direct.keys() and all(torch.equal(got[n].detach(), direct[n].detach()) for n in got)
    flat = torch.cat([p.detach().flatten() for p in enc.parameters()])
    every = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    assert all(torch.equal(every[0], f) for f in every)
    with pytest.raises(ValueError, match="every parameter must be on the meta device"):
        parallelize(GEM(cfg.model, NUM_ITEMS, "cpu", max_seq_len=cfg.data.max_seq_len),
                    layout=plan_layout(world, "cpu"), cfg=cfg, device=torch.device("cpu"))


def _worker(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from gemray.checkpoint import load_checkpoint, save_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = _cfg()
        dmp, opt = _build(cfg, world)
        from gemray.parallel import dense_lr_scales
        assert dense_lr_scales(opt) == [1.0, 0.5]
        _check_materialised(dmp, cfg, world)
        gen = torch.Generator().manual_seed(100 + rank)
        # rank 1: an empty batch at step 1 (still forward/backward), a length-1 sequence at step 2.
        plans = {0: [[3, 5], [4, 2, 6], [2, 2]], 1: [[5, 4], [], [1, 7]]}
        losses = []
        for lengths in plans[rank]:
            loss, _ = dmp(_batch(lengths, gen))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        assert all(torch.isfinite(torch.tensor(losses)))
        before = _snapshot(dmp, opt)
        # Trainer state is global (identical on all ranks in gemray.train); DCP keeps rank 0's copy.
        trainer = {"epoch": 3, "step": 0, "global_step": 9, "history": [{"epoch": 3, "train_loss": 1.25}]}
        save_checkpoint(Path(root) / f"rank{rank}", dmp, opt, trainer, data={"num_items": NUM_ITEMS})
        torch.save(before, Path(root) / f"expected{rank}.pt")
        dist.barrier()
        if rank == 0:  # what Ray Train V2 does with every rank's reported directory
            merged = Path(root) / "merged"
            merged.mkdir()
            for r in range(world):
                for f in (Path(root) / f"rank{r}").iterdir():
                    shutil.copy(f, merged / f.name)
        dist.barrier()

        # A fresh model (different init seed) restored from the merged checkpoint.
        cfg.train.seed = 12345
        dmp2, opt2 = _build(cfg, world)
        assert not all(torch.equal(before[k], v) for k, v in _snapshot(dmp2, opt2).items()
                       if k.startswith("model.")), "fresh model should differ before loading"
        got = load_checkpoint(Path(root) / "merged", dmp2, opt2)
        assert got == {**trainer, "world_size": world}, got
        after = _snapshot(dmp2, opt2)
        assert before.keys() == after.keys(), sorted(set(before) ^ set(after))
        bad = [k for k in before if not torch.equal(before[k], after[k])]
        assert not bad, f"rank {rank}: restored values differ: {bad}"
        # Training continues from the restored state (one more step on both ranks).
        loss, _ = dmp2(_batch([2, 3], gen))
        loss.backward()
        opt2.step()
        (Path(root) / f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def _worker_one_rank(rank: int, port: int, root: str) -> None:
    """World size 1 loads the 2-rank checkpoint: DCP reshards the row-wise tables back together."""
    import torch.distributed as dist

    from gemray.checkpoint import load_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = _cfg()
        cfg.train.seed = 999
        dmp, opt = _build(cfg, 1)
        got = load_checkpoint(Path(root) / "merged", dmp, opt)
        assert got["epoch"] == 3 and got["world_size"] == 2
        e0, e1 = (torch.load(Path(root) / f"expected{r}.pt") for r in (0, 1))
        after = _snapshot(dmp, opt)
        assert after.keys() == e0.keys()
        for k in e0:
            replicated = e0[k].shape == e1[k].shape and torch.equal(e0[k], e1[k])
            want = e0[k] if replicated else torch.cat([e0[k], e1[k]])  # row-wise: rank 0 rows first
            assert torch.equal(after[k], want), k
        (Path(root) / "ok_ws1").write_text("ok")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def merged_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    spawn_ranks(_worker, (2, free_port(), str(root)), 2, [root / "ok0", root / "ok1"])
    assert (root / "ok0").exists() and (root / "ok1").exists()
    return root / "merged"


def _data_files(ckpt: Path, rank: int) -> list[str]:
    """Rank ``rank``'s DCP data files (``__<rank>_<item>_0.distcp``: one per write item)."""
    return sorted(p.name for p in ckpt.glob(f"__{rank}_*.distcp"))


def _largest_data_file(ckpt: Path, rank: int) -> str:
    """Rank ``rank``'s biggest data file (an embedding-table shard on these checkpoints)."""
    return max(_data_files(ckpt, rank), key=lambda n: (ckpt / n).stat().st_size)


def _files_per_item(ckpt: Path) -> dict[str, int]:
    """How many of the DCP ``.metadata``'s items each data file holds."""
    from collections import Counter

    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    return dict(Counter(info.relative_path for info in meta.storage_data.values()))


def test_restore_equals_saved_on_two_ranks(merged_checkpoint):
    # The equality checks run inside the workers (they raise there); here: the merged layout.
    names = sorted(p.name for p in merged_checkpoint.iterdir())
    d0, d1 = _data_files(merged_checkpoint, 0), _data_files(merged_checkpoint, 1)
    assert len(d0) > 2 and len(d1) > 2, names  # model shards, optimizer state, trainer entries
    assert all(re.fullmatch(r"__[01]_\d+_0\.distcp", n) for n in d0 + d1), names
    assert names == sorted([".metadata", *d0, *d1, "manifest_rank0.json", "manifest_rank1.json"])
    # one file per write item: every data file holds exactly one of the items DCP's metadata lists
    per_file = _files_per_item(merged_checkpoint)
    assert sorted(per_file) == sorted(d0 + d1) and set(per_file.values()) == {1}, per_file
    info = verify_checkpoint(merged_checkpoint)
    assert info["world_size"] == 2
    m0 = json.loads((merged_checkpoint / "manifest_rank0.json").read_text())
    assert set(m0["files"]) == {".metadata", *d0}  # rank 0 is DCP's coordinator
    m1 = json.loads((merged_checkpoint / "manifest_rank1.json").read_text())
    assert set(m1["files"]) == set(d1)


def test_load_at_world_size_one(merged_checkpoint):
    root = merged_checkpoint.parent
    spawn_ranks(_worker_one_rank, (free_port(), str(root)), 1, [root / "ok_ws1"])
    assert (root / "ok_ws1").exists()


def test_corrupted_file_is_named(merged_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(merged_checkpoint, bad)
    name = _largest_data_file(bad, 1)  # a shard of rank 1's embedding table
    data = bytearray((bad / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / name).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(name) + " is corrupted"):
        verify_checkpoint(bad)


def test_missing_rank_manifest_and_file(merged_checkpoint, tmp_path):
    a = tmp_path / "a"
    shutil.copytree(merged_checkpoint, a)
    (a / "manifest_rank1.json").unlink()
    with pytest.raises(ValueError, match=r"missing manifest for rank\(s\) \[1\]"):
        verify_checkpoint(a)
    b = tmp_path / "b"
    shutil.copytree(merged_checkpoint, b)
    name = _data_files(b, 0)[0]
    (b / name).unlink()
    with pytest.raises(ValueError, match=re.escape(name) + " listed in a manifest is missing"):
        verify_checkpoint(b)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no manifest_rank"):
        verify_checkpoint(tmp_path)


def test_checkpoint_data_of_a_sharded_checkpoint(merged_checkpoint):
    """The item table's rows come from the DCP metadata of TorchRec's row-wise sharded table (what a resume
    on another catalogue would fail to load), the data record from the manifests."""
    from gemray.checkpoint import checkpoint_data

    assert checkpoint_data(merged_checkpoint) == {"record": {"num_items": NUM_ITEMS}, "item_table_rows": NUM_ITEMS + 1}


def _data_manifest(**kw):
    m = {"format": "ml-100k", "prepared_dir": "/data/ml-100k", "created_unix": 1,
         "vocab": {"num_items": 50}, "counts": {"users": 3, "items": 50, "interactions": 9, "rows_per_file": [9]},
         "source": {"dir": "/raw/ml-100k", "files": [{"name": "u.data", "sha256": "ab" * 32, "bytes": 99}]}}
    m.update(kw)
    return m


def test_data_record_fingerprints_what_the_data_is_not_where_it_lies():
    from gemray.checkpoint import data_record

    rec = data_record(_data_manifest())
    assert rec["num_items"] == 50 and rec["item_table_rows"] == 51
    assert (rec["prepared_dir"], rec["source_dir"]) == ("/data/ml-100k", "/raw/ml-100k")
    assert rec["source_files"] == [["u.data", "ab" * 32]] and len(rec["fingerprint"]) == 16
    # prepared again elsewhere, later, into other files: the same data
    again = data_record(_data_manifest(prepared_dir="/elsewhere", created_unix=2,
                                       counts={"users": 3, "items": 50, "interactions": 9, "rows_per_file": [4, 5]}))
    assert again["fingerprint"] == rec["fingerprint"]
    # an edited ratings file, or other counts: other data
    edited = _data_manifest(source={"dir": "/raw/ml-100k", "files": [{"name": "u.data", "sha256": "cd" * 32}]})
    assert data_record(edited)["fingerprint"] != rec["fingerprint"]
    fewer = _data_manifest(counts={"users": 3, "items": 50, "interactions": 8})
    assert data_record(fewer)["fingerprint"] != rec["fingerprint"]


def test_data_record_of_synthetic_data_names_its_generator_parameters():
    """Synthetic data of the same counts but other parameters (e.g. another seed) is other data: a checkpoint
    trained on one is refused on the other (preflight.resume_mismatch), naming the parameters."""
    from gemray.checkpoint import data_record
    from gemray.controller.preflight import resume_mismatch

    def synth(sha):
        return _data_manifest(format="synthetic", source={"generator": "gemray.pipelines.synthetic",
                                                          "params_sha256": sha, "files": []})

    a, b = data_record(synth("a" * 64)), data_record(synth("b" * 64))
    assert a["params_sha256"] == "a" * 64 and a["fingerprint"] != b["fingerprint"]
    assert "params_sha256" not in data_record(_data_manifest())  # MovieLens records (and fingerprints) unchanged
    why = resume_mismatch({"record": a, "item_table_rows": 51}, b, "/data/synth")
    assert why is not None and "generator parameters (params_sha256) aaaaaaaaaaaa.. -> bbbbbbbbbbbb.." in why[0]
    assert resume_mismatch({"record": a, "item_table_rows": 51}, a, "/data/synth") is None
    # a table sized beyond the data (model.table_rows "item=1000"): the record says the table's rows
    big = data_record(synth("a" * 64), item_table_rows=1000)
    assert big["item_table_rows"] == 1000 and big["num_items"] == 50
    assert resume_mismatch({"record": big, "item_table_rows": 1000}, big, "/data/synth") is None


def _tiny_model(num_items: int):
    """A plain module whose state has the item table under the name TorchRec gives it (no process group)."""
    model = torch.nn.Module()
    model.embeddings = torch.nn.Module()
    model.embeddings.embeddings = torch.nn.ModuleDict({"item": torch.nn.Embedding(num_items + 1, 4)})
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_manifest_records_the_data_it_was_trained_on(tmp_path):
    from gemray.checkpoint import checkpoint_data, data_record, save_checkpoint

    rec = data_record(_data_manifest())
    model, opt = _tiny_model(50)
    save_checkpoint(tmp_path / "new", model, opt, {"epoch": 1, "global_step": 3}, data=rec)
    assert verify_checkpoint(tmp_path / "new")["world_size"] == 1  # the record does not upset verification
    assert json.loads((tmp_path / "new" / "manifest_rank0.json").read_text())["data"] == rec
    assert checkpoint_data(tmp_path / "new") == {"record": rec, "item_table_rows": 51}
    # written before gemray recorded the data: no record, but the table rows are still in DCP's metadata
    save_checkpoint(tmp_path / "old", model, opt, {"epoch": 1, "global_step": 3})
    assert checkpoint_data(tmp_path / "old") == {"record": None, "item_table_rows": 51}
    assert checkpoint_data(tmp_path / "missing") == {"record": None, "item_table_rows": None}


_PAUSE_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from gemray.checkpoint import save_checkpoint

dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in map(int, sys.argv[3:]):
    save_checkpoint(os.path.join(sys.argv[2], f"step-{step}"), model, opt, {"global_step": step})
    print("saved", step, flush=True)
"""


def test_pause_hook_stops_one_rank_inside_the_dcp_write(tmp_path):
    """tests/hooks/sitecustomize.py (what tests/test_elastic.py kills a rank with): with
    GEMRAY_TEST_PAUSE_CKPT_WRITE=<step>:<rank>:<folder> and the hook folder on PYTHONPATH, the save of that
    step stops after the rank's shard file and before DCP's .metadata, and says so in a marker with its pid;
    other steps save normally, and once the marker exists that step saves normally too."""
    import subprocess
    import sys
    import time

    hooks, pause = Path(__file__).parent / "hooks", tmp_path / "pause"
    env = dict(os.environ, GEMRAY_TEST_PAUSE_CKPT_WRITE=f"3:0:{pause}", PYTHONPATH=str(hooks))
    script = tmp_path / "save.py"
    script.write_text(_PAUSE_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(free_port()), str(tmp_path), "2", "3"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        marker = pause / "paused-rank0.json"
        t0 = time.time()
        while not marker.is_file() and proc.poll() is None and time.time() - t0 < 120:
            time.sleep(0.1)
        assert marker.is_file(), proc.communicate(timeout=10)[0]
        time.sleep(0.2)  # the marker is written in one go, after the shard file
        assert json.loads(marker.read_text()) == {"pid": proc.pid, "global_step": 3}
        assert proc.poll() is None  # paused, not finished
        assert (tmp_path / "step-2" / ".metadata").is_file()  # step 2 saved normally
        files = {p.name for p in (tmp_path / "step-3").iterdir()}
        assert any(f.startswith("__0_") and f.endswith(".distcp") for f in files), files  # data files written
        assert ".metadata" not in files, files
    finally:
        proc.kill()
        out = proc.communicate(timeout=30)[0]
    assert "saved 2" in out and "saved 3" not in out, out
    # the marker is there: the restarted attempt writes that step normally
    again = subprocess.run([sys.executable, str(script), str(free_port()), str(tmp_path / "again"), "3"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "saved 3" in again.stdout, again.stdout + again.stderr
    verify_checkpoint(tmp_path / "again" / "step-3")


def test_committed_checkpoints_are_what_ray_train_reads_back(tmp_path, capfd):
    """committed_checkpoints: what ``ray.train.Result.from_path`` lists for a run folder, newest (last
    reported) first, quietly; uncommitted_checkpoints: the other checkpoint_* folders there (a report cut
    short). A run folder without a record, a missing folder, a record Ray refuses: nothing committed."""
    from ray_runs import write_committed

    from gemray.checkpoint import committed_checkpoints, uncommitted_checkpoints

    reported = ["checkpoint_2026-11-30_11-00-01.000001", "checkpoint_2026-11-30_11-00-05.000003",
                "checkpoint_2026-11-30_11-00-09.000002"]
    for n in reported + ["checkpoint_2026-11-30_11-00-12.000004"]:  # the last: reported, never committed
        (tmp_path / n).mkdir()
    (tmp_path / "not-a-checkpoint").mkdir()
    assert committed_checkpoints(tmp_path) == [] and uncommitted_checkpoints(tmp_path) == []  # no record
    assert committed_checkpoints(tmp_path / "missing") == []
    write_committed(tmp_path, reported, [{"global_step": s} for s in (5, 10, 15)])
    assert [p.name for p in committed_checkpoints(tmp_path)] == reported[::-1]
    assert all(p.is_absolute() and p.parent == tmp_path.resolve() for p in committed_checkpoints(tmp_path))
    # the reported-but-never-committed one (e.g. a rank killed while writing/uploading) is told apart
    assert [p.name for p in uncommitted_checkpoints(tmp_path)] == ["checkpoint_2026-11-30_11-00-12.000004"]
    assert "snapshot was found" not in capfd.readouterr().err  # Ray's INFO lines are not shown
    # a committed folder removed by hand: Ray refuses the run folder, so does this (with a warning)
    (tmp_path / reported[0]).rmdir()
    assert committed_checkpoints(tmp_path) == [] and uncommitted_checkpoints(tmp_path) == []


def _small_model(seed: int):
    """A few dense tensors and, after one Adam step, their optimizer state (two moments and a step each)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 6)).square().sum().backward()
    opt.step()
    return model, opt


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_writes_one_file_per_item_and_reports_host_memory(tmp_path, caplog):
    """save_checkpoint writes one DCP data file per write item (what bounds a GPU save's host memory to one
    staged tensor at a time), reports and logs its seconds, bytes and host RSS figures, and loads back."""
    import logging

    from gemray.checkpoint import load_checkpoint, save_checkpoint

    model, opt = _small_model(0)
    with caplog.at_level(logging.INFO, logger="gemray.checkpoint"):
        stats = save_checkpoint(tmp_path / "c", model, opt, {"epoch": 1, "global_step": 1})
    ck = tmp_path / "c"
    data = _data_files(ck, 0)
    per_file = _files_per_item(ck)
    # 4 parameters + 4 x (exp_avg, exp_avg_sq, step) + param_groups entries + trainer json and RNG state
    assert len(data) >= 4 + 4 * 3 + 2 and sorted(per_file) == data and set(per_file.values()) == {1}, per_file
    assert set(json.loads((ck / "manifest_rank0.json").read_text())["files"]) == {".metadata", *data}
    assert stats["files"] == len(data) + 1
    assert stats["bytes"] == sum((ck / n).stat().st_size for n in [".metadata", *data])
    assert stats["seconds"] > 0 and stats["directory"] == str(ck) and stats["rank"] == 0
    for k in ("rss_before", "rss_after", "rss_peak", "maxrss_before", "maxrss_after"):
        assert isinstance(stats[k], int) and stats[k] > 0, (k, stats)
    assert stats["maxrss_after"] >= stats["maxrss_before"] and stats["rss_peak"] >= stats["rss_before"]
    line = next(r.getMessage() for r in caplog.records if "checkpoint save:" in r.getMessage())
    assert line.startswith("rank 0/1 checkpoint save: ") and " files); host RSS " in line and "process peak (VmHWM)" in line
    assert f"checkpoint save: {stats['bytes'] / 1e6:.1f} MB in " in line  # a small state in MB, not "0.00 GB"
    from gemray.checkpoint import save_summary

    assert save_summary({**stats, "bytes": 26_720_000_000, "seconds": 68.1}).startswith(
        "26.72 GB in 68.1 s (392.4 MB/s, ")
    fresh, fresh_opt = _small_model(1)
    out = load_checkpoint(ck, fresh, fresh_opt)
    assert out["global_step"] == 1
    _assert_same(model, fresh)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_single_file_per_rank_checkpoint_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before (DCP's default writer: every item in one ``__<rank>_0.distcp``) verify
    and load: the reader takes each item's file and offset from ``.metadata``."""
    import torch.distributed.checkpoint as dcp

    import gemray.checkpoint as ck
    from gemray.checkpoint import load_checkpoint, save_checkpoint

    model, opt = _small_model(0)
    monkeypatch.setattr(ck, "checkpoint_writer", lambda d: dcp.FileSystemWriter(str(d)))  # the old save
    save_checkpoint(tmp_path / "old", model, opt, {"epoch": 2, "global_step": 7})
    monkeypatch.undo()
    names = sorted(p.name for p in (tmp_path / "old").iterdir())
    assert names == [".metadata", "__0_0.distcp", "manifest_rank0.json"]
    assert _files_per_item(tmp_path / "old") == {"__0_0.distcp": len(dcp.FileSystemReader(
        str(tmp_path / "old")).read_metadata().storage_data)}
    fresh, fresh_opt = _small_model(1)
    assert load_checkpoint(tmp_path / "old", fresh, fresh_opt)["global_step"] == 7
    _assert_same(model, fresh)


_STAGING_SCRIPT = """
import json, sys
import torch
import torch.distributed.checkpoint as dcp
import gemray.checkpoint as ck

writer, out, item = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = 6
base = torch.ones(n, item // 4 + 1024)  # touched: part of the RSS before the save
class Model(torch.nn.Module):
    def state_dict(self):  # views into base: DCP's loaders stage a copy of each (storage larger than the view)
        return {f"w{i}": base[i, :item // 4] for i in range(n)}
class Optim:
    def state_dict(self):
        return {}
if writer == "dcp-default":
    ck.checkpoint_writer = lambda d: dcp.FileSystemWriter(str(d))
print(json.dumps(ck.save_checkpoint(out, Model(), Optim(), {"global_step": 1})))
"""


def test_save_stages_one_item_at_a_time(tmp_path):
    """Host memory of a save: each write item's staged CPU copy is freed before the next one is made. On CPU
    only a view (storage larger than the tensor) is staged as a copy, so the state here is 6 views of 64 MiB;
    the process's peak RSS during the save grows by about one item. DCP's default writer (one file per rank)
    keeps every staged copy until its file closes: about all six -- the GPU case that ran out of host memory."""
    import subprocess
    import sys

    item = 64 << 20
    script = tmp_path / "stage.py"
    script.write_text(_STAGING_SCRIPT)
    grew = {}
    for writer in ("gemray", "dcp-default"):
        run = subprocess.run([sys.executable, str(script), writer, str(tmp_path / writer), str(item)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        stats = json.loads(run.stdout.strip().splitlines()[-1])
        assert stats["bytes"] >= 6 * item
        grew[writer] = (stats["maxrss_after"] - stats["rss_before"]) / item
    # one item staged at a time plus the interpreter's own growth during the save (measured up to 1.53 items here,
    # with a second test run sharing the machine); a second item held would read >= 2
    assert grew["gemray"] < 2.0, grew
    assert grew["dcp-default"] > 4.5, grew  # what the measurement shows when every item is held
