"""The driver (gemray.controller: run, preflight, output_lock, session, results) without a running cluster."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import ray
import torch
from paths import DATA
from ray_runs import write_committed

from gemray.config import JobConfig, apply_overrides
from gemray.controller import output_lock, preflight, results, run, session

REPO = Path(__file__).resolve().parents[1]


class _FakeInit:
    def __init__(self, errors):
        self.errors, self.calls, self.shutdowns = list(errors), 0, 0

    def init(self, **kw):
        self.calls += 1
        assert kw["address"] == "local"
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    def install(errors):
        fake = _FakeInit(errors)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        return fake
    return install


def test_embedded_cluster_start_is_retried_once_after_a_startup_timeout(fake_ray):
    fake = fake_ray([Exception("The current node timed out during startup. This could happen ...")])
    assert session.connect(JobConfig()) is True
    assert (fake.calls, fake.shutdowns) == (2, 1)


def test_other_start_errors_and_a_second_timeout_propagate(fake_ray):
    fake = fake_ray([RuntimeError("port in use")])
    with pytest.raises(RuntimeError, match="port in use"):
        session.connect(JobConfig())
    assert fake.calls == 1
    timeout = "The current node timed out during startup."
    fake = fake_ray([Exception(timeout), Exception(timeout)])
    with pytest.raises(Exception, match="timed out during startup"):
        session.connect(JobConfig())
    assert (fake.calls, fake.shutdowns) == (2, 1)


def test_an_address_where_nothing_listens_is_refused_at_once(fake_ray, monkeypatch):
    """ray.init retries a host:port with nothing behind it indefinitely: refuse before calling it."""
    import socket

    fake = fake_ray([])
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"'127.0.0.1:{port}': no Ray cluster answers there"):
        session.connect(apply_overrides(JobConfig(), [f"ray.address=127.0.0.1:{port}"]))
    assert fake.calls == 0
    joined = []
    monkeypatch.setattr(ray, "init", lambda **kw: joined.append(kw["address"]))
    with socket.socket() as server:  # something listening: ray.init is called with the address
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert session.connect(apply_overrides(JobConfig(), [f"ray.address={address}"])) is False
    assert joined == [address]


def _manifest(num_items=1000, src="/nowhere", files=()):
    return {"vocab": {"num_items": num_items}, "source": {"dir": src, "files": list(files)}}


def _preflight(cfg, manifest, *, embedded, previous=None, num_gpus=None):
    """Both halves of the preflight, as fit runs them around preparing the data."""
    preflight.preflight_resources(cfg, embedded=embedded, num_gpus=num_gpus)
    preflight.preflight_data(cfg, manifest, previous=previous)


def test_preflight_refuses_jobs_that_would_fail_in_the_workers(tmp_path, monkeypatch):
    ok = JobConfig()
    _preflight(ok, _manifest(), embedded=True)
    interp = JobConfig()
    interp.model.retrieval_kernel = "triton"  # runs on CPU in Triton's interpreter (the tests' path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _preflight(interp, _manifest(), embedded=True)
    interp.model.attention_backend = "triton"  # so do the attention kernels (was refused: "needs ray.use_gpu")
    _preflight(interp, _manifest(), embedded=True)
    interp.model.kernel_tiles = '{"long": {"mode": {"dk_from_ds": true}}}'
    _preflight(interp, _manifest(), embedded=True)
    cases = [
        ("train.sparse_optimizer='adam' needs ray.use_gpu", dict(train={"sparse_optimizer": "adam"})),
        ("model.attention_backend='triton' needs ray.use_gpu.*on CPU only in Triton's interpreter, TRITON_INTERPRET=1",
         dict(model={"attention_backend": "triton"})),
        ("model.retrieval_kernel='triton' needs ray.use_gpu",
         dict(model={"retrieval_kernel": "triton", "negatives": "uniform_shared"})),
        ("model.uvqk_kernel='triton' needs ray.use_gpu", dict(model={"uvqk_kernel": "triton"})),
        # the kernel tiles' keys (not only their JSON syntax) are checked before Ray starts
        ("model.kernel_tiles: long.mode: expected an object with keys from",
         dict(model={"kernel_tiles": '{"long": {"mode": {"dk_from_dz": true}}}'})),
        ("model.kernel_tiles: unknown regime", dict(model={"kernel_tiles": '{"huge": {}}'})),
        ("ray.cpus_per_worker=8.0 exceeds the 4 CPUs", dict(ray={"cpus_per_worker": 8.0})),
        # each worker fits, the group does not: 2 x 3 CPUs on 4 (it waited forever before)
        (r"2 worker\(s\) x ray.cpus_per_worker=3.0 exceed the 4 CPUs", dict(ray={"cpus_per_worker": 3.0})),
        ("train.eval_ks=.*above the 1000 items", dict(train={"eval_ks": [10, 2000]})),
        ("train.eval_ks=.*at or above the 1000 items", dict(train={"eval_ks": [10, 1000]})),  # K = N: HR@N is 1
    ]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    idle = JobConfig()  # "uniform" negatives never read retrieval_kernel: warned about as idle, not refused
    idle.model.retrieval_kernel = "triton"
    _preflight(idle, _manifest(), embedded=True)
    assert "has no effect" in idle.ineffective_settings_warning()
    for msg, changes in cases:
        cfg = JobConfig()
        for section, kv in changes.items():
            for k, v in kv.items():
                setattr(getattr(cfg, section), k, v)
        with pytest.raises(ValueError, match=msg):
            _preflight(cfg, _manifest(), embedded=True)
    gpu = JobConfig()
    gpu.ray.use_gpu, gpu.train.sparse_optimizer, gpu.model.attention_backend = True, "adam", "triton"
    _preflight(gpu, _manifest(), embedded=True, num_gpus=2)
    # no (or too few) GPUs on the machine of an embedded cluster: Ray Train would wait for them forever
    with pytest.raises(ValueError, match=r"ray.use_gpu=true needs 2 GPU\(s\) .* this machine has 1"):
        _preflight(gpu, _manifest(), embedded=True, num_gpus=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this machine has 0"):
            _preflight(gpu, _manifest(), embedded=True)
    _preflight(gpu, _manifest(), embedded=False, num_gpus=0)  # an external cluster may have them
    big = JobConfig()
    big.ray.cpus_per_worker = 8.0
    _preflight(big, _manifest(), embedded=False)  # an external cluster may have the CPUs


def test_output_of_ones_own_files_is_refused_before_anything_is_written(tmp_path, capsys):
    """`gemray train --output DIR` into a folder of one's own files wrote over its config.toml (there the --config
    file itself) and metrics.json without a word, and `--output /` wrote into the filesystem's root: a folder
    holding anything a run does not write, or a config.toml a run did not write, is refused with exit 2, nothing
    written (not even logs/); an earlier run's folder (what a re-run resumes) and an empty folder pass."""
    from gemray import cli
    from gemray.config import load_config, to_toml

    tiny = Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml"
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.toml").write_text(tiny.read_text())  # a person's config (with comments), used as --config
    (own / "metrics.json").write_text('{"mine": 1}')
    before = {p.name: p.read_bytes() for p in own.iterdir()}
    argv = ["train", "--config", str(own / "config.toml"), "--output", str(own), "--set",
            f"data.prepared_dir={tmp_path / 'data'}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--output (output_dir) {own}: its config.toml was not written by a gemray run" in err, err
    assert {p.name: p.read_bytes() for p in own.iterdir()} == before and not (tmp_path / "data").exists()
    (own / "notes.txt").write_text("x")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "holds files a gemray run does not write (notes.txt)" in err, err
    assert sorted(p.name for p in own.iterdir()) == ["config.toml", "metrics.json", "notes.txt"]
    with pytest.raises(ValueError, match=r"holds files a gemray run does not write \(.*and \d+ more\)"):
        preflight.preflight_output_contents("/")
    # a run's own config.toml (the dump) and the other entries a run writes pass; so does an empty folder
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(load_config(tiny)))
    for name in ("metrics.json", "events.jsonl", "PREEMPT", "PREEMPT.active"):
        (run_dir / name).write_text("{}")
    preflight.preflight_output_contents(run_dir)
    # gemray evaluate's default results in the run folder are the run's own (they locked the folder)
    from gemray.serve.evaluate import result_path

    for written in (result_path(run_dir, "test"), result_path(run_dir, "valid", tmp_path / "other-data")):
        written.write_text("{}")
    assert preflight.foreign_entries(run_dir) == []
    preflight.preflight_output_contents(run_dir)
    (run_dir / "evaluate_test.json.bak").write_text("{}")
    assert preflight.foreign_entries(run_dir) == ["evaluate_test.json.bak"]
    (run_dir / "evaluate_test.json.bak").unlink()
    preflight.preflight_output_contents(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    preflight.preflight_output_contents(tmp_path / "empty")
    assert preflight.written_by_gemray(to_toml(JobConfig())) and not preflight.written_by_gemray("")
    assert not preflight.written_by_gemray('name = "x"\n# mine\n[train]\nepochs = 1\n')


def test_a_job_of_another_name_in_a_run_folder_is_refused(tmp_path, capsys):
    """A run folder re-used with another `name`: the job trained afresh into ray/<new name> and wrote over the
    earlier run's metrics.json and config.toml, under a warning saying it continued that run (a new user's finding).
    Refused, exit 2, nothing changed; the same name goes ahead (the pure check)."""
    from gemray import cli
    from gemray.config import load_config, to_toml

    tiny = Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml"
    run_dir = tmp_path / "run"
    (run_dir / "ray").mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(load_config(tiny)))
    (run_dir / "metrics.json").write_text('{"hr@10": 0.5}')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert cli.main(["train", "--config", str(tiny), "--output", str(run_dir), "--set", "name=gem-other",
                     f"data.prepared_dir={tmp_path / 'data'}"]) == 2
    err = capsys.readouterr().err
    assert (f"{run_dir}: holds the run named 'gem-tiny' (its config.toml and checkpoints); this job is named "
            "'gem-other'") in err and "--set name=gem-tiny to continue that run" in err, err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    assert not (tmp_path / "data").exists()
    same = load_config(tiny)
    preflight.preflight_run_name(same, load_config(tiny), run_dir)
    preflight.preflight_run_name(same, None, run_dir)


@pytest.mark.parametrize("ks, n_items, too_large, largest, suggested", [
    ([10, 50, 200], 100, "200", 99, [10, 50]),  # the cut-offs below the catalogue, in their order
    ([200, 10, 1000], 150, "200, 1000", 149, [10]),
    ([50, 200], 40, "50, 200", 39, [39]),  # none left: the largest allowed
    ([10, 1000], 1000, "1000", 999, [10]),  # K = N: HR@N is 1 too
])
def test_a_cutoff_refusal_names_the_largest_allowed_and_a_value_that_passes(ks, n_items, too_large, largest,
                                                                             suggested):
    """The refusal of a train.eval_ks cut-off at or above the catalogue named its size but no value that would do;
    it now names the cut-offs too large, the largest allowed (N - 1) and a train.eval_ks that passes as written."""
    with pytest.raises(ValueError) as err:
        preflight.check_cutoffs(ks, n_items)
    msg = str(err.value)
    assert msg.startswith(f"train.eval_ks={ks}: a cut-off at or above the {n_items} items of the catalogue makes")
    assert msg.endswith(f"too large: {too_large}; the largest cut-off allowed is {largest}: e.g. "
                        f"train.eval_ks=[{','.join(map(str, suggested))}]"), msg
    setting = msg.rsplit("e.g. ", 1)[1]
    cfg = apply_overrides(JobConfig(), [setting])  # the suggestion, pasted after --set, is a valid setting
    assert cfg.train.eval_ks == suggested
    preflight.check_cutoffs(cfg.train.eval_ks, n_items)  # and passes
    with pytest.raises(ValueError, match=r"a catalogue of 1 item allows no cut-off \(K must be at least 1 and "
                                         r"below 1\)$"):
        preflight.check_cutoffs([1], 1)


def test_cutoffs_beyond_a_synthetic_catalogue_are_refused_before_generating(tmp_path, capsys):
    """`gemray train --set train.eval_ks=[10,100000]` on a synthetic config was refused only after the data was
    generated (minutes at GEM scale): the catalogue's size is in data.synthetic, so the refusal comes first, with
    nothing written; a cut-off below it passes that check (and the manifest check after generation)."""
    from gemray import cli

    config = str(Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml")
    data, out = tmp_path / "data", tmp_path / "run"
    rc = cli.main(["train", "--config", config, "--output", str(out), "--set", f"data.prepared_dir={data}",
                   "train.eval_ks=[10,100000]"])
    err = capsys.readouterr().err
    assert rc == 2 and "train.eval_ks=[10, 100000]: a cut-off at or above the 400 items of the catalogue " \
        "(data.synthetic: items)" in err, err
    assert err.rstrip().endswith("too large: 100000; the largest cut-off allowed is 399: e.g. train.eval_ks=[10]"), err
    assert not data.exists() and not out.exists()
    cfg = apply_overrides(JobConfig(), ["data.synthetic=[users=64,items=50]", "train.eval_ks=[10,49]",
                                        "model.num_negatives=50"])
    preflight.preflight_catalogue(cfg)
    cfg.train.eval_ks = [50]
    with pytest.raises(ValueError, match="at or above the 50 items"):
        preflight.preflight_catalogue(cfg)
    preflight.preflight_catalogue(JobConfig())  # MovieLens: its catalogue is known once prepared (preflight_data)


def test_data_with_no_user_in_the_splits_is_refused_before_ray_starts(tmp_path, capsys, monkeypatch):
    """50 users of 2 events each: `gemray train` ran 0 steps, saved a checkpoint and exited 0 with hr@5 0.0 over
    num_test_users 0 (a new user's finding). Refused, exit 2, before Ray starts and with nothing written to the
    output folder, naming the folder, why and what to do; data with a user in the splits passes the check."""
    from gemray import cli
    from gemray.pipelines.interactions import prepare_interactions

    src = tmp_path / "raw" / "short.csv"
    src.parent.mkdir()
    src.write_text("user_id,item_id,timestamp\n" + "".join(f"{u},{(u * 7 + j) % 30 + 1},{1000 + j}\n"
                                                            for u in range(1, 51) for j in range(2)))
    data, out = tmp_path / "short", tmp_path / "run"
    manifest = prepare_interactions(str(src), data, progress=False)
    monkeypatch.setattr(run, "_train", lambda *a, **k: pytest.fail("Ray Train started"))
    rc = cli.main(["train", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--output", str(out),
                   "--set", f"data.prepared_dir={data}", f"data.raw_dir={src.parent}", "train.epochs=1",
                   "train.eval_ks=[5]"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"gemray: error: data.prepared_dir {data} has no training or test users: all "
                                      "50 users have fewer than 3 interactions"), err
    assert "give each user at least 3 interactions in the source and prepare it again" in err, err
    assert not out.exists()
    with pytest.raises(ValueError, match="has no training or test users"):
        preflight.check_split_users(manifest, data)
    preflight.check_split_users({**manifest, "splits": {**manifest["splits"], "users": 1}}, data)
    preflight.check_split_users(_manifest(), data)  # no splits recorded: nothing to check


def test_prepared_features_the_model_cannot_read_are_refused():
    """A folder prepared before `gemray prepare interactions` applied the model's feature-name rule (a column 'Cat'
    made feat_Cat) failed a minute into training, in the workers: preflight_data's check refuses it up front,
    naming the folder, the feature and what to do; readable names pass."""
    ok = {"features": {"genre": {"level": "token", "column": "feat_genre"}, "hour": {"level": "request"}}}
    preflight.check_feature_names(ok, "/data/x")
    preflight.check_feature_names({}, "/data/x")  # MovieLens: no declared features
    bad = {"features": {**ok["features"], "Cat": {"level": "token", "column": "feat_Cat"}}}
    with pytest.raises(ValueError, match=r"^data.prepared_dir /data/x: feature name 'Cat': expected lowercase "
                                         r"letters.*rename that column in the source and prepare it again"):
        preflight.check_feature_names(bad, "/data/x")


def test_more_negatives_than_items_are_refused_before_ray_starts(tmp_path, capsys):
    """`--set model.num_negatives=100000` on ml-latest-small's 5,605 items was accepted and the run died inside the
    Ray worker allocating 34 GB (a new user's finding). The negatives are drawn with replacement, so no count is
    invalid as such; more than the catalogue's items is refused before Ray starts (a synthetic catalogue's before
    its data is generated), naming the field, the value and the catalogue's size. As many as the items passes,
    and so does any count without a retrieval task (nothing samples them)."""
    from gemray import cli

    cfg = apply_overrides(JobConfig(), ["model.num_negatives=100000"])
    with pytest.raises(ValueError, match=r"^model.num_negatives=100000: more negatives than the 5605 items of the "
                                         r"catalogue; .*use at most 5605$"):
        _preflight(cfg, _manifest(num_items=5605), embedded=True)
    cfg.model.num_negatives = 5605
    _preflight(cfg, _manifest(num_items=5605), embedded=True)
    cfg.model.num_negatives = 5606
    with pytest.raises(ValueError, match="model.num_negatives=5606: more negatives than the 5605 items"):
        preflight.preflight_data(cfg, _manifest(num_items=5605))
    ranking = apply_overrides(JobConfig(), ["model.tasks=[\"ctr\"]", "model.num_negatives=100000"])
    preflight.check_negatives(ranking, 5605)
    config = str(REPO / "configs" / "gem-tiny.toml")
    data, out = tmp_path / "data", tmp_path / "run"
    rc = cli.main(["train", "--config", config, "--output", str(out), "--set", f"data.prepared_dir={data}",
                   "model.num_negatives=100000"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("gemray: error: model.num_negatives=100000: more negatives than the 400 items "
                                      "of the catalogue (data.synthetic: items)"), err
    assert not data.exists() and not out.exists()


def test_preflight_refuses_a_kernel_tiles_value_as_the_config_does(tmp_path, monkeypatch):
    """A model.kernel_tiles that is neither a file nor inline JSON, or malformed inline JSON, is refused before Ray
    starts with the config's own line (naming the key, the value and both accepted forms; the JSON error's
    position), not a "cannot read" of a file the user never meant."""
    from gemray.model.hstu import kernel_config_of

    monkeypatch.chdir(tmp_path)
    for value, needle in (("[1,2]", "is neither a JSON file (no such file in"), ('{"bad json', "line 1 column 2")):
        cfg = JobConfig()
        cfg.model.kernel_tiles = value
        with pytest.raises(ValueError) as config_err:
            cfg.validate()
        kernel_config_of.cache_clear()
        with pytest.raises(ValueError) as preflight_err:
            _preflight(cfg, _manifest(), embedded=True)
        assert str(preflight_err.value) == str(config_err.value)
        assert str(config_err.value).startswith("model.kernel_tiles") and needle in str(config_err.value)
        if not value.startswith("{"):
            assert repr(value) in str(config_err.value) and "inline JSON object" in str(config_err.value)


def test_preflight_layout_refuses_parallel_degrees_a_fixed_world_cannot_hold(tmp_path):
    """HSDP with dp_shard=3 on 2 workers failed in every worker's setup after Ray started (Ray Train restarted the
    group ray.max_failures times, exit 1 with a traceback): refused before Ray, naming the sizes; an elastic job
    and GPU HSDP with dp_shard=0 (the node's GPU count) are left to the workers."""
    def cfg_with(**parallel):
        cfg = JobConfig()
        for k, v in parallel.items():
            setattr(cfg.parallel, k, v)
        return cfg

    preflight.preflight_layout(cfg_with(dense="hsdp", dp_shard=2))  # 2 workers: 1 x 2
    preflight.preflight_layout(cfg_with(dense="fsdp"))
    with pytest.raises(ValueError, match="dp_shard=3 does not divide world size 2"):
        preflight.preflight_layout(cfg_with(dense="hsdp", dp_shard=3))
    with pytest.raises(ValueError, match="sparse_2d_group=3 does not divide world size 2"):
        preflight.preflight_layout(cfg_with(sparse_2d_group=3))
    elastic = cfg_with(dense="hsdp", dp_shard=3)
    elastic.ray.min_workers, elastic.ray.max_workers = 1, 2
    preflight.preflight_layout(elastic)  # each attempt takes the nearest valid layout
    gpu = cfg_with(dense="hsdp", dp_shard=0)
    gpu.ray.use_gpu = True
    preflight.preflight_layout(gpu)
    # fit refuses it before preparing data or writing anything
    bad = cfg_with(dense="hsdp", dp_shard=3)
    bad.data.raw_dir, bad.data.prepared_dir = str(tmp_path / "raw"), str(tmp_path / "prepared")
    with pytest.raises(ValueError, match="dp_shard=3 does not divide world size 2"):
        run.fit(bad, output_dir=tmp_path / "out")
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_fit_refuses_a_gpu_job_without_gpus_before_preparing_data(tmp_path):
    """ray.use_gpu=true on a machine without GPUs is refused before the data is prepared (which can take
    minutes), with the GPU message, not a data error, and nothing is written."""
    cfg = JobConfig()
    cfg.ray.use_gpu = True
    cfg.data.raw_dir, cfg.data.prepared_dir = str(tmp_path / "raw"), str(tmp_path / "prepared")
    with pytest.raises(ValueError, match=r"ray.use_gpu=true needs \d GPU\(s\) .* this machine has 0"):
        run.fit(cfg, output_dir=tmp_path / "out")
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "out").exists()


def test_relative_paths_are_taken_from_the_driver_directory(tmp_path, monkeypatch):
    """data paths and a set train.events_path / train.ledger_dir become absolute against the directory gemray
    starts in (the workers run elsewhere); unset ("") events_path / ledger_dir stay unset."""
    monkeypatch.chdir(tmp_path)
    cfg = JobConfig()
    cfg.data.raw_dir, cfg.data.prepared_dir = "raw", "~/prep"
    cfg.train.events_path, cfg.train.ledger_dir = "logs/events.jsonl", "ledger"
    cfg.model.kernel_tiles = "configs/tiles.json"
    cfg = run._resolve(cfg)
    assert cfg.model.kernel_tiles == str(tmp_path / "configs" / "tiles.json")  # a Ray worker read it relative
    assert cfg.data.raw_dir == str(tmp_path / "raw")
    assert cfg.data.prepared_dir == str(Path("~/prep").expanduser())
    assert cfg.train.events_path == str(tmp_path / "logs" / "events.jsonl")
    assert cfg.train.ledger_dir == str(tmp_path / "ledger")
    cfg = JobConfig()
    assert (run._resolve(cfg).train.events_path, cfg.train.ledger_dir, cfg.model.kernel_tiles) == ("", "", "")
    cfg.model.kernel_tiles = ' {"medium": {}}'  # inline JSON stays as it is
    assert run._resolve(cfg).model.kernel_tiles == ' {"medium": {}}'


def test_preflight_compares_model_shape_with_the_previous_run():
    prev, same, other = JobConfig(), JobConfig(), JobConfig()
    same.model.dropout = 0.5                  # not a shape: resuming is fine
    _preflight(same, _manifest(), embedded=True, previous=prev)
    other.model.num_blocks = 3
    other.data.max_seq_len = 50
    with pytest.raises(ValueError, match=r"model.num_blocks: 8 -> 3, data.max_seq_len: 200 -> 50.*new --output"):
        _preflight(other, _manifest(), embedded=True, previous=prev)


def _data_manifest(num_items, *, sha="ab", fmt="ml-1m", prepared="/data/ml-1m", src="/raw/ml-1m"):
    """The fields of a prepared data's manifest that a checkpoint's data record comes from."""
    return {"format": fmt, "prepared_dir": prepared, "vocab": {"num_items": num_items},
            "counts": {"users": 6040, "items": num_items, "interactions": 1000209},
            "source": {"dir": src, "files": [{"name": "ratings.dat", "sha256": sha * 32}]}}


def _committed_run(run_dir: Path, num_items: int, manifest=None) -> Path:
    """A Ray Train run folder with one committed checkpoint whose item table has num_items + 1 rows; its
    manifest records ``manifest``'s data (None: as gemray wrote checkpoints before it recorded them)."""
    from gemray.checkpoint import save_checkpoint

    record = None
    if manifest is not None:
        from gemray.checkpoint import data_record

        record = data_record(manifest)
    model = torch.nn.Module()
    model.embeddings = torch.nn.Module()
    model.embeddings.embeddings = torch.nn.ModuleDict({"item": torch.nn.Embedding(num_items + 1, 4)})
    name = "checkpoint_2026-01-01_00-00-00.000000"
    save_checkpoint(run_dir / name, model, torch.optim.SGD(model.parameters(), lr=0.1),
                    {"epoch": 1, "global_step": 3}, **({"data": record} if record else {}))
    write_committed(run_dir, [name])
    return run_dir / name


def test_preflight_resume_refuses_a_checkpoint_of_other_data(tmp_path):
    """ml-1m's checkpoint, then ml-100k's data in the same output folder: refused before Ray starts, naming
    the folder, the checkpoint, the item counts and where its data came from (Ray Train used to retry the
    restore ray.max_failures times and end on torch's "size mismatch for ... item.weight")."""
    out = tmp_path / "out"
    run_dir = out / "ray" / "job"
    cfg = JobConfig()
    cfg.data.prepared_dir = "/data/ml-100k"
    ml100k = _data_manifest(1682, sha="cd", fmt="ml-100k", prepared="/data/ml-100k", src="/raw/ml-100k")
    assert preflight.preflight_resume(cfg, ml100k, run_dir, output_dir=out) is None  # nothing to resume: fresh
    ckpt = _committed_run(run_dir, 3706, _data_manifest(3706))
    with pytest.raises(ValueError) as e:
        preflight.preflight_resume(cfg, ml100k, run_dir, output_dir=out)
    msg = str(e.value)
    for part in (f"output folder {out} holds checkpoint {ckpt}", "item embedding table has 3707 rows (3706 items)",
                 "data.prepared_dir /data/ml-100k has 1682 items (1683 rows)",
                 "trained on /data/ml-1m (prepared from /raw/ml-1m)", "use a new --output", f"or remove {out} "):
        assert part in msg, (part, msg)
    # the same catalogue size but another ratings file: item ids would mean other movies
    edited = _data_manifest(3706, sha="ef", prepared="/data/ml-1m-edited")
    with pytest.raises(ValueError, match=r"same number of items \(3706\) but other data .*ratings.dat sha256 "
                                         r"abababababab\.\. -> efefefefefef\.\."):
        preflight.preflight_resume(cfg, edited, run_dir, output_dir=out)
    # the same data prepared again elsewhere (make demo re-prepares it each time): resumes
    again = _data_manifest(3706, prepared="/elsewhere/ml-1m")
    assert preflight.preflight_resume(cfg, again, run_dir, output_dir=out) == ckpt
    # checkpoints under ray.storage_path, outside the output folder: that is the folder to remove
    with pytest.raises(ValueError, match=f"or remove {run_dir} "):
        preflight.preflight_resume(cfg, ml100k, run_dir, output_dir=tmp_path / "elsewhere")


def test_preflight_resume_is_lenient_with_checkpoints_without_a_record(tmp_path, caplog):
    """Checkpoints written before the data record resume (with a warning) when their item table fits; one
    that cannot load is still refused, from the table rows in its DCP metadata."""
    out = tmp_path / "out"
    run_dir = out / "ray" / "job"
    ckpt = _committed_run(run_dir, 3706)
    cfg = JobConfig()
    with caplog.at_level(logging.WARNING, logger=preflight.log.name):
        assert preflight.preflight_resume(cfg, _data_manifest(3706), run_dir, output_dir=out) == ckpt
    assert "records no data fingerprint" in caplog.text and "cannot be checked; resuming it" in caplog.text
    prev = JobConfig()
    prev.data.prepared_dir, prev.data.raw_dir = "/data/ml-1m", "/raw/ml-1m"
    with pytest.raises(ValueError, match=r"3707 rows \(3706 items\).* 1682 items .*config.toml names "
                                         r"data.prepared_dir /data/ml-1m \(raw /raw/ml-1m\)"):
        preflight.preflight_resume(cfg, _data_manifest(1682), run_dir, output_dir=out, previous=prev)


@pytest.mark.skipif(not (DATA / "ml-100k").is_dir(), reason="ml-100k not available")
@pytest.mark.parametrize("recorded", [True, False], ids=["record", "older-checkpoint"])
def test_train_into_a_folder_of_another_dataset_exits_2_before_ray(tmp_path, monkeypatch, capsys, recorded):
    """`gemray train` with ml-100k into an output folder holding an ml-1m checkpoint of the same job: exit
    status 2 and one line, before Ray starts and before anything in the output folder changes; also for a
    checkpoint written before gemray recorded its data (the item table rows are in its DCP metadata)."""
    from gemray.cli import main
    from gemray.config import load_config

    config = REPO / "configs" / "ml-latest-small.toml"
    out = tmp_path / "out"
    ckpt = _committed_run(out / "ray" / load_config(config).name, 3706, _data_manifest(3706) if recorded else None)

    def no_ray(cfg):
        raise AssertionError("Ray must not start")

    monkeypatch.setattr(session, "connect", no_ray)
    rc = main(["train", "--config", str(config), "--output", str(out), "--set", f"data.raw_dir={DATA / 'ml-100k'}",
               f"data.prepared_dir={tmp_path / 'ml-100k'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"gemray: error: output folder {out} holds checkpoint {ckpt} of other data")
    assert "new --output" in err[0]
    assert ("trained on /data/ml-1m" if recorded else "records no data path") in err[0]
    if recorded:  # refused from the raw ratings file, before ml-100k is prepared (it used to be prepared first)
        assert (f"data.raw_dir {DATA / 'ml-100k'} is other data (format ml-1m -> ml-100k; ratings.dat (sha256 "
                "abababababab..) no longer a source file; u.data (sha256 ") in err[0], err
        assert ") a new source file" in err[0] and "None" not in err[0], err  # was "sha256 None.. -> 0641..."
        assert not (tmp_path / "ml-100k").exists()
    else:  # no record to compare the raw file with: prepared, then refused on the item table's rows
        assert "3707 rows (3706 items)" in err[0] and "1682 items" in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["ray"]  # no config.toml, events or notice written


def test_preflight_resume_source_compares_the_raw_ratings_file_before_preparing(tmp_path, monkeypatch):
    """preflight_resume_source: another ratings file (or format) in data.raw_dir than the checkpoint's record names
    is refused before preparing; the same file, a folder with prepared data, a raw folder given as
    data.prepared_dir, no checkpoint, a checkpoint without a record or a raw_dir without ratings pass (the
    preparation and preflight_resume see to those)."""
    from gemray.checkpoint import file_sha256

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "ratings.dat").write_text("1::1193::5::978300760\n")
    sha = file_sha256(raw / "ratings.dat")
    out = tmp_path / "out"
    run_dir = out / "ray" / "job"
    cfg = JobConfig()
    cfg.data.raw_dir, cfg.data.prepared_dir = str(raw), str(tmp_path / "prep")

    def check():
        preflight.preflight_resume_source(cfg, run_dir, output_dir=out)

    check()  # no checkpoint: a fresh run
    _committed_run(run_dir, 3706, _data_manifest(3706, sha="ab"))
    with pytest.raises(ValueError, match=rf"of other data: data.raw_dir {raw} is other data \(ratings.dat sha256 "
                                         rf"abababababab\.\. -> {sha[:12]}\.\.\), found before preparing it"):
        check()
    (raw / "ratings.dat").unlink()
    check()  # no ratings file in data.raw_dir: the preparation step says so
    (raw / "ratings.dat").write_text("1::1193::5::978300760\n")
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "manifest.json").write_text("{}")
    check()  # prepared data there: nothing is prepared, preflight_resume compares the manifest
    (tmp_path / "prep" / "manifest.json").unlink()
    cfg.data.prepared_dir = str(raw)
    check()  # a raw folder as data.prepared_dir: refused as such when it is loaded
    cfg.data.prepared_dir = str(tmp_path / "prep")
    run_dir = tmp_path / "same" / "ray" / "job"
    _committed_run(run_dir, 3706, _data_manifest(3706, sha=sha[:2]) | {
        "source": {"dir": str(raw), "files": [{"name": "ratings.dat", "sha256": sha}]}})
    check()  # the same ratings file: prepared, then checked in full
    run_dir = tmp_path / "old" / "ray" / "job"
    _committed_run(run_dir, 3706)
    check()  # no record (an older checkpoint): nothing to compare before preparing


def test_preflight_active_refuses_a_folder_in_use_only(tmp_path):
    """preflight_active: a fresh active marker of a live process on this host -> FileExistsError naming marker,
    pid and what to do; no marker, an unreadable one, one without a heartbeat for ACTIVE_STALE_S, or one
    whose pid is gone on this host -> nothing to refuse. Another host's marker is watched: refreshed ->
    refused, stale first -> go ahead."""
    import os
    import socket
    import subprocess
    import time

    from gemray.preemption import ACTIVE_STALE_S, active_path

    notice = tmp_path / "PREEMPT"
    preflight.preflight_active(notice)  # no marker
    marker = active_path(notice)
    marker.write_text("{not json")
    preflight.preflight_active(notice)

    def write(pid, host):
        marker.write_text(json.dumps({"pid": pid, "host": host, "t": time.time()}))

    live = subprocess.Popen(["sleep", "60"])
    try:
        write(live.pid, socket.gethostname())
        with pytest.raises(FileExistsError, match=rf"another gemray run is active .* pid {live.pid} .*"
                                                  r"gemray preempt --output .* another --output"):
            preflight.preflight_active(notice)
        preflight.preflight_active(notice, clock=lambda: time.time() + ACTIVE_STALE_S + 1)  # no heartbeat for too long
        old = time.time() - ACTIVE_STALE_S - 1
        os.utime(marker, (old, old))
        preflight.preflight_active(notice)
    finally:
        live.kill()
        live.wait()
    write(live.pid, socket.gethostname())
    preflight.preflight_active(notice)  # its driver is gone (killed outright): no need to wait out the heartbeat

    write(12345, "another-host")
    waits = []

    def refreshed(s):  # the other host's driver is alive: its heartbeat moves the marker's time
        waits.append(s)
        t = marker.stat().st_mtime + 5
        os.utime(marker, (t, t))

    with pytest.raises(FileExistsError, match="pid 12345 on another-host"):
        preflight.preflight_active(notice, sleep=refreshed)
    assert len(waits) == 1
    write(12345, "another-host")
    fake = [time.time()]

    def silent(s):  # no heartbeat: the marker goes stale while we watch
        fake[0] += s
    preflight.preflight_active(notice, clock=lambda: fake[0], sleep=silent)
    assert fake[0] - marker.stat().st_mtime >= ACTIVE_STALE_S


def test_claim_output_is_exclusive_and_takes_over_abandoned_markers(tmp_path):
    """claim_output: the first claim creates the marker (atomically: a second claim while it lives is refused,
    so two runs started together cannot both proceed); a marker whose driver is gone is taken over."""
    import socket
    import subprocess
    import time

    from gemray.preemption import active_path, claim_active, clear_active

    notice = tmp_path / "out" / "PREEMPT"
    try:
        assert output_lock.claim_output(notice) is True
        marker = active_path(notice)
        assert json.loads(marker.read_text())["pid"] == __import__("os").getpid()
        assert claim_active(notice) is False  # exclusive: the marker is there
        with pytest.raises(FileExistsError, match="another gemray run is active"):
            output_lock.claim_output(notice)  # our own live pid: refused like any live run
    finally:
        clear_active(notice)
    dead = subprocess.Popen(["true"])
    dead.wait()
    active_path(notice).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "t": time.time()}))
    try:
        assert output_lock.claim_output(notice) is True  # abandoned (its pid is gone): taken over at once
        assert json.loads(active_path(notice).read_text())["pid"] != dead.pid
    finally:
        clear_active(notice)
    assert not active_path(notice).exists()


def test_fit_claims_the_folder_before_ray_starts_and_releases_it_on_failure(tmp_path, monkeypatch):
    """The active marker exists before Ray starts (a second run started seconds later is refused: the marker
    used to be written after ray.init, ~10 s in), and a start that fails leaves no marker behind."""
    from gemray.preemption import active_path

    out = tmp_path / "out"
    seen = {}

    def ray_fails(cfg):
        seen["marker"] = active_path(out / "PREEMPT").is_file()
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(session, "connect", ray_fails)
    with pytest.raises(RuntimeError, match="no Ray here"):
        run.fit(REPO / "configs" / "ml-latest-small.toml", output_dir=out,
                overrides=[f"data.raw_dir={DATA / 'ml-latest-small'}", f"data.prepared_dir={tmp_path / 'prep'}"])
    assert seen == {"marker": True} and not active_path(out / "PREEMPT").exists()


def test_train_into_a_folder_in_use_exits_2_before_ray(tmp_path, monkeypatch, capsys):
    """A second `gemray train` into an output folder whose run is active (its driver's marker is fresh):
    exit 2 and one line before Ray starts, and the folder's files are left as they were."""
    import os
    import socket
    import time

    from gemray.cli import main
    from gemray.preemption import active_path

    out = tmp_path / "out"
    out.mkdir()
    marker = active_path(out / "PREEMPT")
    marker.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "t": time.time()}))

    def no_ray(cfg):
        raise AssertionError("Ray must not start")

    monkeypatch.setattr(session, "connect", no_ray)
    rc = main(["train", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--output", str(out), "--set",
               f"data.raw_dir={DATA / 'ml-latest-small'}", f"data.prepared_dir={tmp_path / 'prep'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "another gemray run is active in this output folder" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == [marker.name]
    assert not (tmp_path / "prep").exists()  # refused before the data is prepared (was: prepared, then refused)


def test_train_on_a_damaged_prepared_folder_exits_2_before_ray(tmp_path, monkeypatch, capsys):
    """A prepared history file changed after preparation: `gemray train` refuses in one line naming the file,
    exit 2, before Ray starts (it used to fail in every worker, 4 attempts, with pyarrow's traceback)."""
    from gemray.cli import main
    from gemray.pipelines.movielens import prepare_movielens

    prep = tmp_path / "prep"
    m = prepare_movielens(DATA / "ml-latest-small", prep)
    part = prep / m["files"][0]["path"]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))

    def no_ray(cfg):
        raise AssertionError("Ray must not start")

    monkeypatch.setattr(session, "connect", no_ray)
    rc = main(["train", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--output", str(tmp_path / "o"),
               "--set", f"data.raw_dir={DATA / 'ml-latest-small'}", f"data.prepared_dir={prep}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"{part}: sha256 differs" in err[0], err


@pytest.mark.parametrize("lost", ["manifest.json", "histories/part-00000.parquet"])
def test_damaged_interactions_folder_is_not_remade_from_movielens(lost, tmp_path):
    """`gemray train` on a folder of `gemray prepare interactions` missing its manifest.json or a history file went
    the way of unprepared MovieLens data: re-prepared from data.raw_dir (ML ratings over the user's own logs) or
    advice to point data.raw_dir at a MovieLens download. It is refused naming `gemray prepare interactions`, with
    the folder left as it was."""
    from gemray.pipelines.interactions import prepare_interactions

    (tmp_path / "logs.csv").write_text("user_id,item_id,timestamp\n" + "".join(
        f"u{u},i{i},{u * 100 + i}\n" for u in range(1, 5) for i in range(1, 6)))
    prep = tmp_path / "prep"
    prepare_interactions(str(tmp_path / "logs.csv"), prep, num_files=1)
    (prep / lost).unlink()
    before = sorted(p.relative_to(prep) for p in prep.rglob("*"))
    cfg = JobConfig()
    cfg.data.prepared_dir = str(prep)
    for raw in (DATA / "ml-latest-small", tmp_path / "no-raw"):
        cfg.data.raw_dir = str(raw)
        with pytest.raises(FileNotFoundError) as e:
            run._ensure_prepared(cfg)
        assert "prepare it again (`gemray prepare interactions --src " in str(e.value), str(e.value)
        assert "MovieLens" not in str(e.value) and "prepare movielens" not in str(e.value), str(e.value)
        assert sorted(p.relative_to(prep) for p in prep.rglob("*")) == before


def test_preflight_checks_prepared_data_came_from_raw_dir(tmp_path):
    import hashlib

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "ratings.dat").write_bytes(b"1::2::5::978300760\n")
    (b / "ratings.dat").write_bytes(b"1::3::5::978300760\n")
    files = [{"name": "ratings.dat", "bytes": 19, "sha256": hashlib.sha256(b"1::2::5::978300760\n").hexdigest()}]
    cfg = JobConfig()
    cfg.data.raw_dir = str(b)
    with pytest.raises(ValueError, match="was prepared from .*/a, whose ratings.dat is not the one in data.raw_dir"):
        _preflight(cfg, _manifest(src=str(a), files=files), embedded=True)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "ratings.dat").write_bytes((a / "ratings.dat").read_bytes())
    cfg.data.raw_dir = str(copy)               # same bytes elsewhere: fine
    _preflight(cfg, _manifest(src=str(a), files=files), embedded=True)
    cfg.data.raw_dir = str(tmp_path / "missing")  # raw data not here (e.g. a GPU box with only Parquet): fine
    _preflight(cfg, _manifest(src=str(a), files=files), embedded=True)
    # data.raw_dir without the file it was prepared from (ML-100K's u.data; an ML-1M folder holds ratings.dat): the
    # message said "whose u.data is not the one in data.raw_dir", as if that folder had one; now what it holds
    ml100k = [{**files[0], "name": "u.data"}]
    cfg.data.raw_dir = str(b)
    with pytest.raises(ValueError, match=re.escape(f"was prepared from {a}'s u.data, which data.raw_dir {b} does not "
                                                   "hold (it holds ratings.dat): ")):
        _preflight(cfg, _manifest(src=str(a), files=ml100k), embedded=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg.data.raw_dir = str(empty)
    with pytest.raises(ValueError, match=re.escape(f"which data.raw_dir {empty} does not hold (it holds no MovieLens "
                                                   "ratings file: ratings.dat, u.data or ratings.csv): ")):
        _preflight(cfg, _manifest(src=str(a), files=files), embedded=True)
    # data of `gemray prepare interactions` / synthetic is never re-made from data.raw_dir: shipped without its raw
    # source beside an empty raw folder (the k8s layout) it was refused, with advice to let training prepare it
    for fmt in ("interactions", "amazon-ratings", "synthetic"):
        _preflight(cfg, {**_manifest(src=str(a), files=files), "format": fmt}, embedded=True)
    with pytest.raises(ValueError, match="does not hold"):  # a MovieLens release's still is
        _preflight(cfg, {**_manifest(src=str(a), files=files), "format": "ml-1m"}, embedded=True)


def test_nan_loss_fails_the_step_before_any_update():
    import torch

    from gemray.jagged import JaggedBatch
    from gemray.train.trainer import forward_backward_step as train_step

    class Diverged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, batch):
            return self.w.sum() * float("nan"), {"num_targets": torch.tensor(1.0)}

    model = Diverged()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    batch = JaggedBatch(user_ids=torch.arange(1), offsets=torch.tensor([0, 1]), item_ids=torch.tensor([1]),
                        ratings=torch.tensor([8]), timestamps=torch.tensor([5]))
    with pytest.raises(FloatingPointError, match="training loss is nan"):
        train_step(model, opt, batch, torch.device("cpu"))
    assert model.w.grad is None and float(model.w.detach()) == 1.0


def test_config_refuses_non_finite_numbers_and_empty_name():
    from gemray.config import apply_overrides

    for bad, field in (("train.lr=nan", "train.lr"), ("model.temperature=inf", "model.temperature"),
                       ("train.adam_betas=[0.9, nan]", "train.adam_betas")):
        with pytest.raises(ValueError, match=f"{field}: expected a finite number"):
            apply_overrides(JobConfig(), [bad]).validate()
    for bad, msg in (("ray.num_cpus=-1", "ray.num_cpus"), ("ray.max_failures=-5", "ray.max_failures"),
                     ("name=", "name: expected a non-empty")):
        with pytest.raises(ValueError, match=msg):
            apply_overrides(JobConfig(), [bad]).validate()


def test_worker_process_start_time_is_measured():
    """The ``startup`` event's process_to_train_fn_s needs the process start time (from /proc; the fallback
    would read 0): a child that sleeps 1.5 s after starting must see >= 1.4 s."""
    import subprocess
    import sys

    code = ("import time; from gemray.train.recorder import process_start_time as _process_start_time; time.sleep(1.5); "
            "print(time.time() - _process_start_time())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.4 <= age < 120


def test_comparison_table_rows():
    t = results.comparison_table({"hr@10": 0.33, "ndcg@10": 0.19, "hr@10_unfiltered": 0.26, "ndcg@10_unfiltered": 0.13,
                              "eval_exclude_history": True})
    lines = t.splitlines()
    assert lines[2].split() == ["this", "run", "0.3300", "0.1900"]
    assert lines[3].split() == ["this", "run", "(all", "items)", "0.2600", "0.1300"]
    assert "HSTU-large" in t and "0.3294" in t
    t = results.comparison_table({"hr@10": 0.2, "ndcg@10": 0.1, "eval_exclude_history": False})
    assert t.splitlines()[2].split()[:4] == ["this", "run", "(all", "items)"]
    assert "nan" not in results.comparison_table({"hr@50": 0.5}) and "eval_ks" in results.comparison_table({"hr@50": 0.5})


def test_comparison_table_prints_the_published_rows_for_ml1m_data_only():
    m = {"hr@10": 0.2, "ndcg@10": 0.1}
    assert "HSTU-large" in results.comparison_table(m, "ml-1m") and "HSTU-large" in results.comparison_table(m)
    t = results.comparison_table(m, "synthetic")
    assert "HSTU-large" not in t and "SASRec" not in t and "'synthetic'" in t and "0.2000" in t


def test_comparison_table_says_when_targets_are_in_the_history():
    """Targets in their user's history (synthetic data repeats items; 0 on MovieLens): the table says how many
    and what that caps the history-excluded HR@10 at, which it used to print with no word of targets_in_history."""
    m = {"hr@10": 0.05, "ndcg@10": 0.02, "hr@10_unfiltered": 0.6, "ndcg@10_unfiltered": 0.4,
         "targets_in_history": 181.0, "num_test_users": 200.0, "eval_exclude_history": True}
    last = results.comparison_table(m, "synthetic").splitlines()[-1]
    assert last == ('(targets_in_history: 181 of 200 test targets are in their user\'s input history; the "this run" '
                    'row excludes history items from the ranking and never finds them, so its HR@10 is at most '
                    '0.0950; the all-items row ranks them)'), last
    assert "targets_in_history" not in results.comparison_table({**m, "targets_in_history": 0.0}, "ml-1m")
    assert "targets_in_history" not in results.comparison_table({"hr@10": 0.2, "ndcg@10": 0.1}, "ml-1m")


def test_a_notice_after_the_last_vote_is_reported_and_marked_handled(tmp_path, caplog):
    """A preemption notice that arrives while the run finishes (after the final step's vote): a warning, and
    the notice marked handled with the final checkpoint (a `gemray preempt --wait` returns); none: nothing."""
    from gemray.preemption import read_notice, write_notice

    notice = tmp_path / "PREEMPT"
    results.late_notice(str(notice), {"history": [{"global_step": 20}]}, "/ckpt")
    assert not notice.exists()
    write_notice(notice, "test")
    with caplog.at_level(logging.WARNING, logger=results.log.name):
        results.late_notice(str(notice), {"history": [{"global_step": 10}, {"global_step": 20}]}, "/ckpt")
    assert "came after the last step's vote" in caplog.text
    handled = read_notice(notice)["handled"]
    assert handled["global_step"] == 20 and handled["checkpoint"] == "/ckpt" and handled["finished"] is True


def test_scaling_is_fixed_or_elastic():
    """A fixed group of ray.num_workers, or with min/max set, Ray Train V2's elastic (min, max) and the resize
    check interval; CPUs and GPU per worker from [ray] either way."""
    cfg = apply_overrides(JobConfig(), ["ray.num_workers=3", "ray.cpus_per_worker=1.5"])
    assert run.scaling(cfg) == {"num_workers": 3, "use_gpu": False, "resources_per_worker": {"CPU": 1.5}}
    cfg = apply_overrides(cfg, ["ray.min_workers=1", "ray.max_workers=4", "ray.resize_interval_s=7"])
    kw = run.scaling(cfg)
    assert kw["num_workers"] == (1, 4) and kw["elastic_resize_monitor_interval_s"] == 7
    for one in ("ray.min_workers=1", "ray.max_workers=4"):  # both bounds or none: one alone is refused (training
        with pytest.raises(ValueError, match="set both"):    # ignored it while k8s render used it)
            apply_overrides(JobConfig(), [one])


def test_ray_train_env_defers_to_the_environment_and_is_restored(monkeypatch):
    cfg = apply_overrides(JobConfig(), ["ray.health_check_interval_s=0.25", "ray.worker_start_timeout_s=9"])
    assert session.ray_train_env(cfg, {}) == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
                                              "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "9.0"}
    assert session.ray_train_env(cfg, {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "3"}) == {
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "9.0"}  # an explicit variable wins
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60")
    import os

    with pytest.raises(RuntimeError, match="inside"):
        with session.train_env(cfg) as env:
            assert env == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}
            assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.25"
            raise RuntimeError("inside")
    assert "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in os.environ
    assert os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "60"


def test_ray_session_shuts_down_only_the_cluster_it_started(fake_ray, monkeypatch):
    fake = fake_ray([])
    with session.ray_session(JobConfig()):
        assert fake.shutdowns == 0
    assert (fake.calls, fake.shutdowns) == (1, 1)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # already connected: left as it is
    with session.ray_session(JobConfig()):
        pass
    assert (fake.calls, fake.shutdowns) == (1, 1)


def test_final_metrics_from_the_last_report():
    """metrics.json of a finished run: the test_* metrics of train.eval_ks (others dropped), throughput and
    imbalance averaged over the epochs that report them, per-step events left out, recovery summarised."""
    cfg = apply_overrides(JobConfig(), ["train.eval_ks=[10, 50]", "ray.num_workers=2"])
    reported = {"test_hr@10": 0.3, "test_ndcg@10": 0.2, "test_hr@50": 0.6, "test_ndcg@50": 0.3, "test_hr@200": 0.9,
                "test_hr@10_unfiltered": 0.25, "test_targets_in_history": 4, "test_num_users": 610, "epoch": 2,
                "history": [{"epoch": 1, "samples_per_s": 100.0, "token_imbalance": 1.2},
                            {"epoch": 2, "samples_per_s": 300.0}]}
    events = [{"kind": "attempt_start", "t": 0.0, "attempt": 1, "detail": {"world_size": 2}},
              {"kind": "step", "t": 1.0, "attempt": 1, "detail": {"global_step": 1}},
              {"kind": "checkpoint_begin", "t": 1.0, "attempt": 1, "detail": {"global_step": 1}},
              {"kind": "finished", "t": 2.0, "attempt": 1, "detail": {}}]
    m = results.final_metrics(cfg, reported, events, wall_s=12.5, invocations=2)
    assert {k: m[k] for k in ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@10_unfiltered", "targets_in_history")} == {
        "hr@10": 0.3, "ndcg@10": 0.2, "hr@50": 0.6, "ndcg@50": 0.3, "hr@10_unfiltered": 0.25, "targets_in_history": 4}
    assert "hr@200" not in m and m["num_test_users"] == 610 and m["eval_exclude_history"] is True
    assert (m["samples_per_s"], m["bbs_imbalance"], m["epochs"], m["world_size"]) == (200.0, 1.2, 2, 2)
    assert (m["wall_s"], m["invocations"]) == (12.5, 2) and len(m["history"]) == 2
    assert [e["kind"] for e in m["events"]] == ["attempt_start", "finished"] and m["recovery"] == []
    assert "history" in reported  # the report is not changed


def test_run_record_continues_a_resumed_run_only(tmp_path):
    """The same job resumed in its output folder: events from the start, wall_s and invocations carried on;
    another job (or none) before: events from the end of the file as it is, one invocation."""
    cfg = JobConfig()
    cfg.train.events_path = str(tmp_path / "events.jsonl")
    (tmp_path / "events.jsonl").write_text(
        "".join(json.dumps({"kind": "step", "t": i, "attempt": 1, "detail": {}}) + "\n" for i in range(3)))
    assert results.run_record(cfg, tmp_path, None) == (3, 0.0, 1)
    other = JobConfig()
    other.name = "another-job"
    assert results.run_record(cfg, tmp_path, other) == (3, 0.0, 1)
    assert results.run_record(cfg, tmp_path, JobConfig()) == (0, 0.0, 1)  # killed before metrics.json
    (tmp_path / "metrics.json").write_text(json.dumps({"wall_s": 40.0, "invocations": 2}))
    assert results.run_record(cfg, tmp_path, JobConfig()) == (0, 40.0, 3)


def test_output_claimed_releases_the_folder_however_the_block_ends(tmp_path):
    from gemray.preemption import active_path

    notice = tmp_path / "out" / "PREEMPT"
    with pytest.raises(RuntimeError, match="boom"):
        with output_lock.output_claimed(notice) as claimed:
            assert claimed and active_path(notice).is_file()
            raise RuntimeError("boom")
    assert not active_path(notice).exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nobody here can write: mode 0555, and for root (who writes anywhere) also immutable
    (chattr +i); skips where neither applies (root without chattr support)."""
    import os
    import shutil
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    immutable = False
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        immutable = bool(chattr) and subprocess.run([chattr, "+i", str(ro)], capture_output=True).returncode == 0
        if not immutable:
            ro.chmod(0o755)
            pytest.skip("running as root without chattr +i: no folder is read-only for this process")
    yield ro
    if immutable:
        subprocess.run(["chattr", "-i", str(ro)], check=True)
    ro.chmod(0o755)


@pytest.mark.parametrize("sub", ["", "new"])
def test_train_into_a_read_only_output_exits_2_before_ray(tmp_path, read_only_dir, monkeypatch, capsys, sub):
    """issue 22: a `--output` that cannot be written (an existing read-only folder, or one whose parent is
    read-only): `gemray: error: --output ... is not writable`, exit 2, one line, before Ray starts (was: a
    warning naming the active marker, then "training failed: OSError", exit 1)."""
    from gemray.cli import main

    def no_ray(cfg):
        raise AssertionError("Ray must not start")

    monkeypatch.setattr(session, "connect", no_ray)
    out = read_only_dir / sub if sub else read_only_dir
    rc = main(["train", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--output", str(out), "--set",
               f"data.raw_dir={DATA / 'ml-latest-small'}", f"data.prepared_dir={tmp_path / 'prep'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"gemray: error: --output {out} is not writable"), err
    assert list(read_only_dir.iterdir()) == [] and not (tmp_path / "prep").exists()


def test_fit_probes_the_output_before_anything_starts(tmp_path, monkeypatch):
    """The probe's failure (any OSError creating a file there) is the ValueError, raised before the data is
    prepared or Ray is reached (runs as root too: the file system's refusal is simulated)."""
    import errno
    import tempfile

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    monkeypatch.setattr(session, "connect", lambda cfg: pytest.fail("Ray must not start"))
    cfg = apply_overrides(JobConfig(), [f"data.raw_dir={DATA / 'ml-latest-small'}",
                                        f"data.prepared_dir={tmp_path / 'prep'}"])
    with pytest.raises(ValueError, match=r"--output .* is not writable .*: Read-only file system"):
        run.fit(cfg, output_dir=tmp_path / "out")
    assert not (tmp_path / "prep").exists() and not (tmp_path / "out").exists()


def test_output_inside_the_prepared_data_is_refused_before_anything_is_written(tmp_path):
    data = tmp_path / "data" / "ml"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text("{}")
    for out in (data, data / "run"):
        with pytest.raises(ValueError, match=r"the prepared data folder .* \(data.prepared_dir\)"):
            preflight.preflight_output_outside_data(out, data)
    preflight.preflight_output_outside_data(tmp_path / "data" / "runs", data)  # beside it: fine
    preflight.preflight_output_outside_data(tmp_path, data)  # above it: fine (the data stays apart)
    cfg = apply_overrides(JobConfig(), [f"data.prepared_dir={data}"])
    with pytest.raises(ValueError, match=r"--output \(output_dir\) .* is the prepared data folder"):
        run.fit(cfg, output_dir=data)
    assert sorted(p.name for p in data.iterdir()) == ["manifest.json"]  # no run log, nothing else


def test_cpu_workers_beyond_the_machine_are_refused_on_an_embedded_cluster():
    many = apply_overrides(JobConfig(), ["ray.num_workers=1000"])
    with pytest.raises(ValueError, match=r"ray.num_workers=1000 CPU workers .* 2 usable core\(s\): at most 8"):
        preflight.preflight_resources(many, embedded=True, cores=2)
    preflight.preflight_resources(many, embedded=False, cores=2)  # an external cluster has its own machines
    elastic = apply_overrides(JobConfig(), ["ray.min_workers=1", "ray.max_workers=9"])
    with pytest.raises(ValueError, match=r"ray.max_workers=9 CPU workers"):
        preflight.preflight_resources(elastic, embedded=True, cores=2)
    # the slow elastic tests' 4 workers on the 2-core CI machine stay allowed
    preflight.preflight_resources(apply_overrides(JobConfig(), ["ray.min_workers=3", "ray.max_workers=4"]),
                                  embedded=True, cores=2)


def test_preflight_output_refuses_a_file_on_the_path(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        preflight.preflight_output(tmp_path / "f" / "out")
    preflight.preflight_output(tmp_path / "new" / "out")  # creatable: fine, nothing made
    assert not (tmp_path / "new").exists()


def _failing_connect(root: logging.Logger, seen: list[int]):
    """A stand-in for session.connect that records how many run-log handlers the root has, writes a line to
    stdout (as Ray forwards a worker's) and a DEBUG record, then fails as Ray would."""
    from gemray.controller.console import _RunLogHandler

    def connect(cfg):
        seen.append(sum(isinstance(h, _RunLogHandler) for h in root.handlers))
        print("a worker line on stdout")
        # a logger outside gemray's: cli.main of other commands (tests/test_cli.py) leaves gemray's level set
        logging.getLogger("driver.test").debug("a driver debug record")
        raise RuntimeError("no Ray here")
    return connect


def test_fit_from_python_writes_the_run_log_and_restores_logging(tmp_path, monkeypatch, capsys):
    """gemray.fit from Python writes <output>/logs/gemray.log as `gemray train` does (it wrote none): stdout
    lines and every driver record at DEBUG, while the console shows what it showed before; afterwards the root
    logger's handlers and level and sys.stdout / sys.stderr are as they were."""
    import sys

    root = logging.getLogger()
    before = (list(root.handlers), root.level, sys.stdout, sys.stderr)
    seen: list[int] = []
    monkeypatch.setattr(session, "connect", _failing_connect(root, seen))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="no Ray here"):
        run.fit(REPO / "configs" / "ml-latest-small.toml", output_dir=out,
                overrides=[f"data.raw_dir={DATA / 'ml-latest-small'}", f"data.prepared_dir={tmp_path / 'prep'}"])
    assert seen == [1]
    assert (list(root.handlers), root.level, sys.stdout, sys.stderr) == before
    text = (out / "logs" / "gemray.log").read_text()
    assert "a worker line on stdout" in text and "driver.test DEBUG a driver debug record" in text
    assert "gemray.controller.run INFO prepared data missing at" in text  # held until config.toml, then written
    assert "a worker line on stdout" in capsys.readouterr().out  # the console unchanged


def test_train_cli_and_fit_share_one_run_log(tmp_path, monkeypatch, capsys):
    """`gemray train` opens the run's log and fit, called inside, uses it: one handler, each line once."""
    from gemray.cli import main

    root = logging.getLogger()
    handlers = list(root.handlers)
    seen: list[int] = []
    monkeypatch.setattr(session, "connect", _failing_connect(root, seen))
    out = tmp_path / "out"
    rc = main(["train", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--output", str(out), "--set",
               f"data.raw_dir={DATA / 'ml-latest-small'}", f"data.prepared_dir={tmp_path / 'prep'}"])
    assert rc == 1 and "training failed: RuntimeError: no Ray here" in capsys.readouterr().err
    assert seen == [1] and root.handlers == handlers
    text = (out / "logs" / "gemray.log").read_text()
    assert text.count("a worker line on stdout") == 1 and text.count("a driver debug record") == 1


def test_fit_from_python_keeps_last_resort_warnings_on_stderr(tmp_path, monkeypatch, capsys):
    """With no logging configured (no root handler), Python prints warnings to stderr through its last-resort
    handler; the run log's handler must not silence them, nor show the INFO / DEBUG records it logs."""
    from gemray.controller.console import console_session

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", logging.WARNING)
    with console_session(tmp_path, keep_console=True):
        (tmp_path / "config.toml").write_text("")  # the run owns the folder: the log is written
        logging.getLogger("driver.x").warning("a warning")
        logging.getLogger("driver.x").info("an info record")
    assert root.handlers == [] and root.level == logging.WARNING
    assert capsys.readouterr().err == "a warning\n"
    assert (tmp_path / "logs" / "gemray.log").read_text().splitlines()[-1].endswith("driver.x INFO an info record")


@pytest.mark.parametrize("raw", ["missing", "empty"])
def test_no_data_names_both_paths_and_how_to_point_at_movielens(tmp_path, monkeypatch, capsys, raw):
    """No prepared data and no MovieLens ratings file in data.raw_dir (absent, or a folder without one): one line
    naming both paths and how to point gemray at the download (--set data.raw_dir=..., make demo's DATA_SRC; not
    GEMRAY_SHARED, which changes only ../shared/... paths), exit 2 before Ray starts; the empty folder used to give
    prepare's bare 'no MovieLens ratings file found', the absent one a line with no way out."""
    from gemray.cli import main

    src = tmp_path / "ml-latest-small"
    if raw == "empty":
        src.mkdir()
    monkeypatch.setattr(session, "connect", lambda cfg: pytest.fail("Ray must not start"))
    rc = main(["train", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--output", str(tmp_path / "o"),
               "--set", f"data.raw_dir={src}", f"data.prepared_dir={tmp_path / 'prep'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"gemray: error: no data to train on: data.prepared_dir {tmp_path / 'prep'} is not "
                             "prepared (no manifest.json")
    why = "holds no MovieLens ratings file (ratings.dat, u.data or ratings.csv)" if raw == "empty" else "does not exist"
    assert f"data.raw_dir {src} {why}" in err[0]
    assert "--set data.raw_dir=/path/to/ml-latest-small" in err[0]
    assert "GEMRAY_SHARED" not in err[0] and "DATA_SRC=/path/to/ml-1m" in err[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / "prep").exists()


@pytest.mark.parametrize("raw_dir", ["same", "other", "missing"])
def test_a_raw_movielens_folder_as_prepared_dir_gets_the_command_that_prepares_it(raw_dir, tmp_path, monkeypatch,
                                                                                  capsys):
    """data.prepared_dir naming a raw MovieLens folder (ratings.dat, no manifest): one line saying so, with the
    `gemray prepare movielens` command (into data/<name> under the working directory, never over the raw folder)
    and how to pass the result, exit 2 before anything is prepared or Ray starts; whatever data.raw_dir is. It used
    to start preparing data.raw_dir into that folder ("holds the source ...: choose another --out", naming an
    option the user never gave) or say "no data to train on" when data.raw_dir was missing."""
    import gemray.pipelines.movielens as movielens
    from gemray.cli import build_parser, main

    raw = tmp_path / "ml-1m"
    raw.mkdir()
    (raw / "ratings.dat").write_text("1::1193::5::978300760\n")
    other = tmp_path / "ml-100k"
    other.mkdir()
    (other / "u.data").write_text("1\t1\t5\t874965758\n")
    given = {"same": raw, "other": other, "missing": tmp_path / "nowhere"}[raw_dir]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(session, "connect", lambda cfg: pytest.fail("Ray must not start"))
    monkeypatch.setattr(movielens, "prepare_movielens", lambda *a, **k: pytest.fail("nothing must be prepared"))
    rc = main(["train", "--config", str(REPO / "configs" / "ml-1m.toml"), "--output", str(tmp_path / "o"),
               "--set", f"data.raw_dir={given}", f"data.prepared_dir={raw}"])
    err = capsys.readouterr().err.strip().splitlines()
    out = Path("data") / "ml-1m"
    assert rc == 2 and err == [
        f"gemray: error: data.prepared_dir {raw} holds raw MovieLens ratings (ratings.dat), not prepared data "
        f"(manifest.json and Parquet histories); prepare it into a folder of its own with `gemray prepare movielens "
        f"--src {raw} --out {out}` and pass --set data.prepared_dir={out} (or have it prepared on the way: --set "
        f"data.raw_dir={raw} data.prepared_dir={out})"], err
    assert sorted(p.name for p in raw.iterdir()) == ["ratings.dat"] and not (work / "data").exists()
    assert not (tmp_path / "o").exists()
    # the commands it gives are the CLI's own
    ns = build_parser().parse_args(["prepare", "movielens", "--src", str(raw), "--out", str(out)])
    assert (ns.func.__name__, ns.src, ns.out) == ("_cmd_prepare", str(raw), str(out))
    ns = build_parser().parse_args(["train", "--config", "c.toml", "--set", f"data.raw_dir={raw}",
                                    f"data.prepared_dir={out}"])
    assert ns.overrides == [f"data.raw_dir={raw}", f"data.prepared_dir={out}"]


@pytest.mark.parametrize("given", ["absolute", "shared"])
def test_a_misspelled_raw_dir_gets_the_close_folder_and_gemray_shared_only_for_shared_paths(given, tmp_path,
                                                                                             monkeypatch, capsys):
    """data.raw_dir misspelled (ml-1mm beside an ml-1m folder): the line says it does not exist and suggests the
    folder beside it with the close name; the GEMRAY_SHARED advice comes only for a ../shared/... value, the paths it
    changes (an absolute /work/shared/data/ml-1mm was told to set GEMRAY_SHARED, which would not change it)."""
    from gemray.cli import main

    shared = tmp_path / "shared"
    (shared / "data" / "ml-1m").mkdir(parents=True)
    (shared / "data" / "ml-100k").mkdir()
    monkeypatch.setenv("GEMRAY_SHARED", str(shared))
    monkeypatch.setattr(session, "connect", lambda cfg: pytest.fail("Ray must not start"))
    value = str(shared / "data" / "ml-1mm") if given == "absolute" else "../shared/data/ml-1mm"
    rc = main(["train", "--config", str(REPO / "configs" / "ml-1m.toml"), "--output", str(tmp_path / "o"),
               "--set", f"data.raw_dir={value}", f"data.prepared_dir={tmp_path / 'prep'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert (f"data.raw_dir {shared / 'data' / 'ml-1mm'} does not exist (did you mean {shared / 'data' / 'ml-1m'}?); "
            "point data.raw_dir at your MovieLens download: --set data.raw_dir=/path/to/ml-1m ") in err[0], err
    if given == "absolute":
        assert "GEMRAY_SHARED" not in err[0] and err[0].endswith("; make demo: DATA_SRC=/path/to/ml-1m)"), err
    else:
        assert err[0].endswith("or set GEMRAY_SHARED to the folder holding data/ml-1m for the configs' ../shared/... "
                               "paths (this config's data.raw_dir is '../shared/data/ml-1mm'; make demo: "
                               "DATA_SRC=/path/to/ml-1m)"), err


def test_shared_origin_follows_the_setting_not_its_first_value(tmp_path, monkeypatch):
    """shared_origin: the ../shared/... value a setting was configured as, with or without $GEMRAY_SHARED and after
    fit makes it absolute; None once the setting is given another path (an override, or set in Python)."""
    from gemray.config import load_config, shared_origin

    monkeypatch.chdir(tmp_path)
    for env in ("", str(tmp_path / "s")):
        monkeypatch.setenv("GEMRAY_SHARED", env)
        cfg = load_config(REPO / "configs" / "ml-1m.toml")
        assert shared_origin(cfg, "data.raw_dir") == "../shared/data/ml-1m"
        assert shared_origin(run._resolve(cfg), "data.raw_dir") == "../shared/data/ml-1m"
        assert shared_origin(cfg, "data.prepared_dir") is None
        assert shared_origin(load_config(REPO / "configs" / "ml-1m.toml", ["data.raw_dir=/d/ml-1m"]),
                             "data.raw_dir") is None
        cfg.data.raw_dir = "/d/ml-1m"
        assert shared_origin(cfg, "data.raw_dir") is None


def test_changed_settings_name_what_a_rerun_into_the_same_folder_changes():
    """A second `gemray train` into an output folder with other settings is told which (the warning fit logs
    before config.toml is rewritten); the paths the run fills in itself are not settings."""
    from gemray.config import JobConfig, apply_overrides
    from gemray.controller.run import changed_settings

    before = apply_overrides(JobConfig(), ["train.events_path=/o/events.jsonl", "checkpoint.preempt_notice=/o/n"])
    again = apply_overrides(JobConfig(), ["train.events_path=/p/events.jsonl"])
    assert changed_settings(before, again) == [] and changed_settings(None, again) == []
    other = apply_overrides(JobConfig(), ["train.max_steps_per_epoch=6", "model.table_dtype=fp16"])
    assert changed_settings(before, other) == ["model.table_dtype: 'fp32' -> 'fp16'",
                                               "train.max_steps_per_epoch: 0 -> 6"]


def test_recovery_line_without_a_resumed_step_says_so():
    """A preempted run resumed with nothing left to train has no first resumed step: the recovery line says that
    instead of "nan s" (a new user saw "0 step(s) lost, nan s from the last step ...")."""
    from gemray.controller.results import recovery_line

    r = {"kind": "preemption", "failed_attempt": 0, "attempt": 1, "world_size_before": 1, "world_size_after": 1,
         "steps_lost": 0, "seconds_to_first_step": None}
    assert recovery_line(r) == ("recovery (preemption): attempt 0 -> 1, world 1 -> 1, 0 step(s) lost, no step trained "
                                "by the resumed attempt")
    assert recovery_line(dict(r, kind="failure", steps_lost=3, seconds_to_first_step=12.34)) == (
        "recovery (failure): attempt 0 -> 1, world 1 -> 1, 3 step(s) lost, 12.3 s from the last step before the "
        "failure to the first resumed step")
    assert "nan" not in recovery_line(r)


# -- finished or preempted: the last attempt's own end decides, not the latest checkpoint's report ---------------
def _ev(kind: str, attempt: int, **detail) -> dict:
    return {"kind": kind, "t": float(attempt), "attempt": attempt, "detail": detail}


#: the emergency checkpoint's report (Trainer.maybe_checkpoint inside an epoch, 27 epochs done): what Ray's Result
#: carries while it is the latest checkpoint, also after an attempt that restored it had nothing to train
EMERGENCY = {"epoch": 28, "epochs_completed": 27, "global_step": 275, "checkpoint": "emergency", "preempted": True}
FINAL = {"epoch": 30, "global_step": 300, "final": True, "test_hr@10": 0.3, "history": [{"epoch": 30}]}


@pytest.mark.parametrize("reported, events, want", [
    # finished normally: the final report, the attempt's finished event
    (FINAL, [_ev("attempt_start", 1), _ev("step", 1), _ev("finished", 1)], "finished"),
    # preempted mid-run: the emergency report, the attempt's preempted event
    (EMERGENCY, [_ev("attempt_start", 1), _ev("step", 1), _ev("preempted", 1, global_step=275)], "preempted"),
    # resumed from the emergency checkpoint with train.epochs <= 27: nothing to train, the attempt finished, but
    # the Result still carries the emergency report (the bug: "preempted", exit 75, on every re-run)
    (EMERGENCY, [_ev("attempt_start", 1), _ev("preempted", 1, global_step=275), _ev("attempt_start", 2),
                 _ev("checkpoint_restored", 2), _ev("finished", 2, global_step=275)], "finished"),
    # resumed and trained to the end
    (FINAL, [_ev("attempt_start", 1), _ev("preempted", 1, global_step=275), _ev("attempt_start", 2),
             _ev("step", 2), _ev("finished", 2, global_step=300)], "finished"),
    # resumed and preempted again
    (dict(EMERGENCY, global_step=290), [_ev("attempt_start", 1), _ev("preempted", 1), _ev("attempt_start", 2),
                                        _ev("preempted", 2, global_step=290)], "preempted"),
    # an attempt that died (Ray restarted the group), then the new attempt preempted: the last attempt decides
    (EMERGENCY, [_ev("attempt_start", 1), _ev("step", 1), _ev("attempt_start", 2), _ev("preempted", 2)], "preempted"),
    # no event log (or the last attempt recorded no end): the report's flag, as before
    (EMERGENCY, [], "preempted"),
    (FINAL, [], "finished"),
])
def test_attempt_outcome_reads_the_last_attempts_end(reported, events, want):
    assert results.attempt_outcome(reported, events) == want


def test_final_metrics_of_an_emergency_report_count_the_epochs_done():
    """A run that ended on an emergency checkpoint with nothing to train: epochs is the count done (27), not the
    epoch the checkpoint stopped in (28); no test metrics, no preempted key (so the CLI exits 0)."""
    m = results.final_metrics(JobConfig(), EMERGENCY, [], wall_s=1.0, invocations=2)
    assert m["epochs"] == 27 and "preempted" not in m and "hr@10" not in m and m["history"] == []
    assert results.no_test_line(apply_overrides(JobConfig(), ["train.epochs=20"]), EMERGENCY) == (
        "nothing trained: the checkpoint restored (global step 275, 27 epoch(s) done) already has train.epochs=20 "
        "or more, and no final evaluation followed it, so there are no test metrics; raise train.epochs above 27 "
        "to train on from it")


class _FakeResult:
    def __init__(self, metrics, path="/ckpt/emergency"):
        self.metrics = metrics
        self.checkpoint = type("C", (), {"path": path})()


@pytest.mark.parametrize("last_end, rc", [("finished", 0), ("preempted", 75)])
def test_train_resumed_from_a_preemption_with_nothing_to_train_exits_0(tmp_path, monkeypatch, capsys, last_end, rc):
    """`gemray train` re-run into a preempted run's folder with train.epochs at most the epochs done: the attempt
    restores the emergency checkpoint, trains nothing and records finished, while Ray's Result still carries the
    emergency report. The driver exits 0 with the results it has (it printed "preempted" and exited 75 on every
    re-run, which a RayJob resubmits forever); an attempt that did stop again still exits 75. Ray is stubbed: the
    stand-in for run._train writes the attempt's events and returns the Result."""
    from gemray.cli import main

    out = tmp_path / "out"

    def train(cfg, storage):
        with open(cfg.train.events_path, "a") as f:
            for e in (_ev("attempt_start", 1), _ev("preempted", 1, global_step=275, notice={"reason": "Ctrl-C"}),
                      _ev("attempt_start", 2), _ev(last_end, 2, global_step=275, notice={"reason": "again"})):
                f.write(json.dumps(e) + "\n")
        return _FakeResult(EMERGENCY)

    monkeypatch.setattr(run, "_train", train)
    assert main(["train", "--config", str(REPO / "configs" / "ml-latest-small.toml"), "--output", str(out), "--set",
                 f"data.raw_dir={DATA / 'ml-latest-small'}", f"data.prepared_dir={tmp_path / 'prep'}",
                 "train.epochs=20"]) == rc
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    if rc == 0:
        assert "nothing trained: the checkpoint restored (global step 275, 27 epoch(s) done)" in printed
        assert "re-run the same command" not in printed and "preempted" not in metrics
        assert metrics["epochs"] == 27 and metrics["invocations"] == 1
    else:
        assert "re-run the same command to resume from step 275" in printed and metrics["preempted"]


def test_a_file_as_prepared_dir_is_refused_before_preparing_is_announced(tmp_path, monkeypatch, capsys, caplog):
    """data.prepared_dir naming a file with data.raw_dir set (a mistyped path): one line naming the option, exit 2,
    nothing logged about preparing into it first (was: "prepared data missing at README.md: preparing it from ..."
    then the refusal), the file untouched, Ray not started."""
    import logging

    import gemray.pipelines.movielens as movielens
    from gemray.cli import main

    raw = tmp_path / "ml-1m"
    raw.mkdir()
    (raw / "ratings.dat").write_text("1::1193::5::978300760\n")
    f = tmp_path / "README.md"
    f.write_text("not data")
    monkeypatch.setattr(session, "connect", lambda cfg: pytest.fail("Ray must not start"))
    monkeypatch.setattr(movielens, "prepare_movielens", lambda *a, **k: pytest.fail("nothing must be prepared"))
    caplog.set_level(logging.INFO)
    rc = main(["train", "--config", str(REPO / "configs" / "ml-1m.toml"), "--output", str(tmp_path / "o"),
               "--set", f"data.raw_dir={raw}", f"data.prepared_dir={f}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"gemray: error: data.prepared_dir {f}: exists and is not a folder; refusing to "
                               "replace it"], err
    assert not [r for r in caplog.records if "preparing it from" in r.getMessage()]
    assert f.read_text() == "not data" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("sets, cores, want", [
    (["ray.num_workers=8", "ray.cpus_per_worker=1"], 2,
     "ray.num_workers=8 x ray.cpus_per_worker=1 = 8 CPUs of training workers on this machine's 2 cores: their steps "
     "share the cores, each about 4.0x slower; ray.num_workers=2 fits here, or give ray.address a cluster"),
    (["ray.num_workers=2", "ray.cpus_per_worker=1"], 2, None),  # the demo's: fits
    (["ray.num_workers=8", "ray.cpus_per_worker=1", "ray.use_gpu=true"], 2, None),  # the step is the GPU's
    (["ray.num_workers=8", "ray.cpus_per_worker=1", "ray.address=10.0.0.1:6379"], 2, None),  # a cluster's cores
    (["ray.num_workers=1", "ray.cpus_per_worker=4"], 2,
     "ray.num_workers=1 x ray.cpus_per_worker=4 = 4 CPUs of training workers on this machine's 2 cores: their steps "
     "share the cores, each about 2.0x slower; ray.num_workers=1 fits here, or give ray.address a cluster"),
])
def test_more_cpu_workers_than_cores_is_warned(sets, cores, want, monkeypatch):
    """A new user's 8 CPU workers on a 2-core machine trained several times slower with no word (the embedded
    cluster advertises CPUs the machine does not have); now the driver warns, naming a worker count that fits."""
    from gemray.config import JobConfig, apply_overrides
    from gemray.controller.session import oversubscription_warning

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert oversubscription_warning(apply_overrides(JobConfig(), sets), cores) == want
