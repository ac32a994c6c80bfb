"""prepare_interactions / `gemray prepare interactions`: users' own logs (CSV, Parquet, URIs, Amazon formats).

Checked against hand-written expectations and an independent pure-Python recount; output byte-identical
across memory budgets, worker counts and the order of the inputs; every new kind of bad input one
`gemray: error:` line with nothing left behind. The 20M-row memory measurement is not a test: run this file
as a script (``python tests/test_pipelines_interactions.py bench --help``; BENCHMARKS.md has the figures).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from gemray import cli
from gemray.pipelines.interactions import (InputError, format_summary, hash_ids, parse_memory_budget,
                                           prepare_interactions, resolve_sources)
from gemray.pipelines.movielens import load_manifest
from gemray.pipelines.schema import HISTORY_SCHEMA

REPO = Path(__file__).resolve().parents[1]
GEMRAY = [sys.executable, "-m", "gemray.cli"]


# ------------------------------------------------------------------------------------------------ helpers

def make_log(folder: Path, rows: int, *, files: int = 4, users: int | None = None, items: int | None = None,
             seed: int = 0, fmt: str = "csv", chunk: int = 1_000_000) -> list[Path]:
    """A synthetic interaction log: string user / item ids, log-normal history lengths, Zipf-like item
    popularity, rows in random order across ``files`` files, columns user,item,ts,stars,genre,device
    (device empty = missing in about a quarter of the rows). Streams ``chunk`` rows at a time."""
    users = users or max(rows // 20, 10)
    items = items or max(rows // 100, 10)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    uw = rng.lognormal(0.0, 1.0, users)
    uc = np.cumsum(uw / uw.sum())
    iw = 1.0 / (np.arange(items) + 10.0) ** 0.9
    ic = np.cumsum(iw / iw.sum())
    iperm = rng.permutation(items)
    paths = []
    for k, n in enumerate(len(x) for x in np.array_split(np.arange(rows), files)):
        path = folder / f"log-{k:03d}.{fmt}"
        writer, done = None, 0
        while done < n:
            m = min(chunk, n - done)
            u = np.minimum(np.searchsorted(uc, rng.random(m)), users - 1)
            i = iperm[np.minimum(np.searchsorted(ic, rng.random(m)), items - 1)]
            table = pa.table({
                "user": pc.binary_join_element_wise("u", pa.array(u).cast(pa.string()), ""),
                "item": pc.binary_join_element_wise("sku-", pa.array(i).cast(pa.string()), ""),
                "ts": rng.integers(1_500_000_000, 1_700_000_000, m),
                "stars": rng.integers(1, 6, m),
                "genre": pc.binary_join_element_wise("g", pa.array(rng.integers(0, 30, m)).cast(pa.string()), ""),
                "device": pa.array(np.array(["ios", "android", "web", None], dtype=object)[rng.integers(0, 4, m)],
                                   pa.string()),
            })
            if writer is None:
                writer = (pacsv.CSVWriter(path, table.schema) if fmt == "csv" else pq.ParquetWriter(path, table.schema))
            writer.write_table(table)
            done += m
        writer.close()
        paths.append(path)
    return paths


def recount(rows: list[dict], user: str, item: str, ts: str, rating: str | None, feats: list[str]) -> dict:
    """Independent reference: raw user -> [(raw item, half stars, ts, *raw features)] in stable time order."""
    per = defaultdict(list)
    for r in rows:
        stars = r.get(rating) if rating else None
        per[r[user]].append((r[item], 0 if stars in (None, "") else round(float(stars) * 2), int(r[ts]),
                             *[r[f] if r[f] not in ("",) else None for f in feats]))
    return {u: sorted(v, key=lambda x: x[2]) for u, v in per.items()}


def read_prepared(out: Path, feats: list[str] = ()) -> dict:
    """Prepared folder -> raw user -> [(raw item, rating, ts, *raw features)], checking the layout as it goes."""
    m = json.loads((out / "manifest.json").read_text())
    items = dict(zip(*pq.read_table(out / "items.parquet").to_pydict().values()))
    users = dict(zip(*pq.read_table(out / "users.parquet").to_pydict().values()))
    fmaps = {f: dict(zip(*pq.read_table(out / m["id_maps"]["features"][f]).to_pydict().values())) for f in feats}
    got, prev = {}, 0
    for f in m["files"]:
        t = pq.read_table(out / f["path"])
        assert pa.schema(list(t.schema)[:4]) == HISTORY_SCHEMA
        assert t.schema.names[4:] == [f"feat_{x}" for x in feats]
        for row in t.to_pylist():
            assert row["user_id"] == prev + 1  # dense, ascending, no gaps
            prev = row["user_id"]
            cols = [[items[i] for i in row["item_ids"]], row["ratings"], row["timestamps"]]
            cols += [[fmaps[x].get(v) for v in row[f"feat_{x}"]] for x in feats]
            got[users[row["user_id"]]] = list(zip(*cols))
    assert prev == m["counts"]["users"] == len(users)
    return got


def tree_bytes(out: Path, digest: bool = False) -> dict[str, bytes | str]:
    """Every file of a prepared folder but the run file, by relative path: its bytes (or sha256)."""
    import hashlib

    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() if digest else p.read_bytes()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "prepare_run.json"}


def no_leftovers(out: Path) -> None:
    assert not out.exists(), f"{out} was written"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temp folder left behind"


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ------------------------------------------------------------------------------------------------ unit parts

def test_hash_ids_is_fixed():
    """User order is on-disk contract: these values must never change (they renumber every user)."""
    assert [int(x) for x in hash_ids(pa.array([0, 1, -1, 2**62]))] == \
        [0, 6238072747940578789, 13029008266876403067, 1360429390938723525]
    strs = ["", "a", "alice", "ünï", "B00004TMFE"]
    want = [17665956581633026203, 2841994784060530217, 643244615273433508, 16055257856239486961,
            399387143377556960]
    assert [int(x) for x in hash_ids(pa.array(strs))] == want
    assert [int(x) for x in hash_ids(pa.array(strs, pa.large_string()))] == want
    assert [int(x) for x in hash_ids(pa.array(["zz", *strs]).slice(1))] == want  # sliced arrays: offset honoured
    # no collisions on many similar ids
    many = pc.binary_join_element_wise("user", pa.array(np.arange(50_000)).cast(pa.string()), "")
    assert np.unique(hash_ids(many)).size == 50_000


def test_vocab_refuses_a_hash_collision():
    from gemray.pipelines.interactions import _Vocab

    v = _Vocab("item_id", "string")
    v.add(np.array([5, 6], np.uint64), pa.array(["a", "b"]))
    v.add(np.array([7], np.uint64), pa.array(["c"]))
    v.finalize()
    assert v.sorted_raw.to_pylist() == ["a", "b", "c"] and v.lookup(np.array([7, 5], np.uint64)).tolist() == [2, 0]
    v = _Vocab("item_id", "string")
    v.add(np.array([5, 6], np.uint64), pa.array(["a", "b"]))
    v.add(np.array([5], np.uint64), pa.array(["z"]))  # another value, same hash
    with pytest.raises(InputError, match="'z' and 'a' have the same 64-bit hash"):
        v.finalize()


def test_parse_memory_budget():
    assert parse_memory_budget("1GiB") == 1 << 30
    assert parse_memory_budget("512M") == 512 << 20
    assert parse_memory_budget("2.5g") == int(2.5 * (1 << 30))
    assert parse_memory_budget(300 << 20) == 300 << 20
    for bad in ("lots", "100MiB", "1 PB"):
        with pytest.raises(ValueError, match="--memory-budget"):
            parse_memory_budget(bad)


def test_budget_too_small_for_the_workers(tmp_path):
    src = tmp_path / "log.csv"
    src.write_text(HAND_CSV)
    with pytest.raises(ValueError, match=r"--memory-budget 512 MiB is too small for 4 worker\(s\).*at least 1072 MiB"):
        prepare_interactions(str(src), tmp_path / "out", user_col="uid", item_col="sku", time_col="ts",
                             memory_budget="512MiB", workers=4, progress=False)
    no_leftovers(tmp_path / "out")


def test_glob_folder_and_order(tmp_path):
    for name in ("b.csv", "a.csv", "sub/c.csv", "_SUCCESS", ".hidden.csv", "notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x\n")
    names = lambda fs: [Path(f.path).relative_to(tmp_path).as_posix() for f in fs]  # noqa: E731
    assert names(resolve_sources(str(tmp_path))) == ["a.csv", "b.csv", "sub/c.csv"]
    assert names(resolve_sources(str(tmp_path / "*.csv"))) == ["a.csv", "b.csv"]
    assert names(resolve_sources(str(tmp_path / "**" / "*.csv"))) == ["a.csv", "b.csv", "sub/c.csv"]
    assert names(resolve_sources([str(tmp_path / "b.csv"), "file://" + str(tmp_path / "a.csv")])) == ["a.csv", "b.csv"]
    with pytest.raises(FileNotFoundError, match="matches no input file"):
        resolve_sources(str(tmp_path / "*.parquet"))
    with pytest.raises(InputError, match="cannot tell its format"):
        resolve_sources(str(tmp_path / "notes.txt"))


def test_replacing_other_data_warns(tmp_path, caplog):
    """Into an empty folder or over the same log: quiet (an existing empty --out warned "replacing a prepared folder
    of other data (unknown)"); over another log: one warning naming both logs (and the old one is replaced)."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(HAND_CSV)
    b.write_text(HAND_CSV + "carol,C3,2024-01-05T00:00:00Z,5,jazz,web\n")
    out = tmp_path / "prep"
    out.mkdir()
    kw = dict(user_col="uid", item_col="sku", time_col="ts", progress=False)
    with caplog.at_level("WARNING"):
        prepare_interactions(str(a), out, **kw)
        prepare_interactions(str(a), out, **kw)
        assert not [r for r in caplog.records if "replacing" in r.getMessage()]
        m = prepare_interactions(str(b), out, **kw)
    said = [r for r in caplog.records if "replacing" in r.getMessage()]
    assert [r.name for r in said] == ["gemray.pipelines.interactions"]
    msgs = [r.getMessage() for r in said]
    assert len(msgs) == 1 and "from a.csv (8 interactions, sha256" in msgs[0] and "from b.csv (" in msgs[0], msgs
    assert load_manifest(out)["counts"]["interactions"] == m["counts"]["interactions"] == 9


# ------------------------------------------------------------------------------------------------ hand-checked

HAND_CSV = """\
uid,sku,ts,stars,genre,device
bob,B2,2024-01-01T00:00:10Z,4,rock,ios
alice,A1,100,5,pop,web
carol,B2,300,1,rock,web
bob,A1,50,3.5,pop,
alice,C3,200,,jazz,android
alice,B2,150,2,rock,ios
bob,C3,2024-01-01 00:00:10,4.5,jazz,web
alice,A1,150,3,pop,web
"""
#: By hand from HAND_CSV: items A1 < B2 < C3 -> 1, 2, 3; genre jazz < pop < rock -> 1, 2, 3; device android <
#: ios < web -> 1, 2, 3 (empty = 0). Times: 2024-01-01T00:00:10Z = 1704067210 (the zone-less form: UTC too).
#: Ratings in half stars; no rating = 0. alice's two rows at t=150 keep their file order (B2 line 7, A1 line 9).
HAND_EXPECTED = {
    "alice": [("A1", 10, 100, "pop", "web"), ("B2", 4, 150, "rock", "ios"), ("A1", 6, 150, "pop", "web"),
              ("C3", 0, 200, "jazz", "android")],
    "bob": [("A1", 7, 50, "pop", None), ("B2", 8, 1704067210, "rock", "ios"), ("C3", 9, 1704067210, "jazz", "web")],
    "carol": [("B2", 2, 300, "rock", "web")],
}
HAND_DENSE = {"alice": ([1, 2, 1, 3], [2, 3, 2, 1], [3, 2, 3, 1]), "bob": ([1, 2, 3], [2, 3, 1], [0, 2, 3]),
              "carol": ([2], [3], [3])}


def test_csv_string_ids_hand_checked(tmp_path, capsys):
    src = tmp_path / "log.csv"
    src.write_text(HAND_CSV)
    out = tmp_path / "prep"
    rc, stdout, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out), "--user-col", "uid",
                               "--item-col", "sku", "--time-col", "ts", "--rating-col", "stars",
                               "--feature-cols", "genre,device"], capsys)
    assert rc == 0, err
    assert "3 users, 3 items, 8 interactions" in stdout and "genre (3 values), device (3 values)" in stdout
    assert read_prepared(out, ["genre", "device"]) == HAND_EXPECTED
    m = load_manifest(out, verify=True)  # the readers of MovieLens folders accept it, checksums included
    assert m["features"] == {"genre": {"level": "token", "cardinality": 3, "column": "feat_genre"},
                             "device": {"level": "token", "cardinality": 3, "column": "feat_device"}}
    assert m["id_maps"] == {"users": "users.parquet", "items": "items.parquet",
                            "features": {"genre": "features/genre.parquet", "device": "features/device.parquet"}}
    assert pq.read_table(out / "items.parquet").to_pydict() == {"item_id": [1, 2, 3], "raw_item_id": ["A1", "B2", "C3"]}
    assert m["counts"]["repeated_user_item_rows"] == 1 and m["vocab"]["rating_values"] == [0, 2, 4, 6, 7, 8, 9, 10]
    assert m["splits"]["users"] == 2 and m["splits"]["too_short_users"] == 1
    assert m["source"]["files"][0]["name"] == "log.csv" and "created_unix" not in m and "run" not in m
    run = json.loads((out / "prepare_run.json").read_text())
    assert run["seconds"] > 0 and run["peak_rss_bytes"]["driver"] > 0
    # users are numbered in (hash_ids(raw), raw) order, stated in the manifest
    users = pq.read_table(out / "users.parquet").to_pydict()
    raw = users["raw_user_id"]
    assert users["user_id"] == [1, 2, 3]
    assert raw == sorted(raw, key=lambda u: (int(hash_ids(pa.array([u]))[0]), u))
    dense = {}
    for f in m["files"]:
        for row in pq.read_table(out / f["path"]).to_pylist():
            dense[raw[row["user_id"] - 1]] = (row["item_ids"], row["feat_genre"], row["feat_device"])
    assert dense == HAND_DENSE


def test_repeated_rows_are_kept_and_named_in_the_summary(tmp_path, capsys):
    """Rows repeating a (user, item) pair, exact duplicates (same user, item and timestamp: the same event logged
    twice?) among them, were kept without a word: the manifest counted the repeats but the printed summary did not
    say so (a new user's finding). They stay in the histories (each row is an interaction, as in prepare
    movielens); the summary names both counts, the manifest has both; a log without repeats mentions none."""
    src = tmp_path / "log.csv"
    src.write_text("user_id,item_id,timestamp\n"
                   "u1,a,100\nu1,b,200\nu1,a,100\n"    # u1: a at 100 twice (an exact duplicate)
                   "u1,a,300\n"                         # ... and a again later (a repeat, not a duplicate)
                   "u2,a,100\nu2,b,100\nu2,c,100\n"   # u2: equal times, distinct items: neither
                   "u3,c,5\nu3,c,5\nu3,c,5\n")        # u3: c at 5 three times: 2 exact duplicates
    out = tmp_path / "o"
    rc, stdout, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out)], capsys)
    assert rc == 0, err
    m = load_manifest(out)
    assert m["counts"]["interactions"] == 10
    assert m["counts"]["repeated_user_item_rows"] == 4 and m["counts"]["exact_duplicate_rows"] == 3
    assert read_prepared(out)["u3"] == [("c", 0, 5)] * 3  # kept
    assert ("; 4 rows repeat the (user, item) pair of another row, 3 of them with its timestamp too (exact "
            "duplicates; kept as interactions: remove them from the source if it logs events twice)") in stdout, stdout
    src.write_text("user_id,item_id,timestamp\nu1,a,1\nu1,b,2\nu1,a,3\n")
    rc, stdout, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out)], capsys)
    assert rc == 0 and "; 1 row repeats the (user, item) pair of another row (kept as an interaction)" in stdout, stdout
    assert load_manifest(out)["counts"]["exact_duplicate_rows"] == 0
    src.write_text("user_id,item_id,timestamp\nu1,a,1\nu1,b,2\nu1,c,3\n")
    rc, stdout, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out)], capsys)
    said = stdout.split(str(out))[1]  # the counts, not the folder (the test's name is in it)
    assert rc == 0 and "repeat" not in said and "duplicate" not in said, stdout


@pytest.mark.parametrize("num_files, asked", [(["--num-files", "1000"], "--num-files 1000"),
                                               ([], "8 (--num-files 0 = auto)"),  # the default: auto, 8 here
                                               (["--num-files", "3"], None)])
def test_num_files_capped_at_the_user_count_is_logged(num_files, asked, tmp_path, capsys, caplog):
    """`gemray prepare interactions --num-files 1000` on 3 users wrote 3 files (whole users per file) without a
    word: the cap is logged at INFO (the CLI's default console level) with the count written, the count asked for
    (or chosen by the default, auto) and why, as prepare movielens does; nothing is logged when the files asked for
    are written."""
    src = tmp_path / "log.csv"
    src.write_text("user_id,item_id,timestamp\n" + "".join(f"u{u},i{i},{i}\n" for u in range(3) for i in range(4)))
    out = tmp_path / "o"
    with caplog.at_level("INFO", logger="gemray.pipelines.interactions"):
        rc, stdout, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out), *num_files],
                                  capsys)
    assert rc == 0, err
    capped = [(r.levelname, r.getMessage()) for r in caplog.records if "history files" in r.getMessage()]
    assert capped == ([] if asked is None else [
        ("INFO", f"{out}: writing 3 history files, not {asked}: a file holds whole users' histories and the data "
                 "has 3 users")])
    assert len(load_manifest(out)["files"]) == 3 and "in 3 files" in stdout


def test_data_of_only_too_short_users_warns(tmp_path, capsys, caplog):
    """50 users of 2 events each: `gemray prepare interactions` said "0 users in the splits" in its summary, exit 0,
    and nothing else, and a run on the data trained 0 steps and exited 0 (a new user's finding). The data is still
    written (exit 0), under one WARNING naming how many users are too short and the length the splits need; data
    with users in the splits (one of three too short) prepares without it."""
    src = tmp_path / "short.csv"
    src.write_text("user_id,item_id,timestamp\n" + "".join(f"{u},{(u * 7 + j) % 30 + 1},{1000 + j}\n"
                                                            for u in range(1, 51) for j in range(2)))
    out = tmp_path / "short"
    with caplog.at_level("WARNING", logger="gemray.pipelines.interactions"):
        rc, stdout, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out)], capsys)
    assert rc == 0 and "0 users in the splits, 50 too short (< 3)" in stdout, err
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelname == "WARNING"]
    assert said == [("WARNING", f"{out}: no user is in the train/valid/test splits: all 50 users have fewer than 3 "
                     "interactions, the fewest the leave-one-out split needs (the last item is the test target, the "
                     "one before it the validation target, the rest the training sequence); a run on this data has "
                     "nothing to train or test on (gemray train refuses it): give each user at least 3 "
                     "interactions")], said
    assert load_manifest(out)["splits"]["users"] == 0
    caplog.clear()
    (tmp_path / "log.csv").write_text(HAND_CSV)
    with caplog.at_level("WARNING", logger="gemray.pipelines.interactions"):
        m = prepare_interactions(str(tmp_path / "log.csv"), tmp_path / "hand", user_col="uid", item_col="sku",
                                 time_col="ts", progress=False)
    assert m["splits"]["too_short_users"] == 1 and not [r for r in caplog.records if "splits" in r.getMessage()]


def test_stream_reads_the_four_columns(tmp_path):
    """pipelines/stream.py (named columns) reads a folder with feat_* columns unchanged."""
    from gemray.pipelines.stream import HistoryStream

    src = tmp_path / "log.csv"
    src.write_text(HAND_CSV)
    prepare_interactions(str(src), tmp_path / "prep", user_col="uid", item_col="sku", time_col="ts",
                         rating_col="stars", feature_cols=["genre", "device"], progress=False)
    s = HistoryStream(tmp_path / "prep", "test", rank=0, world_size=1, batch_size=8, max_seq_len=10, reader="arrow")
    batches = list(s.iter_epoch(0))
    assert sum(len(b.user_ids) for b in batches) == 2  # alice, bob (carol has 1 interaction)
    b = batches[0]
    assert sorted(b.targets.tolist()) == [3, 3] and b.item_ids.tolist() in ([1, 2, 1, 1, 2], [1, 2, 1, 2, 1])


# ------------------------------------------------------------------------------------------------ URIs, Parquet

def test_parquet_folder_as_file_uri(tmp_path):
    """A Spark-style Parquet folder (integer ids, a timestamp column, _SUCCESS) as a file:// URI."""
    rng = np.random.default_rng(1)
    n = 3000
    rows = {"user_id": rng.integers(1000, 1100, n), "item_id": rng.integers(5, 400, n) * 7,
            "event_time": pa.array(rng.integers(1_600_000_000, 1_600_100_000, n) * 1000, pa.timestamp("ms")),
            "rating": rng.integers(0, 11, n) / 2.0, "shop": rng.integers(0, 5, n)}
    table = pa.table(rows)
    folder = tmp_path / "events"
    folder.mkdir()
    for k in range(3):
        pq.write_table(table.slice(k * 1000, 1000), folder / f"part-{k:05d}.snappy.parquet")
    (folder / "_SUCCESS").write_text("")
    out = tmp_path / "prep"
    m = prepare_interactions(f"file://{folder}", out, time_col="event_time", rating_col="rating",
                             feature_cols=["shop"], progress=False)
    assert m["input_format"] == "parquet" and len(m["source"]["files"]) == 3
    assert m["columns"]["user_id_type"] == "int" and m["columns"]["item_id_type"] == "int"
    py = table.to_pylist()
    for r in py:
        r["event_time"] = int(r["event_time"].timestamp())
    want = recount(py, "user_id", "item_id", "event_time", "rating", ["shop"])
    assert read_prepared(out, ["shop"]) == want
    raw_items = pq.read_table(out / "items.parquet").column("raw_item_id").to_pylist()
    assert raw_items == sorted(set(rows["item_id"].tolist()))  # integer ids: ascending numeric order


# ------------------------------------------------------------------------------------------------ determinism

@pytest.fixture(scope="module")
def medium_log(tmp_path_factory):
    folder = tmp_path_factory.mktemp("medium") / "logs"
    make_log(folder, 60_000, files=5, users=3000, items=1500, seed=3)
    with open(folder / "log-000.csv", "rb") as f:  # one compressed file: read through the codec
        data = f.read()
    (folder / "log-000.csv").unlink()
    (folder / "log-000.csv.gz").write_bytes(gzip.compress(data, mtime=0))
    return folder


KW = dict(user_col="user", item_col="item", time_col="ts", rating_col="stars", feature_cols=["genre", "device"],
          progress=False)


def test_byte_identical_across_budgets_workers_and_order(medium_log, tmp_path):
    base = prepare_interactions(str(medium_log), tmp_path / "a", memory_budget="2GiB", **KW)
    assert base["counts"]["interactions"] == 60_000 and len(base["source"]["files"]) == 5
    ref = tree_bytes(tmp_path / "a")
    assert "users.parquet" in ref and "features/genre.parquet" in ref
    # tiny partitions and blocks (many spill partitions, oversize ones split again, many read batches)
    prepare_interactions(str(medium_log), tmp_path / "b", memory_budget="256MiB",
                         _tuning={"part_bytes": 100_000, "block_bytes": 70_000, "flush_bytes": 150_000,
                                  "split_bytes": 80_000}, **KW)
    run = json.loads((tmp_path / "b" / "prepare_run.json").read_text())
    assert run["partitions"] > 20
    assert tree_bytes(tmp_path / "b") == ref
    # two worker processes, files given in another order (one by one, reversed)
    files = sorted(str(p) for p in medium_log.iterdir())[::-1]
    prepare_interactions(files, tmp_path / "c", memory_budget="1GiB", workers=2,
                         _tuning={"part_bytes": 500_000}, **KW)
    got = tree_bytes(tmp_path / "c")
    assert {k for k in got if got[k] != ref[k]} == {"manifest.json"}  # only the --src list as given differs
    ma, mc = (json.loads(x) for x in (ref["manifest.json"], got["manifest.json"]))
    assert mc["source"]["uris"] == files
    ma["source"]["uris"] = mc["source"]["uris"]
    assert ma == mc


def test_matches_independent_recount(medium_log, tmp_path):
    out = tmp_path / "prep"
    prepare_interactions(str(medium_log), out, _tuning={"part_bytes": 150_000, "split_bytes": 100_000}, **KW)
    rows = []
    for p in sorted(medium_log.iterdir()):
        t = pacsv.read_csv(p, convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in
                                                                                 ("user", "item", "genre", "device")},
                                                                   strings_can_be_null=True))
        rows += t.to_pylist()
    for r in rows:
        r["device"] = r["device"] or ""
    assert read_prepared(out, ["genre", "device"]) == recount(rows, "user", "item", "ts", "stars", ["genre", "device"])


# ------------------------------------------------------------------------------------------------ Amazon formats

def _kcore_reference(pairs: list[tuple[str, str]], k: int) -> set[tuple[str, str]]:
    rows = list(pairs)
    while True:
        uc, ic = defaultdict(int), defaultdict(int)
        for u, i in rows:
            uc[u] += 1
            ic[i] += 1
        kept = [(u, i) for u, i in rows if uc[u] >= k and ic[i] >= k]
        if len(kept) == len(rows):
            return set(kept)
        rows = kept


def test_amazon_ratings_5core(tmp_path):
    rng = np.random.default_rng(7)
    n = 6000
    lines = []
    for j in range(n):
        u = f"A{int(rng.zipf(1.6)) % 900:05d}XYZ"
        i = f"{int(rng.zipf(1.4)) % 700:010d}" if j % 3 else f"B00{int(rng.integers(0, 500)):07d}"
        lines.append(f"{u},{i},{int(rng.integers(1, 6))}.0,{1_300_000_000 + int(rng.integers(0, 10**7))}")
    src = tmp_path / "ratings_Beauty.csv"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "prep"
    m = prepare_interactions(str(src), out, fmt="amazon-ratings", k_core=5, progress=False,
                             _tuning={"part_bytes": 20_000})
    pairs = [(x.split(",")[0], x.split(",")[1]) for x in lines]
    want = _kcore_reference(pairs, 5)
    got = read_prepared(out)
    assert {(u, e[0]) for u, evs in got.items() for e in evs} == {p for p in want}
    kept_rows = sum(1 for p in pairs if p in want)
    assert m["counts"]["interactions"] == kept_rows and m["k_core"]["removed_interactions"] == n - kept_rows
    assert min(len(v) for v in got.values()) >= 5
    item_counts = defaultdict(int)
    for evs in got.values():
        for e in evs:
            item_counts[e[0]] += 1
    assert min(item_counts.values()) >= 5 and m["k_core"]["iterations"] >= 2
    # ASINs with leading zeros stay text: "0000000012" is not 12
    assert all(isinstance(x, str) for x in pq.read_table(out / "items.parquet").column("raw_item_id").to_pylist())


def test_amazon_seq_positions_and_bad_lines(tmp_path, capsys):
    src = tmp_path / "sequential_data.txt"
    src.write_bytes(b"u1 i1 i2 i3\r\nu2 i2\n\nu1 i4 i5\nu3\nu4 i1 \xff i2\nu5  i9\ti1")
    out = tmp_path / "prep"
    rc, stdout, err = run_cli(["prepare", "interactions", "--format", "amazon-seq", "--src", str(src), "--out",
                               str(out)], capsys)
    assert rc == 2 and err.strip() == (f"gemray: error: {src}:3: field 'row': an empty line: expected "
                                       "'user item1 item2 ...' [field_count]")
    no_leftovers(out)
    m = prepare_interactions(str(src), out, fmt="amazon-seq", on_bad_rows="quarantine", progress=False)
    got = read_prepared(out)
    assert got == {"u1": [("i1", 0, 0), ("i2", 0, 1), ("i3", 0, 2), ("i4", 0, 3), ("i5", 0, 4)],
                   "u2": [("i2", 0, 0)], "u5": [("i9", 0, 0), ("i1", 0, 1)]}
    q = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in q] == [(3, "field_count"), (5, "field_count"), (6, "encoding")]
    assert m["time_unit"] == "position" and m["counts"]["source_rows"] == 7 and m["counts"]["quarantined"] == 3


# ------------------------------------------------------------------------------------------------ bad input

def _bad_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    """(extra CLI args, expected error text) for one kind of bad input."""
    if kind == "missing_column":
        (tmp_path / "a.csv").write_text("user_id,item_id,time\n1,2,3\n")
        return ["--src", str(tmp_path / "a.csv")], \
            f"{tmp_path / 'a.csv'}: no column 'timestamp' (--time-col); the file has: user_id, item_id, time"
    if kind == "mixed_id_types":
        d = tmp_path / "pq"
        d.mkdir()
        pq.write_table(pa.table({"user_id": [1, 2], "item_id": [3, 4], "timestamp": [5, 6]}), d / "a.parquet")
        pq.write_table(pa.table({"user_id": ["x", "y"], "item_id": [3, 4], "timestamp": [5, 6]}), d / "b.parquet")
        return ["--src", str(d)], (f"column 'user_id' (--user-col) has mixed types: string ids in {d / 'b.parquet'} "
                                   f"(string) but int ids in {d / 'a.parquet'}; make them one type, or pass "
                                   "--id-type string")
    if kind == "bad_time":
        (tmp_path / "a.csv").write_text("user_id,item_id,timestamp\nu,i,2024-01-01\nu,j,yesterday\n")
        return ["--src", str(tmp_path / "a.csv")], \
            (f"{tmp_path / 'a.csv'}:3: field 'timestamp': 'yesterday' is not a time (an integer or decimal in "
             "--time-unit, or ISO 8601 such as 2024-01-31T12:00:00Z) [bad_time]")
    if kind == "int_ids":
        (tmp_path / "a.csv").write_text("user_id,item_id,timestamp\n1,2,3\n1,0x2,4\n")
        return ["--src", str(tmp_path / "a.csv"), "--id-type", "int"], \
            f"{tmp_path / 'a.csv'}:3: field 'item_id': '0x2' is not an integer (--id-type int) [non_numeric]"
    if kind == "empty_file":  # 0 bytes (was: KeyError 'user_id'; an empty .csv.gz said "line 1 is empty")
        (tmp_path / "a.csv").write_bytes(b"")
        return ["--src", str(tmp_path / "a.csv")], f"{tmp_path / 'a.csv'}: empty (0 bytes), no CSV header and no rows"
    if kind == "empty_files":  # a folder of empty part files only, read by 2 workers
        d = tmp_path / "parts"
        d.mkdir()
        for name in ("part-0.csv", "part-1.csv"):
            (d / name).write_bytes(b"")
        return ["--src", str(d), "--workers", "2"], \
            f"all 2 files ({d / 'part-0.csv'}, ...): empty (0 bytes), no CSV header and no rows"
    if kind == "feature_name_case":  # prepared fine, then refused by the model a minute into `gemray train`
        (tmp_path / "a.csv").write_text("user_id,item_id,timestamp,Cat\n1,2,3,x\n")
        return ["--src", str(tmp_path / "a.csv"), "--feature-cols", "Cat"], \
            ("--feature-cols 'Cat': a feature name must be lowercase letters, digits and _, starting with a letter "
             "(at most 64 characters): it names the feat_<name> column the model reads and features/<name>.parquet; "
             "rename the source column (e.g. to 'cat')")
    if kind == "unknown_scheme":
        return ["--src", "nosuch://bucket/x.csv"], "--src nosuch://bucket/x.csv: no filesystem for scheme 'nosuch'"
    if kind == "unreachable_http":
        return ["--src", "http://127.0.0.1:9/logs/x.csv"], "--src http://127.0.0.1:9/logs/x.csv: cannot "
    if kind == "unreachable_s3":
        uri = "s3://bucket/logs/?endpoint_override=127.0.0.1:9&scheme=http"
        return ["--src", uri], f"--src {uri}: cannot reach it ("
    if kind == "missing_file":
        return ["--src", f"file://{tmp_path}/nothing/*.parquet"], f"--src file://{tmp_path}/nothing/*.parquet: " \
                                                                 "matches no input file"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing_column", "mixed_id_types", "bad_time", "int_ids", "empty_file",
                                  "empty_files", "feature_name_case", "unknown_scheme", "unreachable_http", "unreachable_s3",
                                  "missing_file"])
def test_bad_input_is_one_error_line_and_nothing_written(tmp_path, capsys, kind):
    args, want = _bad_case(tmp_path, kind)
    out = tmp_path / "prep"
    rc, stdout, err = run_cli(["prepare", "interactions", *args, "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("gemray: error: "), err
    assert want in lines[0], lines[0]
    no_leftovers(out)


SEMI_LOG = "user_id;item_id;timestamp\n1;31;1700000000\n1;32;1700000100\n"


@pytest.mark.parametrize("case", ["semicolon", "tab", "pipe", "comma_in_tsv", "no_header", "no_header_string_ids",
                                  "no_header_iso_times"])
def test_missing_columns_say_the_delimiter_or_the_missing_header(tmp_path, capsys, case):
    """A ';'- or tab-separated file read with ',' has one column named 'user_id;item_id;timestamp', and a file
    without a header row has columns named by its first row ('1', '31', '1700000000'): both said only "no column
    'user_id'". The error now says why: the separator the one column holds, with the --delimiter to pass (which
    then prepares it: '\\t', as a shell passes it, is a tab), or that the first line is data, not names, and the
    names it must give."""
    body = {"semicolon": SEMI_LOG, "tab": SEMI_LOG.replace(";", "\t"), "pipe": SEMI_LOG.replace(";", "|"),
            "comma_in_tsv": SEMI_LOG.replace(";", ","), "no_header": "1,31,1700000000\n1,32,1700000100\n",
            "no_header_string_ids": "u1,sku-31,1700000000.5\n", "no_header_iso_times": "u1,a,2024-01-31\n"}[case]
    src = tmp_path / ("log.tsv" if case == "comma_in_tsv" else "log.csv")
    src.write_text(body)
    out = tmp_path / "prep"
    rc, _, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    header = body.partition("\n")[0]
    fix = {"semicolon": "semicolons (';'), not commas (','); pass --delimiter ';'",
           "tab": "tabs, not commas (','); pass --delimiter '\\t'",
           "pipe": "pipes ('|'), not commas (','); pass --delimiter '|'",
           "comma_in_tsv": "commas (','), not tabs; pass --delimiter ,"}.get(case)
    if fix:
        want = (f"gemray: error: {src}: no column 'user_id' (--user-col); the file has: {header} (one column: the "
                f"file looks delimited by {fix})")
    else:
        want = (f"gemray: error: {src}: no column 'user_id' (--user-col); the file has: {header.replace(',', ', ')} "
                "(data, not names: the file seems to have no header row; its first line must name the columns: "
                "user_id, item_id, timestamp (--user-col, --item-col, --time-col name others))")
    assert lines[0] == want, lines[0]
    no_leftovers(out)
    if fix:  # the option the error names prepares the file
        arg = {"semicolon": ";", "tab": "\\t", "pipe": "|", "comma_in_tsv": ","}[case]
        rc, _, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out), "--delimiter", arg],
                             capsys)
        assert rc == 0, err
        assert read_prepared(out) == {"1": [("31", 0, 1700000000), ("32", 0, 1700000100)]}


def test_a_header_without_the_column_gets_no_hint(tmp_path):
    """Only a header that reads as one separated column or as data gets a hint: a header that names other
    columns is said as before."""
    src = tmp_path / "a.csv"
    src.write_text("user_id,item_id,time\n1,2,3\n")
    with pytest.raises(InputError) as e:
        prepare_interactions(str(src), tmp_path / "prep", progress=False)
    assert str(e.value) == f"{src}: no column 'timestamp' (--time-col); the file has: user_id, item_id, time"


def test_an_error_keeps_the_previous_preparation(tmp_path, capsys):
    src = tmp_path / "log.csv"
    src.write_text(HAND_CSV)
    out = tmp_path / "prep"
    args = ["prepare", "interactions", "--src", str(src), "--out", str(out), "--user-col", "uid", "--item-col", "sku",
            "--time-col", "ts"]
    assert run_cli(args, capsys)[0] == 0
    before = tree_bytes(out)
    src.write_text(HAND_CSV + "dave,A1,not-a-time,1,pop,ios\n")
    rc, _, err = run_cli(args, capsys)
    assert rc == 2 and f"{src}:10: field 'ts'" in err
    assert tree_bytes(out) == before and not [p for p in tmp_path.iterdir() if p.name.startswith(".prep.")]
    (out / "notes.md").write_text("mine")  # a file the manifest does not list: never deleted
    src.write_text(HAND_CSV)
    rc, _, err = run_cli(args, capsys)
    assert rc == 2 and "notes.md" in err and (out / "notes.md").exists()


def test_quarantine_counts_every_kind(tmp_path):
    src = tmp_path / "log.csv"
    src.write_bytes(b"user_id,item_id,timestamp,rating\n"
                    b"u1,i1,10,4\n"
                    b"u1,i2,11,4,extra\n"      # 3: field count
                    b",i3,12,4\n"              # 4: missing user
                    b"u1,i4,13,7\n"            # 5: rating out of range
                    b"u1,i5,-5,1\n"            # 6: before 1970
                    b"u\xff,i6,14,2\n"         # 7: not UTF-8
                    b"\n"                      # 8: empty line (missing user)
                    b"u1,i7,1e3x,2\n"          # 9: unparseable time
                    b"u2,i1,15,2.5\n")
    out = tmp_path / "prep"
    m = prepare_interactions(str(src), out, rating_col="rating", on_bad_rows="quarantine", progress=False,
                             _tuning={"block_bytes": 70_000})
    q = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(r["line"], r["field"], r["reason"]) for r in q] == [
        (3, "row", "field_count"), (4, "user_id", "missing"), (5, "rating", "out_of_range"),
        (6, "timestamp", "out_of_range"), (7, "user_id", "encoding"), (8, "user_id", "missing"),
        (9, "timestamp", "bad_time")]
    assert q[0]["raw"] == "u1,i2,11,4,extra" and q[2]["raw"]["rating"] == "7"
    assert m["counts"]["source_rows"] == 9 == m["counts"]["interactions"] + m["counts"]["quarantined"]
    assert m["quarantine"]["by_reason"] == {"bad_time": 1, "encoding": 1, "field_count": 1, "missing": 2,
                                            "out_of_range": 2}
    assert read_prepared(out) == {"u1": [("i1", 8, 10)], "u2": [("i1", 5, 15)]}


MS_LOG = "user_id,item_id,timestamp\nu1,a,1700000000000\nu1,b,1700000100000\nu1,c,1600000000000\n"


@pytest.mark.parametrize("case", ["csv_ms", "csv_us_as_ms", "csv_decimal_ms", "parquet_ns", "parquet_float_ms",
                                  "one_row_in_ms", "ns_past_2200"])
def test_times_past_2200_name_the_likely_unit(tmp_path, capsys, case):
    """A log in milliseconds (1700000000000) was read as seconds without a word: histories of the year ~55,000.
    A number in --time-unit at or past 2200 is now a bad row (out_of_range), the error naming the file, line,
    field, the year it reads as and the first larger unit that makes it a time before 2200 (with that time)."""
    ms = "it looks like milliseconds (2023-11-14T22:13:20Z); pass --time-unit ms [out_of_range]"
    if case in ("csv_ms", "csv_us_as_ms", "csv_decimal_ms", "one_row_in_ms", "ns_past_2200"):
        src = tmp_path / "log.csv"
        src.write_text({"csv_ms": MS_LOG,
                        "csv_us_as_ms": "user_id,item_id,timestamp\nu1,a,1700000000000000\n",
                        "csv_decimal_ms": "user_id,item_id,timestamp\nu1,a,1700000000000.5\n",
                        "one_row_in_ms": "user_id,item_id,timestamp\nu1,a,1700000000\nu1,b,7258118399\n"
                                         "u1,c,7258118400\n",  # 2199-12-31T23:59:59Z is taken, 2200 is not
                        "ns_past_2200": "user_id,item_id,timestamp\nu1,a,9000000000000000000\n"}[case])
    else:
        src = tmp_path / "log.parquet"
        ts = pa.array([1700000000000000000], pa.int64()) if case == "parquet_ns" else pa.array([1700000000000.5])
        pq.write_table(pa.table({"user_id": [1], "item_id": [2], "timestamp": ts}), src)
    want = {"csv_ms": f"'1700000000000' in --time-unit s is around the year 55840, 2200 or later: {ms}",
            "csv_us_as_ms": "'1700000000000000' in --time-unit ms is around the year 55840, 2200 or later: it looks "
                            "like microseconds (2023-11-14T22:13:20Z); pass --time-unit us [out_of_range]",
            "csv_decimal_ms": f"'1700000000000.5' in --time-unit s is around the year 55840, 2200 or later: {ms}",
            "parquet_ns": "1700000000000000000 in --time-unit s is around the year 53870857431, 2200 or later: it "
                          "looks like nanoseconds (2023-11-14T22:13:20Z); pass --time-unit ns [out_of_range]",
            "parquet_float_ms": f"1700000000000.5 in --time-unit s is around the year 55840, 2200 or later: {ms}",
            "one_row_in_ms": "'7258118400' in --time-unit s is 2200-01-01T00:00:00Z, 2200 or later: it looks like "
                             "milliseconds (1970-03-26T00:08:38Z); pass --time-unit ms [out_of_range]",
            "ns_past_2200": "'9000000000000000000' in --time-unit ns is 2255-03-14T16:00:00Z, 2200 or later: check the "
                            "column's unit (--time-unit s|ms|us|ns) [out_of_range]"}[case]
    args = {"csv_us_as_ms": ["--time-unit", "ms"], "ns_past_2200": ["--time-unit", "ns"]}.get(case, [])
    line = 4 if case == "one_row_in_ms" else 2 if src.suffix == ".csv" else 1
    out = tmp_path / "prep"
    rc, _, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out), *args], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0] == f"gemray: error: {src}:{line}: field 'timestamp': {want}", lines[0]
    no_leftovers(out)


def test_time_unit_warning_decides():
    """Pure: a warning when the unit is not s and more than half of the numeric times are before 1990, naming the
    coarser unit in which the first of them is a time from 1990 to 2200."""
    from gemray.pipelines.interactions import time_unit_warning

    ex = {"file": "log.csv", "line": 2, "value": "'1700000000'", "number": 1700000000.0}
    w = time_unit_warning("ms", 3, 3, ex, "timestamp")
    assert w == {"early": 3, "numeric": 3, "unit": "ms", "likely_unit": "s", "message":
                 "all 3 times in column 'timestamp' (numbers in --time-unit ms) are before 1990, e.g. log.csv:2: "
                 "'1700000000' is 1970-01-20T16:13:20Z; they look like seconds ('1700000000' in s is "
                 "2023-11-14T22:13:20Z): prepare again with --time-unit s (the times are kept as read: logs this old "
                 "exist)"}
    ms = dict(ex, value="1700000000000", number=1700000000000.0)
    assert time_unit_warning("ns", 5, 4, ms, "ts")["likely_unit"] == "ms"
    assert time_unit_warning("ns", 5, 4, ms, "ts")["message"].startswith("4 of 5 times in column 'ts'")
    assert time_unit_warning("us", 2, 2, ex, "ts")["likely_unit"] == "s"
    small = dict(ex, value="5", number=5.0)  # no unit makes it a time after 1990
    assert time_unit_warning("ms", 1, 1, small, "ts")["likely_unit"] is None
    assert "check the column's unit (--time-unit s|ms|us|ns)" in time_unit_warning("ms", 1, 1, small, "ts")["message"]
    assert time_unit_warning("s", 3, 3, ex, "ts") is None  # seconds before 1990: old logs, said by the time range
    assert time_unit_warning("ms", 4, 2, ex, "ts") is None  # half: not most
    assert time_unit_warning("ms", 0, 0, None, "ts") is None  # no numeric times (ISO text, Parquet timestamps)


def test_seconds_read_as_milliseconds_warn(tmp_path, capsys, caplog):
    """A log in seconds prepared with --time-unit ms (or us, ns) put every time in January 1970 without a word.
    It is still prepared as read (old logs exist), but a WARNING names the file, line, column and the unit the
    times look like, and the summary says it beside the dates."""
    src = tmp_path / "log.csv"
    src.write_text("user_id,item_id,timestamp\nu1,a,1700000000\nu1,b,1700000100\nu1,c,1600000000\n")
    out = tmp_path / "prep"
    with caplog.at_level("WARNING", logger="gemray.pipelines.interactions"):
        rc, stdout, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out), "--time-unit",
                                   "ms"], capsys)
    assert rc == 0, err
    assert read_prepared(out) == {"u1": [("c", 0, 1600000), ("a", 0, 1700000), ("b", 0, 1700000)]}
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [f"{out}: all 3 times in column 'timestamp' (numbers in --time-unit ms) are before 1990, e.g. "
                    f"{src}:2: '1700000000' is 1970-01-20T16:13:20Z; they look like seconds ('1700000000' in s is "
                    "2023-11-14T22:13:20Z): prepare again with --time-unit s (the times are kept as read: logs this "
                    "old exist)"], said
    assert ("times from 1970-01-19 to 1970-01-20 (UTC; WARNING: all 3 before 1990 in --time-unit ms: they look like "
            "seconds, pass --time-unit s); ") in stdout, stdout
    assert "time_unit_check" not in load_manifest(out)  # the content manifest is unchanged
    # Parquet nanoseconds holding milliseconds: the same, naming milliseconds
    pq.write_table(pa.table({"user_id": [1, 1], "item_id": [2, 3], "timestamp": [1700000000000, 1700000000500]}),
                   tmp_path / "log.parquet")
    caplog.clear()
    with caplog.at_level("WARNING", logger="gemray.pipelines.interactions"):
        m = prepare_interactions(str(tmp_path / "log.parquet"), tmp_path / "pq", time_unit="ns", progress=False)
    assert m["time_unit_check"]["likely_unit"] == "ms" and "pass --time-unit ms" in format_summary(m)
    assert [r for r in caplog.records if f"{tmp_path / 'log.parquet'}:1: 1700000000000 is" in r.getMessage()]
    # no warning: the right unit; times that state themselves (ISO text) whatever --time-unit says; seconds
    for body, unit in (("u1,a,1700000000000\nu1,b,1700000100000\n", "ms"), ("u1,a,1985-01-01\n", "ms"),
                       ("u1,a,500000000\n", "s")):
        src.write_text("user_id,item_id,timestamp\n" + body)
        caplog.clear()
        with caplog.at_level("WARNING", logger="gemray.pipelines.interactions"):
            m = prepare_interactions(str(src), tmp_path / "ok", time_unit=unit, progress=False)
        assert "time_unit_check" not in m and "WARNING" not in format_summary(m), body
        assert not [r for r in caplog.records if "1990" in r.getMessage()], body


def test_time_unit_ms_reads_milliseconds_and_the_time_range_is_recorded(tmp_path, capsys):
    """The same log with --time-unit ms prepares (times floored to seconds), and the manifest records the range
    of the times (ISO 8601 UTC and unix seconds), which the summary prints as dates: a unit mistake shows at a
    glance. Quarantine mode sets such rows aside with the same problem; when that leaves no row, the error quotes
    the first one (the quarantine file goes with the failed preparation)."""
    src = tmp_path / "log.csv"
    src.write_text(MS_LOG)
    out = tmp_path / "prep"
    rc, stdout, err = run_cli(["prepare", "interactions", "--src", str(src), "--out", str(out), "--time-unit", "ms"],
                              capsys)
    assert rc == 0, err
    assert read_prepared(out) == {"u1": [("c", 0, 1600000000), ("a", 0, 1700000000), ("b", 0, 1700000100)]}
    m = load_manifest(out)
    assert m["time_range"] == {"min": "2020-09-13T12:26:40Z", "max": "2023-11-14T22:15:00Z",
                               "min_unix": 1600000000, "max_unix": 1700000100}
    assert "3 interactions in 1 files; times from 2020-09-13 to 2023-11-14 (UTC); 1 users in the splits" in stdout
    # seconds (the default) as before, with their range; positions (amazon-seq) have none
    (tmp_path / "hand.csv").write_text(HAND_CSV)
    m = prepare_interactions(str(tmp_path / "hand.csv"), tmp_path / "hand", user_col="uid", item_col="sku",
                             time_col="ts", progress=False)
    assert m["time_range"] == {"min": "1970-01-01T00:00:50Z", "max": "2024-01-01T00:00:10Z", "min_unix": 50,
                               "max_unix": 1704067210}
    (tmp_path / "seq.txt").write_text("u1 a b c\n")
    m = prepare_interactions(str(tmp_path / "seq.txt"), tmp_path / "seq", fmt="amazon-seq", progress=False)
    assert m["time_range"] is None and "times from" not in format_summary(m)
    # quarantine: the row in ms is set aside with the same problem, the others kept
    src.write_text("user_id,item_id,timestamp\nu1,a,1700000000\nu1,b,1700000100000\nu1,c,1700000200\n")
    m = prepare_interactions(str(src), tmp_path / "q", on_bad_rows="quarantine", progress=False)
    q = [json.loads(x) for x in (tmp_path / "q" / "quarantine.jsonl").read_text().splitlines()]
    assert [(r["line"], r["field"], r["reason"]) for r in q] == [(3, "timestamp", "out_of_range")]
    assert q[0]["problem"].endswith("it looks like milliseconds (2023-11-14T22:15:00Z); pass --time-unit ms")
    assert m["counts"]["interactions"] == 2 and m["time_range"]["max"] == "2023-11-14T22:16:40Z"
    src.write_text(MS_LOG)
    with pytest.raises(ValueError) as e:
        prepare_interactions(str(src), tmp_path / "q2", on_bad_rows="quarantine", progress=False)
    assert str(e.value) == (f"{src}: no valid interaction rows (3 bad rows quarantined; the first: {src}:2: field "
                            "'timestamp': '1700000000000' in --time-unit s is around the year 55840, 2200 or later: it "
                            "looks like milliseconds (2023-11-14T22:13:20Z); pass --time-unit ms [out_of_range])")
    no_leftovers(tmp_path / "q2")


# ------------------------------------------------------------------------------------------------ end to end

def sparse_short_log(path: Path, *, users: int = 1500, items: int = 400, seed: int = 5) -> Path:
    """A sparse short-history dataset (Amazon-like: 5-12 interactions per user, string ids, shuffled rows, two
    extra columns), with sequential signal: each user keeps to one of 8 item clusters, and after an item comes
    its fixed successor 60% of the time (else another item of the cluster, 10% any item)."""
    rng = np.random.default_rng(seed)
    rows = []
    cluster = rng.integers(0, 8, items)
    by_cluster = [np.flatnonzero(cluster == c) for c in range(8)]
    successor = np.empty(items, np.int64)
    for members in by_cluster:  # one cycle through each cluster
        order = rng.permutation(members)
        successor[order] = np.roll(order, -1)
    for u in range(users):
        taste = int(rng.integers(0, 8))
        n = int(rng.integers(5, 13))
        t = 1_600_000_000 + int(rng.integers(0, 10**6))
        i = int(rng.choice(by_cluster[taste]))
        for k in range(n):
            if k:
                x = rng.random()
                i = int(successor[i]) if x < 0.6 else int(rng.choice(by_cluster[taste])) if x < 0.9 else \
                    int(rng.integers(0, items))
            t += int(rng.integers(60, 86400))
            rows.append((f"cust-{u:05d}", f"P{i:04d}", t, int(rng.integers(1, 6)), f"cat{cluster[i]}",
                         ["app", "web", ""][int(rng.integers(0, 3))]))
    rng.shuffle(rows)
    path.write_text("customer,product,time,stars,category,channel\n"
                    + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


#: The README's "sparse, short histories" recipe, as --set overrides of configs/ml-1m.toml.
RECIPE = ["data.max_seq_len=50", "model.dropout=0.5", "model.num_negatives=512", "model.embedding_dim=64",
          "model.num_blocks=4", "model.num_heads=4", "model.attention_dim=16", "model.linear_dim=16",
          "train.epochs=200", "train.eval_ks=[10,50]"]


def test_readme_recipe_is_the_tested_one():
    text = (REPO / "README.md").read_text()
    block = text[text.index("### Recipe: sparse, short histories"):]
    block = block[block.index("```bash"):block.index("```", block.index("```bash") + 7)]
    for override in RECIPE:
        assert override in block, override


def test_readme_describes_the_log_the_test_generates():
    """The README's figures for the recipe are on `sparse_short_log` as the end-to-end test calls it (its
    defaults): the users / items / lengths it states are the function's."""
    import inspect

    text = " ".join((REPO / "README.md").read_text().split())
    m = re.search(r"`sparse_short_log` in `tests/test_pipelines_interactions.py`: ([\d,]+) users with (\d+)-(\d+) "
                  r"interactions each, ([\d,]+) string-id items in (\d+) clusters", text)
    assert m, "README: the sparse-recipe paragraph no longer names sparse_short_log's counts"
    defaults = {k: p.default for k, p in inspect.signature(sparse_short_log).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert int(m.group(1).replace(",", "")) == defaults["users"]
    assert int(m.group(4).replace(",", "")) == defaults["items"]
    src = inspect.getsource(sparse_short_log)
    assert f"rng.integers({m.group(2)}, {int(m.group(3)) + 1})" in src and f"range({m.group(5)})" in src


@pytest.mark.slow  # prepare + a real `gemray train` (~45 s): make test-slow; make test: preparation tests here, training elsewhere
def test_prepare_then_train_end_to_end(tmp_path):
    """The sparse short-history recipe of the README: a string-id CSV with shuffled rows and two extra columns
    is prepared (5-core) and `gemray train` runs on it and writes metrics."""
    src = sparse_short_log(tmp_path / "events.csv")
    prep = tmp_path / "prepared"
    subprocess.run([*GEMRAY, "prepare", "interactions", "--src", str(src), "--out", str(prep), "--user-col",
                    "customer", "--item-col", "product", "--time-col", "time", "--rating-col", "stars",
                    "--feature-cols", "category,channel", "--k-core", "5"], check=True, cwd=tmp_path)
    m = load_manifest(prep)
    assert m["features"]["category"]["cardinality"] == 8 and m["features"]["channel"]["cardinality"] == 2
    out = tmp_path / "run"
    proc = subprocess.run([*GEMRAY, "train", "--config", str(REPO / "configs" / "ml-1m.toml"), "--set",
                           f"data.prepared_dir={prep}", f"data.raw_dir={src.parent}", *RECIPE, "train.epochs=1",
                           # this stand-in log's catalogue has 400 items: the recipe's 512 negatives are refused above
                           # the catalogue's size (preflight.check_negatives)
                           "model.num_negatives=256",
                           "train.max_steps_per_epoch=3", "train.eval_every=1", "ray.num_workers=1",
                           "checkpoint.keep=1", "--output", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["hr@10"] <= metrics["hr@50"] <= 1.0
    assert metrics["num_test_users"] == m["splits"]["users"]


# ------------------------------------------------------------------------------------------------ benchmark

def _bench(argv: list[str]) -> None:
    """Write a synthetic log (once) and prepare it at each budget, each in a fresh process under /usr/bin/time -v;
    print the peaks and whether the outputs are byte-identical. Not a test: run by hand, figures in BENCHMARKS.md."""
    ap = argparse.ArgumentParser(prog="test_pipelines_interactions.py bench")
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--dir", type=Path, required=True, help="where the log and the prepared folders go")
    ap.add_argument("--budgets", nargs="+", default=["1GiB", "256MiB"])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--via", choices=("api", "cli"), default="api",
                    help="api: prepare_interactions in `python -c`; cli: the `gemray prepare interactions` command")
    ns = ap.parse_args(argv)
    log = ns.dir / "log"
    if not log.exists():
        t = time.perf_counter()
        make_log(log, ns.rows, files=ns.files)
        print(f"wrote {ns.rows} rows in {ns.files} CSV files ({sum(p.stat().st_size for p in log.iterdir()) >> 20} "
              f"MiB) in {time.perf_counter() - t:.0f} s")
    trees = []
    for b in ns.budgets:
        out = ns.dir / f"prepared-{b}-{ns.via}-w{ns.workers}"
        args = ["--src", str(log), "--out", str(out), "--user-col", "user", "--item-col", "item", "--time-col", "ts",
                "--rating-col", "stars", "--feature-cols", "genre,device", "--memory-budget", b,
                "--workers", str(ns.workers)]
        if ns.via == "cli":
            cmd = [*GEMRAY, "prepare", "interactions", *args]
        else:
            cmd = [sys.executable, "-c", "from gemray.pipelines.interactions import prepare_interactions as p; "
                   f"p({str(log)!r}, {str(out)!r}, user_col='user', item_col='item', time_col='ts', "
                   f"rating_col='stars', feature_cols=['genre', 'device'], memory_budget={b!r}, "
                   f"workers={ns.workers}, progress=False)"]
        print("$", " ".join(cmd))
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
        keep = ("Maximum resident", "Elapsed (wall", "User time", "System time")
        print(proc.stdout.strip(), *[x.strip() for x in proc.stderr.splitlines() if x.strip().startswith(keep)],
              sep="\n")
        if proc.returncode:
            print(proc.stderr[-3000:])
            raise SystemExit(proc.returncode)
        print("prepare_run.json:", json.dumps(json.loads((out / "prepare_run.json").read_text())))
        m = json.loads((out / "manifest.json").read_text())
        print("counts:", json.dumps(m["counts"]["users"]), "users,", m["counts"]["items"], "items,",
              m["counts"]["interactions"], "interactions,", len(m["files"]), "files")
        trees.append(tree_bytes(out, digest=True))
    print("byte-identical across budgets:", all(t == trees[0] for t in trees[1:]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench"]:
        _bench(sys.argv[2:])
    else:
        raise SystemExit("usage: python tests/test_pipelines_interactions.py bench --dir DIR [--rows N] [--budgets ...]")


def test_a_header_only_csv_says_it_holds_no_data_rows(tmp_path):
    """A CSV with its header and no data row: the refusal says so, not "(0 bad rows quarantined)" (a new user read
    that as a quarantine having happened, without quarantine mode)."""
    src = tmp_path / "log.csv"
    src.write_text("user_id,item_id,timestamp\n")
    with pytest.raises(ValueError) as e:
        prepare_interactions(str(src), tmp_path / "out", progress=False)
    assert str(e.value) == f"{src}: no valid interaction rows (the files hold a header and no data rows)"


@pytest.mark.parametrize("given,near", [("Rating", "rating"), ("ratings", "rating"), ("score", None)])
def test_a_missing_column_names_its_near_match(tmp_path, given, near):
    """A --rating-col that differs from the file's column only in letter case (or by a close spelling) was refused
    with the column list alone; the refusal now names the column it was likely meant as."""
    src = tmp_path / "a.csv"
    src.write_text("user_id,item_id,timestamp,rating\n1,2,3,4\n")
    with pytest.raises(InputError) as e:
        prepare_interactions(str(src), tmp_path / "prep", rating_col=given, progress=False)
    want = f"{src}: no column {given!r} (--rating-col); the file has: user_id, item_id, timestamp, rating"
    assert str(e.value) == want + (f"; did you mean {near!r}?" if near else "")
