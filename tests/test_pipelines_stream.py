"""HistoryStream: Ray Data -> JaggedBatch, checked against a plain-Python reconstruction per user."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from paths import DATA
import torch

ray = pytest.importorskip("ray")

from gemray.config import DataConfig  # noqa: E402
from gemray.pipelines import load_manifest, prepare_movielens  # noqa: E402
from gemray.pipelines.shards import assign_shards  # noqa: E402
from gemray.pipelines.stream import HistoryStream  # noqa: E402

MAX_LEN = 8
# history lengths of the synthetic users: too short (1, 2), minimal (3 -> train length 1), around
# MAX_LEN (+2 for the held-out items), and long ones that get truncated
LENGTHS = [1, 2, 3, 2, 4, 5, 6, 9, 10, 11, 12, 17, 25, 40, 2, 7, 8, 3, 30, 13, 6, 1, 4, 21, 1, 9, 10, 33, 3, 14,
           16, 5, 6, 7, 50, 3, 4]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    started = not ray.is_initialized()  # reuse a cluster another test module left running
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """An ML-100K-style u.data with skewed lengths and timestamp ties, prepared into 3 files x 2 shards."""
    d = tmp_path_factory.mktemp("synthetic")
    rng = np.random.default_rng(0)
    lines = []
    for u, n in enumerate(LENGTHS, start=1):
        for _ in range(n):
            lines.append(f"{u * 3}\t{rng.integers(1, 200)}\t{rng.integers(1, 6)}\t{rng.integers(0, 40)}")
    rng.shuffle(lines)
    (d / "src").mkdir()
    (d / "src" / "u.data").write_text("\n".join(lines) + "\n")
    prepare_movielens(d / "src", d / "prepared", num_files=3, row_groups_per_file=2)
    return d / "prepared"


def _reference(prepared: Path, split: str, max_len: int) -> dict[int, tuple[list, list, list, int | None]]:
    """user -> (items, ratings, timestamps, target) built with plain Python slicing."""
    man = load_manifest(prepared)
    out = {}
    for f in man["files"]:
        for row in pq.read_table(prepared / f["path"]).to_pylist():
            n = len(row["item_ids"])
            if n < 3:
                continue
            stop = n - 1 if split == "test" else n - 2
            sl = slice(max(0, stop - max_len), stop)
            target = None if split == "train" else (row["item_ids"][stop], row["timestamps"][stop])
            out[row["user_id"]] = (row["item_ids"][sl], row["ratings"][sl], row["timestamps"][sl], target)
    return out


def _rows(batch) -> dict[int, tuple[list, list, list, int | None]]:
    batch.validate()
    o = batch.offsets.tolist()
    for t in (batch.user_ids, batch.offsets, batch.item_ids, batch.ratings, batch.timestamps):
        assert t.dtype == torch.int64
    rows = {}
    for b, u in enumerate(batch.user_ids.tolist()):
        s = slice(o[b], o[b + 1])
        assert (batch.targets is None) == (batch.target_timestamps is None)
        tgt = None if batch.targets is None else (int(batch.targets[b]), int(batch.target_timestamps[b]))
        rows[u] = (batch.item_ids[s].tolist(), batch.ratings[s].tolist(), batch.timestamps[s].tolist(), tgt)
    return rows


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_splits_match_reference_once_per_epoch(synthetic, world_size):
    empties = 0
    for split in ("train", "valid", "test"):
        ref = _reference(synthetic, split, MAX_LEN)
        streams = [HistoryStream(synthetic, split, rank=r, world_size=world_size, batch_size=4, max_seq_len=MAX_LEN,
                                 sub_batch_size=2, bbs_window_batches=2, seed=3) for r in range(world_size)]
        nb = streams[0].num_batches()
        assert all(s.num_batches() == nb for s in streams)
        seen: dict[int, tuple] = {}
        for s in streams:
            batches = list(s.iter_epoch(0))
            assert len(batches) == nb
            sizes = [b.batch_size for b in batches]
            assert all(0 <= x <= 4 for x in sizes)
            first_empty = sizes.index(0) if 0 in sizes else nb
            assert all(x == 0 for x in sizes[first_empty:])  # empty batches only trail
            for b in batches[first_empty:]:
                empties += 1
                assert b.offsets.tolist() == [0] and b.item_ids.numel() == 0 and b.num_tokens == 0
                assert (b.targets is None) == (split == "train")
                if b.targets is not None:
                    assert b.targets.numel() == 0 and b.target_timestamps.numel() == 0
            for b in batches:
                rows = _rows(b)
                assert not set(rows) & set(seen)  # no user twice
                seen.update(rows)
        assert seen == ref  # every eligible user exactly once, values exact (incl. truncation, targets)
    lengths = [len(v[0]) for v in ref.values()]
    assert min(lengths) == 2 and max(lengths) == MAX_LEN  # test split: n=3 -> 2 inputs; long ones truncated
    if world_size == 3:
        assert empties > 0  # ranks with fewer users pad with empty batches


def test_train_short_sequences_and_valid_order(synthetic):
    train = HistoryStream(synthetic, "train", rank=0, world_size=1, batch_size=4, max_seq_len=MAX_LEN,
                          sub_batch_size=2)
    lens = torch.cat([b.lengths for b in train.iter_epoch(0)])
    assert int(lens.min()) == 1 and int(lens.max()) == MAX_LEN  # length-1 train sequences are kept
    assert len(lens) == load_manifest(synthetic)["splits"]["users"]
    valid = HistoryStream(synthetic, "valid", rank=0, world_size=1, batch_size=4, max_seq_len=MAX_LEN)
    users = torch.cat([b.user_ids for b in valid.iter_epoch(0)]).tolist()
    assert users == sorted(users)  # eval splits: no shuffle, ascending user_id
    assert users == sorted(torch.cat([b.user_ids for b in valid.iter_epoch(5)]).tolist())


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("user_ids", "offsets", "item_ids", "ratings",
                                                                    "timestamps"))


def test_resume_and_epoch_seeding(synthetic):
    kw = dict(rank=1, world_size=2, batch_size=4, max_seq_len=MAX_LEN, sub_batch_size=2, bbs_window_batches=2,
              seed=11)
    s = HistoryStream(synthetic, "train", **kw)
    nb = s.num_batches()
    full = list(s.iter_epoch(2))
    restarted = HistoryStream(synthetic, "train", **kw)  # a fresh process after a restart
    for k in (0, 1, nb - 1, nb):
        rest = list(restarted.iter_epoch(2, start_batch=k))
        assert len(rest) == nb - k and all(_same(a, b) for a, b in zip(rest, full[k:]))
    other = list(s.iter_epoch(3))
    assert not all(_same(a, b) for a, b in zip(full, other))  # a new order each epoch
    no_shuffle = HistoryStream(synthetic, "train", **{**kw, "seed": 0}, shuffle=False, bbs=False)
    users = torch.cat([b.user_ids for b in no_shuffle.iter_epoch(0)]).tolist()
    assert users == sorted(users)
    with pytest.raises(ValueError, match="start_batch"):
        next(s.iter_epoch(0, start_batch=nb + 1))


def test_assign_shards_round_robin(synthetic):
    man = load_manifest(synthetic)
    n = len(man["shards"])
    assert n == 6
    for ws in (1, 2, 4, 8):
        got = [[s["index"] for s in assign_shards(man, ws, r)] for r in range(ws)]
        assert sorted(i for g in got for i in g) == list(range(n))
        assert got[0] == list(range(0, n, ws))
    with pytest.raises(ValueError, match="rank"):
        assign_shards(man, 2, 2)
    # more ranks than shards: the idle ranks still yield num_batches() empty batches
    s = HistoryStream(synthetic, "valid", rank=7, world_size=8, batch_size=4, max_seq_len=MAX_LEN)
    batches = list(s.iter_epoch(0))
    assert s.num_samples() == 0 and len(batches) == s.num_batches() > 0
    assert all(b.batch_size == 0 and b.targets.numel() == 0 for b in batches)


def test_real_latest_small_and_from_config(tmp_path):
    out = tmp_path / "ml-latest-small"
    prepare_movielens(DATA / "ml-latest-small", out)
    cfg = DataConfig(prepared_dir=str(out), max_seq_len=50, batch_size=64, eval_batch_size=128, sub_batch_size=16,
                     bbs_window_batches=4)
    users = 0
    for rank in range(2):
        s = HistoryStream.from_config(cfg, "train", rank=rank, world_size=2, seed=0)
        assert s.batch_size == 64 and s.bbs and s.shuffle
        for b in s.iter_epoch(0):
            assert b.max_len <= 50 and b.batch_size <= 64
            assert int(b.ratings.min()) >= 1 and int(b.ratings.max()) <= 10 and int(b.item_ids.min()) >= 1
            seg = torch.repeat_interleave(torch.arange(b.batch_size), b.lengths)
            same = seg[1:] == seg[:-1]
            assert bool((b.timestamps[1:][same] >= b.timestamps[:-1][same]).all())
            users += b.batch_size
    assert users == 610
    ev = HistoryStream.from_config(cfg, "test", rank=0, world_size=1, seed=0)
    assert ev.batch_size == 128 and not ev.bbs and not ev.shuffle and ev.num_batches() == 5


def test_arrow_reader_reads_the_same_table(synthetic):
    """reader="arrow" (pyarrow in the worker, no Ray tasks) yields exactly the Ray Data reader's batches,
    rank by rank (each rank's shard filter applied the same way)."""
    from gemray.pipelines import stream

    for rank in (0, 1):
        kw = dict(rank=rank, world_size=2, batch_size=4, max_seq_len=MAX_LEN, sub_batch_size=2, seed=3)
        stream._READ_CACHE.clear()  # both readers must really read
        ray_batches = list(HistoryStream(synthetic, "train", **kw).iter_epoch(1))
        stream._READ_CACHE.clear()
        arrow_batches = list(HistoryStream(synthetic, "train", reader="arrow", **kw).iter_epoch(1))
        assert len(ray_batches) == len(arrow_batches) > 1
        assert all(_same(a, b) for a, b in zip(ray_batches, arrow_batches))
        assert sum(b.batch_size for b in arrow_batches) > 0
    with pytest.raises(ValueError, match="reader"):
        HistoryStream(synthetic, "train", rank=0, world_size=1, batch_size=4, max_seq_len=4, sub_batch_size=2,
                      reader="spark")


def test_bad_arguments(synthetic, tmp_path):
    with pytest.raises(ValueError, match="split"):
        HistoryStream(synthetic, "eval", rank=0, world_size=1, batch_size=4, max_seq_len=4)
    with pytest.raises(ValueError, match="rank"):
        HistoryStream(synthetic, "train", rank=2, world_size=2, batch_size=4, max_seq_len=4)
    with pytest.raises(ValueError, match="multiple of sub_batch_size"):
        HistoryStream(synthetic, "train", rank=0, world_size=1, batch_size=6, max_seq_len=4, sub_batch_size=4)
    with pytest.raises(FileNotFoundError, match="gemray prepare movielens"):
        HistoryStream(tmp_path / "nothing", "valid", rank=0, world_size=1, batch_size=4, max_seq_len=4)


def test_train_includes_valid_trains_on_test_inputs(synthetic):
    """With data.train_includes_valid the train split is h[:-1] (most recent max_seq_len items): exactly the
    test split's inputs, without targets; the default train split stops one item earlier."""
    ref_test = {u: (*v[:3], None) for u, v in _reference(synthetic, "test", MAX_LEN).items()}
    ref_train = _reference(synthetic, "train", MAX_LEN)
    for flag, want in ((True, ref_test), (False, ref_train)):
        s = HistoryStream(synthetic, "train", rank=0, world_size=1, batch_size=4, max_seq_len=MAX_LEN,
                          sub_batch_size=2, bbs_window_batches=2, seed=3, train_includes_valid=flag)
        seen = {}
        for b in s.iter_epoch(0):
            seen.update(_rows(b))
        assert seen == want
    assert ref_test != ref_train


@pytest.fixture
def truncated(synthetic, tmp_path) -> tuple[Path, Path]:
    """A copy of the prepared folder whose second history file lost its second half (a cut copy)."""
    import shutil

    d = tmp_path / "prepared"
    shutil.copytree(synthetic, d)
    bad = d / "histories" / "part-00001.parquet"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    return d, bad


@pytest.mark.parametrize("reader", ["arrow", "ray_data"])
def test_a_truncated_shard_is_named(truncated, reader):
    """issue 22: a worker reading a damaged shard ends with an error naming the file (was: a cut Ray Data /
    pyarrow traceback with no path)."""
    d, bad = truncated
    with pytest.raises(ValueError, match=re.escape(str(bad)) + r".*truncated or damaged"):
        list(HistoryStream(d, "train", rank=0, world_size=1, batch_size=4, max_seq_len=MAX_LEN, sub_batch_size=4,
                           reader=reader).iter_epoch(1))


def test_bench_bbs_names_a_truncated_file(truncated, capsys):
    """`gemray bench bbs` on a truncated Parquet file: exit 2, one line naming the file."""
    from gemray.cli import main

    d, bad = truncated
    cfg = Path(__file__).resolve().parents[1] / "configs" / "ml-latest-small.toml"
    assert main(["bench", "bbs", "--config", str(cfg), "--world-size", "2", "--set", f"data.prepared_dir={d}",
                 "data.batch_size=4", "data.sub_batch_size=2", "data.max_seq_len=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gemray: error: ") and str(bad) in err[0], err
