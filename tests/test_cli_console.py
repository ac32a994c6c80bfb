"""The ``gemray`` command line as a user meets it: ``--version``, verbosity options after the subcommand, and
no torch / ray import for the subcommands that do not train (``gemray --help``, ``gemray prepare``)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from paths import DATA

from gemray.cli import build_parser, log_level

REPO = Path(__file__).resolve().parents[1]
SMALL = DATA / "ml-latest-small"

_HEAVY = ("torch", "ray", "torchrec", "fbgemm_gpu", "triton")

# Runs gemray.cli.main(argv) in a fresh interpreter, then prints the heavy modules it imported as JSON.
_PROBE = """
import json, sys
from gemray.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:  # --help / --version exit through argparse
    rc = e.code
print("HEAVY=" + json.dumps([m for m in %r if m in sys.modules]))
sys.exit(rc or 0)
""" % (_HEAVY,)


def _heavy_imports(*argv: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("HEAVY="))
    return json.loads(line[len("HEAVY="):])


def test_help_imports_neither_torch_nor_ray():
    assert _heavy_imports("--help") == []
    assert _heavy_imports("train", "--help") == []


def test_prepare_imports_neither_torch_nor_ray(tmp_path):
    if not (SMALL / "ratings.csv").is_file():
        pytest.skip(f"needs {SMALL}")
    assert _heavy_imports("prepare", "movielens", "--src", str(SMALL), "--out", str(tmp_path / "p"),
                          "--num-files", "2", "-v") == []
    assert (tmp_path / "p" / "manifest.json").is_file()


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"gemray {version('gemray')}"


@pytest.mark.parametrize("argv, level", [
    (["train", "--config", "c.toml"], "INFO"),
    (["train", "--config", "c.toml", "-v"], "DEBUG"),
    (["-v", "train", "--config", "c.toml"], "DEBUG"),
    (["train", "--config", "c.toml", "--log-level", "warning"], "WARNING"),
    (["--log-level", "error", "train", "--config", "c.toml"], "ERROR"),
    (["prepare", "movielens", "--src", "a", "--out", "b", "--verbose"], "DEBUG"),
    (["bench", "bbs", "--config", "c.toml", "--log-level", "debug"], "DEBUG"),
])
def test_verbosity_before_or_after_the_subcommand(argv, level):
    import logging

    assert logging.getLevelName(log_level(build_parser().parse_args(argv))) == level


@pytest.mark.parametrize("verbose", [False, True])
def test_quiet_libraries_hides_deprecations_and_internal_warnings(verbose, caplog):
    """evaluate / recommend / export / bench: other libraries' deprecation notices and the TorchRec planner's /
    torch.fx's warnings about gemray's own calls are hidden unless -v; other warnings stay; all restored after."""
    import logging
    import warnings

    from gemray.cli import _quiet_libraries

    planner = logging.getLogger("torchrec.distributed.planner.types")
    fx = logging.getLogger("torch.fx._symbolic_trace")
    before = (planner.level, fx.level)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with caplog.at_level(logging.WARNING), _quiet_libraries(verbose):
            warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
            warnings.warn("broadcast_buffers is deprecated", DeprecationWarning)
            warnings.warn("a user-facing warning", UserWarning)
            planner.warning("The topology was constructed directly")
            fx.warning("is_fx_tracing will return true")
            logging.getLogger("gemray.serve").warning("gemray's own warning")
        warnings.warn("after", FutureWarning)
    shown = [str(w.message) for w in seen]
    logged = [r.getMessage() for r in caplog.records]
    assert "a user-facing warning" in shown and "after" in shown and "gemray's own warning" in logged
    hidden = {"Please use DTensor instead and we are deprecating ShardedTensor.", "broadcast_buffers is deprecated",
              "The topology was constructed directly", "is_fx_tracing will return true"}
    if verbose:
        assert hidden <= set(shown) | set(logged)
    else:
        assert not hidden & (set(shown) | set(logged)), (shown, logged)
    assert (planner.level, fx.level) == before
