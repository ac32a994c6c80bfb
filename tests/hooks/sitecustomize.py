"""Test-only process hook for tests/test_elastic.py: pause one rank inside one checkpoint's DCP write.

A test puts this folder first on ``PYTHONPATH`` of the ``gemray train`` it starts and sets
``GEMRAY_TEST_PAUSE_CKPT_WRITE="<global_step>:<rank>:<folder>"``. Python imports ``sitecustomize`` at start in
every process of that run (the driver, and Ray's worker processes, which inherit the environment), and
here, once ``gemray.checkpoint`` is imported, ``torch.distributed.checkpoint.save`` is wrapped: rank
``<rank>`` saving the checkpoint of ``<global_step>`` writes its data files (through the storage writer gemray
passes, ``gemray.checkpoint.checkpoint_writer``, whose ``write_data`` is wrapped), then (the collective finish
and ``.metadata`` not yet written) writes ``<folder>/paused-rank<r>.json`` (``{"pid", "global_step"}``)
and sleeps, so that the test can SIGKILL the process mid-write. Once only: an existing marker disables it
(the restarted attempt writes normally). Without the variable this file does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

PAUSE_ENV = "GEMRAY_TEST_PAUSE_CKPT_WRITE"


def _parse(spec: str) -> tuple[int, int, Path]:
    try:
        step, rank, folder = spec.split(":", 2)
        return int(step), int(rank), Path(folder)
    except ValueError:
        raise ValueError(f"${PAUSE_ENV}={spec!r}: expected <global_step>:<rank>:<folder>") from None


def _wrap_dcp_save(step: int, rank: int, folder: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    original = dcp.save
    marker = folder / f"paused-rank{rank}.json"

    def pause_after(write_data):  # noqa: ANN001, ANN202
        """``write_data`` that, once it has written this rank's data files, writes the marker and sleeps."""

        def paused(plan, planner):  # noqa: ANN001
            fut = write_data(plan, planner)
            fut.wait()  # this rank's data files are on disk
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"pid": os.getpid(), "global_step": step}))
            logging.getLogger(__name__).warning("%s: rank %d paused inside the DCP write of global step %d "
                                                "(pid %d)", PAUSE_ENV, rank, step, os.getpid())
            time.sleep(600)  # the test kills this process
            return fut

        return paused

    def save(state_dict, *, checkpoint_id=None, storage_writer=None, **kw):  # noqa: ANN001
        trainer = json.loads(state_dict.get("trainer", {}).get("json") or "{}")  # gemray's trainer state
        if (checkpoint_id is not None and trainer.get("global_step") == step
                and dist.is_initialized() and dist.get_rank() == rank and not marker.exists()):
            # gemray passes its own writer (gemray.checkpoint.checkpoint_writer): pause that one, with its
            # settings; without one, DCP's default FileSystemWriter
            storage_writer = storage_writer or dcp.FileSystemWriter(str(checkpoint_id))
            storage_writer.write_data = pause_after(storage_writer.write_data)
        return original(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, **kw)

    dcp.save = save


class _AfterGemrayCheckpoint(importlib.abc.MetaPathFinder):
    """Runs ``then`` right after ``gemray.checkpoint`` is imported (torch is loaded then anyway)."""

    def __init__(self, then):
        self.then = then

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001
        if name != "gemray.checkpoint":
            return None
        sys.meta_path.remove(self)  # find the real spec, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):  # noqa: ANN001
            exec_module(module)
            self.then()

        spec.loader.exec_module = exec_then
        return spec


if os.environ.get(PAUSE_ENV):
    _args = _parse(os.environ[PAUSE_ENV])
    sys.meta_path.insert(0, _AfterGemrayCheckpoint(lambda: _wrap_dcp_save(*_args)))
