"""Refuse to start, with one clear line, when the shared inputs the suite reads are missing.

The tests convert the real MovieLens files and validate the deploy manifests against the KubeRay CRDs; both
live outside the repository (``tests/paths.py``: ``$GEMRAY_SHARED`` or ``../shared`` beside the checkout).
Without them most tests would fail one by one with a bare FileNotFoundError.
"""

import pytest
from paths import CRD_DIR, DATA, SHARED

NEEDED = (DATA / "ml-1m" / "ratings.dat", DATA / "ml-100k" / "u.data", DATA / "ml-latest-small" / "ratings.csv",
          CRD_DIR / "ray.io_rayjobs.yaml", CRD_DIR / "ray.io_rayclusters.yaml")


def pytest_sessionstart(session: pytest.Session) -> None:
    missing = [str(p) for p in NEEDED if not p.is_file()]
    if missing:
        pytest.exit(f"the tests read MovieLens data and KubeRay CRDs from {SHARED} (../shared beside the checkout, "
                    f"or set GEMRAY_SHARED=/path/to/shared): missing {', '.join(missing)}", returncode=4)
