"""Run the README's "Cluster (ray job submit)" and "Kubernetes (KubeRay)" blocks as a new user would.

Each section's ```bash / ```python blocks run in order, in a fresh ``git clone`` of this repo (with
``../shared`` linked beside it), with the venv first on PATH and a throw-away HOME. Blocks preceded by
``<!-- not run by tests ... -->`` (they need a Kubernetes cluster) are skipped. For isolation from other
Ray users of this machine, ``ray start --head`` gets its own temp dir and free ports appended, port 8265
is mapped to the chosen dashboard port, and ``ray stop`` (which would stop every Ray process on the
machine) is replaced by stopping only the processes this test started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from paths import CRD_DIR, SHARED
from proc_utils import free_port, kill_marked

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SKIP_MARK = "<!-- not run by tests"


def section_blocks(text: str, heading: str) -> list[tuple[str, str]]:
    """``[(lang, code)]`` of the runnable fenced blocks under ``## heading`` (until the next ``## ``)."""
    m = re.search(rf"^## {re.escape(heading)}\s*$", text, re.M)
    if not m:
        return []
    body = text[m.end():]
    nxt = re.search(r"^## ", body, re.M)
    body = body[:nxt.start()] if nxt else body
    blocks = []
    for b in re.finditer(r"^```(\w+)\n(.*?)^```", body, re.M | re.S):
        before = body[:b.start()].rstrip().splitlines()
        if before and before[-1].startswith(SKIP_MARK):
            continue
        if b.group(1) in ("bash", "python"):
            blocks.append((b.group(1), b.group(2)))
    return blocks


def _docs() -> list[Path]:
    docs = [REPO / "deploy" / "README.md"]
    if (REPO / "README.md").is_file():
        docs.append(REPO / "README.md")
    return docs


def test_sections_present_and_identical_in_readme():
    dep = (REPO / "deploy" / "README.md").read_text()
    for heading in ("Cluster (ray job submit)", "Kubernetes (KubeRay)"):
        assert section_blocks(dep, heading), heading
        if (REPO / "README.md").is_file() and f"## {heading}" in (REPO / "README.md").read_text():
            assert section_blocks((REPO / "README.md").read_text(), heading) == section_blocks(dep, heading)


def test_section_parser_skips_marked_blocks():
    text = ("## A\n```bash\necho 1\n```\n<!-- not run by tests: x -->\n```bash\nkubectl x\n```\n"
            "```python\nprint(2)\n```\n## B\n```bash\necho 3\n```\n")
    assert section_blocks(text, "A") == [("bash", "echo 1\n"), ("python", "print(2)\n")]
    assert section_blocks(text, "C") == []


def _script(blocks: list[tuple[str, str]]) -> str:
    parts = ["set -euo pipefail"]
    for lang, code in blocks:
        if lang == "bash":
            parts.append(code)
        else:
            parts.append(f"python - <<'GEMRAY_PY_EOF'\n{code}GEMRAY_PY_EOF")
    return "\n".join(parts) + "\n"


def _sandbox(tmp: Path) -> tuple[Path, dict]:
    clone = tmp / "gemray"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    shared = SHARED
    if shared.is_dir():
        (tmp / "shared").symlink_to(shared)
    home = tmp / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
               VIRTUAL_ENV=str(VENV_BIN.parent), RAY_USAGE_STATS_ENABLED="0")
    return clone, env


def _has_cli(*words: str) -> bool:
    exe = VENV_BIN / "gemray"
    if not exe.exists():
        return False
    r = subprocess.run([str(exe), *words, "--help"], capture_output=True, timeout=60)
    return r.returncode == 0


@pytest.mark.skipif(not CRD_DIR.is_dir(), reason=f"no KubeRay CRDs at {CRD_DIR}")
def test_kubernetes_section_runs_up_to_validation(tmp_path):
    if not _has_cli("k8s", "render"):
        pytest.skip("`gemray k8s render` is not registered in gemray/cli.py yet")
    for doc in _docs():
        blocks = section_blocks(doc.read_text(), "Kubernetes (KubeRay)")
        if not blocks:
            continue
        work = tmp_path / doc.parent.name
        work.mkdir()
        clone, env = _sandbox(work)
        r = subprocess.run(["bash", "-c", _script(blocks)], cwd=clone, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"{doc}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert r.stdout.count(": ok") >= 2
        assert "kind: RayJob" in (clone / "runs" / "gemray-small.yaml").read_text()


@pytest.mark.slow  # Ray head + job submit + train, as the README: make test-slow (CI)
def test_cluster_section_runs_as_written(tmp_path):
    if not _has_cli("train"):
        pytest.skip("`gemray train` is not in gemray/cli.py yet")
    doc = _docs()[0]
    blocks = section_blocks(doc.read_text(), "Cluster (ray job submit)")
    clone, env = _sandbox(tmp_path)
    ray_tmp = Path(tempfile.mkdtemp(prefix="grr", dir="/tmp"))  # short: Ray's socket paths
    dash = free_port()
    iso = (f" --port {free_port()} --dashboard-port {dash} --temp-dir {ray_tmp}"
           f" --dashboard-agent-listen-port {free_port()} --dashboard-agent-grpc-port {free_port()}"
           f" --runtime-env-agent-port {free_port()} --metrics-export-port {free_port()}"
           f" --node-manager-port {free_port()} --object-manager-port {free_port()}"
           f" --ray-client-server-port {free_port()} --object-store-memory {300 * 1024**2}"
           " --disable-usage-stats")
    fixed = []
    for lang, code in blocks:
        code = code.replace("127.0.0.1:8265", f"127.0.0.1:{dash}")
        code = re.sub(r"^(ray start --head.*)$", lambda m: m.group(1) + iso, code, flags=re.M)
        code = re.sub(r"^ray stop\s*$", "true  # ray stop: replaced by the test's own teardown", code,
                      flags=re.M)
        fixed.append((lang, code))
    proc = subprocess.Popen(["bash", "-c", _script(fixed)], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=580)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"README cluster block timed out:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        kill_marked(str(ray_tmp))
    assert proc.returncode == 0, out[-4000:]
    assert "SUCCEEDED" in out
    assert (clone / "runs" / "cluster" / "metrics.json").is_file()  # not left in Ray's working-dir copy
    assert any((clone / "runs" / "cluster" / "ray").rglob("*")) and any((clone / "runs" / "cluster-py").rglob("*"))
    assert (clone / "runs" / "cluster-py" / "metrics.json").is_file()  # the Python example's own record
