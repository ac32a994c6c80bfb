"""prepare_movielens / load_manifest: real MovieLens files, independent recounts, bad rows, atomic output."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from paths import DATA

from gemray.pipelines import movielens as ml
from gemray.pipelines.movielens import BadRowError, load_manifest, prepare_movielens
from gemray.pipelines.schema import HISTORY_SCHEMA, ITEMS_SCHEMA

ML1M_SLICE_LINES = 20_000


def _recount(path: Path, fmt: str) -> dict[int, list[tuple[int, int, int]]]:
    """Independent reference: user -> [(raw item, half-star rating, timestamp)] in stable time order."""
    per_user: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    lines = path.read_text(encoding="latin-1").splitlines()
    if fmt == "ml-latest-small":
        assert lines[0] == "userId,movieId,rating,timestamp"
        lines = lines[1:]
    sep = {"ml-1m": "::", "ml-100k": "\t", "ml-latest-small": ","}[fmt]
    for line in lines:
        u, i, r, t = line.split(sep)
        per_user[int(u)].append((int(i), round(float(r) * 2), int(t)))
    return {u: sorted(v, key=lambda x: x[2]) for u, v in per_user.items()}  # sorted() is stable


def _read_histories(out: Path, manifest: dict) -> dict[int, list[tuple[int, int, int]]]:
    items = pq.read_table(out / "items.parquet")
    assert items.schema == ITEMS_SCHEMA
    raw_of = dict(zip(items.column("item_id").to_pylist(), items.column("raw_item_id").to_pylist()))
    got: dict[int, list[tuple[int, int, int]]] = {}
    prev_last = 0
    for f in manifest["files"]:
        pf = pq.ParquetFile(out / f["path"])
        assert pf.schema_arrow == HISTORY_SCHEMA
        assert pf.num_row_groups == f["row_groups"]
        t = pf.read()
        uids = t.column("user_id").to_pylist()
        assert uids == sorted(uids) and uids[0] > prev_last  # contiguous ascending user ranges
        prev_last = uids[-1]
        for row in t.to_pylist():
            assert len(row["item_ids"]) == len(row["ratings"]) == len(row["timestamps"])
            assert row["timestamps"] == sorted(row["timestamps"])
            got[row["user_id"]] = [(raw_of[i], r, ts) for i, r, ts in
                                   zip(row["item_ids"], row["ratings"], row["timestamps"])]
    return got


@pytest.fixture(scope="module")
def ml1m_slice(tmp_path_factory) -> Path:
    """The first lines of the real ML-1M ratings.dat (with a SHA256SUMS for the slice)."""
    d = tmp_path_factory.mktemp("ml1m_slice")
    with open(DATA / "ml-1m" / "ratings.dat", "rb") as f:
        data = b"".join(f.readline() for _ in range(ML1M_SLICE_LINES))
    (d / "ratings.dat").write_bytes(data)
    (d / "SHA256SUMS").write_text(f"{hashlib.sha256(data).hexdigest()}  ratings.dat\n")
    return d


@pytest.mark.parametrize("fmt", ["ml-1m", "ml-100k", "ml-latest-small"])
def test_real_formats_convert_exactly(fmt, ml1m_slice, tmp_path):
    src = ml1m_slice if fmt == "ml-1m" else DATA / fmt
    fname = ml.FORMATS[fmt].filename
    out = tmp_path / "prepared"
    m = prepare_movielens(src, out, num_files=4)
    assert m["format"] == fmt and m["on_bad_rows"] == "error"
    on_disk = load_manifest(out)
    assert on_disk["counts"] == m["counts"] and on_disk["shards"] == m["shards"]

    ref = _recount(src / fname, fmt)
    got = _read_histories(out, m)
    assert got == ref  # every user, item, rating, timestamp, in stable time order
    n_inter = sum(len(v) for v in ref.values())
    raw_items = sorted({i for v in ref.values() for i, _, _ in v})
    c = m["counts"]
    assert (c["users"], c["items"], c["interactions"], c["quarantined"]) == (len(ref), len(raw_items), n_inter, 0)
    assert sum(c["rows_per_file"]) == len(ref) and sum(c["tokens_per_file"]) == n_inter
    assert len(m["files"]) == 4 and all(f["row_groups"] > 1 for f in m["files"])
    assert sum(s["rows"] for s in m["shards"]) == len(ref)

    # dense ids: 1..num_items in ascending raw order, 0 unused
    items = pq.read_table(out / "items.parquet")
    assert items.column("item_id").to_pylist() == list(range(1, len(raw_items) + 1))
    assert items.column("raw_item_id").to_pylist() == raw_items
    assert m["vocab"]["num_items"] == m["vocab"]["max_item_id"] == len(raw_items)

    lens = np.array([len(v) for v in ref.values()])
    assert m["history_length"] == {"min": int(lens.min()), "median": float(np.median(lens)), "max": int(lens.max())}
    assert m["splits"]["too_short_users"] == int((lens < 3).sum())
    assert m["splits"]["users"] == int((lens >= 3).sum())
    assert "h[:-2]" in m["splits"]["protocol"]

    src_file = m["source"]["files"][0]
    assert src_file["name"] == fname
    assert src_file["sha256"] == hashlib.sha256((src / fname).read_bytes()).hexdigest()
    assert src_file["sha256sums"] == "matched"
    expected_ratings = list(range(1, 11)) if fmt == "ml-latest-small" else [2, 4, 6, 8, 10]
    assert m["vocab"]["rating_values"] == expected_ratings


def test_half_star_units(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,10,3.5,5\n1,20,0.5,6\n1,30,5.0,7\n")
    prepare_movielens(src, tmp_path / "o")
    assert pq.read_table(tmp_path / "o/histories/part-00000.parquet").column("ratings").to_pylist() == [[7, 1, 10]]
    (src / "ratings.csv").unlink()
    (src / "ratings.dat").write_text("1::10::4::5\n")
    prepare_movielens(src, tmp_path / "o")  # replaces the previous output
    t = pq.read_table(tmp_path / "o/histories/part-00000.parquet")
    assert t.column("ratings").to_pylist() == [[8]]
    assert load_manifest(tmp_path / "o")["format"] == "ml-1m"


def test_repeated_user_item_rows_are_kept_and_reported(tmp_path):
    """Rows repeating a (user, item) pair stay in the history (each is an interaction) but are counted in the
    manifest and named in the summary; the published ml-100k has none."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("1\t10\t3\t5\n1\t20\t4\t6\n1\t10\t3\t5\n2\t10\t5\t7\n1\t10\t1\t9\n")
    m = prepare_movielens(src, tmp_path / "o")
    assert m["counts"]["interactions"] == 5 and m["counts"]["repeated_user_item_rows"] == 2
    assert "2 rows repeat the (user, item) pair of another row" in ml.format_summary(m)
    real = prepare_movielens(DATA / "ml-100k", tmp_path / "real")
    assert real["counts"]["repeated_user_item_rows"] == 0
    assert "repeat" not in ml.format_summary(real)


def test_fast_and_strict_parsers_agree():
    for fmt in ("ml-100k", "ml-latest-small"):
        f = ml.FORMATS[fmt]
        data = (DATA / fmt / f.filename).read_bytes()
        fast = ml._parse_fast(data, f)
        slow = ml._parse_slow(data, f, f.filename, quarantine=False)
        assert fast is not None
        for name in ("users", "items", "ratings", "timestamps"):
            np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name))
        assert fast.data_lines == slow.data_lines == fast.users.size


def test_ties_keep_file_order_and_short_users_counted(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = ["5\t300\t3\t100", "5\t100\t4\t50", "5\t200\t5\t100", "5\t400\t1\t100",  # ties at t=100
            "7\t100\t2\t9",  # 1 interaction
            "9\t100\t2\t9", "9\t300\t2\t8",  # 2 interactions
            "8\t42\t3\t1", "8\t43\t3\t1", "8\t44\t3\t1"]  # exactly 3, all tied
    (src / "u.data").write_text("\n".join(rows) + "\n")
    m = prepare_movielens(src, tmp_path / "o", num_files=8)
    assert len(m["files"]) == 4  # capped at the user count
    got = _read_histories(tmp_path / "o", m)
    assert [i for i, _, _ in got[5]] == [100, 300, 200, 400]
    assert [i for i, _, _ in got[8]] == [42, 43, 44]
    assert m["splits"]["too_short_users"] == 2 and m["splits"]["users"] == 2
    assert m["counts"]["users"] == 4 and m["history_length"]["min"] == 1


def test_data_of_only_too_short_users_warns(tmp_path, caplog):
    """Every user under 3 ratings: prepared (as before) under one WARNING naming the count and the length needed
    (was: only "0 users in the splits" in the summary); with one user in the splits, no warning."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("1\t10\t3\t5\n1\t20\t4\t6\n2\t10\t5\t7\n")
    with caplog.at_level("WARNING", logger="gemray.pipelines.movielens"):
        m = prepare_movielens(src, tmp_path / "o")
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert m["splits"] == {**m["splits"], "users": 0, "too_short_users": 2}
    assert len(said) == 1 and said[0].startswith(f"{tmp_path / 'o'}: no user is in the train/valid/test splits: "
                                                 "all 2 users have fewer than 3 interactions"), said
    assert said[0].endswith("give each user at least 3 interactions"), said
    caplog.clear()
    (src / "u.data").write_text("1\t10\t3\t5\n1\t20\t4\t6\n1\t30\t4\t7\n2\t10\t5\t7\n")
    with caplog.at_level("WARNING", logger="gemray.pipelines.movielens"):
        m = prepare_movielens(src, tmp_path / "o2")
    assert m["splits"]["users"] == 1 and not [r for r in caplog.records if r.levelname == "WARNING"]


def test_num_files_capped_at_the_user_count_is_logged(tmp_path, caplog, capsys):
    """`gemray prepare movielens --num-files 1000` on ml-100k wrote 943 files (one user at least per file) without
    a word: the cap is logged at INFO (the CLI's default console level) with the count written, the count asked for
    and why; nothing is logged when the files asked for are written."""
    from gemray.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("".join(f"{u}\t{i}\t3\t{u * 100 + i}\n" for u in (1, 2, 3) for i in (1, 2, 3)))
    out = tmp_path / "o"
    with caplog.at_level("INFO", logger="gemray.pipelines.movielens"):
        assert main(["prepare", "movielens", "--src", str(src), "--out", str(out), "--num-files", "1000"]) == 0
    capped = [r for r in caplog.records if "history files" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in capped] == [
        ("INFO", f"{out}: writing 3 history files, not --num-files 1000: a file holds whole users' histories and the "
                 "data has 3 users")]
    assert len(load_manifest(out)["files"]) == 3 and "in 3 files" in capsys.readouterr().out
    caplog.clear()
    with caplog.at_level("INFO", logger="gemray.pipelines.movielens"):
        prepare_movielens(src, out, num_files=3)
    assert not [r for r in caplog.records if "history files" in r.getMessage()]
    # prepared by `gemray train` from a config: the line names data.num_files (it said "--num-files 1000" too)
    from gemray.config import load_config
    from gemray.controller.run import ensure_prepared

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "ml-latest-small.toml"),
                      [f"data.raw_dir={src}", f"data.prepared_dir={tmp_path / 'from_config'}", "data.num_files=1000"])
    caplog.clear()
    with caplog.at_level("INFO", logger="gemray.pipelines.movielens"):
        ensure_prepared(cfg)
    assert [r.getMessage() for r in caplog.records if "history files" in r.getMessage()] == [
        f"{tmp_path / 'from_config'}: writing 3 history files, not data.num_files = 1000: a file holds whole users' "
        "histories and the data has 3 users"]


# ---------------------------------------------------------------------------------------------- bad rows

GOOD = {
    "ml-1m": ["1::10::4::100", "1::11::5::101", "2::10::3::102", "2::12::1::103"],
    "ml-100k": ["1\t10\t4\t100", "1\t11\t5\t101", "2\t10\t3\t102", "2\t12\t1\t103"],
    "ml-latest-small": ["1,10,4.0,100", "1,11,4.5,101", "2,10,3.0,102", "2,12,0.5,103"],
}
HEADER = {"ml-1m": "UserID::MovieID::Rating::Timestamp", "ml-100k": "user id\titem id\trating\ttimestamp",
          "ml-latest-small": "userId,movieId,rating,timestamp"}


def _bad_cases(fmt: str) -> list[tuple[str, bytes, str, str]]:
    """(case, bad line bytes, expected reason, expected field name)."""
    sep = {"ml-1m": "::", "ml-100k": "\t", "ml-latest-small": ","}[fmt]
    names = ml.FORMATS[fmt].fields
    j = sep.join
    bad_rating = "5.5" if fmt == "ml-latest-small" else "6"
    return [
        ("too_few_fields", j(["3", "10", "4"]).encode(), "field_count", "row"),
        ("too_many_fields", j(["3", "10", "4", "100", "7"]).encode(), "field_count", "row"),
        ("non_numeric", j(["3", "x10", "4", "100"]).encode(), "non_numeric", names[1]),
        ("undecodable", j(["3", "10", "4", "100"]).encode() + b"\xff\xfe", "encoding", "bytes"),
        ("user_zero", j(["0", "10", "4", "100"]).encode(), "out_of_range", names[0]),
        ("item_too_big", j(["3", str(2**31), "4", "100"]).encode(), "out_of_range", names[1]),
        ("rating_range", j(["3", "10", bad_rating, "100"]).encode(), "out_of_range", names[2]),
        ("negative_ts", j(["3", "10", "4", "-1"]).encode(), "out_of_range", names[3]),
        ("duplicate_header", HEADER[fmt].encode(), "header", "row"),
    ]


def _write_src(tmp_path: Path, fmt: str, bad: bytes, at: int = 2) -> tuple[Path, int]:
    """Good rows with ``bad`` inserted; returns (folder, 1-based line number of the bad row)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    lines = [g.encode() for g in GOOD[fmt]]
    lines.insert(at, bad)
    line = at + 1
    if fmt == "ml-latest-small":
        lines.insert(0, HEADER[fmt].encode())
        line += 1
    (src / ml.FORMATS[fmt].filename).write_bytes(b"\n".join(lines) + b"\n")
    return src, line


@pytest.mark.parametrize("fmt", ["ml-1m", "ml-100k", "ml-latest-small"])
def test_bad_rows_error_and_quarantine(fmt, tmp_path):
    for case, bad, reason, field in _bad_cases(fmt):
        d = tmp_path / case
        d.mkdir()
        src, line = _write_src(d, fmt, bad)
        fname = ml.FORMATS[fmt].filename
        with pytest.raises(BadRowError) as ei:
            prepare_movielens(src, d / "out")
        e = ei.value
        assert isinstance(e, ValueError)
        assert (e.line, e.reason, e.field) == (line, reason, field), case
        assert f"{fname}:{line}:" in str(e) and repr(field) in str(e)
        assert not (d / "out").exists()  # nothing half-written
        assert not any(p.name.startswith(".out.tmp") for p in d.iterdir())

        m = prepare_movielens(src, d / "out", on_bad_rows="quarantine")
        assert m["quarantine"] == {"file": "quarantine.jsonl", "total": 1, "by_reason": {reason: 1}}, case
        assert m["counts"]["interactions"] == len(GOOD[fmt])  # all good rows kept
        assert m["counts"]["source_data_lines"] == len(GOOD[fmt]) + 1
        assert "1 bad rows quarantined" in ml.format_summary(m)
        recs = [json.loads(x) for x in (d / "out/quarantine.jsonl").read_text().splitlines()]
        assert len(recs) == 1 and recs[0]["line"] == line and recs[0]["reason"] == reason
        assert recs[0]["file"].endswith(fname) and recs[0]["raw"]


def test_many_bad_rows_are_all_counted(tmp_path):
    cases = _bad_cases("ml-1m")
    src = tmp_path / "src"
    src.mkdir()
    lines = [g.encode() for g in GOOD["ml-1m"]] + [b for _, b, _, _ in cases] + [b"", b"4::10::2::5"]
    (src / "ratings.dat").write_bytes(b"\n".join(lines) + b"\n")
    m = prepare_movielens(src, tmp_path / "o", on_bad_rows="quarantine")
    assert m["quarantine"]["total"] == len(cases) + 1  # + the blank line (field_count)
    assert m["counts"]["interactions"] == len(GOOD["ml-1m"]) + 1
    assert m["counts"]["interactions"] + m["quarantine"]["total"] == m["counts"]["source_data_lines"]
    want: dict[str, int] = defaultdict(int)
    for _, _, r, _ in cases:
        want[r] += 1
    want["field_count"] += 1
    assert m["quarantine"]["by_reason"] == dict(sorted(want.items()))


def test_csv_header_must_be_line_one(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ratings.csv").write_text("1,10,4.0,100\n2,10,3.0,5\n")
    with pytest.raises(BadRowError, match=r"ratings.csv:1: field 'row'.*header"):
        prepare_movielens(src, tmp_path / "o")


# ------------------------------------------------------------------------------- sources and output folder

def test_detect_none_or_several(tmp_path):
    with pytest.raises(FileNotFoundError, match="no MovieLens ratings file"):
        prepare_movielens(tmp_path, tmp_path / "o")
    (tmp_path / "u.data").write_text("1\t2\t3\t4\n")
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,2,3.0,4\n")
    with pytest.raises(ValueError, match="several"):
        prepare_movielens(tmp_path, tmp_path / "o")
    with pytest.raises(FileNotFoundError):
        prepare_movielens(tmp_path / "missing", tmp_path / "o")


def test_checksum_mismatch_names_file(ml1m_slice, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ratings.dat").write_bytes((ml1m_slice / "ratings.dat").read_bytes())
    (src / "SHA256SUMS").write_text("0" * 64 + "  ratings.dat\n")
    with pytest.raises(ValueError, match=r"ratings.dat: sha256 .* does not match"):
        prepare_movielens(src, tmp_path / "o")
    (src / "SHA256SUMS").write_text("0" * 64 + "  other.dat\n")
    assert prepare_movielens(src, tmp_path / "o")["source"]["files"][0]["sha256sums"] == "not listed"


def test_output_replaced_atomically_and_foreign_folder_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("1\t2\t3\t4\n1\t3\t3\t5\n")
    out = tmp_path / "o"
    prepare_movielens(src, out, num_files=2)
    (src / "u.data").write_text("1\t2\t3\t4\n1\t3\t3\t5\n2\t9\t1\t1\n")
    m = prepare_movielens(src, out, num_files=1)  # the old manifest's second history file goes with it
    assert m["counts"]["interactions"] == 3 and sorted(p.name for p in (out / "histories").iterdir()) == [
        "part-00000.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "src"]  # no temp folders left
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "x.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing"):
        prepare_movielens(src, foreign)
    assert (foreign / "x.txt").read_text() == "keep me"


def test_prepare_never_deletes_what_it_did_not_write(tmp_path):
    """Replacing --out loses nothing but an earlier preparation: a user file beside the prepared files, another
    program's manifest.json, a source inside --out are refused and left as they are; a symlinked --out replaces
    the folder it points to."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("1\t2\t3\t4\n1\t3\t3\t5\n")
    out = tmp_path / "o"
    prepare_movielens(src, out)
    (out / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match=r"does not list \(notes.txt\).*move them out"):
        prepare_movielens(src, out)
    assert (out / "notes.txt").read_text() == "precious" and (out / "manifest.json").is_file()
    (out / "notes.txt").unlink()
    (out / "raw").mkdir()
    (out / "raw" / "u.data").write_text((src / "u.data").read_text())
    with pytest.raises(ValueError, match="holds the source"):
        prepare_movielens(out / "raw", out)
    assert (out / "raw" / "u.data").is_file()
    web = tmp_path / "web"
    web.mkdir()
    (web / "manifest.json").write_text('{"name": "my webapp"}')
    (web / "index.html").write_text("precious")
    with pytest.raises(ValueError, match="not a gemray manifest"):
        prepare_movielens(src, web)
    assert (web / "index.html").read_text() == "precious"
    target = tmp_path / "target"
    prepare_movielens(src, target)
    link = tmp_path / "link"
    link.symlink_to(target)
    prepare_movielens(src, link)
    assert link.is_symlink() and (target / "manifest.json").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left behind


def test_replacing_other_data_warns(tmp_path, caplog):
    """Re-preparing the same source into its folder is quiet; preparing another dataset over it warns, naming
    both (the old one is still replaced)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "u.data").write_text("1\t2\t3\t4\n1\t3\t3\t5\n")
    (b / "ratings.dat").write_text("1::2::3::4\n1::3::3::5\n2::9::1::1\n")
    out = tmp_path / "o"
    with caplog.at_level("WARNING", logger="gemray.pipelines.movielens"):
        prepare_movielens(a, out)
        prepare_movielens(a, out)
        assert not [r for r in caplog.records if ": replacing " in r.getMessage()]  # (the tmp path says "replacing")
        m = prepare_movielens(b, out)
    msgs = [r.getMessage() for r in caplog.records if ": replacing " in r.getMessage()]
    assert len(msgs) == 1 and "u.data (2 interactions" in msgs[0] and "ratings.dat" in msgs[0], msgs
    assert m["counts"]["interactions"] == 3 and load_manifest(out)["format"] == m["format"]


def test_load_manifest_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="gemray prepare movielens"):
        load_manifest(tmp_path / "nothing")
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("1\t2\t3\t4\n")
    prepare_movielens(src, tmp_path / "o", num_files=1)
    (tmp_path / "o/histories/part-00000.parquet").unlink()
    with pytest.raises(FileNotFoundError, match=r"part-00000.parquet.*gemray prepare movielens"):
        load_manifest(tmp_path / "o")
    (tmp_path / "o/manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable manifest"):
        load_manifest(tmp_path / "o")


def test_remake_hint_names_the_command_of_the_folders_format():
    """Pure: the advice for a damaged or unprepared folder names the command that made data of its format, with what
    its manifest recorded (interactions' sources, synthetic's users / items / seed); unknown: MovieLens."""
    d = Path("/p")
    src = {"source": {"uris": ["a.csv", "s3://b/c.parquet"], "params": {"users": 20, "items": 30, "seed": 1}}}
    assert ml.remake_hint(d, "interactions", src, again=True) == (
        "prepare it again (`gemray prepare interactions --src a.csv --src s3://b/c.parquet --out /p` with the options "
        "it was prepared with; `gemray train` does not make it from data.raw_dir)")
    assert "`gemray prepare interactions --src <your interaction files> --out /p`" in ml.remake_hint(d, "amazon-seq")
    assert ml.remake_hint(d, "synthetic", src, again=True) == (
        "prepare it again (`gemray prepare synthetic --out /p --users 20 --items 30 --seed 1` with the other "
        "parameters it was made with, or delete /p: `gemray train` generates it from data.synthetic)")
    assert "--users U --items N --seed S" in ml.remake_hint(d, "synthetic")
    for fmt in ("ml-1m", None):
        assert ml.remake_hint(d, fmt) == "run `gemray prepare movielens --src <MovieLens folder> --out /p` first"
        assert ml.remake_hint(d, fmt, again=True).startswith("prepare it again (`gemray prepare movielens --src ")


def _prepared_by(kind: str, tmp_path: Path) -> Path:
    """A small folder prepared by `gemray prepare <kind>` (movielens / interactions / synthetic)."""
    out = tmp_path / kind
    rows = [(u, i, u * 100 + i) for u in range(1, 7) for i in range(1, 6)]
    if kind == "movielens":
        (tmp_path / "ml").mkdir()
        (tmp_path / "ml" / "u.data").write_text("".join(f"{u}\t{i}\t3\t{t}\n" for u, i, t in rows))
        ml.prepare_movielens(tmp_path / "ml", out, num_files=2)
    elif kind == "interactions":
        from gemray.pipelines.interactions import prepare_interactions

        (tmp_path / "logs.csv").write_text("user_id,item_id,timestamp\n"
                                           + "".join(f"u{u},i{i},{t}\n" for u, i, t in rows))
        prepare_interactions(str(tmp_path / "logs.csv"), out, num_files=2)
    else:
        from gemray.pipelines.synthetic import prepare_synthetic, spec_from_params

        prepare_synthetic(out, spec_from_params({"users": "12", "items": "20", "seed": "3"}, "test"), num_files=2)
    return out


@pytest.mark.parametrize("kind, command", [
    ("movielens", "`gemray prepare movielens --src <MovieLens folder> --out {d}`"),
    ("interactions", "`gemray prepare interactions --src {src} --out {d}`"),
    ("synthetic", "`gemray prepare synthetic --out {d} --users 12 --items 20 --seed 3`")])
def test_damaged_folder_advice_follows_the_command_that_made_it(kind, command, tmp_path):
    """A folder of `gemray prepare interactions` / `synthetic` with a history file missing, damaged bytes, a corrupt
    or a missing manifest.json was told to re-run `gemray prepare movielens`; the advice now names the command that
    made it (from the manifest, from what is left of a truncated one, or from the folder's files)."""
    d = _prepared_by(kind, tmp_path)
    want = command.format(d=d, src=tmp_path / "logs.csv")
    no_params = want.replace("--users 12 --items 20 --seed 3", "--users U --items N --seed S").replace(
        f"--src {tmp_path / 'logs.csv'}", "--src <your interaction files>")
    m = json.loads((d / "manifest.json").read_text())
    part = d / m["files"][0]["path"]
    good = part.read_bytes()
    part.write_bytes(good[:-30])
    with pytest.raises(ValueError, match=r"part-00000.parquet: ") as e:
        load_manifest(d, verify=True)
    assert f"prepare it again ({want}" in str(e.value), str(e.value)
    part.unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_manifest(d)
    assert "part-00000.parquet but it is missing; prepare it again (" + want in str(e.value), str(e.value)
    part.write_bytes(good)
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text[: len(text) // 2])  # truncated: its "format" entry is still there
    with pytest.raises(ValueError, match="unreadable manifest") as e:
        load_manifest(d)
    assert f"prepare it again ({no_params}" in str(e.value), str(e.value)
    (d / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no manifest.json") as e:
        load_manifest(d)
    if kind == "movielens":  # the folder's files tell MovieLens from nothing: not prepared, as before
        assert str(e.value).endswith(f"; run {want} first"), str(e.value)
    else:
        assert f"its {kind} data is not usable without it; prepare it again ({no_params}" in str(e.value)


def test_load_manifest_refuses_damaged_prepared_files(tmp_path):
    """A prepared folder whose Parquet files are not what prepare_movielens wrote is refused by load_manifest
    (verify=True: what `gemray train` calls before Ray starts), naming the file: a flipped byte (sha256), a
    truncated file (no footer), an items file with other rows; manifests without the sha256 keys (older
    gemray) still get the footer and row-count checks."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("".join(f"{u}\t{i}\t3\t{u * 100 + i}\n" for u in range(1, 9) for i in range(1, 7)))
    out = tmp_path / "o"
    m = prepare_movielens(src, out, num_files=2)
    assert all(len(f["sha256"]) == 64 for f in m["files"]) and len(m["items_sha256"]) == 64
    load_manifest(out, verify=True)
    part = out / m["files"][1]["path"]
    good = part.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    part.write_bytes(bytes(bad))
    load_manifest(out)  # without verify (the workers): existence only
    with pytest.raises(ValueError, match=r"part-00001.parquet: sha256 differs .*gemray prepare movielens"):
        load_manifest(out, verify=True)
    mpath = out / "manifest.json"
    old = json.loads(mpath.read_text())
    for f in old["files"]:
        del f["sha256"]
    del old["items_sha256"]
    mpath.write_text(json.dumps(old))
    part.write_bytes(good[: len(good) - 20])
    with pytest.raises(ValueError, match=r"part-00001.parquet: not a readable Parquet file"):
        load_manifest(out, verify=True)
    part.write_bytes(good)
    load_manifest(out, verify=True)
    items = out / m["items_file"]
    pq.write_table(pq.read_table(items).slice(1), items)
    with pytest.raises(ValueError, match=r"items.parquet: \d+ rows, manifest.json says \d+"):
        load_manifest(out, verify=True)


TRICKY = {
    "ml-1m": [b"1::10::4::100\r\n2::11::5::101\r\n", b"1::10::4::100", b"1::010::4::100\n", b"1:: 10::4::100\n",
              b"1::10 ::4::100\n", b"1::10::4::1e3\n", b"1::10::4.0::100\n", b"1::10::4::100::\n", b"1::10:4::100\n",
              b"1::10::4::100\n\n", b"1::10::4::00\n", b"1::0x1::4::5\n", b"1\t::10::4::5\n", b"+1::10::4::5\n",
              b"1::10::4::5\r2::11::4::6\n", b'"1"::10::4::5\n', b"1::10::4::5\n::::::\n"],
    "ml-100k": [b"1\t10\t4\t100\n", b"1\t10\t4\t100 \n", b"1 \t10\t4\t100\n", b"1\t10\t4\t100\t\n", b"1\t\t4\t100\n"],
    "ml-latest-small": [b"\xef\xbb\xbfuserId,movieId,rating,timestamp\n1,10,4.0,100\n",
                        b"userId,movieId,rating,timestamp\r\n1,10,4,100\r\n", b"userId,movieId,rating,timestamp\n",
                        *(b"userId,movieId,rating,timestamp\n1,10," + r + b",100\n"
                          for r in (b"4.", b".5", b"4.50", b"nan", b" 4.0", b"4e0", b"4..5", b"-4.0", b"4.25"))],
}


@pytest.mark.parametrize("fmt", list(TRICKY))
def test_fast_path_never_accepts_what_the_strict_parser_rejects(fmt):
    f = ml.FORMATS[fmt]
    for data in TRICKY[fmt]:
        fast = ml._parse_fast(data, f)
        slow = ml._parse_slow(data, f, f.filename, quarantine=True)
        if fast is None:
            continue
        assert not slow.bad, data
        for name in ("users", "items", "ratings", "timestamps"):
            np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name), err_msg=repr(data))
    assert ml._parse_fast(TRICKY[fmt][0], f) is not None  # the well-formed first case takes the fast path


def test_only_bad_rows_is_an_error_even_when_quarantining(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_bytes(b"x\ty\tz\tw\n1\t2\n")
    with pytest.raises(ValueError, match=r"no valid rating rows \(2 bad rows"):
        prepare_movielens(src, tmp_path / "o", on_bad_rows="quarantine")
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="on_bad_rows"):
        prepare_movielens(src, tmp_path / "o", on_bad_rows="skip")


@pytest.mark.parametrize("fmt", ["ml-1m", "ml-100k", "ml-latest-small"])
def test_file_cut_mid_line_is_a_bad_row(fmt, tmp_path):
    """A copy that stopped early ends without a newline; its last line still parses (a shorter timestamp)."""
    src, _ = _write_src(tmp_path, fmt, GOOD[fmt][0].encode())
    path = src / ml.FORMATS[fmt].filename
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # drop the newline and the timestamp's last two digits
    last = data.count(b"\n")
    with pytest.raises(BadRowError) as ei:
        prepare_movielens(src, tmp_path / "out")
    assert (ei.value.line, ei.value.reason) == (last, "truncated")
    assert f"{ml.FORMATS[fmt].filename}:{last}:" in str(ei.value) and "newline" in str(ei.value)
    m = prepare_movielens(src, tmp_path / "out", on_bad_rows="quarantine")
    assert m["quarantine"]["by_reason"] == {"truncated": 1}
    assert m["counts"]["interactions"] + 1 == m["counts"]["source_data_lines"]


@pytest.mark.parametrize("fmt", ["ml-1m", "ml-100k", "ml-latest-small"])
@pytest.mark.parametrize("on_bad_rows", ["error", "quarantine"])
def test_a_utf8_bom_is_accepted_in_every_format(fmt, on_bad_rows, tmp_path):
    """issue 22: a UTF-8 byte-order mark before line 1 of ratings.dat / u.data (as of ratings.csv) is no data
    byte: the file prepares, and with quarantine its first (valid) row is kept, nothing quarantined."""
    src = tmp_path / "src"
    src.mkdir()
    lines = ([HEADER[fmt]] if fmt == "ml-latest-small" else []) + GOOD[fmt]
    (src / ml.FORMATS[fmt].filename).write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    m = prepare_movielens(src, tmp_path / "o", on_bad_rows=on_bad_rows)
    assert m["counts"]["interactions"] == len(GOOD[fmt]) and m["counts"]["quarantined"] == 0, m["counts"]
    f = ml.FORMATS[fmt]
    data = (src / f.filename).read_bytes()
    slow = ml._parse_slow(data, f, f.filename, quarantine=True)
    assert not slow.bad and slow.users.tolist()[0] == 1 and slow.items.tolist()[0] == 10


def test_preparing_twice_gives_an_identical_manifest(tmp_path, monkeypatch):
    """issue 22: run-time facts (created_unix, seconds) go to prepare_run.json, so manifest.json is the same
    bytes for two preparations of the same source; the second replaces the first (its run file is listed)."""
    src, _ = _write_src(tmp_path, "ml-1m", b"3::10::4::100")
    prepare_movielens(src, tmp_path / "a")
    first = (tmp_path / "a" / "manifest.json").read_bytes()
    run_first = json.loads((tmp_path / "a" / ml.RUN_FILE).read_text())
    monkeypatch.setattr(ml.time, "time", lambda: run_first["created_unix"] + 3600.0)  # an hour later
    prepare_movielens(src, tmp_path / "a")  # replaces its own earlier output
    prepare_movielens(src, tmp_path / "b")
    assert (tmp_path / "a" / "manifest.json").read_bytes() == first == (tmp_path / "b" / "manifest.json").read_bytes()
    run = json.loads((tmp_path / "a" / ml.RUN_FILE).read_text())
    assert run["created_unix"] > run_first["created_unix"] and run["seconds"] >= 0
    m = json.loads(first)
    assert "created_unix" not in m and "seconds" not in m["conversion"] and m["run_file"] == ml.RUN_FILE
    load_manifest(tmp_path / "a", verify=True)


def test_an_empty_ratings_file_says_it_holds_no_data_rows(tmp_path):
    """An empty u.data: the refusal says the file holds no data rows, not "(0 bad rows quarantined)"."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_bytes(b"")
    with pytest.raises(ValueError, match=r"u\.data: no valid rating rows \(the file holds no data rows\)"):
        prepare_movielens(src, tmp_path / "o")
    assert not (tmp_path / "o").exists()
