"""The elastic controller re-lays the parallel layout at every resize, with an HSDP dense part sharded over 2
ranks (``parallel.dense = hsdp``, ``parallel.dp_shard = 2``); the ledger stays exact (0 lost, 0 duplicated)
and DCP restores across world sizes.

- ``test_resize_two_one_two_hsdp``: tests/test_elastic.py's 2 -> 1 -> 2 node removal / addition scenario. At 1
  worker dp_shard 2 does not divide the world: the Trainer takes the nearest valid layout
  (``gemray.parallel.dims.resolve``: dp_shard 1), restoring the FSDP-sharded checkpoint of 2 ranks; back at 2
  workers, HSDP over 2 again.
- ``test_resize_four_three_hsdp``: 4 -> 3 workers (a node removed mid-epoch): dp_shard 2 does not divide 3, so
  the 3-worker attempts run the nearest valid layout, dp_shard 3 x dp_replicate 1 (the smallest divisor of 3
  >= 2), restoring the checkpoint that 4 ranks saved as HSDP 2 x 2.
"""

from __future__ import annotations

import time

import pytest
import test_elastic as te
from test_elastic import _fit_driving_cluster

from gemray.checkpoint import committed_checkpoints
from gemray.events import read_events
from gemray.ledger import audit, read_attempts


def test_resize_two_one_two_hsdp(tmp_path, monkeypatch):
    base = te._overrides
    monkeypatch.setattr(te, "_overrides", lambda *a, **k: base(*a, **k) + ["parallel.dense=hsdp",
                                                                            "parallel.dp_shard=2"])
    te.test_resize_two_one_two(tmp_path)


@pytest.mark.slow  # make test-slow; make test: the 4 -> 3 decision itself (tests/test_parallel_dims.py)
def test_resize_four_three_hsdp(tmp_path):
    """A 3-CPU head "node" and a 1-CPU one, workers ask 1 CPU each (data.reader=arrow: no Ray Data tasks), so the
    group of 4 is 3 workers on the head and 1 on the other node. Once the 4-worker attempt has trained past its
    step-5 checkpoint and Ray has committed it, that node is removed: the group restarts at 3 workers with the
    nearest valid HSDP layout, restores that checkpoint (DCP resharding 4 -> 3 ranks) and finishes there."""
    if not te.SRC.is_dir():
        pytest.skip(f"{te.SRC} not available")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    extra = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ledger, run_dir = tmp_path / "ledger-resize43", tmp_path / "out" / "ray" / "resize43"
    marks: dict = {}

    def remove_when_trained(attempts) -> bool:
        ranked = [(a, a["ranks"][min(a["ranks"])]["world_size"]) for a in attempts if a["ranks"]]
        # 10 steps per epoch at 4 x 16: past the step-5 checkpoint, mid-epoch 1, and once Ray has committed it
        # (it does at its next poll of the workers, ray.health_check_interval_s; a checkpoint the group dies
        # before is not restored, and the 3-worker attempt would start from scratch)
        if (ranked and ranked[0][1] == 4 and max([s["g"] for s in ranked[0][0]["steps"]], default=0) >= 6
                and committed_checkpoints(run_dir)):
            cluster.remove_node(extra)
            marks["removed"] = time.time()
            return True
        return False

    out = _fit_driving_cluster(cluster, tmp_path, "resize43", [
        "ray.min_workers=3", "ray.max_workers=4", "ray.cpus_per_worker=1", "ray.resize_interval_s=2",
        "ray.max_failures=5", "ray.worker_start_timeout_s=3", "data.reader=arrow", "parallel.dense=hsdp",
        "parallel.dp_shard=2"], remove_when_trained, timeout_s=300)
    assert "error" not in out, out.get("error")
    assert not out["alive"], "gemray.fit did not return"
    res = out["res"]
    assert "removed" in marks, marks

    attempts = read_attempts(ledger)
    worlds = [a["ranks"][min(a["ranks"])]["world_size"] for a in attempts if a["ranks"]]  # started attempts
    assert worlds[0] == 4 and worlds[-1] == 3 and set(worlds) == {3, 4}, worlds
    ids = te._all_user_ids(tmp_path / "prepared")
    rep = audit(ledger, ids, te.EPOCHS)
    for e in range(te.EPOCHS):
        ep = rep["epochs"][e]
        assert (ep["trained"] == len(ids) == 610 and ep["lost"] == [] and ep["duplicated"] == []
                and ep["unexpected"] == []), (e, ep)
    events = res.metrics["events"]
    resizes = [(e["detail"]["from_world_size"], e["detail"]["to_world_size"]) for e in events if e["kind"] == "resize"]
    assert (4, 3) in resizes and set(resizes) <= {(4, 3)}, resizes
    restored = [e["detail"] for e in events if e["kind"] == "checkpoint_restored"]
    # DCP resharding: a checkpoint saved by 4 ranks (HSDP 2 x 2) restored by 3 (HSDP 1 x 3)
    assert any((r["saved_world_size"], r["world_size"]) == (4, 3) for r in restored), restored
    assert res.metrics["world_size"] == 3 and [h["epoch"] for h in res.metrics["history"]] == [1, 2]
    starts = [e["detail"] for e in read_events(tmp_path / "out" / "events.jsonl") if e["kind"] == "attempt_start"]
    assert starts[-1]["world_size"] == 3
    # the layout each attempt ran (attempt_start's "layout"): the configured one at 4, the nearest valid one at 3
    layouts = {(d["world_size"], d["layout"]["dense"], d["layout"]["dp_replicate"], d["layout"]["dp_shard"])
               for d in starts}
    assert layouts == {(4, "hsdp", 2, 2), (3, "hsdp", 1, 3)}, layouts  # never dp_shard 2 at 3 ranks
    meshes = [e["detail"]["dense_mesh"] for e in events if e["kind"] == "resize"]
    assert meshes and all(m == [1, 3] for m in meshes), meshes
