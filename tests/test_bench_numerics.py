"""The FP8 numerics guard's decision (gemray.bench.numerics) and its CLI wiring."""

import math

import pytest

from gemray.bench.numerics import compare_quality, format_rows, quality_keys
from gemray.cli import build_parser


def test_ranking_metrics_preferred_over_hr():
    m = {"test_ne_ctr": 0.9, "test_auc_ctr": 0.7, "hr@10": 0.3, "ne": 0.95, "samples_per_s": 10.0}
    assert quality_keys(m) == ["ne", "test_auc_ctr", "test_ne_ctr"]
    assert quality_keys({"hr@10": 0.3, "hr@50": 0.5}) == ["hr@10"]
    with pytest.raises(ValueError, match="no NE"):
        quality_keys({"preempted": True})


def test_compare_within_and_beyond_rtol():
    ok, rows = compare_quality({"hr@10": 0.5000}, {"hr@10": 0.50049}, rtol=1e-3)
    assert ok and rows[0][0] == "hr@10" and rows[0][3] == pytest.approx(0.00049 / 0.5)
    ok, rows = compare_quality({"test_ne_ctr": 0.9, "test_auc_ctr": 0.7}, {"test_ne_ctr": 0.9, "test_auc_ctr": 0.699})
    assert not ok and [r[0] for r in rows] == ["test_auc_ctr", "test_ne_ctr"]
    assert "FAIL" in format_rows(rows, 1e-3)
    assert not compare_quality({"hr@10": 0.5}, {"hr@10": math.nan})[0]
    with pytest.raises(ValueError, match="did not report"):
        compare_quality({"hr@10": 0.5}, {"ndcg@10": 0.5})
    with pytest.raises(ValueError):
        compare_quality({"hr@10": 0.5}, {"hr@10": 0.5}, rtol=-1)


def test_cli_parses_bench_numerics():
    ns = build_parser().parse_args(["bench", "numerics", "--config", "c.toml", "--steps", "5", "--set", "a.b=1"])
    assert ns.steps == 5 and ns.rtol == 1e-3 and ns.overrides == ["a.b=1"] and ns.func.__name__ == "_cmd_bench_numerics"
