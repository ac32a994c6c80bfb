"""A quiet console for ``gemray train``, and the full log in the run folder.

By default the console shows gemray's own lines (the driver's prints and log records, the workers' ``gemray.*``
log lines that Ray forwards to the driver) and warnings of the driver's Ray; everything else the driver and the
workers write (FBGEMM's "Successfully loaded" lines, Ray Train and Ray Data chatter,
the PlacementGroupCleaner's "multiple active Ray instances" / "Failed to query Ray Train Controller actor
state" lines, library warnings) goes only to ``<output>/logs/gemray.log``, which gets every line and every log
record of the driver at DEBUG. ``-v`` shows everything on the console as well.

How: Ray forwards the workers' stdout / stderr to the driver, printing each line with a ``(Actor pid=N)``
prefix to ``sys.stdout`` / ``sys.stderr`` (``ray._private.worker.print_to_stdstream``); :func:`console_session`
puts a :class:`FilteredStream` in their place, which writes every line to the log and the lines
:func:`keep_line` accepts to the terminal. Output that libraries write to file descriptor 1/2 directly (C++
code in the driver) bypasses Python and is not filtered. On a terminal, rank 0's progress lines become a tqdm bar
per epoch (:class:`ProgressBar`); elsewhere (a pipe, a file, CI) they stay plain lines.

The log file is opened once the run owns the output folder (``fit`` writes the run's ``config.toml`` there after
its pre-flight checks): lines before that are held in memory, and dropped when the run is refused, so a refused
run leaves nothing behind.

``fit`` called from Python (no CLI) writes the same log (:func:`run_log`): the same session with the console left as
it was (every line shown, log records at the levels the loggers had); under ``gemray train`` it uses the CLI's
session, one handler.

:func:`keep_line` is pure; :class:`FilteredStream`, :class:`RunLog`, :func:`console_session` and :func:`run_log` act.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

LOG_NAME = "logs/gemray.log"  #: the full log, relative to the run's output folder

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray's prefix of a forwarded worker line: "(RayTrainWorker pid=123)", "(pid=123, ip=10.0.0.1)", "(raylet)"
_RAY_PREFIX = re.compile(r"^\((?:[^()]*?\s)?(?:pid=[^)]*|raylet|autoscaler)\)\s?")
# gemray's log format (cli.main and the workers' gemray.train._setup_logging): "HH:MM:SS gemray.x LEVEL msg"
_GEMRAY_RECORD = re.compile(r"^\d\d:\d\d:\d\d gemray(?:\.[\w.]+)? (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
# Ray's own driver-side log format: "2026-12-02 04:06:22,714<TAB>WARNING file.py:85 -- message"
_RAY_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s")

def keep_line(line: str, *, level: int = logging.INFO, verbose: bool = False) -> bool:
    """Pure: whether a console line (ANSI colours allowed, no newline) is shown on the terminal.

    Shown: everything when ``verbose``; a worker line forwarded by Ray only when it is a gemray log record of
    ``level`` or above; a driver line that is a Ray log record only at WARNING or above; any other driver line
    (gemray's prints, the results table, a traceback of the driver) always."""
    if verbose:
        return True
    text = _ANSI.sub("", line)
    worker = _RAY_PREFIX.match(text)
    if worker:
        m = _GEMRAY_RECORD.match(text[worker.end():])
        return bool(m) and logging.getLevelName(m.group(1)) >= level
    m = _RAY_RECORD.match(text)
    if m:
        return logging.getLevelName(m.group(1)) >= logging.WARNING
    m = _GEMRAY_RECORD.match(text)
    if m:
        return logging.getLevelName(m.group(1)) >= level
    return True


class RunLog:
    """The full log file ``<output>/logs/gemray.log``, appended to from several threads: held in memory until
    the run owns the folder (``fit`` has written this run's ``config.toml`` there, after every pre-flight check;
    checked at each write), then written line by line (flushed: a killed run keeps its lines). A run refused
    before that leaves no log. A log that cannot be created is given up with one warning on ``fallback``."""

    def __init__(self, output: Path, fallback: TextIO):
        self.path = Path(output) / LOG_NAME
        self._config = Path(output) / "config.toml"
        self._t0 = time.time() - 2.0  # file system timestamps may be coarse
        self._fallback = fallback
        self._pending: list[str] = []
        self._file: TextIO | None = None
        self._failed = False
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            if self._failed:
                return
            if self._file is None:
                self._pending.append(text)
                if not self._owned():
                    return
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = open(self.path, "a", encoding="utf-8")
                except OSError as e:
                    self._failed = True
                    self._pending.clear()
                    self._fallback.write(f"gemray: warning: no log file: cannot write {self.path} ({e})\n")
                    return
                text, self._pending = "".join(self._pending), []
            self._file.write(text)
            self._file.flush()

    def _owned(self) -> bool:
        try:
            return self._config.stat().st_mtime >= self._t0
        except OSError:
            return False

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            self._pending.clear()
            self._failed = True  # a handler that outlives the session (Ray's) writes nowhere now


# rank 0's progress line (gemray.train.stats.progress_line) as Ray forwards it
_PROGRESS = re.compile(r"gemray\.train INFO epoch (\d+) step (\d+)/(\d+) \(global \d+\) loss (\S+), "
                       r"(?:lr (\S+), )?(\d+) samples/s, .* ETA (\S+)$")


def parse_progress(line: str) -> tuple[int, int, int, str] | None:
    """Pure: ``(epoch, step, steps, postfix)`` of a console line carrying rank 0's progress line, else None.
    The postfix (the bar's text) keeps the loss, the learning rate when the line has one, samples/s and ETA."""
    m = _PROGRESS.search(_ANSI.sub("", line))
    if not m:
        return None
    lr = "" if m.group(5) is None else f"lr {m.group(5)}, "
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)),
            f"loss {m.group(4)}, {lr}{m.group(6)} samples/s, ETA {m.group(7)}")


class ProgressBar:
    """On a terminal: rank 0's progress lines drawn as one tqdm bar per epoch (step N/M, rate, ETA) instead of
    printed one by one. Not thread-safe by itself: :class:`FilteredStream` calls it under its lock."""

    def __init__(self, terminal: TextIO):
        self.terminal = terminal
        self.bar = None
        self.epoch = None

    def update(self, epoch: int, step: int, steps: int, postfix: str) -> None:
        from tqdm import tqdm

        if self.bar is None or self.epoch != epoch or self.bar.total != steps:
            self.close()
            # the width once per epoch; a terminal that reports 0 columns (a bare pty) gets 100
            width = shutil.get_terminal_size((100, 20)).columns
            self.bar = tqdm(total=steps, desc=f"epoch {epoch}", unit="step", file=self.terminal, leave=True,
                            ncols=width, mininterval=0,
                            # rate and ETA from rank 0's line (the postfix): Ray forwards lines in batches, so
                            # tqdm's own timing of the updates would be the forwarding's, not the training's
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}{postfix}]")
            self.epoch = epoch
        self.bar.update(max(0, step - self.bar.n))
        self.bar.set_postfix_str(postfix)
        if step >= steps:
            self.close()

    def write(self, line: str) -> None:
        """``line`` above the bar."""
        if self.bar is not None:
            self.bar.clear()
        self.terminal.write(line + "\n")
        if self.bar is not None:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class FilteredStream:
    """A text stream in place of ``sys.stdout`` / ``sys.stderr``: each complete line goes to ``log`` (ANSI
    colours removed) and, when :func:`keep_line` accepts it, to ``terminal``; with ``bar`` (a terminal), rank
    0's progress lines drive it instead. Other attributes (``isatty``, ``fileno``, ``encoding``) are the
    terminal's."""

    def __init__(self, terminal: TextIO, log: RunLog, *, level: int, verbose: bool, bar: ProgressBar | None = None):
        self.terminal, self.log, self.level, self.verbose, self.bar = terminal, log, level, verbose, bar
        self._buf = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._buf += text
            *lines, self._buf = self._buf.split("\n")
            for line in lines:
                self.log.write(_ANSI.sub("", line) + "\n")
                if not keep_line(line, level=self.level, verbose=self.verbose):
                    continue
                progress = parse_progress(line) if self.bar is not None else None
                if progress is not None:
                    self.bar.update(*progress)
                elif self.bar is not None:
                    self.bar.write(line)
                else:
                    self.terminal.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.terminal.flush()

    def __getattr__(self, name: str):
        return getattr(self.terminal, name)


class _ConsoleFilter(logging.Filter):
    """Driver log records on the console: gemray's at ``level``, third-party ones at WARNING (all: verbose)."""

    def __init__(self, level: int, verbose: bool):
        super().__init__()
        self.level, self.verbose = level, verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "gemray" or record.name.startswith("gemray."):
            return record.levelno >= self.level
        return self.verbose or record.levelno >= logging.WARNING


class _RunLogHandler(logging.Handler):
    def __init__(self, log: RunLog):
        super().__init__(logging.DEBUG)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.write(self.format(record) + "\n")
        except Exception:  # logging must never break the run
            self.handleError(record)


class _AsBefore(logging.Filter):
    """A root handler's records as they were before the session lowered the root logger to DEBUG: a record
    passes when it is at or above the level its logger had then (its own, an ancestor's, or ``root_level``)."""

    def __init__(self, root_level: int):
        super().__init__()
        self.root_level = root_level

    def filter(self, record: logging.LogRecord) -> bool:
        lg = logging.getLogger(record.name)
        while lg.level == logging.NOTSET and lg.parent is not None:
            lg = lg.parent
        return record.levelno >= (self.root_level if lg.parent is None else lg.level)


class _LastResort(logging.Handler):
    """Stands in for ``logging.lastResort`` while the run log is the root's only handler: a record that no
    handler below the root takes goes to it, as it did before the run log's handler existed (Python prints such
    warnings to stderr only when no handler at all takes them)."""

    def __init__(self, root_level: int):
        super().__init__(logging.lastResort.level)
        self.addFilter(_AsBefore(root_level))

    def emit(self, record: logging.LogRecord) -> None:
        lg = logging.getLogger(record.name)
        while lg.parent is not None:
            if lg.handlers:
                return
            lg = lg.parent
        logging.lastResort.handle(record)


#: the log file of each open session (resolved path -> RunLog): :func:`run_log` joins one instead of opening twice
_OPEN: dict[Path, RunLog] = {}


@contextmanager
def console_session(output: str | Path, *, level: int = logging.INFO, verbose: bool = False,
                    keep_console: bool = False) -> Iterator[RunLog]:
    """``with console_session(output_dir, level=..., verbose=...) as log:`` the quiet console and the full log
    (:class:`RunLog` at ``output_dir/logs/gemray.log``) for the block: the root logger's handlers that print to
    the terminal filtered (gemray's loggers at ``level``, third-party ones at WARNING; everything when
    ``verbose``; their own logger levels are left as they are, so torch's INFO stays off), a DEBUG handler to the
    log file added, ``sys.stdout`` / ``sys.stderr`` replaced by :class:`FilteredStream`.

    ``keep_console`` (``fit`` from Python, :func:`run_log`): the same log, the console as it was: every line
    shown, and each of the root's handlers gets the records it got before (:class:`_AsBefore`; with no handler
    at all, Python's last-resort stderr printer keeps printing warnings, :class:`_LastResort`); ``level`` and
    ``verbose`` are unused. Everything is restored on the way out."""
    out_term, err_term = sys.stdout, sys.stderr
    log = RunLog(Path(output), err_term)
    key = log.path.resolve()
    root = logging.getLogger()
    saved_level = root.level
    if keep_console:
        filtered, console_filter = list(root.handlers), _AsBefore(saved_level)
    else:  # the root's handlers that print to the terminal (cli.main's basicConfig one) get the console filter
        filtered = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
                    and getattr(h, "stream", None) in (out_term, err_term)]
        console_filter = _ConsoleFilter(level, verbose)
    for h in filtered:
        h.addFilter(console_filter)
    added = [_LastResort(saved_level)] if keep_console and not root.handlers and logging.lastResort else []
    to_file = _RunLogHandler(log)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    added.append(to_file)
    for h in added:
        root.addHandler(h)
    root.setLevel(logging.DEBUG)
    shown = verbose or keep_console
    tty = getattr(err_term, "isatty", lambda: False)()
    bar = ProgressBar(err_term) if tty and not shown else None  # Ray prints the workers' stderr to stderr
    sys.stdout = FilteredStream(out_term, log, level=level, verbose=shown)
    sys.stderr = FilteredStream(err_term, log, level=level, verbose=shown, bar=bar)
    _OPEN[key] = log
    try:
        yield log
    finally:
        _OPEN.pop(key, None)
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, FilteredStream) and stream._buf:
                stream.write("\n")
        sys.stdout, sys.stderr = out_term, err_term
        if bar is not None:
            bar.close()
        for h in added:
            root.removeHandler(h)
        for h in filtered:
            h.removeFilter(console_filter)
        root.setLevel(saved_level)
        log.close()


@contextmanager
def run_log(output: str | Path) -> Iterator[RunLog]:
    """``with run_log(output_dir) as log:`` what ``fit`` runs in: the full log ``output_dir/logs/gemray.log``.
    Under ``gemray train`` the CLI's :func:`console_session` for that folder is open already and is used as it
    is (one handler, one copy of each line); otherwise (``fit`` from Python) a :func:`console_session` with
    ``keep_console`` for the block, closed on the way out, as the CLI's is."""
    log = _OPEN.get((Path(output) / LOG_NAME).resolve())
    if log is not None:
        yield log
        return
    with console_session(output, keep_console=True) as log:
        yield log
