"""benchmarks/ and deploy/: what lives where, and that the docs point at files that exist.

deploy/ holds deployment only; the GPU-machine scripts in benchmarks/ install the checkout in place and call the
`gemray` CLI (no copying the tree into a package layout, no kernel module internals); every script has its command
in benchmarks/README.md; reports are named <model>_<hardware>_<date>.md; the docs' links and script paths resolve.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.sh") if p.name != "h200_env.sh")  # h200_env.sh is sourced by them
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "deploy" / "README.md", BENCH / "README.md"]


def test_deploy_holds_deployment_only():
    allowed = re.compile(r"(Dockerfile(\.[\w.]+)?|README\.md|[\w-]+\.yaml)")
    stray = [p.name for p in (REPO / "deploy").iterdir() if not allowed.fullmatch(p.name)]
    assert not stray, f"deploy/ is for the image and the manifests; move these to benchmarks/: {stray}"


def test_scripts_install_in_place_and_call_the_cli():
    assert {p.name for p in SCRIPTS} >= {"kernels_h200.sh", "ml1m_h200.sh", "ml1m_ab_h200.sh"}
    for script in SCRIPTS:
        text = script.read_text()
        assert re.search(r"^\. benchmarks/h200_env\.sh\b", text, re.M), f"{script.name}: does not source h200_env.sh"
        assert not re.search(r"cp -r (kernels|pipelines|gemray)\b", text), f"{script.name}: copies the tree"
        assert "gemray.kernels" not in text, f"{script.name}: reaches into the kernel modules; use the CLI"
        assert "PYTHONPATH=$P" not in text and "/tmp/gemray-pkg" not in text, f"{script.name}: package layout"
    env = (BENCH / "h200_env.sh").read_text()
    assert "pip install -q --no-deps --no-build-isolation -e ." in env
    calls = "".join(p.read_text() for p in SCRIPTS)
    assert "gemray bench kernels" in calls and "gemray train" in calls


@pytest.mark.parametrize("script", SCRIPTS + [BENCH / "h200_env.sh"], ids=lambda p: p.name)
def test_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", "-x", str(script.relative_to(REPO))], cwd=REPO, capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stdout


def test_every_script_has_its_command_in_the_readme():
    readme = (BENCH / "README.md").read_text()
    for script in SCRIPTS:
        assert f"bash benchmarks/{script.name}`" in readme, f"benchmarks/README.md has no command for {script.name}"


def test_report_names():
    reports = sorted((BENCH / "reports").glob("*"))
    assert reports
    for r in reports:
        assert re.fullmatch(r"[a-z0-9-]+_[a-z0-9-]+_\d{4}-\d{2}-\d{2}\.md", r.name), r.name
    readme = (BENCH / "README.md").read_text()
    missing = [r.name for r in reports if f"(reports/{r.name})" not in readme]
    assert not missing, f"benchmarks/README.md does not list {missing}"


@pytest.mark.parametrize("doc", DOCS + sorted((BENCH / "reports").glob("*.md")), ids=lambda p: p.name)
def test_doc_paths_resolve(doc):
    text = doc.read_text()
    links = [m for m in re.findall(r"\]\(([^)#\s]+)\)", text) if not m.startswith(("http://", "https://"))]
    broken = [m for m in links if not (doc.parent / m).exists()]
    scripts = re.findall(r"\bbenchmarks/[\w./-]+\.(?:sh|md)\b", text)
    broken += [s for s in scripts if not (REPO / s).exists()]
    assert not broken, f"{doc.relative_to(REPO)}: no such file: {sorted(set(broken))}"
    if doc.parent == BENCH / "reports":
        return  # the reports quote the commands as they were run, old paths included
    assert "kernels/NOTES.md" not in text, f"{doc.relative_to(REPO)}: kernels/NOTES.md moved to benchmarks/reports/"
    # deploy/h200/ is gone: BENCHMARKS.md may name a script there only to say how a figure was run then
    stale = [m.group() for m in re.finditer(r"deploy/h200\b[\w./]*", text)
             if "run then as" not in text[max(0, m.start() - 200):m.start()]]
    assert not stale, f"{doc.relative_to(REPO)}: names moved scripts {stale}; benchmarks/README.md has their commands"
