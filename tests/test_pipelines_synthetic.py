"""gemray prepare synthetic: determinism, distributions, label signal, manifest, and streaming of the GEM fields.

Datasets are small (3,000 users, ~120k events: about a second each) and built once per module. Statistical
checks state their tolerance next to them (a few standard errors, or a KS critical value at 99.9%).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from gemray.cli import SYNTHETIC_DEFAULTS, main
from gemray.jagged import JaggedBatch
from gemray.pipelines.movielens import load_manifest
from gemray.pipelines.schema import SPLITS, history_schema
from gemray.pipelines.stream import HistoryStream, item_feature_tables
from gemray.pipelines.synthetic import (_Guide, SyntheticSpec, format_synthetic_summary, item_table_bytes,
                                        length_pmf, normalized_entropy, parse_features, prepare_synthetic)

BASE = dict(users=3000, items=3000, seed=7, mean_len=40.0, max_len=400, min_len=4)


def _spec(**kw) -> SyntheticSpec:
    return SyntheticSpec(**{**BASE, **kw})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> prepared folder, generated lazily (each once per module)."""
    root = tmp_path_factory.mktemp("synthetic")
    made: dict[str, Path] = {}
    recipes = {
        "base": (_spec(), dict(num_files=3, row_groups_per_file=2, workers=1)),
        "small_w1": (_spec(users=700, max_len=200), dict(num_files=3, row_groups_per_file=2, workers=1)),
        "small_w2": (_spec(users=700, max_len=200), dict(num_files=3, row_groups_per_file=2, workers=2)),
        "layout": (_spec(), dict(num_files=2, row_groups_per_file=3, workers=1)),
        "seed8": (_spec(seed=8), dict(num_files=3, row_groups_per_file=2, workers=1)),
        "zipf": (_spec(length_dist="zipf", mean_len=30.0), dict(num_files=2, row_groups_per_file=2, workers=1)),
        "noise": (_spec(signal=0.0), dict(num_files=2, row_groups_per_file=2, workers=1)),
    }

    def get(name: str) -> Path:
        if name not in made:
            spec, kw = recipes[name]
            prepare_synthetic(root / name, spec, progress=False, **kw)
            made[name] = root / name
        return made[name]

    return get


def _table(folder: Path):
    return pq.read_table(folder / "histories").sort_by("user_id")


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ determinism

def test_same_seed_byte_identical_whatever_the_worker_count(folders):
    a, b = _files(folders("small_w1")), _files(folders("small_w2"))
    assert sorted(a) == ["histories/part-00000.parquet", "histories/part-00001.parquet",
                         "histories/part-00002.parquet", "items.parquet", "manifest.json", "prepare_run.json"]
    run_a, run_b = json.loads(a.pop("prepare_run.json")), json.loads(b.pop("prepare_run.json"))
    assert (run_a["workers"], run_b["workers"]) == (1, 2) and run_a["seconds"] >= 0  # run-time facts only there
    assert a == b  # manifest.json included


def test_layout_changes_files_not_rows(folders):
    base, other = folders("base"), folders("layout")
    assert _files(base)["histories/part-00000.parquet"] != _files(other)["histories/part-00000.parquet"]
    assert len(load_manifest(other)["shards"]) == 6 and len(load_manifest(other)["files"]) == 2
    assert _table(base).equals(_table(other))  # every row, every value (blocks straddling row groups included)


def test_different_seed_differs(folders):
    a, b = _table(folders("base")), _table(folders("seed8"))
    assert a.num_rows == b.num_rows
    assert not a.column("item_ids").equals(b.column("item_ids"))
    assert not a.column("cand_click").equals(b.column("cand_click"))


def test_guide_search_is_searchsorted():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 5000):
        cum = np.cumsum((rng.permutation(n) + 1.0) ** -1.1)
        x = np.concatenate([rng.random(20000) * cum[-1], cum[:-1], np.nextafter(cum[:-1], 0), [0.0]])
        assert np.array_equal(_Guide(cum).search(x), np.minimum(np.searchsorted(cum, x, side="right"), n - 1))


# -------------------------------------------------------------------------------------------------- manifest

def test_manifest_counts_shards_and_checksums(folders, tmp_path):
    folder = folders("base")
    m = load_manifest(folder, verify=True)
    t = _table(folder)
    assert t.schema == history_schema(m)
    n = pc.list_value_length(t.column("item_ids")).to_numpy()
    nc = pc.list_value_length(t.column("cand_item_ids")).to_numpy()
    assert m["format"] == "synthetic" and m["counts"]["users"] == t.num_rows == 3000
    assert m["counts"]["interactions"] == n.sum() and m["counts"]["candidates"] == nc.sum()
    assert m["counts"]["clicks"] == pc.sum(pc.list_flatten(t.column("cand_click"))).as_py()
    assert t.column("user_id").to_pylist() == list(range(1, 3001))
    shards = m["shards"]
    assert [s["index"] for s in shards] == list(range(6)) and sum(s["rows"] for s in shards) == 3000
    assert sum(s["tokens"] for s in shards) == n.sum()
    assert all(a["first_user_id"] <= a["last_user_id"] < b["first_user_id"] for a, b in zip(shards, shards[1:]))
    for s in shards:  # each shard's recorded range and counts are what its row group holds
        rg = pq.ParquetFile(folder / s["file"]).read_row_group(s["row_group"])
        assert rg.num_rows == s["rows"] and rg.column("user_id")[0].as_py() == s["first_user_id"]
        assert pc.sum(pc.list_value_length(rg.column("item_ids"))).as_py() == s["tokens"]
    codes = t.column("request_split").to_numpy()
    assert [int((codes == i).sum()) for i in range(3)] == [m["ranking"]["requests"][s] for s in SPLITS]
    assert set(m["features"]) == {"category", "author", "hour", "device"}
    assert m["features"]["author"] == {**m["features"]["author"], "level": "token", "cardinality": 2048,
                                       "column": "feat_author"}
    assert m["features"]["hour"]["level"] == "request" and m["features"]["hour"]["column"] == "ctx_hour"
    # a changed byte is refused by the checksum
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    part = copy / m["files"][1]["path"]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        load_manifest(copy, verify=True)


def test_feature_values_dense_and_aligned(folders):
    folder = folders("base")
    m = load_manifest(folder)
    t = _table(folder)
    items = item_feature_tables(m)
    flat = pc.list_flatten(t.column("item_ids")).to_numpy()
    for name in ("category", "author"):
        tok = pc.list_flatten(t.column(f"feat_{name}")).to_numpy()
        assert tok.size == flat.size and np.array_equal(tok, items[name][flat])  # per token = per item value
        card = m["features"][name]["cardinality"]
        assert 0 <= tok.min() and tok.max() <= card
        missing = float((items[name][1:] == 0).mean())
        assert abs(missing - 0.01) < 0.01  # 3,000 items at 1%: 30 +- 5.5 missing
    hour, device = t.column("ctx_hour").to_numpy(), t.column("ctx_device").to_numpy()
    assert hour.min() >= 1 and hour.max() <= 24 and len(np.unique(hour)) == 24
    assert device.min() >= 1 and device.max() <= 4


# -------------------------------------------------------------------------------------------- distributions

@pytest.mark.parametrize("name,dist", [("base", "lognormal"), ("zipf", "zipf")])
def test_history_lengths_follow_the_distribution(folders, name, dist):
    folder = folders(name)
    spec = SyntheticSpec.from_dict(load_manifest(folder)["source"]["params"])
    assert spec.length_dist == dist
    k, pmf, params = length_pmf(spec)
    assert abs(params["mean"] - spec.mean_len) < 1e-6  # solved exactly on the capped support
    n = pc.list_value_length(_table(folder).column("item_ids")).to_numpy()
    assert n.min() >= spec.min_len and n.max() <= spec.max_len
    emp = np.searchsorted(np.sort(n), k, side="right") / n.size
    ks = np.abs(emp - np.cumsum(pmf)).max()
    assert ks < 1.95 / math.sqrt(n.size)  # KS critical value at 99.9% (conservative for a discrete law)
    sd = math.sqrt(float((pmf * (k - params["mean"]) ** 2).sum()))
    assert abs(n.mean() - spec.mean_len) < 4 * sd / math.sqrt(n.size)
    if dist == "zipf":  # P(k) ~ k**-a: log-log slope of the pmf is -a, and the tail is heavy
        a = params["exponent"]
        assert a > 1 and np.allclose(np.diff(np.log(pmf)) / np.diff(np.log(k)), -a)
    else:  # log-normal: log lengths inside the range have the solved location and shape
        mid = np.log(n[(n > spec.min_len) & (n < spec.max_len)])
        assert abs(np.median(mid) - params["mu"]) < 0.1 and abs(np.std(mid) - spec.len_sigma) < 0.15
    assert (n == spec.max_len).sum() <= 3 * pmf[-1] * n.size + 5  # the cap takes the tail's mass, no more


def test_item_popularity_is_zipf(folders):
    flat = pc.list_flatten(_table(folders("base")).column("item_ids")).to_numpy()
    counts = np.sort(np.bincount(flat, minlength=3001)[1:])[::-1]
    ranks = np.arange(1, counts.size + 1)
    sl = slice(2, 300)  # ranks 3..300: past the noisiest head, with >= ~100 events each
    slope = np.polyfit(np.log(ranks[sl]), np.log(counts[sl]), 1)[0]
    assert abs(slope + 1.0) < 0.15  # item_zipf = 1.0 (observed within +-0.05 at these sizes)


def test_length_and_spec_errors_name_the_flag():
    with pytest.raises(ValueError, match="--mean-len 5000"):
        _spec(mean_len=5000.0)
    with pytest.raises(ValueError, match="--mean-len"):
        _spec(length_dist="zipf", mean_len=300.0)  # above the range's midpoint: needs a negative exponent
    with pytest.raises(ValueError, match="--stickiness"):
        _spec(stickiness=0.7, follow=0.5)
    with pytest.raises(ValueError, match="--min-len"):
        _spec(min_len=2)
    with pytest.raises(ValueError, match="--features"):
        _spec(features=(("category", 5), ("category", 6)))
    with pytest.raises(ValueError, match="--split-fractions"):
        _spec(split_fractions=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="NAME=CARDINALITY"):
        parse_features("category=64,author")
    assert parse_features("category=64, author=9") == (("category", 64), ("author", 9))


def test_cli_defaults_are_the_spec_defaults():
    spec_defaults = {f.name: f.default for f in dataclasses.fields(SyntheticSpec)}
    assert SYNTHETIC_DEFAULTS == {k: spec_defaults[k] for k in SYNTHETIC_DEFAULTS}
    assert set(spec_defaults) - set(SYNTHETIC_DEFAULTS) == {"users", "items", "seed", "min_candidates"}


# ---------------------------------------------------------------------------------------------------- signal

def _auc(score: np.ndarray, label: np.ndarray) -> float:
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.from_numpy(score.astype(np.float32)), torch.from_numpy(label.astype(np.int64))))


def _ranking_features(folder: Path):
    """Per candidate: split, click, convert, and three history-derived features a model could compute (the share
    of the last 32 events before the request in the candidate's category, the share over the whole input, the
    candidate's log popularity in the histories)."""
    m = load_manifest(folder)
    t = _table(folder)
    cat = item_feature_tables(m)["category"]
    n = pc.list_value_length(t.column("item_ids")).to_numpy()
    flat = pc.list_flatten(t.column("item_ids")).to_numpy()
    start = np.concatenate([[0], np.cumsum(n)[:-1]])
    code = t.column("request_split").to_numpy()
    stop = n - np.where(code == 2, 1, 2)
    rows = np.repeat(np.arange(t.num_rows), n)
    pos = np.arange(flat.size) - start[rows]
    before = pos < stop[rows]  # the input before the request
    recent = before & (pos >= stop[rows] - 32)
    n_cat = int(cat.max()) + 1

    def share(mask: np.ndarray) -> np.ndarray:  # [rows, categories] share of the masked events per category
        h = np.zeros((t.num_rows, n_cat))
        np.add.at(h, (rows[mask], cat[flat[mask]]), 1.0)
        return h / np.maximum(h.sum(axis=1, keepdims=True), 1)

    nc = pc.list_value_length(t.column("cand_item_ids")).to_numpy()
    crow = np.repeat(np.arange(t.num_rows), nc)
    cand = pc.list_flatten(t.column("cand_item_ids")).to_numpy()
    pop = np.bincount(flat, minlength=m["counts"]["items"] + 1) + 1.0
    x = np.column_stack([share(recent)[crow, cat[cand]], share(before)[crow, cat[cand]], np.log(pop[cand])])
    click = pc.list_flatten(t.column("cand_click")).to_numpy().astype(np.float64)
    convert = pc.list_flatten(t.column("cand_convert")).to_numpy().astype(np.float64)
    return code[crow], click, convert, x


def _fit_logistic(x: np.ndarray, y: np.ndarray, iters: int = 25) -> np.ndarray:
    """Newton's method for logistic regression with an intercept and a tiny ridge."""
    x1 = np.column_stack([np.ones(len(x)), x])
    w = np.zeros(x1.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-x1 @ w))
        grad = x1.T @ (p - y) + 1e-6 * w
        hess = (x1 * (p * (1 - p))[:, None]).T @ x1 + 1e-6 * np.eye(len(w))
        w -= np.linalg.solve(hess, grad)
    return w


def _ne_of(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    p = np.clip(1 / (1 + np.exp(-np.column_stack([np.ones(len(x)), x]) @ w)), 1e-12, 1 - 1e-12)
    ll = -(y * np.log(p) + (1 - y) * np.log1p(-p)).sum()
    return normalized_entropy(ll, len(y), int(y.sum()))


def test_labels_carry_learnable_signal(folders):
    m = load_manifest(folders("base"))
    split, click, convert, x = _ranking_features(folders("base"))
    assert (convert <= click).all() and convert.sum() > 0
    rate = click.mean()
    assert abs(rate - 0.05) < 0.004  # calibrated to ctr 0.05: SE 0.0005 at ~180k candidates, +-1.5% calibration
    assert abs(convert.sum() / click.sum() - 0.1) < 0.025  # cvr 0.1 among ~9k clicks: SE 0.003
    train, held = split == 0, split != 0
    # one history-derived feature alone ranks held-out clicks well above chance (about 1,000 held-out clicks:
    # the AUC's SE is ~0.01)
    assert _auc(x[held, 0], click[held]) > 0.6
    # a three-feature logistic regression fitted on train requests brings held-out NE clearly below 1
    w = _fit_logistic(x[train], click[train])
    ne = _ne_of(x[held], click[held], w)
    assert ne < 0.96  # observed 0.925 (the SE of an NE over ~38k held-out candidates is ~0.01)
    # and the generator's own probabilities are the floor: below what the simple model reaches
    oracle = m["ranking"]["oracle_ne"]["click"]
    assert all(0.7 < oracle[s] < ne for s in ("valid", "test"))


def test_no_signal_means_noise_labels(folders):
    m = load_manifest(folders("noise"))
    split, click, _, x = _ranking_features(folders("noise"))
    held = split != 0
    assert abs(_auc(x[held, 0], click[held]) - 0.5) < 0.05  # ~5 SE of an AUC over ~1,000 held-out clicks
    w = _fit_logistic(x[split == 0], click[split == 0])
    assert _ne_of(x[held], click[held], w) > 0.98
    assert all(abs(m["ranking"]["oracle_ne"]["click"][s] - 1) < 0.02 for s in SPLITS)


def test_next_item_structure_beats_popularity(folders):
    """Leave-one-out test targets: a first-order transition count (fitted on the train sequences h[:-2]) with the
    last item's category as fallback reaches far more HR@10 than the 10 most popular items."""
    folder = folders("base")
    t = _table(folder)
    cat = item_feature_tables(load_manifest(folder))["category"]
    n = pc.list_value_length(t.column("item_ids")).to_numpy()
    flat = pc.list_flatten(t.column("item_ids")).to_numpy()
    start = np.concatenate([[0], np.cumsum(n)[:-1]])
    trans: dict[int, Counter] = defaultdict(Counter)
    pop: Counter = Counter()
    for s, length in zip(start, n):
        h = flat[s:s + length - 2].tolist()
        pop.update(h)
        for a, b in zip(h, h[1:]):
            trans[a][b] += 1
    top10 = {i for i, _ in pop.most_common(10)}
    by_cat: dict[int, list[int]] = defaultdict(list)
    for i, _ in pop.most_common():
        by_cat[int(cat[i])].append(i)
    hit_pop = hit_seq = 0
    for s, length in zip(start, n):
        last, target = int(flat[s + length - 2]), int(flat[s + length - 1])
        hit_pop += target in top10
        rec = [i for i, _ in trans[last].most_common(10)]
        rec += [i for i in by_cat[int(cat[last])] if i not in rec][:10 - len(rec)]
        hit_seq += target in rec
    hr_pop, hr_seq = hit_pop / len(n), hit_seq / len(n)
    assert hr_pop > 0.1  # a popular head exists (Zipf over 3,000 items)
    assert hr_seq > hr_pop + 0.15  # observed ~0.71 vs ~0.35; SE of each ~0.009


# ---------------------------------------------------------------------------------------------------- stream

def _reference(folder: Path, split: str, max_len: int) -> dict[int, dict]:
    out = {}
    for row in _table(folder).to_pylist():
        n = len(row["item_ids"])
        stop = n - 1 if split == "test" else n - 2
        sl = slice(max(0, stop - max_len), stop)
        mine = row["request_split"] == SPLITS.index(split)
        out[row["user_id"]] = {
            "items": row["item_ids"][sl], "category": row["feat_category"][sl], "author": row["feat_author"][sl],
            "hour": row["ctx_hour"], "device": row["ctx_device"],
            "cands": row["cand_item_ids"] if mine else [],
            "labels": list(zip(row["cand_click"], row["cand_convert"])) if mine else []}
    return out


def _rows(batch: JaggedBatch) -> dict[int, dict]:
    batch.validate()
    o, co = batch.offsets.tolist(), batch.candidate_offsets.tolist()
    assert batch.labels.dtype == torch.float32 and batch.candidate_ids.dtype == torch.int64
    out = {}
    for b, u in enumerate(batch.user_ids.tolist()):
        s, c = slice(o[b], o[b + 1]), slice(co[b], co[b + 1])
        out[u] = {"items": batch.item_ids[s].tolist(), "category": batch.features["category"][s].tolist(),
                  "author": batch.features["author"][s].tolist(), "hour": int(batch.context["hour"][b]),
                  "device": int(batch.context["device"][b]), "cands": batch.candidate_ids[c].tolist(),
                  "labels": [tuple(int(v) for v in x) for x in batch.labels[c].tolist()]}
    return out


@pytest.mark.parametrize("world_size", [1, 3])
def test_stream_candidates_line_up_with_parquet(folders, world_size):
    folder = folders("base")
    max_len = 24
    seen_cands = 0
    for split in SPLITS:
        ref = _reference(folder, split, max_len)
        got: dict[int, dict] = {}
        streams = [HistoryStream(folder, split, rank=r, world_size=world_size, batch_size=64, max_seq_len=max_len,
                                 sub_batch_size=16, bbs_window_batches=4, seed=5, reader="arrow")
                   for r in range(world_size)]
        for st in streams:
            for batch in st.iter_epoch(1):
                rows = _rows(batch)
                assert not set(rows) & set(got)
                got.update(rows)
        assert got == ref  # every user once; tokens, features, context, candidates and labels exact under BBS
        seen_cands += sum(len(v["cands"]) for v in got.values())
    assert seen_cands == load_manifest(folder)["counts"]["candidates"]  # each request's candidates in one split


def test_trailing_empty_batches_carry_empty_gem_fields(folders):
    folder = folders("base")
    # 6 shards over 4 ranks: ranks 2 and 3 hold 1 shard, ranks 0 and 1 two: the light ranks pad with B=0 batches
    streams = [HistoryStream(folder, "valid", rank=r, world_size=4, batch_size=128, max_seq_len=16, reader="arrow")
               for r in range(4)]
    empties = [b for st in streams for b in st.iter_epoch(0) if b.batch_size == 0]
    assert empties
    for b in empties:
        b.validate()
        assert b.candidate_offsets.tolist() == [0] and b.candidate_ids.numel() == 0
        assert tuple(b.labels.shape) == (0, 2) and b.labels.dtype == torch.float32
        assert set(b.features) == {"category", "author"} and all(v.numel() == 0 for v in b.features.values())
        assert set(b.context) == {"hour", "device"} and all(v.numel() == 0 for v in b.context.values())
        assert b.targets.numel() == 0


def test_stream_refuses_data_that_breaks_the_declared_schema(folders, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(folders("base"), bad)
    man = json.loads((bad / "manifest.json").read_text())
    man["features"]["color"] = {"level": "token", "cardinality": 3, "column": "feat_color"}
    (bad / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="feat_color"):
        next(HistoryStream(bad, "train", rank=0, world_size=1, batch_size=8, max_seq_len=8, sub_batch_size=8, reader="arrow")
             .iter_epoch(0))
    del man["features"]["color"]
    man["features"]["category"]["cardinality"] = 10  # the files hold values up to 64
    (bad / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="outside 0..10"):
        next(HistoryStream(bad, "valid", rank=0, world_size=1, batch_size=8, max_seq_len=8, reader="arrow")
             .iter_epoch(0))


def test_gem_fields_validate_and_move():
    b = JaggedBatch(user_ids=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 3]), item_ids=torch.tensor([4, 5, 6]),
                    ratings=torch.tensor([8, 6, 10]), timestamps=torch.tensor([1, 2, 3]),
                    features={"category": torch.tensor([1, 1, 2])}, context={"hour": torch.tensor([5, 9])},
                    candidate_offsets=torch.tensor([0, 2, 3]), candidate_ids=torch.tensor([7, 8, 9]),
                    labels=torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))
    assert b.validate().num_candidates == 3
    moved = b.to("meta")
    assert moved.features["category"].is_meta and moved.context["hour"].is_meta and moved.labels.is_meta
    assert b.features["category"].device.type == "cpu"
    for change, field in [({"features": {"category": torch.tensor([1, 2])}}, "features"),
                          ({"context": {"hour": torch.tensor([5])}}, "context"),
                          ({"candidate_ids": torch.tensor([7, 8])}, "candidate_ids"),
                          ({"candidate_offsets": torch.tensor([0, 3, 2])}, "candidate_offsets"),
                          ({"labels": torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])}, "convert"),
                          ({"labels": torch.tensor([[1, 1], [0, 0], [1, 0]])}, "float32"),
                          ({"labels": None}, "labels")]:
        with pytest.raises(ValueError, match=field):
            b.with_(**change).validate()
    plain = JaggedBatch(user_ids=b.user_ids, offsets=b.offsets, item_ids=b.item_ids, ratings=b.ratings,
                        timestamps=b.timestamps)
    assert plain.validate().num_candidates == 0 and plain.to("meta").features is None


def test_cli_summary_says_n_a_for_a_split_without_requests(tmp_path, capsys):
    """5 users leave the valid / test splits without ranking requests: their floor NE reads "n/a (no requests)", not
    Python's None (a new user's finding)."""
    out = tmp_path / "few"
    assert main(["prepare", "synthetic", "--out", str(out), "--users", "5", "--items", "100", "--seed", "1",
                 "--max-len", "100", "--mean-len", "20", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    ne = load_manifest(out, verify=True)["ranking"]["oracle_ne"]["click"]
    empty = [s for s, v in ne.items() if v is None]
    assert empty, ne  # the case this test is about
    assert "None" not in printed and all(f"{s} n/a (no requests)" in printed for s in empty), printed


def test_cli_summary_names_why_a_split_has_no_floor_ne(tmp_path, capsys):
    """A split with requests but no clicks said "n/a (no requests)" (a new user's finding): the reason is now its
    labels (no clicks / every candidate clicked); a split without requests keeps "n/a (no requests)"."""
    out = tmp_path / "few"
    assert main(["prepare", "synthetic", "--out", str(out), "--users", "5", "--items", "100", "--seed", "1",
                 "--max-len", "100", "--mean-len", "20", "--workers", "1"]) == 0
    capsys.readouterr()
    m = load_manifest(out, verify=True)
    r = m["ranking"]
    assert r["requests"]["train"] > 0 and r["clicks"]["train"] > 0, r
    r["clicks"]["train"], r["oracle_ne"]["click"]["train"] = 0, None
    assert "train n/a (no clicks)" in format_synthetic_summary(m)
    r["clicks"]["train"] = r["candidates"]["train"]
    assert "train n/a (every candidate clicked)" in format_synthetic_summary(m)
    r["requests"]["train"] = 0
    assert "train n/a (no requests)" in format_synthetic_summary(m)


def test_cli_refuses_item_tables_larger_than_memory(tmp_path, capsys):
    """A feature cardinality (or --items) whose item tables cannot fit this machine's memory is refused up front,
    naming the largest feature (was numpy's raw MemoryError from deep inside the generator: a new user's finding)."""
    out = tmp_path / "huge"
    rc = main(["prepare", "synthetic", "--out", str(out), "--users", "3", "--items", "4", "--seed", "1",
               "--min-len", "3", "--max-len", "3", "--features", "category=1000000000000"])
    err = capsys.readouterr().err
    assert rc == 2 and "largest category=1000000000000" in err and "GiB of memory" in err, err
    assert not out.exists()
    small = SyntheticSpec(users=3, items=4, features=(("category", 1000),))
    assert 4 * (16 + 16 + 4 * small.latent_dim) < item_table_bytes(small) < 2**20


def test_cli_prepare_synthetic(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["prepare", "synthetic", "--out", str(out), "--users", "40", "--items", "50", "--seed", "3",
               "--mean-len", "12", "--max-len", "64", "--candidates", "8", "--min-candidates", "4",
               "--features", "genre=5", "--num-files", "2", "--workers", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "prepared synthetic" in printed and "40 users" in printed
    m = load_manifest(out, verify=True)
    assert set(m["features"]) == {"genre", "hour", "device"} and m["ranking"]["candidates_per_request"] == [4, 8]
    nc = pc.list_value_length(_table(out).column("cand_item_ids")).to_numpy()
    assert nc.min() >= 1 and nc.max() <= 8
    assert main(["prepare", "synthetic", "--out", str(tmp_path / "x"), "--users", "5", "--items", "5", "--seed",
                 "1", "--follow", "0.9"]) == 2
    assert "--stickiness" in capsys.readouterr().err


@pytest.mark.parametrize("args, line", [
    (["--mean-len", "2", "--max-len", "3"], "--min-len (default 8) must be <= --max-len (3): pass --min-len 3"),
    (["--max-len", "6"], "--min-len (default 8) must be <= --max-len (6): pass --min-len between 3 and 6"),
    (["--min-len", "5000"], "--min-len (5000) must be <= --max-len (default 4096): pass --max-len 5000 or more"),
    (["--min-len", "9", "--max-len", "5"], "--min-len (9) must be <= --max-len (5)"),
    (["--max-len", "2"], "--max-len: expected an integer >= 3, got 2"),  # the flag's own bound still comes first
])
def test_cli_length_range_refusal_says_which_value_is_the_default(args, line, tmp_path, capsys):
    """`gemray prepare synthetic --mean-len 2 --max-len 3` was refused with "--min-len (8) must be <= --max-len (3)",
    a value the user never gave: a defaulted side now says "(default 8)" and which flag to pass; exit 2, nothing
    written."""
    assert main(["prepare", "synthetic", "--out", str(tmp_path / "x"), "--users", "5", "--items", "5", "--seed", "1",
                 *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"gemray: error: {line}"]
    assert list(tmp_path.iterdir()) == []


def _assert_config_refusal(entries: str, line: str, tmp_path) -> None:
    """gem-tiny's config with data.synthetic = [users=64, items=100, seed=0, <entries>]: ensure_synthetic refuses
    with exactly "data.synthetic: <line>" and generates nothing."""
    from gemray.config import load_config
    from gemray.pipelines.synthetic import ensure_synthetic

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml"),
                      [f"data.prepared_dir={tmp_path / 'data'}",
                       f"data.synthetic=[users=64,items=100,seed=0,{entries}]"])
    with pytest.raises(ValueError) as e:
        ensure_synthetic(cfg.data)
    assert str(e.value) == f"data.synthetic: {line}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("entries, line", [
    ("max_len=3", 'min_len (default 8) must be <= max_len (3): add "min_len=3"'),
    ("max_len=6", 'min_len (default 8) must be <= max_len (6): add "min_len=N" with 3 <= N <= 6'),
    ("min_len=5000", 'min_len (5000) must be <= max_len (default 4096): add "max_len=N" with N >= 5000'),
    ("min_len=9,max_len=5", "min_len (9) must be <= max_len (5)"),
    ("max_len=2", "max_len: expected an integer >= 3, got 2"),  # the value's own bound still comes first (in entry names)
])
def test_config_length_range_refusal_names_the_entries_and_the_default(entries, line, tmp_path):
    """data.synthetic = [..., "max_len=3"] (the spec `gemray train` generates from) was refused with "data.synthetic:
    --min-len (8) must be <= --max-len (3)": a default the user never gave, in CLI flags the config has none of. A
    defaulted side now says "(default 8)" and which entry to add, in the entries' names; nothing is generated. The
    CLI's messages are unchanged (test_cli_length_range_refusal_says_which_value_is_the_default)."""
    _assert_config_refusal(entries, line, tmp_path)


FIXED = "every history 50 events long; leave {m} out, give {m}=50, or widen the range"


@pytest.mark.parametrize("args, line", [
    (["--min-len", "50", "--max-len", "50", "--mean-len", "200"],
     "--mean-len 200: --min-len (50) = --max-len (50) makes " + FIXED.format(m="--mean-len")),
    (["--min-len", "50", "--max-len", "50", "--mean-len", "49.5"],
     "--mean-len 49.5: --min-len (50) = --max-len (50) makes " + FIXED.format(m="--mean-len")),
    (["--max-len", "8", "--mean-len", "20"], "--mean-len 20: --min-len (default 8) = --max-len (8) makes every history "
     "8 events long; leave --mean-len out, give --mean-len=8, or widen the range"),
    # the reach refusal names the default as the min / max refusals do, and the value as given when it was given
    (["--max-len", "100"], "--mean-len (default 200): a capped log-normal on 8..100 has a mean strictly between 8 and "
     "100 (e.g. --mean-len=54)"),
    (["--max-len", "100", "--length-dist", "zipf"], "--mean-len (default 200): a Zipf length distribution (exponent "
     ">= 0) on 8..100 has a mean in (8, 54] (e.g. --mean-len=54)"),
    (["--max-len", "100", "--mean-len", "200"], "--mean-len 200: a capped log-normal on 8..100 has a mean strictly "
     "between 8 and 100 (e.g. --mean-len=54)"),
])
def test_cli_mean_len_refusals(args, line, tmp_path, capsys):
    """`gemray prepare synthetic --min-len 50 --max-len 50 --mean-len 200` wrote histories of 50 events, the mean
    asked for silently ignored: a --mean-len other than that one length is refused naming the three flags (a
    default side as such). A range the default mean cannot reach said "--mean-len 200", a value the user never
    gave: it says "(default 200)". Exit 2, nothing written."""
    assert main(["prepare", "synthetic", "--out", str(tmp_path / "x"), "--users", "5", "--items", "5", "--seed", "1",
                 *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"gemray: error: {line}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--min-len", "5", "--max-len", "5", "--mean-len", "5"],
                                  ["--min-len", "5", "--max-len", "5"]])
def test_cli_fixed_length_accepts_its_own_mean_or_none(args, tmp_path, capsys):
    """--min-len = --max-len with --mean-len equal to that length, or without --mean-len (its default unused), is
    accepted: every history has that length."""
    out = tmp_path / "x"
    assert main(["prepare", "synthetic", "--out", str(out), "--users", "4", "--items", "20", "--seed", "1",
                 "--num-files", "1", "--workers", "1", *args]) == 0
    assert "history length mean 5, median 5, max 5" in capsys.readouterr().out
    assert set(pc.list_value_length(_table(out).column("item_ids")).to_pylist()) == {5}


@pytest.mark.parametrize("entries, line", [
    ("min_len=50,max_len=50,mean_len=200",
     "mean_len 200: min_len (50) = max_len (50) makes " + FIXED.format(m="mean_len")),
    ("max_len=8,mean_len=20", "mean_len 20: min_len (default 8) = max_len (8) makes every history 8 events long; "
     "leave mean_len out, give mean_len=8, or widen the range"),
    ("max_len=100", "mean_len (default 200): a capped log-normal on 8..100 has a mean strictly between 8 and 100 "
     "(e.g. mean_len=54)"),
])
def test_config_mean_len_refusals_name_the_entries(entries, line, tmp_path):
    """data.synthetic's mean_len: refused with one length fixed by min_len = max_len unless equal to it, and the
    reach refusal says "(default 200)" when mean_len is not among the entries, in the entries' names as the other
    refusals there; nothing is generated."""
    from gemray.pipelines.synthetic import spec_from_params

    _assert_config_refusal(entries, line, tmp_path)
    spec = spec_from_params({"users": "4", "items": "20", "min_len": "50", "max_len": "50", "mean_len": "50"})
    assert (spec.min_len, spec.max_len, spec.mean_len) == (50, 50, 50.0)


def test_replacing_other_data_warns(tmp_path, caplog, capsys):
    """prepare synthetic over a folder of other data (another seed, or a MovieLens preparation) replaced it without a
    word, where prepare movielens warns (a new user's finding); re-preparing the same data stays silent."""
    out = tmp_path / "o"
    args = ["prepare", "synthetic", "--out", str(out), "--users", "3", "--items", "20", "--min-len", "3",
            "--max-len", "5", "--mean-len", "4", "--workers", "1"]

    def replacing(seed: int) -> list[str]:
        caplog.clear()
        with caplog.at_level("INFO", logger="gemray.pipelines.synthetic"):
            assert main(args + ["--seed", str(seed)]) == 0
        said = [r for r in caplog.records if r.levelname == "WARNING" and "replacing" in r.getMessage()]
        assert all(r.name == "gemray.pipelines.synthetic" for r in said)  # the command's logger, not movielens'
        return [r.getMessage() for r in said]

    assert replacing(0) == [] and replacing(0) == []
    seed0 = json.loads((out / "manifest.json").read_text())
    n0, sha0 = seed0["counts"]["interactions"], seed0["source"]["params_sha256"]
    msgs = replacing(1)
    manifest = json.loads((out / "manifest.json").read_text())
    sha1 = manifest["source"]["params_sha256"]
    assert sha1 != sha0
    assert msgs == [f"{out}: replacing synthetic data ({n0} interactions, seed 0, parameters sha256 {sha0[:12]}...) "
                    f"with synthetic data (seed 1, parameters sha256 {sha1[:12]}...); checkpoints of the old data will "
                    "not resume on it"]
    manifest["format"] = "movielens-1m"
    (out / "manifest.json").write_text(json.dumps(manifest))
    msgs = replacing(1)
    assert len(msgs) == 1 and msgs[0].startswith(f"{out}: replacing movielens-1m data ("), msgs


def test_num_files_capped_at_the_user_count_is_logged(tmp_path, caplog, capsys):
    """`gemray prepare synthetic --users 3 --num-files 1000` wrote 3 files (whole users per file) without a word: the
    cap is logged at INFO (the CLI's default console level) with the count written, the count asked for and why, as
    prepare movielens does; nothing is logged when the files asked for are written."""
    out = tmp_path / "o"
    with caplog.at_level("INFO", logger="gemray.pipelines.synthetic"):
        assert main(["prepare", "synthetic", "--out", str(out), "--users", "3", "--items", "20", "--seed", "0",
                     "--min-len", "3", "--max-len", "5", "--mean-len", "4", "--num-files", "1000",
                     "--workers", "1"]) == 0
    capped = [r for r in caplog.records if "history files" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in capped] == [
        ("INFO", f"{out}: writing 3 history files, not --num-files 1000: a file holds whole users' histories and the "
                 "data has 3 users")]
    assert len(load_manifest(out)["files"]) == 3 and "in 3 files" in capsys.readouterr().out
    caplog.clear()
    with caplog.at_level("INFO", logger="gemray.pipelines.synthetic"):
        prepare_synthetic(out, _spec(users=3, items=20, min_len=3, max_len=5, mean_len=4.0), num_files=3,
                          progress=False, workers=1)
    assert not [r for r in caplog.records if "history files" in r.getMessage()]


def test_num_files_capped_from_a_config_names_data_num_files(tmp_path, caplog, capsys):
    """`gemray train` generating data.synthetic of 3 users with data.num_files = 8 logged "not --num-files 8", a
    flag the user never passed: the line names the config key."""
    from gemray.config import load_config
    from gemray.pipelines.synthetic import ensure_synthetic

    out = tmp_path / "data"
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml"),
                      [f"data.prepared_dir={out}", "data.num_files=8",
                       "data.synthetic=[users=3,items=20,seed=0,min_len=3,max_len=5,mean_len=4]"])
    with caplog.at_level("INFO", logger="gemray.pipelines.synthetic"):
        ensure_synthetic(cfg.data)
    capped = [r.getMessage() for r in caplog.records if "history files" in r.getMessage()]
    assert capped == [f"{out}: writing 3 history files, not data.num_files = 8: a file holds whole users' histories "
                      "and the data has 3 users"]


def test_sigterm_to_prepare_cleans_up_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """SIGTERM to `gemray prepare` (here mid-generation) left the .OUT.tmp-<pid>-* folder beside --out (Ctrl-C
    removed it): it now takes the same path, exits 143 with one line, and the previous handler is back after."""
    import os
    import signal

    from gemray.pipelines import synthetic

    def not_reached(signum, frame):
        raise AssertionError("SIGTERM reached the previous handler: prepare did not catch it")

    def terminated(tasks, *a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("still running after SIGTERM")

    monkeypatch.setattr(synthetic, "_run_tasks", terminated)
    before = signal.signal(signal.SIGTERM, not_reached)
    try:
        rc = main(["prepare", "synthetic", "--out", str(tmp_path / "out"), "--users", "20", "--items", "20",
                   "--seed", "1", "--max-len", "16", "--mean-len", "10", "--min-len", "4", "--num-files", "1",
                   "--workers", "1"])
        assert signal.getsignal(signal.SIGTERM) is not_reached
    finally:
        signal.signal(signal.SIGTERM, before)
    assert rc == 143 and capsys.readouterr().err.strip() == "gemray: error: terminated (SIGTERM)"
    assert [p.name for p in tmp_path.iterdir()] == []


def test_ray_data_reader_reads_the_gem_columns(folders):
    """The Ray Data reader (the default inside Ray Train) brings the extra columns too: same batches as pyarrow."""
    ray = pytest.importorskip("ray")
    from gemray.pipelines import stream

    folder = folders("small_w1")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        got = {}
        for reader in ("arrow", "ray_data"):
            stream._READ_CACHE.clear()  # the cache is per folder and shards, not per reader
            st = HistoryStream(folder, "test", rank=1, world_size=2, batch_size=64, max_seq_len=32, reader=reader)
            got[reader] = {}
            for batch in st.iter_epoch(0):
                got[reader].update(_rows(batch))
        assert got["arrow"] == got["ray_data"] and len(got["arrow"]) == st.num_samples() > 0
        assert sum(len(v["cands"]) for v in got["arrow"].values()) > 0
    finally:
        stream._READ_CACHE.clear()
        if started:
            ray.shutdown()


def test_pool_forks_only_while_the_process_has_one_thread():
    """fork copies only the calling thread (a lock another thread holds stays held in the child: gemray.fit after
    an embedded Ray hung there), so the generator's pool forks only in a single-threaded process, else spawns."""
    import threading

    from gemray.pipelines import synthetic

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert synthetic._can_fork() is False
    finally:
        stop.set()
        t.join()


def test_the_write_rate_keeps_its_digits_for_small_data(tmp_path, caplog):
    """The 'synthetic: wrote ...' line gives the rate with 3 significant digits, in events/s below a million per
    second (a tiny dataset logged '(0.00 M events/s)')."""
    import logging
    import re

    from gemray.pipelines.synthetic import events_rate

    assert events_rate(12_345_678, 1.0) == "12.3 M events/s" and events_rate(2_500_000_000, 2.0) == "1,250 M events/s"
    assert events_rate(4_560, 1.0) == "4,560 events/s" and events_rate(875, 10.0) == "87.5 events/s"
    assert events_rate(3, 1000.0) == "0.003 events/s" and events_rate(0, 0.0) == "0 events/s"
    with caplog.at_level(logging.INFO, logger="gemray.pipelines.synthetic"):
        m = prepare_synthetic(tmp_path / "tiny", _spec(users=20, items=50, max_len=12, mean_len=8.0), num_files=1,
                              progress=False, workers=1)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("synthetic: wrote"))
    got = re.search(r"\((\S+) (M )?events/s\)$", line)
    assert got is not None and float(got.group(1).replace(",", "")) > 0, line
    assert f"{m['counts']['interactions']} events" in line


def _worker_sigint() -> bool:
    import signal

    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_pool_workers_leave_ctrl_c_to_the_parent():
    """SIGINT reaches the whole foreground process group: the generator's pool workers ignore it (the parent ends
    them) instead of each printing a KeyboardInterrupt traceback."""
    import multiprocessing as mp
    import signal

    from gemray.pipelines import synthetic

    # a Python handler here, so that spawned children start with Ctrl-C handled whatever this process inherited (a
    # background job of a non-interactive shell starts with SIGINT ignored, and ignored signals stay so in children)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool:
            assert pool.apply(_worker_sigint) is False  # a plain worker handles it
        with ctx.Pool(1, initializer=synthetic._init_worker, initargs=(None,)) as pool:
            assert pool.apply(_worker_sigint) is True
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_file_as_prepared_dir_is_refused_before_generation_is_announced(tmp_path, caplog):
    """data.prepared_dir naming a file (a mistyped path): ValueError naming the option and the file, logged nothing
    about generating into it first (was: "prepared data missing at README.md: generating ..." then the refusal), and
    the file is left as it was."""
    import logging

    from gemray.config import load_config
    from gemray.controller.run import ensure_prepared

    f = tmp_path / "README.md"
    f.write_text("not data")
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml"),
                      [f"data.prepared_dir={f}"])
    caplog.set_level(logging.INFO, logger="gemray.pipelines.synthetic")
    with pytest.raises(ValueError, match=f"data.prepared_dir {f}: exists and is not a folder"):
        ensure_prepared(cfg)
    assert not [r for r in caplog.records if "generating" in r.getMessage()]
    assert f.read_text() == "not data"


@pytest.mark.parametrize("lengths, dist, shown, works", [
    (dict(min_len=4, max_len=5), "lognormal", "--mean-len=4.5", 4.5),
    (dict(min_len=5000, max_len=6000), "lognormal", "--mean-len=5500", 5500.0),
    (dict(min_len=5, max_len=9), "zipf", "--mean-len=7", 7.0),
])
def test_mean_len_refusal_suggests_a_value_that_works(lengths, dist, shown, works):
    """A length range the default mean (200) cannot reach was refused naming only the range ("has a mean strictly
    between 4 and 5"), so following the min / max refusal's advice led to a second refusal with no value to pass (a
    new user's finding). It now suggests one inside the reachable range, and that value is accepted."""
    with pytest.raises(ValueError) as e:
        SyntheticSpec(users=10, items=20, seed=0, length_dist=dist, **lengths)
    assert f"(e.g. {shown})" in str(e.value)
    spec = SyntheticSpec(users=10, items=20, seed=0, length_dist=dist, mean_len=works, **lengths)
    assert abs(length_pmf(spec)[2]["mean"] - works) < 1e-3 * works


def test_config_spec_refusals_use_the_entries_names():
    """data.synthetic's refusals from SyntheticSpec name the entries (``mean_len``, ``max_len``), not the CLI's flags
    (``--mean-len``), and the suggestion reads as the entry to add."""
    from gemray.pipelines.synthetic import spec_from_params

    with pytest.raises(ValueError) as e:
        spec_from_params({"users": "64", "items": "100", "seed": "0", "min_len": "8", "max_len": "10"})
    msg = str(e.value)
    assert msg.startswith("data.synthetic: mean_len (default 200): ") and "(e.g. mean_len=9)" in msg
    assert "--" not in msg
    spec_from_params({"users": "64", "items": "100", "seed": "0", "min_len": "8", "max_len": "10", "mean_len": "9"})
