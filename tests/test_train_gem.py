"""GEM with ranking tasks end to end: configs/gem-tiny.toml trains through ``gemray train`` on data it generates
itself (data.synthetic), reporting NE / AUC per task beside HR / NDCG; auto-preparation refuses a prepared
folder of other generator parameters; bf16 training runs on CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gemray.config import load_config
from gemray.pipelines.synthetic import ensure_synthetic, synthetic_mismatch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "gem-tiny.toml"


def _tiny_overrides(tmp: Path, *extra: str) -> list[str]:
    return [f"data.prepared_dir={tmp / 'data'}", "train.epochs=2", "train.max_steps_per_epoch=4",
            "ray.max_failures=0", *extra]


def test_auto_prepare_generates_then_refuses_other_parameters(tmp_path, caplog):
    cfg = load_config(TINY, overrides=[f"data.prepared_dir={tmp_path / 'data'}"])
    with caplog.at_level("INFO", logger="gemray.pipelines.synthetic"):
        manifest = ensure_synthetic(cfg.data)
    assert "generating synthetic data" in caplog.text and "generated" in caplog.text
    assert manifest["format"] == "synthetic" and manifest["counts"]["users"] == 320
    assert (tmp_path / "data" / "manifest.json").is_file()
    again = ensure_synthetic(cfg.data)  # prepared and matching: used as is, not regenerated
    assert again["source"]["params_sha256"] == manifest["source"]["params_sha256"]
    other = load_config(TINY, overrides=[f"data.prepared_dir={tmp_path / 'data'}",
                                         "data.synthetic=[users=320,items=400,seed=1]"])
    with pytest.raises(ValueError, match=r"other parameters than data.synthetic \(.*seed: prepared 0, config 1"):
        ensure_synthetic(other.data)
    with pytest.raises(ValueError, match="unknown parameter 'colour'"):
        ensure_synthetic(load_config(TINY, overrides=[f"data.prepared_dir={tmp_path / 'x'}",
                                                      "data.synthetic=[users=3,items=4,colour=red]"]).data)
    assert "not synthetic data" in synthetic_mismatch({"format": "ml-1m"}, {}, "d")
    with pytest.raises(ValueError, match="data.synthetic: 'users=U' and 'items=N' are required"):
        load_config(TINY, overrides=["data.synthetic=[seed=1]"])


def test_gem_tiny_trains_end_to_end_with_ne_and_auc(tmp_path):
    import gemray

    res = gemray.fit(TINY, output_dir=tmp_path / "out", overrides=_tiny_overrides(tmp_path))
    m = json.loads((Path(res.output_dir) / "metrics.json").read_text())
    for t in ("ctr", "cvr"):
        assert m[f"test_{t}_num_examples"] > 0
        assert math.isfinite(m[f"test_{t}_ne"]) and m[f"test_{t}_ne"] > 0
        assert 0.0 <= m[f"test_{t}_auc"] <= 1.0
    assert 0.0 <= m["hr@10"] <= m["hr@50"] <= 1.0  # retrieval is still evaluated
    last = m["history"][-1]
    for t in ("retrieval", "ctr", "cvr"):
        assert last[f"train_loss_{t}"] > 0
    assert "valid_ctr_auc" in last and "valid_hr@10" in last


def test_gem_tiny_bf16_ranking_only_on_cpu(tmp_path):
    import gemray

    res = gemray.fit(TINY, output_dir=tmp_path / "out", overrides=_tiny_overrides(
        tmp_path, "train.precision=bf16", "model.tasks=[ctr,cvr]", "model.task_weights=[]", "train.epochs=1"))
    m = res.metrics
    assert math.isfinite(m["test_ctr_ne"]) and "hr@10" not in m
    assert m["history"][-1]["train_loss"] > 0
