"""Refuse to start, with one clear line, when the shared inputs the selected tests read are missing.

The tests convert the real MovieLens files and validate the deploy manifests against the KubeRay CRDs; both
live outside the repository (``tests/paths.py``: ``$GEMRAY_SHARED`` or ``../shared`` beside the checkout).
Without them most tests would fail one by one with a bare FileNotFoundError. The check runs after
collection and only when a selected test's module imports a shared path, so a selection that needs none
(e.g. ``pytest -m gpu tests/test_kernels_*.py`` on a GPU machine without the data) runs as usual.
"""

import os
import shutil
import sys

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at the first import of the kernel modules: set it
# here, before any test module imports them, on machines without an NVIDIA driver (the CPU CI), so the kernels run
# in the interpreter whichever test file happens to import them first.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from paths import CRD_DIR, DATA, SHARED  # noqa: E402

NEEDED = (DATA / "ml-1m" / "ratings.dat", DATA / "ml-100k" / "u.data", DATA / "ml-latest-small" / "ratings.csv",
          CRD_DIR / "ray.io_rayjobs.yaml", CRD_DIR / "ray.io_rayclusters.yaml")


def _reads_shared(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return module is not None and any(v is DATA or v is CRD_DIR or v is SHARED for v in vars(module).values())


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(_reads_shared(item) for item in session.items):
        return
    missing = [str(p) for p in NEEDED if not p.is_file()]
    if missing:
        pytest.exit(f"the tests read MovieLens data and KubeRay CRDs from {SHARED} (../shared beside the checkout, "
                    f"or set GEMRAY_SHARED=/path/to/shared): missing {', '.join(missing)}", returncode=4)


@pytest.fixture(autouse=True)
def _automatic_gc_restored():
    """Python's automatic garbage collection as each test found it: a Trainer stepped in-process switches it off
    (``train.gc_every_steps``, default 50) and gives it back in the training loop's and the bench's ``finally``;
    tests that step a bare Trainer never reach those, and later tests would run without it."""
    import gc

    was = gc.isenabled()
    yield
    if was and not gc.isenabled():
        gc.enable()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._gemray_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with pytest's exit status once everything is reported, skipping the interpreter's
    finalisation: on 2026-12-03 `make test` passed every test, printed its summary and then died with SIGSEGV in
    a native library's teardown (no Python frame: faulthandler is already off there; the suite leaves Ray core
    workers, Triton's interpreter and inductor's compile workers loaded), which fails CI on a green run."""
    status = getattr(config, "_gemray_exitstatus", None)
    if status is None or hasattr(config, "workerinput"):  # an xdist worker: its controller still reads its channel
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
