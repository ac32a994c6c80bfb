"""End to end on Ray Train: 2 workers on ml-latest-small (a few steps per epoch), then a resume.

``gemray.fit`` starts an embedded Ray cluster, prepares the data into tmp, trains 2 epochs with 2
TorchRec-sharded workers, writes metrics.json / curves.png / config.toml and commits DCP checkpoints.
Re-running the same job (same output folder and name) with more epochs resumes from the latest committed
checkpoint and continues at the next epoch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paths import DATA

from gemray.checkpoint import verify_checkpoint
from gemray.config import load_config

REPO = Path(__file__).resolve().parents[1]
SRC = DATA / "ml-latest-small"  # $GEMRAY_SHARED or ../shared beside the checkout (tests/paths.py)
KEYS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200")


def _overrides(tmp: Path, epochs: int) -> list[str]:
    return [f"data.raw_dir={SRC}", f"data.prepared_dir={tmp / 'prepared'}", f"train.epochs={epochs}",
            "train.max_steps_per_epoch=3", "train.eval_every=1", "train.log_every=1",
            "ray.max_failures=0", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    if not SRC.is_dir():
        pytest.skip(f"{SRC} not available")
    import gemray

    tmp = tmp_path_factory.mktemp("fit")
    res = gemray.fit(REPO / "configs" / "ml-latest-small.toml", output_dir=tmp / "out",
                     overrides=_overrides(tmp, 2))
    return tmp, res


def test_two_worker_run_outputs(first_run):
    tmp, res = first_run
    out = Path(res.output_dir)
    assert out == (tmp / "out").resolve()
    m = json.loads((out / "metrics.json").read_text())
    assert m == json.loads(json.dumps(res.metrics))
    for k in KEYS:
        assert 0.0 <= m[k] <= 1.0, (k, m[k])
    assert m["hr@10"] <= m["hr@50"] <= m["hr@200"]
    # published protocol: history items are not ranked; MovieLens never repeats a (user, item) pair, so no
    # target is in its history and removing seen items can only lift a target's rank
    assert m["eval_exclude_history"] is True and m["targets_in_history"] == 0
    for k in KEYS:
        assert m[k] >= m[f"{k}_unfiltered"], (k, m[k], m[f"{k}_unfiltered"])
    assert m["ndcg@200"] > m["ndcg@200_unfiltered"]  # seen items above a top-200 target: it moves up
    assert m["num_test_users"] == 610  # every ml-latest-small user has >= 3 ratings
    assert m["epochs"] == 2 and m["world_size"] == 2
    assert m["samples_per_s"] > 0 and m["wall_s"] > 0
    assert 1.0 <= m["bbs_imbalance"] < 2.0
    assert [h["epoch"] for h in m["history"]] == [1, 2]
    for h in m["history"]:
        assert h["train_loss"] > 0 and 0.0 <= h["valid_hr@10"] <= 1.0
        assert h["global_step"] == 3 * h["epoch"]
    assert m["history"][1]["train_loss"] < m["history"][0]["train_loss"]
    # events number epochs as the log lines do ("epoch 2 done"), with the completed count beside
    saved = [e["detail"] for e in m["events"] if e["kind"] == "checkpoint_saved"]
    assert [(s["epoch"], s["epochs_completed"], s["reason"]) for s in saved] == [(1, 1, "epoch"), (2, 2, "final")]
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    cfg = load_config(out / "config.toml")
    assert cfg.train.epochs == 2 and Path(cfg.data.prepared_dir).is_absolute()


def test_checkpoint_committed(first_run):
    _, res = first_run
    assert res.checkpoint_path is not None
    ckpt = Path(res.checkpoint_path)
    info = verify_checkpoint(ckpt)
    assert info["world_size"] == 2
    assert ".metadata" in info["files"]
    for r in (0, 1):  # each rank's data files: one per write item (__<rank>_<item>_0.distcp)
        assert len([n for n in info["files"] if n.startswith(f"__{r}_") and n.endswith(".distcp")]) > 2, info
    # one checkpoint per epoch, both kept (checkpoint.keep=3)
    assert len([p for p in ckpt.parent.glob("checkpoint_*") if p.is_dir()]) == 2
    # every rank's manifest names the data the model was trained on (checked before a resume)
    from gemray.checkpoint import checkpoint_data

    data = checkpoint_data(ckpt)
    assert data["item_table_rows"] == data["record"]["num_items"] + 1 == 9724 + 1
    assert data["record"]["format"] == "ml-latest-small" and data["record"]["prepared_dir"].endswith("prepared")
    for r in (0, 1):
        assert json.loads((ckpt / f"manifest_rank{r}.json").read_text())["data"] == data["record"]


def test_resume_continues_at_next_epoch(first_run):
    tmp, res1 = first_run
    import gemray

    res2 = gemray.fit(REPO / "configs" / "ml-latest-small.toml", output_dir=tmp / "out",
                      overrides=_overrides(tmp, 3))
    hist = res2.metrics["history"]
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    # epochs 1-2 come from the restored checkpoint, unchanged; only epoch 3 was trained now
    for old, new in zip(res1.metrics["history"], hist[:2]):
        diff = {k: (old.get(k), new.get(k)) for k in set(old) | set(new) if old.get(k) != new.get(k)}
        assert not diff, diff
    assert hist[2]["global_step"] == 9
    assert res2.checkpoint_path != res1.checkpoint_path
    assert verify_checkpoint(res2.checkpoint_path)["world_size"] == 2
    # the resumed run keeps the first invocation's record: its events, and its wall time added
    m1, m2 = res1.metrics, res2.metrics
    assert m1["invocations"] == 1 and m2["invocations"] == 2
    assert m2["wall_s"] > m1["wall_s"]
    attempts = [e["attempt"] for e in m2["events"] if e["kind"] == "attempt_start"]
    assert len(attempts) == 2 and len(set(attempts)) == 2
    assert [e["kind"] for e in m2["events"]].count("finished") == 2
    restored = next(e["detail"] for e in m2["events"] if e["kind"] == "checkpoint_restored")
    assert (restored["epoch"], restored["epochs_completed"]) == (3, 2)  # "resuming at epoch 3"
    assert m2["recovery"] == []  # a planned resume after a finished run is not a failure recovery


def test_resume_on_another_dataset_is_refused_before_ray(first_run):
    """The same job and output folder with ml-100k's data: refused up front (it used to start the workers,
    fail to load the 9725-row item table into a 1683-row one and retry ray.max_failures times), and since
    preflight_resume_source before ml-100k is prepared: its ratings file is not the one the checkpoint records."""
    tmp, _ = first_run
    import time

    import gemray

    out = (tmp / "out").resolve()
    before = (out / "config.toml").read_text()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"output folder {out} holds checkpoint {out}/ray/.*checkpoint_.* of other "
                                         r"data: data.raw_dir .*ml-100k is other data \(.*\), found before preparing "
                                         r"it .*new --output"):
        gemray.fit(REPO / "configs" / "ml-latest-small.toml", output_dir=tmp / "out",
                   overrides=[f"data.raw_dir={SRC.parent / 'ml-100k'}", f"data.prepared_dir={tmp / 'ml-100k'}",
                              "train.epochs=4"])
    assert time.perf_counter() - t0 < 60  # no Ray
    assert not (tmp / "ml-100k").exists()  # refused before ml-100k was prepared
    assert (out / "config.toml").read_text() == before
