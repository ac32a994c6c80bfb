"""Where the tests find the checkout and the shared inputs (MovieLens data, KubeRay CRDs).

``SHARED`` is ``$GEMRAY_SHARED`` when set, else ``../shared`` beside the checkout (the layout of the README).
Tests that need a file from it skip, naming the path, when it is missing.
"""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GEMRAY_SHARED") or REPO.parent / "shared").resolve()
DATA = SHARED / "data"
CRD_DIR = SHARED / "k8s" / "crds"
