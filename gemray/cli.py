"""The ``gemray`` command line.

    gemray --version | --help             (every subcommand: -v / --log-level LEVEL; --help lists its options)
    gemray prepare movielens --src DIR --out DIR [--on-bad-rows error|quarantine] [--num-files N]
    gemray prepare synthetic --out DIR --users U --items N --seed S [--max-len L] [--length-dist ...] ...
                                          (seeded GEM-style data: gemray.pipelines.synthetic)
    gemray prepare interactions --src PATH|GLOB|URI --out DIR [--format ...] [--user-col C] [--item-col C]
                               [--time-col C] [--rating-col C] [--feature-cols C1,C2] [--k-core K]
                               [--memory-budget 1GiB] [--workers N] ...   (gemray.pipelines.interactions)
    gemray train --config FILE [--set section.key=value ...] [--output DIR]
    gemray preempt --output DIR | --notice PATH [--reason TEXT] [--wait SECONDS]
                                          (ask a running `gemray train` to checkpoint and stop)
    gemray evaluate --checkpoint RUN_OR_CKPT [--split valid|test] [--k K ...] [--data DIR] [--json FILE]
                                          (gemray.serve.evaluate: reproduces metrics.json's test figures)
    gemray recommend --checkpoint RUN_OR_CKPT (--user ID ... | --users-file FILE) [--k K] [--out RECS.parquet|.csv]
                                          (gemray.serve.recommend: top-K per user, history excluded)
    gemray export --checkpoint RUN_OR_CKPT --out DIR
                                          (gemray.serve.export: torch.export user tower + item embeddings)
    gemray bench bbs --config FILE [--world-size N] [--set ...]
    gemray bench kernels [ARGS...]        (gemray.bench.kernels.main)
    gemray bench train --config FILE [--set ...] [--steps N] [--warmup W] [--profile] [--sync-debug] [--json PATH]
                                          (gemray.bench.train: step time, tokens/s, MFU, data stall)
    gemray bench numerics --config FILE --steps N [--rtol R] [--output DIR] [--set ...]
                                          (gemray.bench.numerics: the FP8 numerics guard, bf16 vs fp8)
    gemray submit --config FILE [--address URL] [--task train|prepare] ...   (gemray.controller.submit)
    gemray k8s render --config FILE [--kind rayjob|raycluster|pvc] [--gpu] [--image ...] [--storage ...]
    gemray k8s validate FILES [--crds DIR]             (gemray.k8s.cli)
    gemray k8s regenerate FILES [--root DIR]           (re-render deploy/*.yaml from their first lines)

User errors (bad config values, unknown keys, missing files, bad data rows) print one line
``gemray: error: ...`` and exit with status 2; a training failure exits with status 1; a run stopped by a
preemption notice (SIGTERM or Ctrl-C to ``gemray train``, or ``gemray preempt``) after its emergency checkpoint
exits with status 75 (EX_TEMPFAIL: re-run the same command to resume); a second Ctrl-C stops at once, 130.
``gemray prepare`` stopped by Ctrl-C exits 130, by SIGTERM 143 (128 + 15), both after removing its temporary
output folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from gemray.config import USER_ERRORS
from gemray.config import writable_file as _writable_file  # an output path checked before any work
from gemray.preemption import EXIT_PREEMPTED  # 75, sysexits EX_TEMPFAIL

EXIT_TERMINATED = 143  # 128 + SIGTERM, as 130 is 128 + SIGINT for a KeyboardInterrupt


class Terminated(KeyboardInterrupt):
    """SIGTERM during a command run under :func:`_sigterm_raises`: a KeyboardInterrupt, so that the clean-up a
    Ctrl-C gets (the preparers' ``except BaseException``: remove the ``.OUT.tmp-<pid>-*`` folder, stop the pool)
    runs for it too; :func:`main` exits with :data:`EXIT_TERMINATED`."""


def _fail(msg: str, code: int = 2) -> int:
    print(f"gemray: error: {msg}", file=sys.stderr)
    return code


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the block runs (``gemray prepare``), SIGTERM raises :class:`Terminated` in the main thread instead of
    killing the process at once, which left the temporary output folder behind. A repeat within
    ``preemption.SIGTERM_REPEAT_S`` of the first is the same signal (GNU ``timeout`` sends one to the command and
    one to its process group) and is ignored while the clean-up runs; a later one takes the previous handler's
    action. A pool worker forked inside the block inherits the handler: there SIGTERM does what it did before
    (the default: the worker ends; the parent cleans up). The previous handler is restored afterwards. A no-op
    off the main thread (where Python cannot install signal handlers)."""
    import os
    import signal
    import threading
    import time

    from gemray.preemption import SIGTERM_REPEAT_S, pass_sigterm_on

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    owner = os.getpid()
    first = []

    def handler(signum, frame):
        if os.getpid() != owner:  # a forked worker
            return pass_sigterm_on(previous, signum, frame)
        now = time.monotonic()
        if not first:
            first.append(now)
            raise Terminated
        if now - first[0] >= SIGTERM_REPEAT_S:
            pass_sigterm_on(previous, signum, frame)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _add_set(p: argparse.ArgumentParser, example: str = "train.epochs=2") -> None:
    p.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                   metavar="SECTION.KEY=VALUE", help=f"override config values, e.g. {example}")


def _cmd_prepare(ns: argparse.Namespace) -> int:
    from gemray.pipelines.movielens import format_summary, prepare_movielens

    manifest = prepare_movielens(ns.src, ns.out, on_bad_rows=ns.on_bad_rows, num_files=ns.num_files)
    print(format_summary(manifest, ns.out))  # stdout, once (prepare_movielens logs it at DEBUG only)
    return 0


def _cmd_prepare_synthetic(ns: argparse.Namespace) -> int:
    from gemray.pipelines.synthetic import (SyntheticSpec, check_fixed_length_mean, format_synthetic_summary,
                                            name_default_mean, parse_features, parse_fractions, prepare_synthetic)

    rg = ns.row_groups_per_file
    if rg != "auto":
        if not rg.isdigit() or int(rg) < 1:
            raise ValueError(f"--row-groups-per-file: expected an integer >= 1 or 'auto', got {rg!r}")
        rg = int(rg)
    min_len, max_len = _synthetic_length_range(ns.min_len, ns.max_len)
    check_fixed_length_mean(min_len, max_len, ns.mean_len, min_default=ns.min_len is None,
                            max_default=ns.max_len is None)
    mean_len = SYNTHETIC_DEFAULTS["mean_len"] if ns.mean_len is None else ns.mean_len
    try:
        spec = SyntheticSpec(users=ns.users, items=ns.items, seed=ns.seed, max_len=max_len, min_len=min_len,
                             length_dist=ns.length_dist, mean_len=mean_len, len_sigma=ns.len_sigma,
                             item_zipf=ns.item_zipf, features=parse_features(ns.features),
                             missing_rate=ns.missing_rate, devices=ns.devices, candidates=ns.candidates,
                             min_candidates=ns.min_candidates, ctr=ns.ctr, cvr=ns.cvr, signal=ns.signal,
                             stickiness=ns.stickiness, follow=ns.follow, interests=ns.interests,
                             latent_dim=ns.latent_dim, split_fractions=parse_fractions(ns.split_fractions))
    except ValueError as e:  # a mean out of the range's reach, not given: "--mean-len (default 200)"
        raise ValueError(name_default_mean(str(e), ns.mean_len is not None)) from None
    manifest = prepare_synthetic(ns.out, spec, num_files=ns.num_files, row_groups_per_file=rg, workers=ns.workers)
    print(format_synthetic_summary(manifest, ns.out))
    return 0


# SyntheticSpec's defaults, here so that building the parser does not import pyarrow (tests hold them equal)
SYNTHETIC_DEFAULTS = {"max_len": 4096, "min_len": 8, "length_dist": "lognormal", "mean_len": 200.0, "len_sigma": 1.0,
                      "item_zipf": 1.0, "features": (("category", 64), ("author", 2048)), "missing_rate": 0.01,
                      "devices": 4, "candidates": 64, "ctr": 0.05, "cvr": 0.1, "signal": 1.0, "stickiness": 0.6,
                      "follow": 0.2, "interests": 4, "latent_dim": 16, "split_fractions": (0.8, 0.1, 0.1)}


def _synthetic_length_range(min_len: int | None, max_len: int | None) -> tuple[int, int]:
    """``gemray prepare synthetic``'s (--min-len, --max-len), None for a flag not given (its default then). Raises
    ValueError for min > max saying which value is the default and which flag to pass (was "--min-len (8) must be <=
    --max-len (3)" after `--max-len 3` alone: a value the user never gave). Each flag's own bound (>= 3) is left to
    SyntheticSpec, which checks it first."""
    from gemray.pipelines.schema import MIN_HISTORY_FOR_SPLITS as lowest

    lo = SYNTHETIC_DEFAULTS["min_len"] if min_len is None else min_len
    hi = SYNTHETIC_DEFAULTS["max_len"] if max_len is None else max_len
    if lowest <= hi < lo:
        if min_len is None:
            what = str(lowest) if hi == lowest else f"between {lowest} and {hi}"
            raise ValueError(f"--min-len (default {lo}) must be <= --max-len ({hi}): pass --min-len {what}")
        if max_len is None:
            raise ValueError(f"--min-len ({lo}) must be <= --max-len (default {hi}): pass --max-len {lo} or more")
    return lo, hi


def _add_synthetic_parser(prep_sub) -> None:
    dflt = SYNTHETIC_DEFAULTS
    sy = prep_sub.add_parser(
        "synthetic", help="seeded synthetic GEM-style data (long histories, side features, candidates + labels)",
        description="Generate a seeded synthetic dataset in the prepared-folder layout (manifest.json, items.parquet, "
                    "histories/part-*.parquet): Zipf item popularity, long-tail history lengths with sequential "
                    "structure, item side features (feat_<name>), request context (ctx_hour, ctx_device) and one "
                    "ranking request per user with candidates and click / convert labels that a model can learn. "
                    "The same arguments give byte-identical files (any --workers). See "
                    "gemray.pipelines.synthetic for the signal model.")
    sy.add_argument("--out", required=True, help="output folder (replaced atomically if it is a prepared folder)")
    sy.add_argument("--users", type=int, required=True, help="users (rows, one ranking request each)")
    sy.add_argument("--items", type=int, required=True, help="items (dense ids 1..N)")
    sy.add_argument("--seed", type=int, required=True, help="the seed (0..2**63-1)")
    g = sy.add_argument_group("histories")
    # None: not given (the default is filled in by _synthetic_length_range / _cmd_prepare_synthetic, whose refusals
    # say which was given)
    g.add_argument("--max-len", type=int, default=None, help=f"longest history (events; default {dflt['max_len']})")
    g.add_argument("--min-len", type=int, default=None, help=f"shortest history (>= 3; default {dflt['min_len']})")
    g.add_argument("--length-dist", choices=("lognormal", "zipf"), default=dflt["length_dist"],
                   help="history length distribution on min..max length (default %(default)s)")
    g.add_argument("--mean-len", type=float, default=None,
                   help="mean history length after the cap; the distribution's location / exponent is solved for it "
                        f"(default {dflt['mean_len']:g}; with --min-len = --max-len, that length or none)")
    g.add_argument("--len-sigma", type=float, default=dflt["len_sigma"], help="log-normal shape (default %(default)s)")
    g.add_argument("--item-zipf", type=float, default=dflt["item_zipf"],
                   help="item popularity exponent, p ~ rank**-s (default %(default)s)")
    g.add_argument("--stickiness", type=float, default=dflt["stickiness"],
                   help="chance that the next event stays in the session's category (default %(default)s)")
    g.add_argument("--follow", type=float, default=dflt["follow"],
                   help="chance that the next event is a follow-up of the previous item (default %(default)s)")
    g.add_argument("--interests", type=int, default=dflt["interests"],
                   help="categories of interest per user (default %(default)s)")
    g = sy.add_argument_group("features")
    g.add_argument("--features", default=",".join(f"{n}={c}" for n, c in dflt["features"]),
                   help="item side features NAME=CARDINALITY,... written as feat_<name> per token; the first one "
                        "drives sessions and candidates (default %(default)s)")
    g.add_argument("--missing-rate", type=float, default=dflt["missing_rate"],
                   help="share of item feature values stored as 0 = missing (default %(default)s)")
    g.add_argument("--devices", type=int, default=dflt["devices"],
                   help="cardinality of the ctx_device request feature (default %(default)s)")
    g.add_argument("--latent-dim", type=int, default=dflt["latent_dim"],
                   help="dimension of the latent user / item vectors behind the labels (default %(default)s)")
    g = sy.add_argument_group("ranking")
    g.add_argument("--candidates", type=int, default=dflt["candidates"],
                   help="candidates per request (at most; default %(default)s)")
    g.add_argument("--min-candidates", type=int, default=None,
                   help="fewest candidates per request: counts are uniform in min..max (default: = --candidates)")
    g.add_argument("--ctr", type=float, default=dflt["ctr"], help="click rate to calibrate to (default %(default)s)")
    g.add_argument("--cvr", type=float, default=dflt["cvr"],
                   help="conversion rate among clicks to calibrate to (default %(default)s)")
    g.add_argument("--signal", type=float, default=dflt["signal"],
                   help="scale of the learnable part of the label logits; 0 = labels are noise (default %(default)s)")
    g.add_argument("--split-fractions", default=",".join(f"{x:g}" for x in dflt["split_fractions"]),
                   help="train,valid,test shares of the ranking requests (default %(default)s)")
    g = sy.add_argument_group("output")
    g.add_argument("--num-files", type=int, default=8,
                   help="history files (default %(default)s; capped at the user count, said in an INFO line)")
    g.add_argument("--row-groups-per-file", default="auto",
                   help="row groups (shards) per file, or auto: >= 4, more to keep ~4M tokens per row group "
                        "(default %(default)s)")
    g.add_argument("--workers", type=int, default=None,
                   help="processes writing files in parallel (default: usable CPUs, at most --num-files); the "
                        "output does not depend on it")
    sy.set_defaults(func=_cmd_prepare_synthetic)


def _cmd_prepare_interactions(ns: argparse.Namespace) -> int:
    from gemray.pipelines.interactions import format_summary, prepare_interactions

    features = [c.strip() for v in ns.feature_cols for c in v.split(",") if c.strip()]
    manifest = prepare_interactions(
        ns.src, ns.out, fmt=ns.format, user_col=ns.user_col, item_col=ns.item_col, time_col=ns.time_col,
        rating_col=ns.rating_col, feature_cols=features, id_type=ns.id_type, time_unit=ns.time_unit,
        delimiter=ns.delimiter, k_core=ns.k_core, on_bad_rows=ns.on_bad_rows, num_files=ns.num_files,
        memory_budget=ns.memory_budget, workers=ns.workers, progress=sys.stderr.isatty())
    print(format_summary(manifest, ns.out))
    return 0


def _add_prepare_interactions(prep_sub) -> None:
    """The ``gemray prepare interactions`` parser (gemray.pipelines.interactions)."""
    from gemray.pipelines.interactions import DEFAULT_MEMORY_BUDGET, FORMATS, ID_TYPES, TIME_UNITS

    it = prep_sub.add_parser(
        "interactions", help="your own logs: Parquet / CSV / Amazon review files, local or on an object store",
        description="Convert interaction logs (one row per user-item event) to per-user Parquet histories with "
                    "dense ids, out of core: memory is bounded by --memory-budget, not by the input size. "
                    "Raw ids go to users.parquet / items.parquet, extra categorical columns become feat_<name> "
                    "columns (features/<name>.parquet maps them back).")
    it.add_argument("--src", required=True, action="append",
                    help="file, folder, glob or URI (file://, s3://, gs://, hdfs://, or any installed fsspec "
                         "scheme); repeat for several; files are read in path order")
    it.add_argument("--out", required=True, help="output folder (prepared Parquet + manifest.json)")
    it.add_argument("--format", choices=FORMATS, default="auto",
                    help="auto (by extension: .parquet/.pq, .csv/.tsv, possibly .gz/.bz2/.zst/.lz4), parquet, csv, "
                         "amazon-ratings (headerless user,item,rating,timestamp), amazon-seq (user item1 item2 ...)")
    it.add_argument("--user-col", default=None, help="user id column (default user_id)")
    it.add_argument("--item-col", default=None, help="item id column (default item_id)")
    it.add_argument("--time-col", default=None, help="time column (default timestamp): unix time in --time-unit, "
                    "ISO 8601 text, or a Parquet timestamp / date")
    it.add_argument("--rating-col", default=None, help="star rating column, 0..5 in steps of 0.5 (default: none, "
                    "ratings 0)")
    it.add_argument("--feature-cols", action="append", default=[], metavar="C1,C2",
                    help="categorical columns carried as sparse token features feat_<name> (comma-separated or "
                         "repeated)")
    it.add_argument("--id-type", choices=ID_TYPES, default="auto",
                    help="auto (Parquet: the column type; CSV: the exact text), string, or int (non-integers are "
                         "bad rows)")
    it.add_argument("--time-unit", choices=tuple(TIME_UNITS), default="s",
                    help="unit of numeric times (default s); a number that reads as 2200 or later in it is a bad "
                         "row whose error names the likely unit (e.g. ms); when most read as before 1990 in ms, us "
                         "or ns, a warning names the likely unit (e.g. s)")
    it.add_argument("--delimiter", default=None, help="CSV field separator, one character: e.g. ';' or '|', "
                    "'\\t' for a tab (default ',', tab for .tsv)")
    it.add_argument("--k-core", type=int, default=0, metavar="K",
                    help="keep only users and items with >= K interactions, repeated until stable (the Amazon "
                         "5-core: 5; default 0 = off)")
    it.add_argument("--on-bad-rows", choices=("error", "quarantine"), default="error",
                    help="error (default): stop at the first bad row, naming file, line and field; quarantine: "
                         "write bad rows to quarantine.jsonl, count them in the manifest and go on")
    it.add_argument("--num-files", type=int, default=0,
                    help="history files (default 0 = max(8, interactions / 1Mi): row groups of ~256k interactions, the shards "
                         "training reads; capped at the user count, said in an INFO line)")
    it.add_argument("--memory-budget", default=DEFAULT_MEMORY_BUDGET,
                    help=f"working memory bound, e.g. 512MiB, 2GiB (default {DEFAULT_MEMORY_BUDGET}); the output "
                         "does not depend on it")
    it.add_argument("--workers", type=int, default=1,
                    help="processes for reading and grouping (default 1); the output does not depend on it")
    it.set_defaults(func=_cmd_prepare_interactions)


def _cmd_train(ns: argparse.Namespace) -> int:
    from gemray.config import load_config
    from gemray.controller.run import fit

    from gemray.controller.console import console_session

    cfg = load_config(ns.config, ns.overrides)  # validate before anything starts
    out = Path(ns.output or Path("runs") / cfg.name).expanduser().resolve()  # fit's default
    if ns.dry_run:  # the resolved config (every key), nothing started, nothing written
        from gemray.config import to_toml

        print(to_toml(cfg), end="")
        print(f"gemray train --dry-run: {ns.config} is valid with {len(ns.overrides)} --set value(s); "
              f"output would be {out}", file=sys.stderr)
        return 0
    with console_session(out, level=log_level(ns), verbose=ns.verbose) as run_log:
        try:
            res = fit(cfg, output_dir=ns.output)
        except USER_ERRORS:
            raise
        except Exception as e:  # Ray's TrainingFailedError and friends: not a usage error
            print(f"gemray: training failed: {type(e).__name__}: {e}", file=sys.stderr)
            if run_log.path.is_file():
                print(f"gemray: the full log (workers included) is in {run_log.path}", file=sys.stderr)
            return 1
    if res.metrics.get("preempted"):
        print(f"preempted: emergency checkpoint of global step {res.metrics['global_step']} committed at "
              f"{res.checkpoint_path}; re-run the same command to resume from step {res.metrics['global_step']}")
        return EXIT_PREEMPTED
    print(f"outputs: {res.output_dir} (metrics.json, curves.png, config.toml, logs/gemray.log, tensorboard/); "
          f"checkpoint: {res.checkpoint_path}")
    return 0


TRAIN_EPILOG = """\
config keys:
  every key of the [data], [model], [train], [ray], [checkpoint] and [parallel] sections is documented in the
  class docstrings of gemray/config.py (DataConfig, ModelConfig, TrainConfig, RayConfig, CheckpointConfig,
  ParallelConfig);
  configs/*.toml are complete examples. --set takes the same keys: section.key=value.

exit status:
  0   finished: metrics.json, curves.png, config.toml and the final checkpoint are in --output
  1   training failed (the error is printed; see the run's events.jsonl)
  2   usage error: bad config value, unknown key, missing file, unwritable --output, bad data row
  75  preempted (SIGTERM, `gemray preempt`, or Ctrl-C): the emergency checkpoint is committed;
      re-run the same command to resume from it. A second Ctrl-C stops at once (status 130).

examples:
  gemray train --config configs/ml-1m.toml
  gemray train --config configs/ml-1m.toml --set train.epochs=2 data.batch_size=64 --output runs/try
  gemray preempt --output runs/try --wait 300     # from another shell: checkpoint and stop
  gemray train --config configs/ml-1m.toml --set train.epochs=2 --dry-run   # the resolved config, nothing run
"""


def _run_active(notice: Path) -> bool:
    """True when the active marker beside ``notice`` (just written) exists and is not stale: its modification
    time is within ``preemption.ACTIVE_STALE_S`` seconds of the notice's (one file system clock)."""
    from gemray import preemption

    try:
        marker_t = preemption.active_path(notice).stat().st_mtime
        notice_t = notice.stat().st_mtime
    except OSError:
        return False
    return (not preemption.marker_is_stale(marker_t, notice_t, preemption.ACTIVE_STALE_S)
            and not preemption.marker_owner_gone(notice))


def _cmd_preempt(ns: argparse.Namespace) -> int:
    """Write the notice (unless one is already pending there; a handled one whose run has gone is replaced), then
    optionally wait for the run to commit its emergency checkpoint. Exit 0 when written/handled/no run is active,
    1 on a --wait timeout; raises NotADirectoryError for a missing --output folder and ValueError for a negative
    --wait."""
    import socket

    from gemray import preemption
    from gemray.preemption import (NOTICE_NAME, active_path, is_handled, read_notice, wait_until_handled,
                                   write_notice)

    if ns.wait is not None and ns.wait < 0:
        raise ValueError(f"--wait {ns.wait}: expected >= 0 seconds")
    if ns.output is not None:
        out = Path(ns.output)
        if not out.is_dir():
            raise NotADirectoryError(f"--output {out}: " + ("a file, not a folder" if out.exists() else "no such folder")
                                     + " (the --output of the running `gemray train`)")
        path = out / NOTICE_NAME
        if not active_path(path).exists():  # no run there now: a notice in a folder no run can use is lost
            from gemray.controller.preflight import foreign_entries

            extra = foreign_entries(out)
            if extra:
                raise ValueError(f"--output {out}: not a gemray run's output folder (it holds "
                                 f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}, which no run writes) "
                                 "and no run is active there: give the --output of the running `gemray train`")
    else:
        path = Path(ns.notice)
        if path.is_dir():
            return _fail(f"--notice {path} is a folder: give the notice file's path (e.g. {path / NOTICE_NAME}), "
                         "or the run's folder with --output")
        if not path.parent.is_dir():  # e.g. a pod deleted before its run started: nothing to stop
            print(f"no run folder {path.parent}: no run has started there, nothing to preempt")
            return 0
    existing = read_notice(path)
    if existing is not None and is_handled(existing) and not active_path(path).exists():
        # an earlier preemption's notice, handled, its run gone (no active marker): history, not a pending notice
        # (answering from it reported that old checkpoint as this request's); the next run removes a new one at start
        print(f"replacing the handled notice of an earlier preemption at {path} "
              f"(global step {existing['handled'].get('global_step')})")
        existing = None
    if existing is None:
        write_notice(path, ns.reason.replace("{host}", socket.gethostname()))
        if _run_active(path):
            print(f"preemption notice written to {path}: the run checkpoints at its next poll step "
                  "(checkpoint.preempt_poll_steps) and stops")
        else:
            name = active_path(path).name
            why = (f"no {name}" if not active_path(path).exists() else
                   f"its {name} names a process that no longer exists" if preemption.marker_owner_gone(path) else
                   f"its {name} is stale")
            print(f"preemption notice written to {path}, but no run is active there now ({why}): the next run "
                  "started there removes it at start")
    else:
        print(f"a preemption notice is already at {path} (reason: {existing.get('reason')}); not replacing it")
    if ns.wait is None:
        return 0
    outcome, notice = wait_until_handled(path, ns.wait)
    if outcome == "handled":
        h = notice["handled"]
        if h.get("finished"):  # the notice reached the run after its last step's vote
            print(f"the run finished before it could stop: final checkpoint of global step {h.get('global_step')} "
                  f"committed at {h.get('checkpoint')}; nothing to resume")
        else:
            print(f"emergency checkpoint of global step {h.get('global_step')} committed at {h.get('checkpoint')}")
        return 0
    if outcome == "no_run":
        print(f"no run is active for {path}: nothing to wait for")
        return 0
    if outcome == "stale":
        why = ("names a process of this host that no longer exists" if preemption.marker_owner_gone(path) else
               f"has not been refreshed for {preemption.ACTIVE_STALE_S:g} s or more (a live driver refreshes it "
               f"every {preemption.ACTIVE_HEARTBEAT_S:g} s)")
        print(f"no run is active for {path}: its active marker {active_path(path).name} {why}, so its driver was "
              "killed without removing it; nothing to wait for")
        return 0
    return _fail(f"--wait {ns.wait:g}: the run did not commit its emergency checkpoint within {ns.wait:g} s "
                 f"(notice {path}); it falls back to its last periodic checkpoint if stopped now", 1)


def _cmd_bench_bbs(ns: argparse.Namespace) -> int:
    from gemray.config import load_config
    from gemray.pipelines.bbs import simulate_imbalance

    cfg = load_config(ns.config, ns.overrides)
    world = ns.world_size or cfg.ray.num_workers
    d = cfg.data
    rows = []
    for bbs in (False, True):
        r = simulate_imbalance(Path(d.prepared_dir).resolve(), split="train", world_size=world,
                               batch_size=d.batch_size, max_seq_len=d.max_seq_len,
                               sub_batch_size=d.sub_batch_size, bbs=bbs, seed=cfg.train.seed, shuffle=d.shuffle,
                               train_includes_valid=d.train_includes_valid)
        rows.append(("with BBS" if bbs else "without BBS", r))
    print(f"token imbalance of the training plan (max/mean tokens per rank per step, mean over an epoch's steps), "
          f"{d.prepared_dir}, world size {world}, batch {d.batch_size}:")
    for name, r in rows:
        print(f"  {name:<12} {r['imbalance']:.3f}  ({r['steps']} step{'' if r['steps'] == 1 else 's'}, last step "
              f"{r['last_step_imbalance']:.3f}, {r['tokens_per_step_mean']:.0f} tokens per rank-step)")
    return 0


def _cmd_bench_numerics(ns: argparse.Namespace) -> int:
    """Train the config in bf16 and in fp8 (same data, seed, steps) and compare NE / AUC or HR@10."""
    import json

    from gemray.bench.numerics import compare_quality, format_rows
    from gemray.controller.run import fit

    if ns.steps < 1:
        return _fail(f"--steps must be >= 1, got {ns.steps}")
    out = Path(ns.output)
    metrics = {}
    for precision in ("bf16", "fp8"):
        sets = list(ns.overrides) + [f"train.precision={precision}", "train.epochs=1", "train.eval_every=1",
                                     f"train.max_steps_per_epoch={ns.steps}"]
        res = fit(ns.config, output_dir=out / precision, overrides=sets)
        metrics[precision] = {k: v for k, v in res.metrics.items() if isinstance(v, (int, float))}
    ok, rows = compare_quality(metrics["bf16"], metrics["fp8"], ns.rtol)
    print(f"numerics guard: {ns.config}, {ns.steps} steps, outputs in {out}")
    print(format_rows(rows, ns.rtol))
    (out / "numerics.json").write_text(json.dumps({"ok": ok, "rtol": ns.rtol, "steps": ns.steps, "rows": rows,
                                                   "bf16": metrics["bf16"], "fp8": metrics["fp8"]}, indent=2))
    if not ok:
        print(f"numerics guard FAILED: fp8 differs from bf16 by more than rtol {ns.rtol:g}", file=sys.stderr)
        return 1
    return 0


def _cmd_bench_kernels(ns: argparse.Namespace) -> int:
    from gemray.bench import kernels as bench

    return int(bench.main(ns.args) or 0)


def _cmd_bench_train(ns: argparse.Namespace) -> int:
    import json

    from gemray.bench.train import bench_device, check_step_counts, format_table, run_bench
    from gemray.config import load_config

    from gemray.controller.preflight import preflight_kernel_tiles
    from gemray.controller.run import ensure_prepared

    if ns.json:  # an unwritable --json refused now, not after every step ran (its missing folders are made then)
        _writable_file(ns.json, "--json", make_parents=True)
    cfg = load_config(ns.config, ns.overrides)
    # bad step counts and a GPU that is not here: one line (ValueError) before the data is prepared or anything built
    check_step_counts(ns.steps, ns.warmup, ns.profile_steps, ns.host_profile)
    bench_device(cfg)
    if ns.sync_debug:  # refused before the data is prepared or anything is built
        import torch

        if not (cfg.ray.use_gpu and torch.cuda.is_available()):
            print("gemray: error: bench train --sync-debug needs a CUDA device (torch.cuda.set_sync_debug_mode); "
                  f"this run would be on the CPU (ray.use_gpu = {str(cfg.ray.use_gpu).lower()}, CUDA "
                  f"{'available' if torch.cuda.is_available() else 'not available'})", file=sys.stderr)
            return 2
    preflight_kernel_tiles(cfg)  # as `gemray train`: a bad model.kernel_tiles refused before the data is generated
    ensure_prepared(cfg)  # as `gemray train`: prepare the data first where the config says how
    res = run_bench(cfg, steps=ns.steps, warmup=ns.warmup, profile=ns.profile, profile_steps=ns.profile_steps,
                    warm_up_kernels=not ns.no_kernel_warmup, sync_debug=ns.sync_debug,
                    host_profile_steps=ns.host_profile)
    print(format_table(res))
    if ns.json:
        out = Path(ns.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2, sort_keys=True, default=str))
        print(f"json: {out}")
    return 0


def _cmd_submit(ns: argparse.Namespace) -> int:
    from gemray.controller.submit import JobServerRefused, cli_submit

    try:
        return cli_submit(ns)
    except JobServerRefused as e:  # a server answered but refused the token: its address and what to pass, one line
        return _fail(str(e), 1)
    except ConnectionError as e:  # no job server at --address / $RAY_ADDRESS: one line, not a traceback
        print(f"gemray: error: cannot reach the Ray job server ({e}); is the cluster up and --address right?",
              file=sys.stderr)
        return 1


_K8S_HELP = """usage: gemray k8s {render,validate,regenerate} ...

KubeRay manifests from a gemray config (gemray.k8s):
  render --config FILE [--kind rayjob|raycluster|pvc] [--gpu] [--image ...] [--storage ...] [--output FILE]
  validate FILES [--crds DIR]       check manifests against the KubeRay CRDs
  regenerate FILES [--root DIR]     re-render manifests in place from their "# Generated by:" lines
`gemray k8s render --help` and `gemray k8s validate --help` list every option."""


_K8S_COMMANDS = ("render", "validate", "regenerate")


def _cmd_k8s(ns: argparse.Namespace) -> int:
    from gemray.k8s.cli import main as k8s_main

    if ns.k8s_command in ("-h", "--help"):
        print(_K8S_HELP)
        return 0
    if ns.k8s_command not in _K8S_COMMANDS:
        print(_K8S_HELP.splitlines()[0], file=sys.stderr)
        what = ("a subcommand is required" if ns.k8s_command is None
                else f"invalid choice: {ns.k8s_command!r}")
        return _fail(f"k8s: {what} (choose from {', '.join(map(repr, _K8S_COMMANDS))})")
    return k8s_main([ns.k8s_command, *ns.args])


class _StrayRun(argparse.Action):
    """A hidden catch-all positional of evaluate / recommend / export, which take no positional argument: a run
    folder given bare (``gemray evaluate runs/x``) is collected here and refused by :class:`_Parser` once the whole
    command line is read (``--checkpoint`` may come after it), through ``parser.error`` (usage, one error line,
    exit 2), instead of argparse's "the following arguments are required: --checkpoint" or "unrecognized
    arguments"."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values:
            parser.stray = [*getattr(parser, "stray", []), *values]


def stray_message(stray: list[str], checkpoint: str | None) -> str:
    """Pure: the refusal of run folders ``stray`` given bare to evaluate / recommend / export. Without
    ``--checkpoint`` (``checkpoint`` None): the flag to give the first one with. With it: the run was given twice,
    both named, and the bare one(s) to drop (it said "unexpected argument" only, or, with the bare folder first,
    "give the run as --checkpoint" although --checkpoint was there)."""
    import shlex

    quoted = ", ".join(repr(v) for v in stray)
    if checkpoint is None:
        what = f"unexpected argument {quoted}" if len(stray) == 1 else f"unexpected arguments {quoted}"
        return f"{what}: give the run as --checkpoint {shlex.quote(stray[0])}"
    bare = f"the bare argument {quoted}" if len(stray) == 1 else f"the bare arguments {quoted}"
    return (f"both --checkpoint {shlex.quote(checkpoint)} and {bare} were given: drop {quoted} (the run is given "
            "by --checkpoint alone)")


class _Parser(argparse.ArgumentParser):
    """gemray's subcommand parsers: those with a :class:`_StrayRun` positional (evaluate / recommend / export)
    refuse a bare run folder after the whole command line is read, so that the message knows whether
    ``--checkpoint`` was given too, before it or after it (:func:`stray_message`); the others parse as argparse
    does, except that an unrecognized argument is refused by the subcommand's own parser, with its usage (argparse
    hands a subparser's leftovers up to the top-level parser, whose usage lists the subcommands, not the options)."""

    def parse_known_args(self, args=None, namespace=None):
        self.stray = []
        ns, extras = super().parse_known_args(args, namespace)
        if self.stray:
            self.error(stray_message(self.stray, getattr(ns, "checkpoint", None)))
        if extras:  # `gemray train --config c.toml --sett x=y`: train's usage, not gemray's
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def error(self, message):
        if getattr(self, "stray", None) and "required: --checkpoint" in message:  # the run given bare alone
            message = stray_message(self.stray, None)
        super().error(message)


def _add_serve_parsers(sub) -> None:
    """evaluate / recommend / export: use a trained checkpoint in this process (gemray.serve; no Ray cluster)."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--checkpoint", required=True, metavar="RUN_OR_CKPT_DIR",
                       help="a `gemray train --output` folder (its newest committed checkpoint that verifies), "
                            "its ray/<name> run folder, or one checkpoint_* folder")
        p.add_argument("stray", nargs="*", action=_StrayRun, help=argparse.SUPPRESS)  # `gemray evaluate runs/x`
        p.add_argument("--config", default=None, help="training config (default: the run's config.toml)")
        p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when the run trained on GPUs)")
        # (a training setting such as train.epochs does nothing here: the example is one that does)
        _add_set(p, "data.eval_batch_size=64")

    ev = sub.add_parser("evaluate", help="HR@K / NDCG@K (and NE / AUC / calibration per ranking task) of a "
                                         "checkpoint on a split (as training evaluates)",
                        description="Evaluate a trained checkpoint with the evaluators training used; prints a "
                                    "table and writes JSON. On the run's own config and test split it reproduces "
                                    "metrics.json's figures.")
    common(ev)
    ev.add_argument("--split", choices=("valid", "test"), default="test",
                    help="test (default): each user's last item as the target, as metrics.json's test figures; valid: "
                         "the item before it, as the per-epoch validation figures")
    ev.add_argument("--k", type=int, nargs="+", default=None, help="cut-offs (default: the run's train.eval_ks)")
    ev.add_argument("--data", default=None, metavar="PREPARED_DIR",
                    help="another prepared folder with the same item vocabulary (default: the run's)")
    ev.add_argument("--world-size", type=int, default=None,
                    help="ranks to partition the split into (default: the checkpoint's, as its training did)")
    ev.add_argument("--json", default=None, metavar="FILE",
                    help="where to write the result (default: evaluate_<split>.json in the run's folder, beside its "
                         "config.toml; evaluate_<split>.<folder name>.json for another --data than the run's; "
                         "'-' for stdout only)")
    ev.set_defaults(func=_cmd_evaluate)

    rc = sub.add_parser("recommend", help="top-K items per user from the retrieval head (history excluded)",
                        description="Top-K items for users from their full history in the prepared data, none "
                                    "from the history. Ids are the data's raw ids (users.parquet / items.parquet).")
    common(rc)
    who = rc.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", action="append", metavar="ID", help="a user id (repeat for more)")
    who.add_argument("--users-file", metavar="FILE", help="user ids: one per line, or a user_id column (.parquet/.csv)")
    rc.add_argument("--k", type=int, default=10,
                    help="items per user (default 10; at most the catalogue's item count, a larger one is refused)")
    rc.add_argument("--data", default=None, metavar="PREPARED_DIR", help="histories from this prepared folder")
    rc.add_argument("--out", default=None, metavar="RECS.parquet|RECS.csv",
                    help="write the rows (user_id, rank, item_id, score) instead of printing them, in the format of "
                         "the suffix: .parquet (Parquet) or .csv (CSV with a header); another suffix is refused")
    rc.set_defaults(func=_cmd_recommend)

    ex = sub.add_parser("export", help="serving artifact loadable with plain PyTorch (no gemray / TorchRec / Ray)",
                        description="Export the user tower as a torch.export program over jagged inputs (values + "
                                    "offsets) and the item embeddings as .npy, with serving.json; see the README.")
    common(ex)
    ex.add_argument("--out", required=True, metavar="DIR", help="output folder (created; must be empty)")
    ex.set_defaults(func=_cmd_export)


def _cmd_evaluate(ns: argparse.Namespace) -> int:
    import json

    from gemray.serve import load_trained
    from gemray.checkpoint import data_record
    from gemray.serve.evaluate import check_arguments, check_cutoffs, evaluate, format_metrics, result_path
    from gemray.serve.model import check_device, prepared_manifest, run_config

    check_arguments(ns.split, ns.k, ns.world_size)  # before the model and the data are loaded
    check_device(ns.device)
    if ns.json not in (None, "-"):
        _writable_file(ns.json, "--json")  # before the model is loaded and the split evaluated
    # an unprepared (e.g. raw MovieLens) --data is refused before the checkpoint is looked at, one of another item
    # count before the model loads (load_trained); the manifest is read once
    manifest = prepared_manifest(ns.data) if ns.data is not None else None
    if ns.k is not None:  # a --k above the item count, from the manifest of the data evaluated, before the model loads
        items = manifest if manifest is not None else prepared_manifest(
            run_config(ns.checkpoint, config=ns.config, overrides=ns.overrides).data.prepared_dir)
        check_cutoffs(ns.k, data_record(items)["num_items"])
    trained = load_trained(ns.checkpoint, config=ns.config, overrides=ns.overrides, device=ns.device,
                           data_manifest=manifest)
    res = evaluate(trained, ns.split, ks=ns.k, prepared_dir=ns.data, world_size=ns.world_size, manifest=manifest)
    print(format_metrics(res))
    text = json.dumps(res, indent=1, sort_keys=True)
    if ns.json == "-":
        print(text)
        return 0
    # default: the run's output folder when --checkpoint is one (it holds config.toml), else beside the checkpoint
    # (never beside a --config file, which may sit in the source tree); another --data than the run's gets a file
    # of its own, named after the data folder (the run's evaluate_<split>.json stays its own data's)
    given = Path(ns.checkpoint).expanduser()
    base = given if (given / "config.toml").is_file() else trained.checkpoint.parent
    path = Path(ns.json) if ns.json else result_path(base, ns.split, ns.data, trained.cfg.data.prepared_dir)
    path.write_text(text + "\n")
    print(f"written: {path}" + (f" (the evaluation of --data {ns.data})" if ns.data is not None else ""))
    return 0


def _cmd_recommend(ns: argparse.Namespace) -> int:
    from gemray.serve import load_trained
    from gemray.serve.model import check_device, prepared_manifest, run_config
    from gemray.checkpoint import data_record
    from gemray.serve.recommend import (IdMaps, check_k, check_recommendable, read_users_file, recommend,
                                        recs_format, users_file_locations, write_recs)

    if ns.out and not Path(ns.out).expanduser().is_dir():  # first of all: another suffix, before its folder is
        recs_format(ns.out)  # looked at (an existing folder is refused as such below: it names no file at all)
    check_k(ns.k)  # >= 1, before the model is loaded (recommend() refuses it too, for Python callers)
    check_device(ns.device)
    if ns.out:
        _writable_file(ns.out, "--out")  # before the model is loaded and the users scored
    # a model recommend cannot serve is refused from its config, before any checkpoint is read
    cfg = run_config(ns.checkpoint, config=ns.config, overrides=ns.overrides)
    check_recommendable(cfg)
    users = ns.user if ns.user else read_users_file(ns.users_file)
    # as evaluate: an unprepared --data refused before the checkpoint is looked at, another item count before the
    # model loads; the manifest of the data served (--data's, else the run's) read once
    served = ns.data if ns.data is not None else cfg.data.prepared_dir
    manifest = prepared_manifest(served)
    check_k(ns.k, data_record(manifest)["num_items"])  # a --k above the catalogue, from its manifest too
    maps = IdMaps(manifest)
    # a user the data does not have, from its manifest / id maps: refused before the model loads (naming its line)
    maps.dense_users(users, where=None if ns.user else users_file_locations(ns.users_file))
    trained = load_trained(ns.checkpoint, config=ns.config, overrides=ns.overrides, device=ns.device,
                           data_manifest=manifest if ns.data is not None else None)
    recs = recommend(trained, users, k=ns.k, prepared_dir=served, manifest=manifest, maps=maps)
    if ns.out:
        fmt = write_recs(recs, ns.out)
        print(f"written: {ns.out} ({fmt}, {recs.num_rows} rows, {len(users)} users, k={ns.k})")
        return 0
    for row in recs.to_pylist():
        print(f"user {row['user_id']}\t{row['rank']}\titem {row['item_id']}\t{row['score']:.4f}")
    return 0


def _cmd_export(ns: argparse.Namespace) -> int:
    from gemray.serve import load_trained
    from gemray.serve.export import (ITEM_IDS_FILE, ITEMS_FILE, PROGRAM_FILE, SPEC_FILE, check_exportable,
                                     check_out_dir, export)
    from gemray.serve.model import check_device, run_config

    check_device(ns.device)  # a --device cuda without CUDA: one line, before anything is read
    # a model export cannot write is refused from its config, before any checkpoint is read
    check_exportable(run_config(ns.checkpoint, config=ns.config, overrides=ns.overrides))
    check_out_dir(ns.out)  # a used --out too, before the checkpoint is loaded
    trained = load_trained(ns.checkpoint, config=ns.config, overrides=ns.overrides, device=ns.device)
    out = export(trained, ns.out)
    # every file written (item_ids.npy only where the data maps its ids), named from the files themselves
    written = [f for f in (PROGRAM_FILE, ITEMS_FILE, ITEM_IDS_FILE, SPEC_FILE) if (out / f).is_file()]
    print(f"exported: {out} ({', '.join(written)}; loading snippet in the README)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree (exposed for tests and docs)."""
    ap = argparse.ArgumentParser(prog="gemray", description="Ray-orchestrated GEM/HSTU training")
    ap.add_argument("--version", action="version", version=f"gemray {_version()}")
    _add_verbosity(ap, top=True)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    prep = sub.add_parser("prepare", help="convert raw data to Parquet histories")
    prep_sub = prep.add_subparsers(dest="dataset", required=True)
    ml = prep_sub.add_parser("movielens", help="MovieLens ml-1m / ml-100k / ml-latest(-small)")
    ml.add_argument("--src", required=True, help="folder with ratings.dat, u.data or ratings.csv (or that file)")
    ml.add_argument("--out", required=True, help="output folder (prepared Parquet + manifest.json)")
    ml.add_argument("--on-bad-rows", choices=("error", "quarantine"), default="error",
                    help="error (default): stop at the first bad row, naming file, line and field; quarantine: "
                         "write bad rows to quarantine.jsonl, count them in the manifest and go on")
    ml.add_argument("--num-files", type=int, default=8,
                    help="Parquet files to write (default 8; capped at the user count, said in an INFO line): the "
                         "unit Ray Data reads in parallel")
    ml.set_defaults(func=_cmd_prepare)
    _add_synthetic_parser(prep_sub)
    _add_prepare_interactions(prep_sub)

    tr = sub.add_parser("train", help="train with Ray Train (embedded local cluster unless RAY_ADDRESS)",
                        description="Train the model of a TOML config with Ray Train: an embedded local Ray "
                                    "cluster unless RAY_ADDRESS is set; writes metrics.json, curves.png, "
                                    "config.toml and checkpoints to --output. Re-running the same command "
                                    "resumes from the newest committed checkpoint.",
                        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("--config", required=True, help="TOML config, e.g. configs/ml-1m.toml")
    _add_set(tr)
    tr.add_argument("--output", default=None, help="output folder (default runs/<name>)")
    tr.add_argument("--dry-run", action="store_true",
                    help="validate the config and its --set values, print the resolved config (TOML, every key) and "
                    "exit 0 without starting Ray or writing anything (exit 2 on a bad value, as training would)")
    tr.set_defaults(func=_cmd_train)

    pre = sub.add_parser("preempt", help="ask a running `gemray train` to take an emergency checkpoint and stop",
                         description="Write a preemption notice (the file DIR/PREEMPT, or --notice PATH) for a "
                                     "running `gemray train`: at its next poll step "
                                     "(checkpoint.preempt_poll_steps) every rank agrees to stop, the run commits "
                                     "an emergency checkpoint and exits with status 75; re-running the same "
                                     "train command resumes from it. Works across hosts on a shared folder.")
    where = pre.add_mutually_exclusive_group(required=True)
    where.add_argument("--output", default=None,
                       help="the run's output folder (its --output, default runs/<name>); notice: DIR/PREEMPT; "
                       "a missing folder is refused (exit 2), unlike --notice's")
    where.add_argument("--notice", default=None, metavar="PATH",
                       help="the notice file itself (checkpoint.preempt_notice); a missing folder means no run "
                       "has started there: exit 0 without writing")
    pre.add_argument("--reason", default="gemray preempt on {host}",
                     help="recorded in the notice and the events; {host} becomes this host's name (a pod's name)")
    pre.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                     help="block until the run has committed its emergency checkpoint (exit 0), no run is "
                     "active or its driver is gone (its active marker 20 s or more behind; exit 0) or SECONDS "
                     "pass (exit 1)")
    pre.set_defaults(func=_cmd_preempt)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bb = bsub.add_parser("bbs", help="token imbalance across ranks with and without BBS")
    bb.add_argument("--config", required=True,
                    help="TOML config: the training plan of its data.prepared_dir, batch_size, sub_batch_size, "
                    "max_seq_len, shuffle and train_includes_valid (and train.seed) is simulated")
    bb.add_argument("--world-size", type=int, default=None, help="default: ray.num_workers")
    _add_set(bb)
    bb.set_defaults(func=_cmd_bench_bbs)
    bt = bsub.add_parser("train", help="time real training steps in one process: step time, tokens/s, MFU, "
                         "memory, data stall, compile stalls; --profile: where the step goes",
                         description="Build the config's model through the Trainer (world size 1, no Ray), compile "
                                     "the attention kernels for every reachable length regime, then time "
                                     "--warmup + --steps training steps on the real data pipeline "
                                     "(gemray.bench.train).")
    bt.add_argument("--config", required=True,
                    help="TOML config (e.g. configs/gem-h200.toml): its model, data and train sections are built "
                         "and timed as one rank, no Ray (ray.use_gpu picks cuda:0)")
    _add_set(bt)
    bt.add_argument("--steps", type=int, default=30, help="measured steps (default %(default)s)")
    bt.add_argument("--warmup", type=int, default=10, help="steps before the measured ones (default %(default)s)")
    bt.add_argument("--profile", action="store_true", help="torch.profiler over a few more steps: time by category")
    bt.add_argument("--profile-steps", type=int, default=3, help="profiled steps (default %(default)s)")
    bt.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="N more steps under cProfile: where the host's time goes, own time per function")
    bt.add_argument("--no-kernel-warmup", action="store_true",
                    help="skip the ahead-of-time kernel compile (to see the compile stalls)")
    bt.add_argument("--sync-debug", action="store_true",
                    help="GPU only: one more step under torch.cuda.set_sync_debug_mode('warn'), reporting each host "
                         "synchronisation site (file:line) with its count")
    bt.add_argument("--json", default=None, metavar="PATH", help="write the full result (per-step records too)")
    bt.set_defaults(func=_cmd_bench_train)
    bn = bsub.add_parser("numerics", help="FP8 numerics guard: train bf16 and fp8 on the same data and seed, "
                         "exit 1 when NE / AUC (ranking) or HR@10 (retrieval) differ by more than --rtol")
    bn.add_argument("--config", required=True,
                    help="TOML config of both runs (e.g. configs/gem-h200.toml); train.precision is set per run: "
                         "bf16 for bf16/, fp8 for fp8/")
    bn.add_argument("--steps", type=int, required=True, help="training steps of each run (one epoch)")
    bn.add_argument("--rtol", type=float, default=1e-3, help="largest relative difference (default %(default)g)")
    bn.add_argument("--output", default="runs/numerics", help="folder of the two runs (bf16/, fp8/) and "
                    "numerics.json (default %(default)s)")
    _add_set(bn)
    bn.set_defaults(func=_cmd_bench_numerics)
    bk = bsub.add_parser("kernels", help="Triton kernel benchmarks (gemray.bench.kernels)",
                         prefix_chars="+")  # every option after `kernels` goes to gemray.bench.kernels
    bk.add_argument("args", nargs=argparse.REMAINDER, help="passed to gemray.bench.kernels")
    bk.set_defaults(func=_cmd_bench_kernels)

    try:
        from gemray.controller.submit import add_submit_arguments
    except ImportError:  # pragma: no cover - submit needs ray[default]'s job client
        add_submit_arguments = None
    if add_submit_arguments is not None:
        sm = sub.add_parser("submit", help="submit a job to a running Ray cluster (ray job submit)",
                            description="Submit a gemray task (train, or prepare) to a running Ray cluster's job "
                                        "server (gemray.submit): the config is validated here and sent with the "
                                        "job; paths in it are read on the cluster. Waits for the job and prints "
                                        "its result unless --no-wait.")
        add_submit_arguments(sm)
        sm.set_defaults(func=_cmd_submit)
    # options after the subcommand go to gemray.k8s untouched: no option prefix of its own ("+" never starts an
    # argument here), no argparse help; the subcommand is checked in _cmd_k8s
    _add_serve_parsers(sub)
    k8 = sub.add_parser("k8s", help="KubeRay manifests: render from a config, validate against the CRDs",
                        prefix_chars="+", add_help=False, usage=_K8S_HELP.splitlines()[0][len("usage: "):])
    k8.add_argument("k8s_command", nargs="?", metavar="{render,validate,regenerate}",
                    help="render a manifest from a config, validate manifests, regenerate deploy/*.yaml")
    k8.add_argument("args", nargs=argparse.REMAINDER, help="see `gemray k8s render --help`")
    k8.set_defaults(func=_cmd_k8s)
    _add_verbosity_everywhere(ap)
    _name_subcommands(ap)
    return ap


def _name_subcommands(parser: argparse.ArgumentParser) -> None:
    """Show every sub-command group by its choices: a missing one then reads "the following arguments are required:
    {bbs,train,numerics,kernels}", not the group's internal name ("bench", "dataset", "command")."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            if action.metavar is None:
                action.metavar = "{" + ",".join(action.choices) + "}"
            for child in action.choices.values():
                _name_subcommands(child)


LOG_LEVELS = ("debug", "info", "warning", "error")


def _version() -> str:
    from gemray import __version__

    return __version__


def _add_verbosity(p: argparse.ArgumentParser, *, top: bool) -> None:
    """``-v`` / ``--log-level`` on ``p``. Below the top level their default is SUPPRESS, so that
    ``gemray -v train ...`` and ``gemray train ... -v`` both work and a subcommand never resets the top's."""
    dflt = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("-v", "--verbose", action="store_true", **({"default": False} if top else dflt),
                   help="debug logging; in a training run (gemray train) also every line of Ray and the workers on "
                        "the console (default: gemray's own lines and warnings; the run's full log is in "
                        "<output>/logs/gemray.log)")
    p.add_argument("--log-level", choices=LOG_LEVELS, **({"default": "info"} if top else dflt),
                   help="gemray's console log level (default info; -v = debug)")


def _add_verbosity_everywhere(ap: argparse.ArgumentParser) -> None:
    """Give every subcommand parser (recursively) the ``-v`` / ``--log-level`` options, except those that pass
    their options on untouched (``prefix_chars="+"``: bench kernels, k8s)."""
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                if sp.prefix_chars == "-":
                    _add_verbosity(sp, top=False)
                    _add_verbosity_everywhere(sp)


def log_level(ns: argparse.Namespace) -> int:
    """Pure: the console log level of gemray's loggers for parsed arguments ``ns``."""
    return logging.DEBUG if ns.verbose else getattr(logging, ns.log_level.upper())


#: Loggers of other libraries whose warnings are about how gemray calls them, not about the user's job:
#: TorchRec's planner ("The topology was constructed directly ...", "known issue with TorchRec's dense tensor
#: size calculation in dry run") and torch.fx's "is_fx_tracing will return true for both ...".
_INTERNAL_WARNING_LOGGERS = ("torchrec.distributed.planner", "torch.fx._symbolic_trace")


@contextmanager
def _quiet_libraries(verbose: bool) -> Iterator[None]:
    """For the commands other than train (which has its own console, gemray.controller.console): while the
    command runs, hide other libraries' deprecation notices (FutureWarning / DeprecationWarning: TorchRec's
    ``broadcast_buffers``, DCP's "Please use DTensor instead ... ShardedTensor") and the warnings of
    ``_INTERNAL_WARNING_LOGGERS``, which address gemray's code rather than the user (``gemray evaluate`` printed
    12 such lines around its 4 own). Other warnings stay. ``verbose`` (-v): nothing is hidden. The warning filters
    and logger levels are restored afterwards."""
    if verbose:
        yield
        return
    import warnings

    loggers = [logging.getLogger(name) for name in _INTERNAL_WARNING_LOGGERS]
    saved = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, lvl in zip(loggers, saved):
                lg.setLevel(lvl)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gemray`` console script; returns the exit status."""
    ap = build_parser()
    ns = ap.parse_args(argv)
    level = log_level(ns)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    train = getattr(ns, "func", None) is _cmd_train
    if not train and not ns.verbose:
        # a quiet console for the other commands too (train has its own, gemray.controller.console): other
        # libraries' INFO (FBGEMM's "Successfully loaded" lines) only with -v; TorchRec's sharding chatter comes
        # then as gemray.parallel.sharding DEBUG (torchrec_logs_at_debug)
        logging.getLogger().setLevel(max(level, logging.WARNING))
        logging.getLogger("gemray").setLevel(level)
    if getattr(ns, "world_size", None) is not None and ns.world_size < 1:
        return _fail(f"--world-size must be >= 1, got {ns.world_size}")
    # prepare: SIGTERM cleans up as Ctrl-C does (train has its own handler: a preemption notice)
    signals = _sigterm_raises() if ns.command == "prepare" else nullcontext()
    try:
        with signals, _quiet_libraries(ns.verbose or train):
            return ns.func(ns)
    except USER_ERRORS as e:
        return _fail(str(e))
    except Terminated:
        return _fail("terminated (SIGTERM)", EXIT_TERMINATED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
