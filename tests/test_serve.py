"""gemray evaluate / recommend / export on a checkpoint trained here (ml-latest-small, 2 workers, 3 steps).

evaluate must give metrics.json's test figures and the history's validation figures bit for bit (the split
partitioned as the 2-rank training partitioned it); recommend K items per user, none from the user's history;
the exported user tower must load in a process where gemray, torchrec and ray cannot be imported and give the
in-process model's user embeddings.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from paths import DATA

REPO = Path(__file__).resolve().parents[1]
SRC = DATA / "ml-latest-small"
TEST_KEYS = [f"{m}@{k}{s}" for k in (10, 50, 200) for m in ("hr", "ndcg") for s in ("", "_unfiltered")]


@pytest.fixture(autouse=True, scope="module")
def _no_leftover_process_group():
    """gemray.serve opens a one-rank process group in this process (init_single_process_group) and keeps it, as a
    notebook user would want; tests after this module expect none."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not SRC.is_dir():
        pytest.skip(f"{SRC} not available")
    import gemray

    tmp = tmp_path_factory.mktemp("serve")
    res = gemray.fit(REPO / "configs" / "ml-latest-small.toml", output_dir=tmp / "out",
                     overrides=[f"data.raw_dir={SRC}", f"data.prepared_dir={tmp / 'prepared'}", "train.epochs=1",
                                "train.max_steps_per_epoch=3", "ray.max_failures=0"])
    return tmp, res


@pytest.fixture(scope="module")
def trained(run):
    from gemray.serve import load_trained

    tmp, res = run
    return load_trained(tmp / "out")


def test_evaluate_reproduces_metrics_json(run, trained):
    from gemray.serve.evaluate import evaluate

    tmp, res = run
    assert str(trained.checkpoint) == res.checkpoint_path  # the run's newest committed checkpoint
    m = json.loads((tmp / "out" / "metrics.json").read_text())
    out = evaluate(trained, "test")
    assert out["world_size"] == 2 and out["metrics"]["num_users"] == m["num_test_users"] == 610
    assert {k: out["metrics"][k] for k in TEST_KEYS} == {k: m[k] for k in TEST_KEYS}
    assert out["metrics"]["targets_in_history"] == m["targets_in_history"]
    # the validation split reproduces the epoch's valid_* figures too
    val = evaluate(trained, "valid")["metrics"]
    hist = m["history"][-1]
    assert {k: val[k] for k in TEST_KEYS} == {k: hist[f"valid_{k}"] for k in TEST_KEYS}
    # one rank's partition gives the same figures up to float rounding
    one = evaluate(trained, "test", world_size=1)["metrics"]
    for k in TEST_KEYS:
        assert one[k] == pytest.approx(m[k], rel=1e-9, abs=1e-12), k


def test_evaluate_cli_other_k_and_json(run, trained, tmp_path, capsys):
    from gemray.cli import main

    tmp, _ = run
    dest = tmp_path / "ev.json"
    assert main(["evaluate", "--checkpoint", str(trained.checkpoint), "--k", "1", "5", "--json", str(dest)]) == 0
    got = json.loads(dest.read_text())
    assert got["split"] == "test" and set(got["metrics"]) >= {"hr@1", "hr@5", "ndcg@1", "ndcg@5"}
    assert "hr@10" not in got["metrics"] and got["metrics"]["hr@1"] <= got["metrics"]["hr@5"]
    assert "HR@K" in capsys.readouterr().out


def _one_step_checkpoint(cfg, ckpt: Path) -> None:
    """A checkpoint at ``ckpt`` of ``cfg``'s model after one training step on the CPU (its data prepared)."""
    from model_utils import cpu_trainer

    from gemray.bench.train import first_batch
    from gemray.checkpoint import save_checkpoint

    with cpu_trainer(cfg) as tr:
        tr.begin_epoch(0)
        tr.train_step(first_batch(tr))
        save_checkpoint(ckpt, tr.dmp, tr.optimizer, {"epoch": 1, "consumed": 0, "epoch_step": 0, "history": [],
                                                     "global_step": tr.global_step, "partial": None},
                        data=tr.trained_on)


def test_evaluate_cli_prints_the_ranking_tasks_figures_of_its_json(tmp_path, capsys):
    """A gem-tiny checkpoint (ranking tasks ctr and cvr; saved after one CPU step, outside Ray): the printed
    summary has each task's NE, AUC +/- its error bound and calibration, the values its JSON holds (was: the
    HR / NDCG table only; the ranking figures reached the JSON alone)."""
    import re

    from gemray.cli import main
    from gemray.config import load_config, to_toml
    from gemray.pipelines.synthetic import ensure_synthetic

    cfg = load_config(REPO / "configs" / "gem-tiny.toml", [f"data.prepared_dir={tmp_path / 'data'}",
                                                           "ray.use_gpu=false", "train.eval_ks=[10]"])
    ensure_synthetic(cfg.data)
    ckpt = tmp_path / "ckpt"
    _one_step_checkpoint(cfg, ckpt)
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    dest = tmp_path / "ev.json"
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(ckpt), "--config", str(tmp_path / "config.toml"),
                 "--json", str(dest)]) == 0
    out = capsys.readouterr().out
    m = json.loads(dest.read_text())["metrics"]
    assert "HR@K" in out and f"{m['hr@10']:>10.4f}" in out  # the retrieval table stays
    for task in ("ctr", "cvr"):
        line = next((x for x in out.splitlines() if x.startswith(f"{task}: ")), None)
        assert line is not None, out
        got = re.match(r"\w+: NE (\S+), AUC (\S+) \+/- (\S+), calibration (\S+), ", line)
        assert got is not None, line
        printed = [float(v) for v in got.groups()]
        want = [m[f"{task}_{k}"] for k in ("ne", "auc", "auc_error_bound", "calibration")]
        assert m[f"{task}_num_examples"] > 0 and all(math.isfinite(v) for v in want), m
        assert printed == [pytest.approx(v, abs=5e-5) for v in want], (line, want)  # printed to 4 decimals


def test_evaluate_other_data_with_other_items_is_refused(trained, tmp_path):
    from gemray.pipelines.movielens import prepare_movielens
    from gemray.serve.evaluate import evaluate

    if not (DATA / "ml-100k").is_dir():
        pytest.skip("ml-100k not available")
    other = tmp_path / "ml100k"
    prepare_movielens(DATA / "ml-100k", other)
    with pytest.raises(ValueError, match=r"1682 items.*item table for 9724"):
        evaluate(trained, "test", prepared_dir=other)
    # the run's own data named explicitly is accepted
    from gemray.serve.model import check_data

    assert check_data(trained, trained.cfg.data.prepared_dir)["counts"]["items"] == 9724


def _histories(trained, users):
    from gemray.pipelines.movielens import load_manifest
    from gemray.serve.recommend import read_histories

    return read_histories(load_manifest(trained.cfg.data.prepared_dir), users)


def test_recommend_k_items_none_from_history(trained, tmp_path):
    from gemray.cli import main
    from gemray.serve.recommend import IdMaps, recommend

    users = [1, 2, 3, 77, 610]
    recs = recommend(trained, users, k=10)
    assert recs.column_names == ["user_id", "rank", "item_id", "score"]
    maps = IdMaps(__import__("gemray.pipelines.movielens", fromlist=["x"]).load_manifest(trained.cfg.data.prepared_dir))
    hist = _histories(trained, users)
    rows = recs.to_pylist()
    for u, h in zip(users, hist.column("item_ids").to_pylist()):
        mine = [r for r in rows if r["user_id"] == u]
        assert [r["rank"] for r in mine] == list(range(1, 11))
        seen_raw = set(maps.raw_items(np.asarray(h)))
        assert not seen_raw & {r["item_id"] for r in mine}, u
        assert len({r["item_id"] for r in mine}) == 10
        scores = [r["score"] for r in mine]
        assert scores == sorted(scores, reverse=True) and all(np.isfinite(scores))
    # raw MovieLens movie ids come back (ml-latest-small's go up to 193609; dense ids stop at 9724)
    assert set(recs.column("item_id").to_pylist()) <= set(maps.items[1].tolist())
    # batch mode: a users file -> Parquet, same rows
    uf = tmp_path / "users.txt"
    uf.write_text("# users\n" + "\n".join(map(str, users)) + "\n")
    out = tmp_path / "recs.parquet"
    assert main(["recommend", "--checkpoint", str(trained.checkpoint), "--users-file", str(uf), "--k", "10",
                 "--out", str(out)]) == 0
    assert pq.read_table(out).to_pylist() == rows
    with pytest.raises(ValueError, match=r"user id 999999: not a user of .* \(610 users, ids 1\.\.610\)$"):
        recommend(trained, [999999], k=3)
    # k above what a user has left outside their history: only those items (a new user's --k 5000 got every item,
    # the history ones and the padding id at -inf last)
    big = recommend(trained, users[:2], k=trained.num_items).to_pylist()
    for u, h in zip(users[:2], hist.column("item_ids").to_pylist()[:2]):
        mine = [r for r in big if r["user_id"] == u]
        assert len(mine) == trained.num_items - len(set(h)), u
        assert [r["rank"] for r in mine] == list(range(1, len(mine) + 1))
        assert all(np.isfinite(r["score"]) and r["item_id"] is not None for r in mine)
        assert not set(maps.raw_items(np.asarray(h))) & {r["item_id"] for r in mine}


GUARD = r"""
import importlib.abc, sys
class Forbid(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("gemray", "torchrec", "ray", "fbgemm_gpu"):
            raise ImportError(f"forbidden import: {name}")
        return None
sys.meta_path.insert(0, Forbid())
import json, numpy as np, torch
d = sys.argv[1]
prog = torch.export.load(d + "/user_tower.pt2").module()
items = torch.from_numpy(np.load(d + "/item_embeddings.npy"))
inp = torch.load(d + "/../inputs.pt")
users = prog(inp["item_ids"], inp["offsets"], inp["timestamps"], inp["ratings"], inp["query_time"])
torch.save({"users": users, "scores": users @ items.T}, d + "/../got.pt")
assert not [m for m in sys.modules if m.split(".")[0] in ("gemray", "torchrec", "ray")]
print("ok", json.load(open(d + "/serving.json"))["num_items"])
"""


def test_export_loads_without_training_stack(trained, tmp_path):
    from gemray.serve.export import export
    from gemray.serve.recommend import history_batch

    out = export(trained, tmp_path / "export")
    spec = json.loads((out / "serving.json").read_text())
    assert spec["num_items"] == 9724 and spec["embedding_dim"] == 32
    ids = np.load(out / "item_ids.npy")
    assert ids.shape == (9725,) and ids[0] == -1
    # 7 users of very different lengths (some longer than max_seq_len = 50: truncated)
    batch, _ = history_batch(_histories(trained, [1, 2, 5, 9, 100, 414, 610]), trained.cfg.data.max_seq_len)
    assert int(batch.lengths.max()) == 50 and int(batch.lengths.min()) < 50
    with torch.no_grad():
        want_users = trained.model.user_embeddings(batch)
        want_scores = want_users @ trained.model.item_embeddings(torch.arange(0, 9725)).T
    torch.save({"item_ids": batch.item_ids, "offsets": batch.offsets, "timestamps": batch.timestamps,
                "ratings": batch.ratings, "query_time": batch.target_timestamps}, tmp_path / "inputs.pt")
    proc = subprocess.run([sys.executable, "-c", GUARD, str(out)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok 9724")
    got = torch.load(tmp_path / "got.pt")
    torch.testing.assert_close(got["users"], want_users, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got["scores"], want_scores, atol=2e-5, rtol=1e-4)
    with pytest.raises(FileExistsError):
        export(trained, out)


def test_checkpoint_not_found_is_a_clear_error(tmp_path, capsys):
    from gemray.cli import main
    from gemray.serve.model import locate_checkpoint

    with pytest.raises(FileNotFoundError, match="no such folder"):
        locate_checkpoint(tmp_path / "missing")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.toml").write_text('name = "x"\n')
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        locate_checkpoint(tmp_path / "out")
    assert main(["evaluate", "--checkpoint", str(tmp_path / "out")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    # an output folder copied without its config.toml, given --config: the run is looked for under ray/<name>
    (tmp_path / "out" / "config.toml").rename(tmp_path / "x.toml")
    (tmp_path / "out" / "ray" / "x").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=f"no committed checkpoint in {tmp_path / 'out' / 'ray' / 'x'} "):
        locate_checkpoint(tmp_path / "out", tmp_path / "x.toml")


@pytest.mark.parametrize("command", ["recommend", "evaluate"])
def test_output_path_is_checked_before_the_model_loads(command, tmp_path, monkeypatch, capsys):
    """`recommend --out` / `evaluate --json` that cannot be written: exit 2 with one line naming the option, before
    the checkpoint is even looked at (was: after loading the model and scoring every user)."""
    import errno
    import tempfile

    import gemray.serve
    from gemray.cli import main

    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    args = {"recommend": ["recommend", "--user", "1", "--out"], "evaluate": ["evaluate", "--json"]}[command]
    option = args[-1]
    base = [*args[:-1], "--checkpoint", str(tmp_path / "run")]
    (tmp_path / "adir").mkdir()
    cases = [(tmp_path / "nowhere" / "r.parquet", "does not exist"), (tmp_path / "adir", "is a folder")]
    for target, why in cases:
        assert main([*base, option, str(target)]) == 2, target
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"gemray: error: {option} {target}") and why in err[0], err

    def refuse(*a, **k):  # a read-only folder, for root too
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    name = "r.csv" if command == "recommend" else "r.out"  # (recommend refuses another suffix before the folder)
    assert main([*base, option, str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gemray: error: {option} {tmp_path / name} is not writable: Read-only file system"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]  # nothing written


@pytest.mark.parametrize("name", ["recs.txt", "recs", "recs.csv.gz"])
def test_recommend_out_of_another_suffix_is_refused_before_the_model_loads(name, tmp_path, monkeypatch, capsys):
    """`gemray recommend --out recs.txt`: exit 2 with one line naming --out and the suffixes it takes, before the
    checkpoint is looked at (was: Parquet bytes written under whatever name, after the whole load)."""
    import gemray.serve
    import gemray.serve.model as serve_model
    from gemray.cli import main

    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.setattr(serve_model, "find_config", lambda *a, **k: pytest.fail("the run must not be read"))
    out = tmp_path / name
    assert main(["recommend", "--user", "1", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"gemray: error: --out {out}: "), err
    assert "name a .parquet (Parquet) or .csv (CSV) file" in err[0], err
    assert sorted(tmp_path.iterdir()) == []  # nothing written


def test_recommend_out_suffix_is_refused_before_its_folder_or_anything_else(tmp_path, monkeypatch, capsys):
    """`gemray recommend --out nowhere/r.xlsx`: the suffix is refused first, in one line naming the suffixes recommend
    writes (was: the missing folder reported first, and only after fixing it the suffix); also before --k, --device
    and the users file are looked at."""
    import gemray.serve
    import gemray.serve.model as serve_model
    from gemray.cli import main

    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.setattr(serve_model, "find_config", lambda *a, **k: pytest.fail("the run must not be read"))
    out = tmp_path / "nowhere" / "r.xlsx"
    for extra in ([], ["--k", "0"], ["--device", "tpu"]):
        assert main(["recommend", "--users-file", str(tmp_path / "no-users.csv"), "--checkpoint",
                     str(tmp_path / "run"), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"gemray: error: --out {out}: suffix '.xlsx' is neither .parquet nor .csv; name a .parquet "
                       "(Parquet) or .csv (CSV) file, the suffix picks the format"], (extra, err)
    assert sorted(tmp_path.iterdir()) == []  # nothing written, no folder made


@pytest.mark.parametrize("command", ["evaluate", "recommend"])
def test_raw_movielens_data_is_refused_before_the_checkpoint_with_a_prepare_command(command, tmp_path, monkeypatch,
                                                                                    capsys):
    """`gemray evaluate --data <raw MovieLens folder>` (ratings.dat, no manifest.json): exit 2 with one line that gives
    the `gemray prepare movielens` command into a folder of its own, before the checkpoint is looked at (was: after
    loading the model, "run `gemray prepare movielens --src <MovieLens folder> --out <the raw folder>` first")."""
    import gemray.serve
    import gemray.serve.model as serve_model
    from gemray.cli import build_parser, main

    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    for name in ("committed_checkpoints", "checkpoint_data", "load_model_state"):
        monkeypatch.setattr(serve_model, name, lambda *a, **k: pytest.fail("the checkpoint must not be read"))
    raw = tmp_path / "ml-1m"
    raw.mkdir()
    (raw / "ratings.dat").write_text("1::1193::5::978300760\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('name = "x"\n')  # the default (ML-1M retrieval) model: recommend serves it
    args = {"evaluate": ["evaluate"], "recommend": ["recommend", "--user", "1"]}[command]
    work = tmp_path / "work"  # the working directory: the suggestion is its data/ml-1m, not beside the raw folder
    work.mkdir()
    monkeypatch.chdir(work)
    assert main([*args, "--checkpoint", str(run), "--data", str(raw)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    out = Path("data") / "ml-1m"
    assert err == [f"gemray: error: --data {raw} holds raw MovieLens ratings (ratings.dat), not prepared data "
                   f"(manifest.json and Parquet histories); prepare it into a folder of its own with `gemray prepare "
                   f"movielens --src {raw} --out {out}` and pass --data {out}"], err
    assert f"--out {raw}`" not in err[0] and f"--out {raw} " not in err[0]
    assert sorted(p.name for p in raw.iterdir()) == ["ratings.dat"] and not out.exists()  # nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ml-1m", "run", "work"]  # nothing beside the raw folder
    # the command it gives is the CLI's own
    ns = build_parser().parse_args(["prepare", "movielens", "--src", str(raw), "--out", str(out)])
    assert (ns.func.__name__, ns.src, ns.out) == ("_cmd_prepare", str(raw), str(out))


@pytest.mark.parametrize("args, line", [
    (["evaluate", "--k", "0"], "--k 0: every cut-off must be >= 1 (got 0)"),
    (["evaluate", "--k", "10", "-5"], "--k 10 -5: every cut-off must be >= 1 (got -5)"),
    (["recommend", "--user", "1", "--k", "0"], "--k 0: expected >= 1"),
])
def test_k_is_checked_before_the_model_loads(args, line, tmp_path, monkeypatch, capsys):
    """`gemray evaluate --k 0` (or a negative cut-off), `gemray recommend --k 0`: exit 2 with one line naming the
    flag, before the checkpoint is looked at (was: refused only after loading the model and the data)."""
    import gemray.serve
    import gemray.serve.model as serve_model
    from gemray.cli import main

    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.setattr(serve_model, "find_config", lambda *a, **k: pytest.fail("the run must not be read"))
    assert main([*args, "--checkpoint", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gemray: error: {line}"], err


@pytest.mark.parametrize("command", ["evaluate", "recommend", "export"])
def test_device_without_cuda_is_refused_before_the_model_loads(command, tmp_path, monkeypatch, capsys):
    """`--device cuda` where CUDA is not available: exit 2 with one line naming --device, before the run is looked
    at (was: a traceback from the NCCL process group after the checkpoint was read, exit 1); a device string torch
    does not know (`--device gpu`) and a `cuda:N` beyond the visible devices likewise."""
    import gemray.serve
    import gemray.serve.model as serve_model
    from gemray.cli import main

    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.setattr(serve_model, "find_config", lambda *a, **k: pytest.fail("the run must not be read"))
    args = {"evaluate": ["evaluate"], "recommend": ["recommend", "--user", "1"],
            "export": ["export", "--out", str(tmp_path / "exp")]}[command]
    base = [*args, "--checkpoint", str(tmp_path / "run")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [("cuda", "--device cuda: CUDA is not available on this machine; use --device cpu (or leave --device "
                      "out)"),
             ("cuda:0", "--device cuda:0: CUDA is not available"),
             ("gpu", "--device gpu: expected cpu, cuda or cuda:N")]
    for device, line in cases:
        assert main([*base, "--device", device]) == 2, device
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"gemray: error: {line}"), err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main([*base, "--device", "cuda:2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gemray: error: --device cuda:2: this machine has 2 CUDA device(s), cuda:0..cuda:1"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_check_arguments_names_the_flag():
    """gemray.serve.evaluate.check_arguments, which evaluate() runs too: each refusal names its flag; None = the
    defaults (world_size 0 was taken as the default by evaluate() and is refused now, as the CLI refuses it)."""
    from gemray.serve.evaluate import check_arguments

    check_arguments("valid", [1, 200], 2)
    check_arguments()
    for kwargs, flag in ((dict(split="train"), "--split 'train'"), (dict(ks=[]), "--k (none)"),
                         (dict(ks=[5, 0]), "--k 5 0"), (dict(world_size=0), "--world-size 0")):
        with pytest.raises(ValueError, match=f"^{re.escape(flag)}: "):
            check_arguments(**kwargs)


def test_a_bad_id_of_a_users_file_is_refused_naming_its_line(tmp_path):
    """`recommend --users-file` with an id the data does not have said "user id 'abc': ..." without the file or the
    line (a new user's finding); the refusal now starts with FILE:LINE (text, CSV with its header as line 1) or
    FILE: row N (Parquet)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from gemray.serve.recommend import IdMaps, read_users_file, users_file_locations

    pq.write_table(pa.table({"user_id": pa.array([1, 2, 3], pa.int64()), "raw_user_id": ["ann", "bob", "cy"]}),
                   tmp_path / "users.parquet")
    maps = IdMaps({"prepared_dir": str(tmp_path), "id_maps": {"users": "users.parquet"}})
    plain = IdMaps({"prepared_dir": str(tmp_path / "none"), "counts": {"users": 3}})
    text = tmp_path / "ids.txt"
    text.write_text("# users\nann\n\ncy\nzed\n")
    table = pa.table({"user_id": ["bob", "cy", "zed"]})
    pacsv.write_csv(table, tmp_path / "ids.csv")
    pq.write_table(table, tmp_path / "ids.parquet")
    for f, place in ((text, f"{text}:5"), (tmp_path / "ids.csv", f"{tmp_path / 'ids.csv'}:4"),
                     (tmp_path / "ids.parquet", f"{tmp_path / 'ids.parquet'}: row 3")):
        ids = read_users_file(f)
        where = users_file_locations(f)
        assert len(where) == len(ids)
        with pytest.raises(ValueError) as e:
            maps.dense_users(ids, where=where)
        assert str(e.value).startswith(f"{place}: user id 'zed': not a user of"), str(e.value)
    assert maps.dense_users(["ann", "cy"], where=[f"{text}:2", f"{text}:4"]) == [1, 3]
    text.write_text("1\nabc\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(text))}:2: user id 'abc': .* integers"):
        plain.dense_users(read_users_file(text), where=users_file_locations(text))


def test_a_user_given_twice_is_refused_naming_both_places(tmp_path):
    """`recommend --user 1 --user 1` wrote user 1's rows twice: a user given twice (the same user, however spelled) is
    refused at its second place, naming the first (FILE:LINE / FILE: row N for a users file, as an unknown id)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from gemray.serve.recommend import IdMaps, read_users_file, users_file_locations

    pq.write_table(pa.table({"user_id": pa.array([1, 2, 3], pa.int64()), "raw_user_id": ["ann", "bob", "cy"]}),
                   tmp_path / "users.parquet")
    maps = IdMaps({"prepared_dir": str(tmp_path), "id_maps": {"users": "users.parquet"}})
    plain = IdMaps({"prepared_dir": str(tmp_path / "none"), "counts": {"users": 3}})
    for m, ids, line in ((plain, ["1", "2", "1"], "user id 1: given twice; give each user once"),
                         (plain, ["1", "2", "01"], "user id 01: given twice (first as 1); give each user once"),
                         (maps, ["bob", "cy", "bob"], "user id 'bob': given twice; give each user once")):
        with pytest.raises(ValueError) as e:
            m.dense_users(ids)
        assert str(e.value) == line
    text = tmp_path / "ids.txt"
    text.write_text("# users\nann\n\ncy\nann\n")
    table = pa.table({"user_id": ["bob", "cy", "bob"]})
    pacsv.write_csv(table, tmp_path / "ids.csv")
    pq.write_table(table, tmp_path / "ids.parquet")
    for f, first, second, user in ((text, f"{text}:2", f"{text}:5", "ann"),
                                   (tmp_path / "ids.csv", f"{tmp_path / 'ids.csv'}:2", f"{tmp_path / 'ids.csv'}:4",
                                    "bob"),
                                   (tmp_path / "ids.parquet", f"{tmp_path / 'ids.parquet'}: row 1",
                                    f"{tmp_path / 'ids.parquet'}: row 3", "bob")):
        with pytest.raises(ValueError) as e:
            maps.dense_users(read_users_file(f), where=users_file_locations(f))
        assert str(e.value) == f"{second}: user id {user!r}: given twice (first at {first}); give each user once"
    assert plain.dense_users(["1", "2", "3"]) == [1, 2, 3] and maps.dense_users(["cy", "ann"]) == [3, 1]


def test_id_maps_raw_string_ids(tmp_path):
    """A `gemray prepare interactions` folder maps string user / item ids: users are taken and items given back raw."""
    import pyarrow as pa

    from gemray.serve.recommend import IdMaps

    pq.write_table(pa.table({"user_id": pa.array([1, 2, 3], pa.int64()), "raw_user_id": ["ann", "bob", "cy"]}),
                   tmp_path / "users.parquet")
    pq.write_table(pa.table({"item_id": pa.array([1, 2], pa.int64()), "raw_item_id": ["B00X", "B00Y"]}),
                   tmp_path / "items.parquet")
    maps = IdMaps({"prepared_dir": str(tmp_path), "id_maps": {"users": "users.parquet", "items": "items.parquet"}})
    assert maps.dense_users(["cy", "ann"]) == [3, 1]
    assert maps.raw_users(np.array([2, 3])) == ["bob", "cy"]
    assert maps.raw_items(np.array([[2, 1]])) == ["B00Y", "B00X"]
    with pytest.raises(ValueError, match="'dan'"):
        maps.dense_users(["dan"])
    plain = IdMaps({"prepared_dir": str(tmp_path / "none")})  # MovieLens-like without items.parquet: ids as is
    assert plain.dense_users(["7"]) == [7] and plain.raw_items(np.array([5])) == [5]


def test_recommend_refuses_models_with_token_features_naming_them():
    """A GEM run (model.token_features) is refused in one line that names the features and points at evaluate
    (it said 'only the prepared GEM folders carry' them, on a run trained on such a folder)."""
    from types import SimpleNamespace

    from gemray.config import JobConfig
    from gemray.serve.recommend import recommend

    cfg = JobConfig()
    cfg.model.token_features = ["category", "author"]
    with pytest.raises(ValueError, match=r"token_features = \['category', 'author'\].*gemray evaluate"):
        recommend(SimpleNamespace(cfg=cfg), [1], k=5)


def _gem_run(tmp_path: Path, corrupt: bool, sets: list[str] | None = None) -> Path:
    """A gem-tiny run folder (config.toml) whose checkpoint is absent, or (``corrupt``) a checkpoint_* folder whose
    manifest is garbage and that holds no DCP files; returns what --checkpoint names: the run, or that folder."""
    from gemray.config import load_config, to_toml

    out = tmp_path / "run"
    out.mkdir()
    cfg = load_config(REPO / "configs" / "gem-tiny.toml", sets)
    (out / "config.toml").write_text(to_toml(cfg))
    if not corrupt:
        return out
    ckpt = out / "ray" / cfg.name / "checkpoint_2026-12-04_00-00-00.000000"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest_rank0.json").write_text("{not json")
    return ckpt


NO_TOKENS = ["model.token_features=[]", "model.candidate_features=[]"]  # gem-tiny's ranking tasks stay


@pytest.mark.parametrize("corrupt", [False, True], ids=["absent", "corrupt"])
@pytest.mark.parametrize("command, sets, refusal", [
    ("recommend", None, r"recommend: models with per-token side features \(model.token_features = "
                        r"\['category', 'author'\]"),
    ("export", None, r"export: .* this model has model.token_features = \['category', 'author'\] and ranking tasks "
                     r"\(model.tasks = \['retrieval', 'ctr', 'cvr'\]\), which is not exported yet"),
    ("export", NO_TOKENS, r"export: .* this model has ranking tasks \(model.tasks = \['retrieval', 'ctr', 'cvr'\]\), "
                          r"which is not exported yet"),
    ("recommend", NO_TOKENS, r"recommend: it serves the retrieval model alone .* model.tasks = \['retrieval', 'ctr', "
                             r"'cvr'\]"),
    ("recommend", [*NO_TOKENS, 'model.tasks=["ctr", "cvr"]', "model.task_weights=[1.0, 1.0]"],
     r"recommend: .* model.tasks = \['ctr', 'cvr'\]"),
])
def test_unservable_models_are_refused_from_the_config_before_the_checkpoint(command, sets, refusal, corrupt,
                                                                             tmp_path, monkeypatch, capsys):
    """recommend / export refuse a model they cannot serve from the run's config.toml, before any checkpoint is
    looked at: on a run whose checkpoint is absent or corrupt the error is still the refusal (it was 'no committed
    checkpoint', or a load error after reading the checkpoint), exit 2, one line."""
    import re

    import gemray.serve.model as serve_model
    from gemray.cli import main

    for name in ("committed_checkpoints", "checkpoint_data", "load_model_state"):
        monkeypatch.setattr(serve_model, name, lambda *a, **k: pytest.fail("the checkpoint must not be read"))
    target = _gem_run(tmp_path, corrupt, sets)
    args = {"recommend": ["recommend", "--user", "1"], "export": ["export", "--out", str(tmp_path / "serving")]}
    assert main([*args[command], "--checkpoint", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(f"gemray: error: {refusal}", err[0]), err
    assert not (tmp_path / "serving").exists()


def test_run_config_is_found_without_a_checkpoint(tmp_path):
    """find_config / run_config: the run's config.toml from an output folder, a Ray Train run folder and a
    checkpoint folder, overrides applied; a folder with none names where it looked."""
    from gemray.serve.model import find_config, run_config

    ckpt = _gem_run(tmp_path, corrupt=True)
    out = tmp_path / "run"
    for given in (out, ckpt.parent, ckpt):
        assert find_config(given) == out / "config.toml", given
    assert run_config(ckpt, overrides=["train.epochs=7"]).train.epochs == 7
    (tmp_path / "other").mkdir()
    a_file = tmp_path / "config.toml.txt"
    a_file.write_text("")
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        find_config(a_file)
    with pytest.raises(FileNotFoundError, match=r"not a gemray run folder: no config.toml in it \(or pass --config\)"):
        find_config(tmp_path / "other")


def test_a_folder_without_config_names_where_it_looked(tmp_path, capsys):
    """`gemray evaluate --checkpoint` on an empty (or any non-run) folder: one line saying that folder is not a run
    folder, as it has no config.toml (was: 'no config.toml found beside the run (/config.toml)', a path two levels
    up that the user never named). A Ray Train run folder or a checkpoint folder whose output folder lost its
    config.toml names that output folder."""
    from gemray.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["evaluate", "--checkpoint", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gemray: error: --checkpoint {empty} is not a gemray run folder: no config.toml in it "
                   "(or pass --config)"], err
    ckpt = tmp_path / "out" / "ray" / "gem-tiny" / "checkpoint_2026-12-04_00-00-00.000000"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest_rank0.json").write_text("{}")
    for given, what in ((ckpt.parent, "a Ray Train run folder"), (ckpt, "a checkpoint folder")):
        assert main(["evaluate", "--checkpoint", str(given)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--checkpoint {given} is {what} " in err[0], err
        assert f"its `gemray train --output` folder, {tmp_path / 'out'}, holds no config.toml" in err[0], err
        assert err[0].endswith("(pass the training config with --config)"), err


def test_raw_data_already_under_data_gets_a_prepared_folder_of_its_own(tmp_path, monkeypatch):
    """Raw MovieLens in the working directory's data/ml-1m itself: the suggested --out is data/ml-1m-prepared,
    never the raw folder."""
    from gemray.serve.model import prepared_manifest

    monkeypatch.chdir(tmp_path)
    raw = tmp_path / "data" / "ml-1m"
    raw.mkdir(parents=True)
    (raw / "ratings.dat").write_text("1::1193::5::978300760\n")
    with pytest.raises(FileNotFoundError, match=r"--out data/ml-1m-prepared` and pass --data data/ml-1m-prepared$"):
        prepared_manifest("data/ml-1m")


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A retrieval model (configs/ml-latest-small.toml's) on a tiny synthetic dataset of 200 items, one CPU step,
    saved outside Ray as <tmp>/run/ray/<name>/checkpoint_0 (its config.toml three levels up, as a run's); returns
    (checkpoint folder, its prepared data, prepared data of 150 items)."""
    from gemray.config import load_config, to_toml
    from gemray.pipelines.synthetic import SyntheticSpec, prepare_synthetic

    tmp = tmp_path_factory.mktemp("small")
    spec = dict(users=60, seed=3, max_len=24, min_len=4, mean_len=10.0, candidates=4)
    prepare_synthetic(tmp / "data", SyntheticSpec(items=200, **spec), num_files=1, progress=False, workers=1)
    prepare_synthetic(tmp / "other", SyntheticSpec(items=150, **spec), num_files=1, progress=False, workers=1)
    cfg = load_config(REPO / "configs" / "ml-latest-small.toml",
                      [f"data.prepared_dir={tmp / 'data'}", "data.max_seq_len=24", "data.batch_size=16",
                       "data.reader=arrow", "ray.use_gpu=false", "train.eval_ks=[10]"])
    ckpt = tmp / "run" / "ray" / cfg.name / "checkpoint_0"
    _one_step_checkpoint(cfg, ckpt)
    (tmp / "run" / "config.toml").write_text(to_toml(cfg))
    return ckpt, tmp / "data", tmp / "other"


COMMANDS = {"evaluate": ["evaluate", "--json", "-"], "recommend": ["recommend", "--user", "1", "--k", "3"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_data_of_another_item_count_is_refused_before_the_model_is_built(command, small_checkpoint, monkeypatch,
                                                                          capsys):
    """`gemray evaluate / recommend --data` of another item count than the checkpoint's: exit 2 with one line naming
    both counts and both folders, from the manifests, before the model is built or a weight read (was: after the
    whole load, ~5 s on ML-1M)."""
    import gemray.model.gem
    import gemray.serve.model as serve_model
    from gemray.cli import main

    ckpt, data, other = small_checkpoint
    monkeypatch.setattr(gemray.model.gem, "GEM", lambda *a, **k: pytest.fail("the model must not be built"))
    monkeypatch.setattr(serve_model, "load_model_state", lambda *a, **k: pytest.fail("no weight must be read"))
    assert main([*COMMANDS[command], "--checkpoint", str(ckpt), "--data", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gemray: error: --data {other.resolve()}: 150 items, but the checkpoint {ckpt.resolve()} has an "
                   f"item table for 200 (trained on {data.resolve()}): item ids would not match; use data prepared "
                   "with the same item vocabulary"], err


@pytest.mark.parametrize("with_data", [False, True], ids=["run_data", "data"])
def test_k_above_the_item_count_is_refused_before_the_model_loads(with_data, small_checkpoint, monkeypatch, capsys):
    """`gemray evaluate --k 5000` on a 200-item catalogue: exit 2 naming --k and the count, from the manifest of the
    data evaluated (the run's, or --data's), before the model is loaded (was: refused only after the load)."""
    import gemray.serve
    from gemray.cli import main

    ckpt, data, _ = small_checkpoint
    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    assert main(["evaluate", "--checkpoint", str(ckpt), "--k", "10", "5000", *(["--data", str(data)] * with_data)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gemray: error: --k 10 5000: a cut-off at or above the 200 items of the catalogue (5000) makes "
                   "HR@K trivially 1 (every target ranks below N, a history-excluded one at N-1; as gemray train "
                   "refuses it); the largest cut-off allowed is 199: e.g. --k 10"], err
    # K = N too: a target excluded with the history ranks N-1, so HR@N was 1.0000 (a new user's --k 400 on 400 items)
    assert main(["evaluate", "--checkpoint", str(ckpt), "--k", "200", *(["--data", str(data)] * with_data)]) == 2
    assert "--k 200: a cut-off at or above the 200 items" in capsys.readouterr().err


def test_recommend_out_format_follows_the_suffix(small_checkpoint, tmp_path, capsys):
    """`gemray recommend --out recs.csv` writes CSV (a header line, then the Parquet file's rows), `--out recs.parquet`
    (any case) Parquet (was: Parquet bytes in recs.csv); the written line names the format."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from gemray.cli import main

    ckpt, _, _ = small_checkpoint
    args = ["recommend", "--checkpoint", str(ckpt), "--user", "1", "--user", "7", "--k", "4", "--out"]
    written = {}
    for name, fmt in (("recs.csv", "CSV"), ("recs.parquet", "Parquet"), ("RECS.PARQUET", "Parquet")):
        assert main([*args, str(tmp_path / name)]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == f"written: {tmp_path / name} ({fmt}, 8 rows, 2 users, k=4)"
        written[name] = (tmp_path / name).read_bytes()
    assert written["recs.csv"].splitlines()[0] == b'"user_id","rank","item_id","score"'
    assert written["recs.parquet"][:4] == b"PAR1" and written["RECS.PARQUET"] == written["recs.parquet"]
    parquet = pq.read_table(tmp_path / "recs.parquet")
    csv = pacsv.read_csv(tmp_path / "recs.csv").cast(parquet.schema)
    assert csv.column_names == ["user_id", "rank", "item_id", "score"] and csv.num_rows == 8
    assert csv.drop(["score"]).equals(parquet.drop(["score"]))
    assert csv.column("score").to_pylist() == parquet.column("score").to_pylist()  # float32 round trips via text
    assert pa.types.is_float32(parquet.schema.field("score").type)


@pytest.mark.parametrize("with_data", [False, True], ids=["run_data", "data"])
def test_recommend_k_above_the_item_count_is_refused_before_the_model_loads(with_data, small_checkpoint, monkeypatch,
                                                                             capsys):
    """`gemray recommend --k 100000` on a 200-item catalogue: exit 2 naming --k and the count, from the manifest of
    the data served (the run's, or --data's), before the model is loaded (was: silently capped at the item count,
    198 rows for a user with 2 history items); recommend() refuses it too. --k 200 (= N) is served."""
    from types import SimpleNamespace

    import gemray.serve
    from gemray.cli import main
    from gemray.config import JobConfig
    from gemray.serve.recommend import recommend

    ckpt, data, _ = small_checkpoint
    real = gemray.serve.load_trained
    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    data_args = ["--data", str(data)] * with_data
    for k in ("100000", "201"):
        assert main(["recommend", "--checkpoint", str(ckpt), "--user", "1", "--k", k, *data_args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"gemray: error: --k {k}: more than the 200 items of the catalogue; give --k 200 or less "
                       "(each user gets at most the items outside their history)"], err
    with pytest.raises(ValueError, match=r"^--k 201: more than the 200 items"):
        recommend(SimpleNamespace(num_items=200, cfg=JobConfig()), [1], k=201)
    monkeypatch.setattr(gemray.serve, "load_trained", real)
    assert main(["recommend", "--checkpoint", str(ckpt), "--user", "1", "--k", "200", *data_args]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("user 1\t")]
    assert 0 < len(rows) < 200  # every item outside the user's history


def test_recommend_unknown_user_names_the_users_of_the_data(small_checkpoint, capsys):
    """`gemray recommend --user 999999` said "user 999999: no history in DIR (dense user id; 1 missing)": it now
    names the id, the data and its users' count and id range; an id without history (in a gap of the range) too."""
    from gemray.cli import main
    from gemray.serve.recommend import read_histories

    ckpt, data, _ = small_checkpoint
    assert main(["recommend", "--checkpoint", str(ckpt), "--user", "1", "--user", "999999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gemray: error: user id 999999: not a user of {data.resolve()} (60 users, ids 1..60)"], err
    manifest = json.loads((data / "manifest.json").read_text()) | {"prepared_dir": str(data)}
    with pytest.raises(ValueError, match=r"^user id 0: no history in .* \(60 users, ids 1\.\.60\)$"):
        read_histories(manifest, [3, 0])  # dense ids, as for an id in a gap of the range


@pytest.mark.parametrize("with_data", [False, True], ids=["run_data", "data"])
def test_recommend_unknown_user_is_refused_before_the_model_loads(with_data, small_checkpoint, monkeypatch, capsys):
    """`gemray recommend --user 999999`: the id is checked against the served data's manifest (the run's
    data.prepared_dir, or --data) before the model loads, same message (was: after the whole load, 13-17 s on an
    ML-1M run)."""
    import gemray.serve
    from gemray.cli import main

    ckpt, data, _ = small_checkpoint
    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    assert main(["recommend", "--checkpoint", str(ckpt), "--user", "1", "--user", "999999",
                 *(["--data", str(data)] * with_data)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gemray: error: user id 999999: not a user of {data.resolve()} (60 users, ids 1..60)"], err


@pytest.mark.parametrize("users_file", [False, True], ids=["user", "users_file"])
def test_recommend_a_user_given_twice_is_refused_before_the_model_loads(users_file, small_checkpoint, tmp_path,
                                                                         monkeypatch, capsys):
    """`gemray recommend --user 1 --user 1 --out recs.csv` wrote user 1's rows twice: exit 2 with one line naming the
    id (and, for --users-file, the line of each place), before the model loads, nothing written."""
    import gemray.serve
    from gemray.cli import main

    ckpt, _, _ = small_checkpoint
    monkeypatch.setattr(gemray.serve, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    ids = tmp_path / "ids.txt"
    ids.write_text("1\n7\n1\n")
    who = ["--users-file", str(ids)] if users_file else ["--user", "1", "--user", "7", "--user", "1"]
    out = tmp_path / "recs.csv"
    assert main(["recommend", "--checkpoint", str(ckpt), *who, "--k", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    place = f"{ids}:3: " if users_file else ""
    first = f" (first at {ids}:1)" if users_file else ""
    assert err == [f"gemray: error: {place}user id 1: given twice{first}; give each user once"], err
    assert not out.exists()


def test_data_refusals_come_before_the_model_code_is_imported(small_checkpoint):
    """An unknown user and --data of another item count are refused from manifests and the checkpoint's record,
    before TorchRec (the model's code, seconds to import) is imported, in a fresh process as a user runs them."""
    ckpt, data, other = small_checkpoint
    runs = [["recommend", "--checkpoint", str(ckpt), "--user", "999999"],
            ["evaluate", "--checkpoint", str(ckpt), "--data", str(other), "--json", "-"],
            ["recommend", "--checkpoint", str(ckpt), "--data", str(other), "--user", "1"]]
    code = ("import json, sys\nfrom gemray.cli import main\n"
            f"for argv in {runs!r}:\n"
            "    print(json.dumps([main(argv), 'torchrec' in sys.modules]), flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert [json.loads(ln) for ln in p.stdout.splitlines()] == [[2, False]] * 3, p.stdout + p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("gemray: error: ")]
    assert len(errors) == 3 and "user id 999999: not a user of" in errors[0], p.stderr
    assert all("150 items, but the checkpoint" in e for e in errors[1:]), p.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_data_manifest_is_read_once(command, small_checkpoint, monkeypatch, capsys):
    """`gemray evaluate / recommend --data DIR` reads DIR's manifest once, for the check before the model loads and
    the one after (was: twice, the second time in check_data)."""
    import gemray.serve.model as serve_model
    from gemray.cli import main

    ckpt, data, _ = small_checkpoint
    reads = []
    real = serve_model.prepared_manifest
    monkeypatch.setattr(serve_model, "prepared_manifest", lambda *a, **k: reads.append(a) or real(*a, **k))
    assert main([*COMMANDS[command], "--checkpoint", str(ckpt), "--data", str(data)]) == 0
    assert reads == [(str(data),)], reads
    assert capsys.readouterr().out


def test_evaluate_of_other_data_keeps_the_runs_own_json(small_checkpoint, tmp_path, capsys):
    """`gemray evaluate --data OTHER` wrote its figures to the run's evaluate_test.json, over the run's evaluation
    of its own data: it now writes evaluate_test.<folder name>.json and says so; without --data, or with the run's
    own folder as --data, evaluate_test.json as before."""
    from gemray.cli import main
    from gemray.pipelines.synthetic import SyntheticSpec, prepare_synthetic

    ckpt, data, _ = small_checkpoint
    other = tmp_path / "fresh"  # the checkpoint's 200 items, another seed
    prepare_synthetic(other, SyntheticSpec(users=30, items=200, seed=9, max_len=24, min_len=4, mean_len=10.0,
                                           candidates=4), num_files=1, progress=False, workers=1)
    own = ckpt.parent / "evaluate_test.json"
    own.unlink(missing_ok=True)
    assert main(["evaluate", "--checkpoint", str(ckpt)]) == 0
    before = own.read_text()
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(other)]) == 0
    assert own.read_text() == before
    foreign = ckpt.parent / "evaluate_test.fresh.json"
    assert json.loads(foreign.read_text())["prepared_dir"] == str(other.resolve())
    assert f"written: {foreign} (the evaluation of --data {other})" in capsys.readouterr().out
    # pure: the run's own folder named as --data, relative or not, is the run's own file
    from gemray.serve.evaluate import result_path

    assert result_path("r", "valid", data, data) == result_path("r", "valid") == Path("r/evaluate_valid.json")
    assert result_path("r", "test", "x/../fresh", data) == Path("r/evaluate_test.fresh.json")


def test_data_of_larger_feature_cardinalities_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    """`gemray evaluate --data` with the checkpoint's item count but larger side-feature cardinalities (a new user's
    `gemray prepare synthetic` defaults against a gem-tiny run): refused naming each feature and both sizes before
    the model is built (was: FBGEMM's bounds check mapped the ids to row 0, figures printed, exit 0)."""
    import gemray.model.gem
    import gemray.serve.model as serve_model
    from gemray.cli import main
    from gemray.config import load_config, to_toml
    from gemray.pipelines.synthetic import SyntheticSpec, ensure_synthetic, prepare_synthetic

    cfg = load_config(REPO / "configs" / "gem-tiny.toml", [f"data.prepared_dir={tmp_path / 'data'}",
                                                           "ray.use_gpu=false", "train.eval_ks=[10]"])
    ensure_synthetic(cfg.data)
    ckpt = tmp_path / "run" / "ray" / cfg.name / "checkpoint_0"
    _one_step_checkpoint(cfg, ckpt)
    (tmp_path / "run" / "config.toml").write_text(to_toml(cfg))
    other = tmp_path / "other"  # 400 items as gem-tiny's, features 16 / 32 (gem-tiny: 8 / 32)
    prepare_synthetic(other, SyntheticSpec(users=40, items=400, seed=5, max_len=24, min_len=4, mean_len=10.0,
                                           features=(("category", 16), ("author", 32)), devices=3, candidates=4),
                      num_files=1, progress=False, workers=1)
    monkeypatch.setattr(gemray.model.gem, "GEM", lambda *a, **k: pytest.fail("the model must not be built"))
    assert main(["evaluate", "--json", "-", "--checkpoint", str(ckpt), "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert "its ids do not fit the tables" in err and "feature 'category': cardinality 16 > 8" in err, err
    assert "author" not in err.split("do not fit")[1], err


def test_evaluation_threads_follow_the_training_ranks():
    """Pure: a training rank of ray.cpus_per_worker C computes with floor(C) threads (Ray's OMP_NUM_THREADS, at
    least 1)."""
    from gemray.config import JobConfig
    from gemray.serve.evaluate import rank_threads

    cfg = JobConfig()
    for cpus, want in ((1.0, 1), (0.5, 1), (2.0, 2), (3.7, 3)):
        cfg.ray.cpus_per_worker = cpus
        assert rank_threads(cfg) == want


def test_evaluate_computes_with_a_training_ranks_threads(small_checkpoint, monkeypatch):
    """gemray evaluate computed its batches with torch's thread pool over every core, where each training rank (a
    Ray worker of ray.cpus_per_worker = 1) computes with one thread: on ML-1M 68-135 s against ~20 s in training
    whenever another job shared the cores (every small op waits for a descheduled thread). Its batches now run
    with the rank's threads (here 1, not this process's 3), the process's setting restored after, the figures
    those of the default pool."""
    from gemray.serve import load_trained
    from gemray.serve.evaluate import evaluate
    from gemray.train.evaluation import RetrievalEvaluator

    ckpt, _, _ = small_checkpoint
    trained = load_trained(ckpt)
    seen = []
    real = RetrievalEvaluator.batch_sums
    monkeypatch.setattr(RetrievalEvaluator, "batch_sums",
                        lambda self, *a: seen.append(torch.get_num_threads()) or real(self, *a))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        out = evaluate(trained, "test", world_size=2)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}, seen
    assert out["threads"] == 1 and out["metrics"]["num_users"] > 0


def test_export_cli_names_every_file_it_wrote(small_checkpoint, tmp_path, capsys):
    """`gemray export` prints the files it wrote, item_ids.npy included where the data maps its ids (was: a fixed
    list without it)."""
    from gemray.cli import main

    ckpt, _, _ = small_checkpoint
    out = tmp_path / "exp"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("exported: ")]
    got = re.fullmatch(rf"exported: {re.escape(str(out.resolve()))} \((.*); loading snippet in the README\)", line)
    assert got is not None, line
    assert "item_ids.npy" in got.group(1).split(", ")
    assert sorted(got.group(1).split(", ")) == sorted(p.name for p in out.iterdir()), line


def test_exported_program_takes_a_batch_of_one_user(small_checkpoint, tmp_path):
    """The exported program, saved and loaded, called with B = 1 (offsets of 2 entries, the common online request)
    gives the model's user embedding (was: "Guard failed: -1 + offsets.size()[0] >= 2": traced on 2 users, B was
    0/1-specialised to >= 2 despite Dim("B", min=1)); a history longer than max_seq_len is refused naming it (was: a
    bare "index 24 is out of bounds" of the positional table)."""
    from gemray.pipelines.movielens import load_manifest
    from gemray.serve import load_trained
    from gemray.serve.export import export
    from gemray.serve.recommend import history_batch, read_histories

    ckpt, data, _ = small_checkpoint
    trained = load_trained(ckpt)
    out = export(trained, tmp_path / "exp")
    prog = torch.export.load(str(out / "user_tower.pt2")).module()
    n = trained.cfg.data.max_seq_len
    for users in ([3], [7], [3, 7]):
        batch, _ = history_batch(read_histories(load_manifest(data), users), n)
        assert batch.offsets.shape == (len(users) + 1,)
        with torch.no_grad():
            want = trained.model.user_embeddings(batch)
            got = prog(batch.item_ids, batch.offsets, batch.timestamps, batch.ratings, batch.target_timestamps)
        assert got.shape == (len(users), want.shape[1])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    T = n + 1
    with pytest.raises(RuntimeError, match=f"longer than max_seq_len = {n} tokens"):
        prog(torch.ones(T, dtype=torch.int64), torch.tensor([0, T]), torch.arange(T) * 60 + 10**9,
             torch.zeros(T, dtype=torch.int64), torch.tensor([10**9 + 60 * T]))


@pytest.mark.parametrize("command", ["evaluate", "recommend", "export"])
def test_set_of_a_shape_setting_is_refused_before_the_model_is_built(command, small_checkpoint, monkeypatch, capsys,
                                                                    tmp_path):
    """`--set model.num_blocks=1` on a 2-block checkpoint: exit 2 with one line naming the change (was: evaluate
    loaded the blocks the smaller model has and reported other metrics, exit 0, over the run's evaluate JSON; a
    larger one ended in a torch traceback, exit 1). A setting that keeps the shape still loads."""
    import gemray.model.gem
    from gemray.cli import main
    from gemray.serve import load_trained

    ckpt, _, _ = small_checkpoint
    args = {"evaluate": ["evaluate", "--json", "-"], "recommend": ["recommend", "--user", "1", "--k", "3"],
            "export": ["export", "--out", str(tmp_path / "exp")]}[command]
    real = gemray.model.gem.GEM
    monkeypatch.setattr(gemray.model.gem, "GEM", lambda *a, **k: pytest.fail("the model must not be built"))
    assert main([*args, "--checkpoint", str(ckpt), "--set", "model.num_blocks=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "changes the shape of the model the checkpoint holds (model.num_blocks: 2 -> 1)" in err[0]
    monkeypatch.setattr(gemray.model.gem, "GEM", real)
    assert load_trained(ckpt, overrides=["model.attention_backend=reference"]).cfg.model.num_blocks == 2


def test_wrong_kind_of_path_is_named_as_such(tmp_path):
    """A folder given as --users-file, a file or a used folder as export's --out: each said as what it is (a new
    user read "no such file" for a folder that exists)."""
    from gemray.serve.export import check_out_dir
    from gemray.serve.recommend import read_users_file

    with pytest.raises(FileNotFoundError, match="a folder, not a file"):
        read_users_file(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_users_file(tmp_path / "none.txt")
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        check_out_dir(tmp_path / "f")
    with pytest.raises(FileExistsError, match="not empty"):
        check_out_dir(tmp_path)
    assert check_out_dir(tmp_path / "new") == (tmp_path / "new").resolve() and not (tmp_path / "new").exists()



def test_a_run_whose_only_checkpoint_is_corrupt_gets_one_error_not_a_warning_that_contradicts_it(tmp_path, monkeypatch,
                                                                                                  caplog):
    """`gemray evaluate --checkpoint` on a run whose one checkpoint was truncated warned "taking the previous committed
    one" and then failed with "no committed checkpoint ... verifies"; now only the error names it. With an older
    checkpoint that verifies, the skipped one is still warned about."""
    import logging

    from gemray.serve import model as serve_model

    bad, good = tmp_path / "checkpoint_000002", tmp_path / "checkpoint_000001"
    verdict = {bad: "shard 0 truncated", good: None}
    monkeypatch.setattr(serve_model, "committed_checkpoints", lambda run_dir: [c for c in (bad, good) if c in cands])
    monkeypatch.setattr(serve_model, "choose_checkpoint", lambda cs: (
        next((c for c in cs if verdict[c] is None), None), [(c, verdict[c]) for c in cs if verdict[c]]))
    (tmp_path / "config.toml").write_text('name = "t"\n')
    cands = {bad}
    with caplog.at_level(logging.WARNING, logger=serve_model.log.name):
        with pytest.raises(ValueError, match=r"no committed checkpoint of .* verifies: checkpoint_000002: shard 0 "
                                             r"truncated$"):
            serve_model.locate_checkpoint(tmp_path)
    assert not caplog.records
    cands = {bad, good}
    with caplog.at_level(logging.WARNING, logger=serve_model.log.name):
        assert serve_model.locate_checkpoint(tmp_path)[0] == good
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {bad} is unusable (shard 0 truncated); taking the previous committed one"]
