"""Ray Train run folders for tests that need no Ray cluster: a checkpoint_manager_snapshot.json as Ray Train
2.60's controller writes it after committing checkpoints (what ``ray.train.Result.from_path`` reads back).

The schema is Ray's (ray.train.v2._internal.execution.checkpoint.checkpoint_manager._CheckpointManagerState);
tests/test_checkpoint.py checks that Ray reads this file back, so a change of schema in a Ray upgrade fails
there, by name, rather than in every test that builds a run folder.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_committed(run_dir: Path, names: list[str], metrics: list[dict] | None = None) -> None:
    """Record the checkpoint folders ``names`` of ``run_dir`` (oldest first, as they were reported) as
    committed by Ray Train, with their reported ``metrics`` (default ``{}``). The folders must exist."""
    import ray

    metrics = metrics or [{} for _ in names]
    results = [{"version": 0, "checkpoint_dir_name": n, "metrics": m} for n, m in zip(names, metrics)]
    snapshot = {
        "ray_version": ray.__version__,
        "checkpoint_results": results,
        "checkpoint_report_indices": list(range(len(names))),
        "latest_checkpoint_result": results[-1] if results else None,
        "pending_training_results": [],
        "pending_validation_specs": [],
        "current_report_index": len(names),
        "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
