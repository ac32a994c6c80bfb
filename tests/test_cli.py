"""The ``gemray`` CLI: argument parsing, one-line user errors with exit status 2, prepare + bench bbs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from paths import DATA

from gemray.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "ml-latest-small.toml")
SMALL = DATA / "ml-latest-small"


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, no traceback
    assert err[0].startswith("gemray: error: ")
    return err[0]


@pytest.mark.parametrize("sets, needle", [
    (["train.epochs=abc"], "train.epochs: expected int, got 'abc'"),
    (["train.lr_base_fan_in=16.5"], "train.lr_base_fan_in: expected int, got '16.5'"),  # 16.0 is taken as 16
    (["bogus.x=1"], "unknown section 'bogus'"),
    (["train.nope=1"], "unknown key train.nope"),
    (["train.epochs"], "expected section.key=value"),
    (["train.epochs=0"], "train.epochs: expected > 0"),
])
def test_bad_set_is_one_line_exit_2(capsys, sets, needle):
    assert main(["train", "--config", CONFIG, "--set", *sets]) == 2
    assert needle in _err_line(capsys)


def test_train_dry_run_prints_the_resolved_config_and_starts_nothing(capsys, tmp_path):
    """``gemray train --dry-run`` (what ``make demo`` runs before it prepares data): the config with its --set values
    as TOML (loadable again, the values applied), exit 0, no output folder; a bad value is the same one-line exit 2."""
    import tomllib

    from gemray.config import load_config

    out = tmp_path / "run"
    assert main(["train", "--config", CONFIG, "--set", "train.epochs=3", "data.batch_size=48", "--output", str(out),
                 "--dry-run"]) == 0
    cap = capsys.readouterr()
    resolved = tomllib.loads(cap.out)
    assert resolved["train"]["epochs"] == 3 and resolved["data"]["batch_size"] == 48
    written = tmp_path / "resolved.toml"
    written.write_text(cap.out)
    assert load_config(written) == load_config(CONFIG, ["train.epochs=3", "data.batch_size=48"])
    assert "is valid with 2 --set value(s)" in cap.err and str(out) in cap.err
    assert not out.exists()
    assert main(["train", "--config", CONFIG, "--set", "train.epochs=0", "--dry-run"]) == 2
    assert "train.epochs: expected > 0" in _err_line(capsys)


@pytest.mark.parametrize("argv, line", [
    (["prepare", "movielens", "--src", "{src}", "--out", "{out}", "--num-files", "0"],
     "--num-files: expected an integer >= 1, got 0"),
    (["prepare", "synthetic", "--out", "{out}", "--users", "5", "--items", "5", "--seed", "1", "--max-len", "20",
      "--mean-len", "10", "--num-files", "0"], "--num-files: expected an integer >= 1, got 0"),
    (["prepare", "interactions", "--src", "{src}/log.csv", "--out", "{out}", "--num-files", "-1"],
     "--num-files: expected an integer >= 0 (0 = auto), got -1"),  # 0 = auto there
    (["train", "--config", CONFIG, "--set", "data.num_files=0", "--output", "{out}"],
     "data.num_files: expected an integer >= 1, got 0"),
])
def test_num_files_below_its_bound_is_one_refusal_naming_its_source(argv, line, capsys, tmp_path):
    """--num-files 0 was refused in three wordings by prepare movielens / synthetic / interactions ("num_files
    (--num-files): expected >= 1, got 0", "--num-files: expected an integer >= 1, got 0", "--num-files -1: expected
    >= 0 (0 = auto); row_groups_per_file >= 1") and a fourth for data.num_files ("expected > 0"): one message from one
    place (gemray.config.check_num_files) naming the flag or the config key given; exit 2, nothing written."""
    from gemray.pipelines.movielens import prepare_movielens

    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("1\t1\t3\t100\n1\t2\t3\t101\n1\t3\t3\t102\n")
    (src / "log.csv").write_text("user_id,item_id,timestamp\nu1,i1,1\nu1,i2,2\nu1,i3,3\n")
    out = tmp_path / "out"
    assert main([a.format(src=src, out=out) for a in argv]) == 2
    assert _err_line(capsys) == f"gemray: error: {line}"
    assert not out.exists()
    with pytest.raises(ValueError, match=r"^data\.num_files: expected an integer >= 1, got 0$"):
        prepare_movielens(src, out, num_files=0, num_files_name="data.num_files")  # as gemray train prepares


def test_missing_config_and_source(capsys, tmp_path):
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "config file not found" in _err_line(capsys)
    assert main(["train", "--config", str(tmp_path)]) == 2
    assert "is a folder" in _err_line(capsys)
    assert main(["prepare", "movielens", "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in _err_line(capsys)
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nepochs = 1\n")
    assert main(["bench", "bbs", "--config", str(bad)]) == 2
    assert "invalid TOML" in _err_line(capsys)


def test_bench_options_refused_not_ignored(capsys):
    """--world-size 0 was taken as "the config's", and a malformed --tiles JSON was ignored under
    --host-profile (exit 0): both are one-line errors with status 2 (from the new-user check)."""
    assert main(["bench", "bbs", "--config", CONFIG, "--world-size", "0"]) == 2
    assert "--world-size must be >= 1, got 0" in _err_line(capsys)
    assert main(["bench", "kernels", "--host-profile", "--tiles", "{bad json"]) == 2
    err = capsys.readouterr().err
    assert "--tiles: not a tiles JSON" in err, err
    assert main(["bench", "kernels", "--host-profile", "--tiles", '{"nosuchregime": {}}']) == 2
    assert "--tiles: not a tiles JSON" in capsys.readouterr().err


def test_bench_bbs_needs_prepared_data(capsys, tmp_path):
    assert main(["bench", "bbs", "--config", CONFIG, "--set", f"data.prepared_dir={tmp_path / 'x'}"]) == 2
    assert "gemray prepare movielens" in _err_line(capsys)


def test_set_accepts_several_values_and_repeats():
    ns = build_parser().parse_args(["train", "--config", "c.toml", "--set", "a.b=1", "c.d=2",
                                    "--set", "e.f=3", "--output", "o"])
    assert ns.overrides == ["a.b=1", "c.d=2", "e.f=3"] and ns.output == "o"
    ns = build_parser().parse_args(["bench", "kernels", "--skip", "flex"])
    assert ns.args == ["--skip", "flex"]


@pytest.mark.skipif(not SMALL.is_dir(), reason="ml-latest-small not available")
def test_prepare_then_bench_bbs(capsys, tmp_path):
    out = tmp_path / "prep"
    assert main(["prepare", "movielens", "--src", str(SMALL), "--out", str(out), "--num-files", "2",
                 "--on-bad-rows", "quarantine"]) == 0
    text = capsys.readouterr().out
    assert "610 users" in text and "0 bad rows quarantined" in text
    assert main(["bench", "bbs", "--config", CONFIG, "--world-size", "2",
                 "--set", f"data.prepared_dir={out}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    without = [ln for ln in lines if "without BBS" in ln]
    with_ = [ln for ln in lines if "with BBS" in ln]
    assert len(without) == 1 and len(with_) == 1
    vals = [float(ln.split()[2]) for ln in (without[0], with_[0])]
    assert all(v >= 1.0 for v in vals)
    assert all("steps, last step " in ln for ln in (without[0], with_[0]))
    # 610 users at 2 x 320: one (partial) step, spread over both ranks, said in the singular (was "(1 steps")
    assert main(["bench", "bbs", "--config", CONFIG, "--world-size", "2",
                 "--set", f"data.prepared_dir={out}", "data.batch_size=320"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "BBS" in ln]
    assert len(lines) == 2 and all("(1 step, last step " in ln for ln in lines), lines


def test_console_script_exit_code(tmp_path):
    exe = Path(sys.executable).with_name("gemray")
    if not exe.exists():
        pytest.skip("gemray console script not installed (pip install -e .)")
    p = subprocess.run([str(exe), "train", "--config", CONFIG, "--set", "model.dropout=2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == "gemray: error: model.dropout: expected 0 <= dropout < 1, got 2.0"


def test_output_that_is_a_file_is_a_user_error(capsys, tmp_path):
    out = tmp_path / "a-file"
    out.write_text("not a folder")
    assert main(["train", "--config", CONFIG, "--output", str(out)]) == 2
    assert "is not a folder" in _err_line(capsys)
    assert out.read_text() == "not a folder"


def test_make_data_refuses_a_source_without_ml1m_ratings(tmp_path):
    """`make data` / `make demo` train MovieLens-1M from data/ml-1m: another release (no ratings.dat) is
    refused before `gemray prepare` would overwrite that folder."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "u.data").write_text("1\t2\t3\t881250949\n")  # an ml-100k-style source
    venv = tmp_path / "venv"  # not built: -o marks the install step as done, the guard runs first
    out = subprocess.run(["make", "-s", "-C", str(root), "-o", f"{venv}/bin/.installed", "data",
                          f"DATA_SRC={tmp_path}", f"VENV={venv}"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "holds no ratings.dat" in out.stderr and "data/ml-1m is left as it is" in out.stderr


@pytest.mark.parametrize("argv, err", [([], "a subcommand is required"), (["bogus"], "invalid choice: 'bogus'")])
def test_k8s_without_a_valid_subcommand(capsys, argv, err):
    """`gemray k8s` alone or with an unknown subcommand: exit 2, the usage line and one error naming the three
    subcommands (not argparse's "+h" usage or "-h" / "--help" among the choices)."""
    assert main(["k8s", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["usage: gemray k8s {render,validate,regenerate} ...",
                     f"gemray: error: k8s: {err} (choose from 'render', 'validate', 'regenerate')"], lines


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_k8s_help_lists_its_commands(capsys, flag):
    """`gemray k8s --help` (its options go to gemray.k8s untouched, so argparse's own -h is not there) prints
    the subcommands, exit 0; a subcommand's --help is gemray.k8s's."""
    assert main(["k8s", flag]) == 0
    out = capsys.readouterr().out
    assert "render --config FILE" in out and "validate FILES" in out and "regenerate FILES" in out


@pytest.mark.parametrize("argv, prog, extra", [
    (["train", "--config", CONFIG, "--sett", "train.epochs=1"], "train", "--sett train.epochs=1"),
    (["prepare", "movielens", "--src", "a", "--out", "b", "--bogus"], "prepare movielens", "--bogus"),
    (["bench", "train", "--config", CONFIG, "--stepz=3", "--json", "r.json"], "bench train", "--stepz=3"),
    (["evaluate", "--checkpoint", "runs/x", "--top=5"], "evaluate", "--top=5"),
])
def test_an_unknown_option_shows_the_subcommands_usage(argv, prog, extra, capsys):
    """`gemray train --config c.toml --sett x=y` (a mistyped option): exit 2 with train's usage, which lists its
    options, and the error under train's name (was: gemray's top-level usage, listing the subcommands only, and
    'gemray: error: unrecognized arguments'); nested subcommands (prepare movielens, bench train) likewise."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"usage: gemray {prog} ") and err[-1].startswith(f"gemray {prog}: error: "), err
    assert "unrecognized arguments: " in err[-1] and extra in err[-1], err


@pytest.mark.parametrize("argv, prog, choices", [
    ([], "gemray", "{prepare,train,preempt,bench,submit,evaluate,recommend,export,k8s}"),
    (["bench"], "gemray bench", "{bbs,train,numerics,kernels}"),
    (["prepare"], "gemray prepare", "{movielens,synthetic,interactions}"),
])
def test_a_missing_subcommand_is_named_by_its_choices(argv, prog, choices, capsys):
    """`gemray bench` alone: exit 2 naming the sub-commands it takes (was: "required: bench", argparse's internal
    name of the group)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"{prog}: error: the following arguments are required: {choices}", err


@pytest.mark.parametrize("argv, line", [
    (["evaluate", "runs/x"], "unexpected argument 'runs/x': give the run as --checkpoint runs/x"),
    (["recommend", "runs/x", "--user", "1"], "unexpected argument 'runs/x': give the run as --checkpoint runs/x"),
    (["export", "my runs/x", "--out", "serving"],
     "unexpected argument 'my runs/x': give the run as --checkpoint 'my runs/x'"),
    (["evaluate", "runs/x", "runs/y"], "unexpected arguments 'runs/x', 'runs/y': give the run as --checkpoint runs/x"),
    (["evaluate", "--checkpoint", "runs/x", "runs/y"],
     "both --checkpoint runs/x and the bare argument 'runs/y' were given: drop 'runs/y' (the run is given by "
     "--checkpoint alone)"),
    # the bare folder before --checkpoint said "give the run as --checkpoint runs/y", --checkpoint being there
    (["recommend", "runs/y", "--user", "1", "--checkpoint", "runs/x"],
     "both --checkpoint runs/x and the bare argument 'runs/y' were given: drop 'runs/y' (the run is given by "
     "--checkpoint alone)"),
    (["export", "runs/y", "runs/z", "--checkpoint", "my runs/x", "--out", "serving"],
     "both --checkpoint 'my runs/x' and the bare arguments 'runs/y', 'runs/z' were given: drop 'runs/y', 'runs/z' "
     "(the run is given by --checkpoint alone)"),
])
def test_serve_commands_name_the_flag_for_a_bare_run_folder(argv, line, capsys):
    """`gemray evaluate runs/x` (the run given bare, as a positional): exit 2 with the flag that names it (was
    argparse's 'the following arguments are required: --checkpoint', or 'unrecognized arguments: runs/x' beside
    --checkpoint); recommend and export share the parser's --checkpoint and say the same. With --checkpoint given
    too, before or after the bare folder, it says both were given and which to drop."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"usage: gemray {argv[0]} ") and err[-1] == f"gemray {argv[0]}: error: {line}", err


@pytest.mark.parametrize("out_of", [lambda tmp: Path("/proc/p1"),  # /proc takes no new folder, even from root
                                    lambda tmp: tmp / "a-file" / "sub" / "prepared"])
def test_prepare_refuses_an_out_it_cannot_create(capsys, tmp_path, out_of):
    """An --out whose folder takes no new folder was refused only after the source was parsed, with a raw errno
    line naming the internal temporary folder (`/proc/.p1.tmp-<pid>-...`): now one line naming --out and why."""
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    src = tmp_path / "src"
    src.mkdir()
    (src / "u.data").write_text("1\t2\t3\t4\n1\t3\t3\t5\n")
    (tmp_path / "a-file").write_text("not a folder")
    out = out_of(tmp_path)
    assert main(["prepare", "movielens", "--src", str(src), "--out", str(out)]) == 2
    err = _err_line(capsys)
    assert err.startswith(f"gemray: error: {out}: cannot create it: ") and err.endswith("choose another --out"), err
    assert ".tmp-" not in err and "[Errno" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "src"]  # no probe left behind


def test_k8s_validate_refuses_a_file_that_is_no_manifest(capsys, tmp_path):
    """`gemray k8s validate README.md` printed `error:` (not `gemray: error:`), exit 1, with PyYAML's multi-line
    message squashed into one (its source excerpt and caret inline, the stream named "<unicode string>"). A file
    that is no manifest at all is a usage error as a missing one is: one `gemray: error:` line naming the file and
    where the parser stopped, exit 2."""
    pytest.importorskip("yaml")
    md = tmp_path / "README.md"
    md.write_text("# gemray\n\nRay-orchestrated training. Data streams them\nas jagged: no padding.\n")
    assert main(["k8s", "validate", str(md), "--crds", str(tmp_path)]) == 2
    assert _err_line(capsys) == (f"gemray: error: {md}: not valid YAML: line 4, column 10: mapping values are not "
                                 "allowed here")
    md.write_text("# gemray\n\nRay-orchestrated: training\nData streams them as jagged\n")
    assert main(["k8s", "validate", str(md), "--crds", str(tmp_path)]) == 2
    assert _err_line(capsys) == (f"gemray: error: {md}: not valid YAML: line 5, column 1: could not find expected "
                                 "':' (while scanning a simple key at line 4, column 1)")
    md.write_text("just a sentence\n")
    assert main(["k8s", "validate", str(md), "--crds", str(tmp_path)]) == 2
    assert _err_line(capsys) == f"gemray: error: {md} (document 1): not a Kubernetes object (a str)"
