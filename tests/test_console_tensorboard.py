"""The quiet console of ``gemray train`` (gemray.controller.console), its full log in the run folder, the
per-epoch progress line, and the TensorBoard scalars (gemray.controller.tensorboard) read back against
metrics.json."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from paths import DATA

from gemray.controller.console import FilteredStream, RunLog, keep_line
from gemray.controller.tensorboard import log_mlflow, scalars
from gemray.train.stats import epoch_summary, progress_line

REPO = Path(__file__).resolve().parents[1]
SMALL = DATA / "ml-latest-small"
C = "\x1b[36m"  # Ray's colour of a worker prefix
R = "\x1b[0m"


@pytest.mark.parametrize("line, shown", [
    (f"{C}(RayTrainWorker pid=21606){R} 04:07:52 gemray.train INFO rank 0/2 on cpu (gloo)", True),
    (f"{C}(RayTrainWorker pid=21606){R} Successfully loaded: 'fbgemm_gpu_py.so'", False),
    (f"{C}(RayTrainWorker pid=21606){R} GreedyPerfPartitioner - sort_by: SortBy.STORAGE", False),
    (f"{C}(PlacementGroupCleaner pid=21492){R} Found multiple active Ray instances: {{'a', 'b'}}.", False),
    (f"{C}(PlacementGroupCleaner pid=21492){R} Failed to query Ray Train Controller actor state.", False),
    ("(pid=123, ip=10.0.0.2) 04:07:52 gemray.events WARNING event failure_detected: {}", True),
    ("(raylet) [2026-12-02 04:07:52,480 E 21015] core_worker.cc:2465: Actor died", False),
    ("2026-12-02 04:06:45,420\tINFO worker.py:2038 -- Started a local Ray instance.", False),
    ("2026-12-02 04:06:22,714\tWARNING authentication_token_setup.py:85 -- Token authentication", True),
    ("model                    HR@10  NDCG@10", True),  # the driver's own prints
    ("04:06:49 gemray.controller.session INFO started an embedded Ray cluster", True),
])
def test_keep_line(line, shown):
    assert keep_line(line) is shown
    assert keep_line(line, verbose=True)


def test_keep_line_follows_the_level():
    line = "(RayTrainWorker pid=1) 04:07:52 gemray.train INFO epoch 1 step 2/5"
    assert not keep_line(line, level=logging.WARNING)
    assert keep_line(line.replace(" INFO ", " WARNING "), level=logging.WARNING)


def test_filtered_stream_logs_every_line_and_holds_them_until_the_folder_exists(tmp_path):
    term = io.StringIO()
    out = tmp_path / "run"
    log = RunLog(out, term)
    s = FilteredStream(term, log, level=logging.INFO, verbose=False)
    s.write(f"{C}(RayTrainWorker pid=1){R} Successfully loaded: 'x.so'\n(RayTrainWorker pid=1) 04:07:52 ")
    s.write("gemray.train INFO hello\n")
    assert not (out / "logs").exists()  # before fit owns the output folder: held in memory
    out.mkdir()
    s.write("still held\n")
    assert not (out / "logs").exists()
    (out / "config.toml").write_text("")  # fit's mark that the run owns the folder
    s.write("driver line\n")
    log.close()
    assert term.getvalue() == "(RayTrainWorker pid=1) 04:07:52 gemray.train INFO hello\nstill held\ndriver line\n"
    assert (out / "logs" / "gemray.log").read_text().splitlines() == [
        "(RayTrainWorker pid=1) Successfully loaded: 'x.so'", "(RayTrainWorker pid=1) 04:07:52 gemray.train INFO hello",
        "still held", "driver line"]


def test_progress_line():
    line = progress_line(2, 30, 120, 150, 5.0, 800.4, 30000.0, done=10, elapsed_s=20.0)
    assert line == ("epoch 2 step 30/120 (global 150) loss 5.0000, 800 samples/s, 30000 tokens/s (rank 0), "
                    "ETA 0:03:00")  # 90 steps left at 2 s per step
    assert progress_line(1, 0, 5, 0, 1.0, 0, 0, done=0, elapsed_s=0).endswith("ETA ?")
    # the base dense learning rate (train.lr x the warm-up factor) after the loss, when the trainer passes it
    assert progress_line(2, 30, 120, 150, 5.0, 800.4, 30000.0, done=10, elapsed_s=20.0, lr=2.5e-4) == (
        "epoch 2 step 30/120 (global 150) loss 5.0000, lr 2.50e-04, 800 samples/s, 30000 tokens/s (rank 0), "
        "ETA 0:03:00")


def test_epoch_summary_is_short_and_keeps_the_figures():
    """The console's per-epoch line: no None fields or bookkeeping (was: every field of the record, e.g.
    `local_mfu=None, mfu_flops=7.132e+11, peak_flops=None`, and the unfiltered twins of each figure)."""
    rec = {"epoch": 5, "global_step": 120, "train_loss": 3.0371, "samples_per_s": 59.95, "tokens_per_s": 6473.2,
           "token_imbalance": 1.03, "train_s": 100.7, "model_tflops_per_s": 0.007079, "local_mfu": None,
           "mfu_flops": 7.132e11, "mfu_rank_s": 201.5, "peak_flops": None, "valid_hr@10": 0.18891,
           "valid_ndcg@10": 0.10154, "valid_hr@10_unfiltered": 0.1412, "valid_targets_in_history": 0,
           "epoch_s": 157.64}
    assert epoch_summary(10, rec) == (
        "epoch 5/10 done in 157.6 s (global step 120): train loss 3.037, 59.95 samples/s, 6473 tokens/s, "
        "token imbalance 1.030, 0.00708 TFLOP/s; valid hr@10 0.1889, ndcg@10 0.1015")
    assert epoch_summary(3, {"epoch": 1, "global_step": 4, "train_loss": 2.0, "local_mfu": 0.4012}) == (
        "epoch 1/3 done (global step 4): train loss 2, MFU 40.12%")


def test_epoch_summary_writes_each_ranking_task_as_the_test_line():
    """The per-epoch validation figures of a ranking task: NE, AUC +/- its bound, calibration, ... as
    ranking_summary writes them for the test line and gemray evaluate (was: raw pairs, `ctr_num_examples 254.0000,
    ctr_logloss 0.5452, ..., ctr_auc_error_bound 0.0001`)."""
    from gemray.train.evaluation import ranking_summary

    valid = {"hr@10": 0.1187, "ndcg@10": 0.0711, "ctr_num_examples": 254.0, "ctr_logloss": 0.5452,
             "ctr_base_rate": 0.2362, "ctr_calibration": 0.8906, "ctr_ne": 0.9974, "ctr_auc": 0.5364,
             "ctr_auc_error_bound": 0.0001, "cvr_ne": 1.0141, "cvr_auc": 0.5106}
    rec = {"epoch": 1, "global_step": 10, "train_loss": 6.164, **{f"valid_{k}": v for k, v in valid.items()}}
    ctr, cvr = ranking_summary(valid)
    assert ctr == ("ctr: NE 0.9974, AUC 0.5364 +/- 0.0001, calibration 0.8906, log loss 0.5452, base rate 0.2362, "
                   "254 examples")
    assert epoch_summary(1, rec) == (f"epoch 1/1 done (global step 10): train loss 6.164; valid hr@10 0.1187, "
                                     f"ndcg@10 0.0711; {ctr}; {cvr}")
    ranking_only = {"epoch": 1, "global_step": 10, "train_loss": 2.0, "valid_ctr_ne": 0.5, "valid_ctr_auc": 0.6}
    assert epoch_summary(1, ranking_only) == ("epoch 1/1 done (global step 10): train loss 2; valid ctr: NE 0.5000, "
                                              "AUC 0.6000")


def test_test_line_writes_each_ranking_task_as_evaluate_prints_it():
    """gemray train's test line (gemray.train.evaluation.split_summary): the retrieval figures as key=value, then
    per ranking task NE, AUC +/- its bound, calibration, ... -- ranking_summary's lines, which gemray evaluate
    prints under its table (one formatter for both)."""
    from gemray.train.evaluation import ranking_summary, split_summary

    test = {"hr@10": 0.3, "num_users": 32.0, "ctr_ne": 0.93, "ctr_auc": 0.61, "ctr_auc_error_bound": 0.004,
            "ctr_logloss": 0.52, "ctr_base_rate": 0.2, "ctr_calibration": 1.07, "ctr_num_examples": 640.0,
            "cvr_ne": 0.71, "cvr_auc": float("nan"), "cvr_auc_error_bound": float("nan")}
    ctr = "ctr: NE 0.9300, AUC 0.6100 +/- 0.0040, calibration 1.0700, log loss 0.5200, base rate 0.2000, 640 examples"
    assert ranking_summary(test) == [ctr, "cvr: NE 0.7100, AUC nan +/- nan"]
    assert split_summary("test", test) == (f"test: hr@10=0.3000, num_users=32.0000; {ctr}; "
                                           "cvr: NE 0.7100, AUC nan +/- nan")
    assert split_summary("test", {"ctr_ne": 0.5, "ctr_auc": 0.6}) == "test: ctr: NE 0.5000, AUC 0.6000"  # ranking only
    assert split_summary("test", {"hr@10": 0.25}) == "test: hr@10=0.2500" and ranking_summary({"hr@10": 0.25}) == []


def test_scalars_and_mlflow(monkeypatch):
    metrics = {"history": [{"epoch": 1, "global_step": 5, "train_loss": 7.5, "valid_hr@10": 0.1, "final": True},
                           {"epoch": 2, "global_step": 10, "train_loss": 7.0, "samples_per_s": 99.0}],
               "hr@10": 0.2, "ndcg@10_unfiltered": 0.05, "epochs": 2, "wall_s": 12.0, "samples_per_s": 99.0,
               "bbs": True, "world_size": 2, "test_ctr_ne": 0.9, "test_ctr_auc": float("nan"),
               "test_cvr_calibration": 1.1, "num_test_users": 7}
    events = [{"kind": "step", "detail": {"global_step": 1, "loss": 8.0, "lr": 5e-4}},
              {"kind": "step", "detail": {"global_step": 2}},  # an older run's heartbeat: no loss, no lr
              {"kind": "step", "detail": {"global_step": 1, "loss": 7.9, "lr": 4e-4}},  # a restart repeats step 1
              {"kind": "step", "detail": {"global_step": 3, "loss": 7.8, "lr": 1e-3}},
              {"kind": "resize", "detail": {"global_step": 1, "loss": 0.0, "lr": 1.0}}]
    pts = scalars(metrics, events)
    assert pts == [("step/train_loss", 7.9, 1), ("step/train_loss", 7.8, 3), ("step/lr", 4e-4, 1),
                   ("step/lr", 1e-3, 3), ("epoch/train_loss", 7.5, 1), ("epoch/valid_hr@10", 0.1, 1),
                   ("epoch/samples_per_s", 99.0, 2), ("epoch/train_loss", 7.0, 2), ("test/ctr_ne", 0.9, 2),
                   ("test/cvr_calibration", 1.1, 2), ("test/hr@10", 0.2, 2), ("test/ndcg@10_unfiltered", 0.05, 2),
                   ("run/samples_per_s", 99.0, 2), ("run/wall_s", 12.0, 2)]  # a NaN (no positives) left out
    logged = []
    fake = types.SimpleNamespace(start_run=lambda run_name: open(__file__),  # any context manager
                                 log_metric=lambda k, v, step: logged.append((k, v, step)))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    assert not log_mlflow("job", pts, environ={})
    assert log_mlflow("job", pts, environ={"GEMRAY_MLFLOW": "1"})
    assert ("epoch/valid_hr_at_10", 0.1, 1) in logged and len(logged) == len(pts)


def test_ranking_test_metrics_reach_tensorboard(tmp_path):
    """A gem-tiny run's metrics.json (gemray.controller.results.final_metrics of a last report with retrieval and
    ranking-task test metrics) exported as event files: every numeric test metric reads back under test/, the
    ranking tasks' as test/<task>_<metric> (was: test/hr@K and test/ndcg@K only), at x = the last epoch."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gemray.config import load_config
    from gemray.controller import results, tensorboard

    cfg = load_config(REPO / "configs" / "gem-tiny.toml", overrides=["train.eval_ks=[10]"])
    assert set(cfg.model.ranking_tasks) == {"ctr", "cvr"}
    ranking = {f"test_{t}_{m}": v for t in ("ctr", "cvr") for m, v in
               (("ne", 0.93 if t == "ctr" else 0.71), ("auc", 0.61), ("auc_error_bound", 0.004), ("logloss", 0.52),
                ("base_rate", 0.2), ("calibration", 1.07), ("num_examples", 640.0))}
    reported = {"test_hr@10": 0.3, "test_ndcg@10": 0.2, "test_num_users": 32, "epoch": 2, **ranking,
                "history": [{"epoch": 1, "train_loss": 3.0, "valid_ctr_ne": 0.95},
                            {"epoch": 2, "train_loss": 2.5, "valid_ctr_ne": 0.94}]}
    metrics = results.final_metrics(cfg, reported, [], wall_s=1.0, invocations=1)
    assert metrics["test_ctr_ne"] == 0.93  # metrics.json keeps the reported names
    tensorboard.export(cfg.name, tmp_path, metrics, [])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    for k, v in ranking.items():
        assert got[f"test/{k[len('test_'):]}"] == [(2, pytest.approx(v, rel=1e-6))], k
    assert got["test/ctr_ne"] == [(2, pytest.approx(0.93))] and got["test/cvr_ne"] == [(2, pytest.approx(0.71))]
    assert got["test/hr@10"] == [(2, pytest.approx(0.3))] and got["test/ndcg@10"] == [(2, pytest.approx(0.2))]
    assert got["epoch/valid_ctr_ne"] == [(1, pytest.approx(0.95)), (2, pytest.approx(0.94))]
    assert not any(t.startswith("test/test_") for t in got)


@pytest.mark.slow  # a real `gemray train` (~1 min): make test-slow; make test: the filter, progress and summary tests above
def test_train_console_log_and_tensorboard(tmp_path):
    """A tiny `gemray train` (2 workers, 1 epoch of 6 steps): the console is gemray's own lines plus at most a few
    others, with progress lines "step N/M ... ETA"; the full log in <output>/logs/gemray.log has the rest; the
    TensorBoard scalars read back equal metrics.json (and the step losses of events.jsonl)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not (SMALL / "ratings.csv").is_file():
        pytest.skip(f"needs {SMALL}")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gemray.cli", "train", "--config", str(REPO / "configs" / "ml-latest-small.toml"),
           "--set", "train.epochs=1", "train.max_steps_per_epoch=6", "train.log_every=2", "train.eval_ks=[10]",
           "train.compile_dynamic=all",  # compile is off: one "has no effect" warning, on the console and in the log
           f"data.raw_dir={SMALL}", f"data.prepared_dir={tmp_path / 'data'}", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", x) for x in console]
    ours = re.compile(r"^(\(\S+ pid=\d+\) )?\d\d:\d\d:\d\d gemray[.\w]* [A-Z]+ ")
    own_prints = ("model ", "---", "this run", "SASRec", "HSTU", "(published rows", "outputs: ", "prepared ")
    others = [x for x in plain if not ours.match(x) and not x.startswith(own_prints)]
    assert len(others) <= 3, others
    progress = [x for x in plain if re.search(r"gemray\.train INFO epoch 1 step \d+/\d+ .* ETA \d+:\d\d:\d\d$", x)]
    assert progress and progress[-1].split("step ")[1].split(" ")[0] in ("5/5", "6/6"), progress
    log = out / "logs" / "gemray.log"
    lines = log.read_text().splitlines()
    assert len(lines) > len(console) + 20
    assert any("Successfully loaded" in x or "GreedyPerfPartitioner" in x for x in lines)  # the workers' chatter
    idle = "gemray.config WARNING train.compile_dynamic = \"all\" has no effect without train.compile = true"
    assert sum(idle in x for x in plain) == 1 and sum(idle in x for x in lines) == 1

    metrics = json.loads((out / "metrics.json").read_text())
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    got = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    h = metrics["history"][0]
    for k in ("train_loss", "samples_per_s", "tokens_per_s", "valid_hr@10", "valid_ndcg@10"):
        assert got[f"epoch/{k}"] == [(1, pytest.approx(h[k], rel=1e-6))], k
    for k in ("hr@10", "ndcg@10"):
        assert got[f"test/{k}"] == [(1, pytest.approx(metrics[k], rel=1e-6))], k
    assert got["run/samples_per_s"] == [(1, pytest.approx(metrics["samples_per_s"], rel=1e-6))]
    steps = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    losses = {e["detail"]["global_step"]: e["detail"]["loss"] for e in steps if e["kind"] == "step"}
    assert sorted(losses) == list(range(1, h["global_step"] + 1))
    assert got["step/train_loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in sorted(losses.items())]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_become_a_bar_on_a_terminal(tmp_path):
    from gemray.controller.console import ProgressBar, parse_progress

    line = "(RayTrainWorker pid=1) 04:22:50 gemray.train INFO " + progress_line(1, 2, 4, 2, 7.5, 190, 8070, done=2,
                                                                               elapsed_s=1.0)
    assert parse_progress(line) == (1, 2, 4, "loss 7.5000, 190 samples/s, ETA 0:00:01")
    with_lr = line.replace("loss 7.5000, ", "loss 7.5000, lr 2.50e-04, ")  # the trainer's lines carry the lr
    assert parse_progress(with_lr) == (1, 2, 4, "loss 7.5000, lr 2.50e-04, 190 samples/s, ETA 0:00:01")
    assert parse_progress("(RayTrainWorker pid=1) 04:22:50 gemray.train INFO epoch 1 done: epoch=1") is None
    term = _Tty()
    s = FilteredStream(term, RunLog(tmp_path, term), level=logging.INFO, verbose=False, bar=ProgressBar(term))
    s.write(line + "\n")
    s.write("(RayTrainWorker pid=1) 04:22:51 gemray.train INFO epoch 1 done: epoch=1\n")
    s.write(line.replace("step 2/4", "step 4/4") + "\n")
    shown = term.getvalue()
    assert "epoch 1:" in shown and "4/4" in shown and "loss 7.5000, 190 samples/s, ETA 0:00:01" in shown  # tqdm's bar
    assert "step 2/4" not in shown and "epoch 1 done: epoch=1\n" in shown
    assert s.bar.bar is None  # closed at the epoch's last step


def test_readme_lists_the_console_lines_of_a_checkpoint_save():
    """README "Logs and TensorBoard" lists the console lines of a run; those of a checkpoint save were missing:
    rank 0's `checkpoint save:` line (gemray.checkpoint) and the `checkpoint_saved` event (gemray.events). Its
    example lines are lines the console shows (keep_line), and the save line is what save_summary prints for the
    figures of the event beside it, as the event's own save_summary."""
    from gemray.checkpoint import save_summary

    section = (REPO / "README.md").read_text().split("## Logs and TensorBoard\n", 1)[1].split("\n## ", 1)[0]
    prose, block = section.split("```\n", 2)[:2]
    assert "`checkpoint_saved` event" in " ".join(prose.split())
    lines = block.strip().splitlines()
    assert lines and all(keep_line(ln) for ln in lines), lines
    save = [ln for ln in lines if " gemray.checkpoint INFO rank 0/" in ln and " checkpoint save: " in ln]
    event = [ln for ln in lines if " gemray.events INFO event checkpoint_saved: " in ln]
    assert len(save) == 1 and len(event) == 1, lines
    detail = json.loads(event[0].split("event checkpoint_saved: ", 1)[1])
    assert detail["reason"] in ("final", "epoch", "periodic", "emergency")
    assert save[0].split(" checkpoint save: ", 1)[1] == save_summary(detail["save"]) == detail["save_summary"]
