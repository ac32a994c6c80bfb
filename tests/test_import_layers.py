"""The import-layering contracts of pyproject.toml ([tool.importlinter]), checked with import-linter's `lint-imports`.

grimp, which import-linter uses, finds a package's modules by walking its folder; gemray.kernels and gemray.pipelines
live outside gemray/ (pyproject's package-dir), so `lint-imports` is run over a link tree laid out as the installed
package: gemray/ with kernels/ and pipelines/ inside it, every file a symlink to the checkout's. A plain
`lint-imports` in the checkout fails with "Missing layer in container 'gemray': module gemray.kernels does not exist".

By hand, with lint-imports' own report: `make lint-imports` (this file run as a script; arguments after it go to
lint-imports, e.g. `make lint-imports ARGS="--contract layers --show-timings"`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"


def _lint_imports() -> str:
    exe = Path(sys.executable).parent / "lint-imports"
    found = str(exe) if exe.is_file() else shutil.which("lint-imports")
    if not found:
        pytest.fail("lint-imports not found: install the test extra (`make install` or `pip install import-linter`)")
    return found


def _link_tree(src: Path, dst: Path) -> None:
    """dst mirrors src: real folders, each file a symlink (so probes can be added to dst without touching src)."""
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out = dst / Path(root).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for f in files:
            if f.endswith(".py"):
                (out / f).symlink_to(Path(root) / f)


def _package_tree(tmp: Path) -> Path:
    """tmp/gemray as the installed package: gemray/ plus every package-dir mapping (kernels/, pipelines/)."""
    mapping = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    _link_tree(REPO / "gemray", tmp / "gemray")
    for package, folder in mapping.items():
        assert package.startswith("gemray."), package
        _link_tree(REPO / folder, tmp.joinpath(*package.split(".")))
    return tmp


def _run(tree: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))  # the link tree's gemray, not the editable install's
    # --no-cache: a cache in the temporary tree would go with it (and none is left in the checkout)
    return subprocess.run([_lint_imports(), "--no-cache", "--no-logo", *args, str(PYPROJECT)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def test_contracts_kept(tmp_path):
    out = _run(_package_tree(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in out.stdout, out.stdout


def test_contracts_catch_upward_imports(tmp_path):
    """A kernel importing the model and a pipeline importing a kernel each break their contract, and a new
    gemray module that the layers do not place breaks the layers contract (it is exhaustive)."""
    tree = _package_tree(tmp_path)
    (tree / "gemray" / "kernels" / "_probe_up.py").write_text("import gemray.model.hstu\n")
    (tree / "gemray" / "pipelines" / "_probe_model.py").write_text("from gemray.kernels import reference\n")
    (tree / "gemray" / "probe_unplaced.py").write_text("")
    out = _run(tree)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Contracts: 0 kept, 2 broken." in out.stdout, out.stdout
    assert "gemray.kernels._probe_up -> gemray.model.hstu" in out.stdout, out.stdout
    assert "gemray.pipelines._probe_model -> gemray.kernels.reference" in out.stdout, out.stdout
    assert "gemray.probe_unplaced" in out.stdout, out.stdout


def test_make_lint_imports_runs_the_contracts_by_hand():
    """A plain `lint-imports` in a fresh venv failed ("module gemray.kernels does not exist") although this test
    passed: `make lint-imports` (documented in the README) runs it over the link tree and prints its report; its
    ARGS go to lint-imports."""
    venv = Path(sys.prefix)  # this interpreter's venv; -o: take its install as done
    make = ["make", "-s", "-C", str(REPO), "-o", f"{venv}/bin/.installed", f"VENV={venv}", "lint-imports"]
    out = subprocess.run(make, capture_output=True, text=True, timeout=300)
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"Contracts: {len(contracts)} kept, 0 broken." in out.stdout, out.stdout
    out = subprocess.run([*make, "ARGS=--contract layers"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Contracts: 1 kept, 0 broken." in out.stdout, out.stdout + out.stderr

def main(argv: list[str]) -> int:
    """`make lint-imports`: lint-imports over a fresh link tree, its report printed and its exit status returned;
    ``argv`` goes to lint-imports (e.g. ["--contract", "layers", "--verbose"])."""
    with tempfile.TemporaryDirectory(prefix="gemray-lint-imports-") as tmp:
        out = _run(_package_tree(Path(tmp)), *argv)
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr)
    return out.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
