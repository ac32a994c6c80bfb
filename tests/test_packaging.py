"""pyproject.toml declares what the package imports: every third-party top-level import of gemray/, kernels/ and
pipelines/ is a dependency or an extra's, the `cpu` and `cuda` extras each cover all that training imports, and
the tested constraints file pins every declared package."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONSTRAINTS = REPO / "configs" / "constraints-cpu.txt"
SOURCES = ("gemray", "kernels", "pipelines")
# import names whose distribution is not installed in the test venv (optional: asked for by an env flag)
NOT_INSTALLED = {"mlflow": "mlflow"}
# installed by the documented `pip install --no-deps torchrec` step on CPU (README "Install")
NO_DEPS_STEP = {"torchrec"}
# import names provided by another distribution in one of the stacks
ALTERNATIVES = {"fbgemm-gpu-cpu": "fbgemm-gpu"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_names(reqs: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs}


def _imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the source files (relative) importing it (absolute imports only)."""
    out: dict[str, set[str]] = {}
    for top in SOURCES:
        for path in (REPO / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    root = n.split(".")[0]
                    if root not in sys.stdlib_module_names and root not in ("gemray", "__future__"):
                        out.setdefault(root, set()).add(str(path.relative_to(REPO)))
    return out


@cache
def _installed() -> dict[str, list[str]]:
    return packages_distributions()


def _dists(module: str) -> set[str]:
    if module in NOT_INSTALLED:
        return {NOT_INSTALLED[module]}
    found = _installed().get(module)
    assert found, f"import {module!r} belongs to no installed distribution"
    return {_norm(d) for d in found}


def test_every_import_is_declared():
    base = _req_names(PYPROJECT["project"]["dependencies"])
    extras = {k: _req_names(v) for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    declared = base.union(*extras.values())
    cpu = base | extras["cpu"] | NO_DEPS_STEP
    cuda = base | extras["cuda"]
    missing, cpu_gaps, cuda_gaps = {}, {}, {}
    for module, files in sorted(_imports().items()):
        dists = _dists(module)
        options = dists | {ALTERNATIVES[d] for d in dists if d in ALTERNATIVES}
        if not options & declared:
            missing[module] = sorted(files)
        optional = module in NOT_INSTALLED or all(f.startswith("gemray/k8s/") for f in files)
        if not optional and not options & cpu:
            cpu_gaps[module] = sorted(files)
        if not optional and not options & cuda:
            cuda_gaps[module] = sorted(files)
    assert not missing, f"imported but in no dependency or extra of pyproject.toml: {missing}"
    assert not cpu_gaps, f"not installed by `pip install .[cpu]` + the torchrec --no-deps step: {cpu_gaps}"
    assert not cuda_gaps, f"not installed by `pip install .[cuda]`: {cuda_gaps}"


def test_the_scanner_sees_the_stack():  # guards the test above against scanning nothing
    seen = set(_imports())
    assert {"torch", "ray", "torchrec", "pyarrow", "triton", "fbgemm_gpu", "numpy"} <= seen


def test_constraints_pin_every_declared_package():
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, ver = line.partition("==")
            assert ver, f"{CONSTRAINTS.name}: {line!r} is not name==version"
            pins[_norm(name)] = ver
    base = _req_names(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    needed = base | _req_names(extras["cpu"]) | _req_names(extras["test"]) | _req_names(extras["k8s"]) | NO_DEPS_STEP
    assert not needed - set(pins), f"{CONSTRAINTS.name} lacks pins for {sorted(needed - set(pins))}"
    assert "fbgemm-gpu" not in pins  # the CPU stack: fbgemm-gpu-cpu only (the same fbgemm_gpu folder)
