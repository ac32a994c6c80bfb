"""Shared memory of the attention kernels' launches (gemray.kernels.config.smem_bytes / fit_tile): every tile the
default config launches on an sm_90 GPU fits a block's 232,448 bytes (227 KiB) with a margin, for every regime,
head-dim bucket (the model allows up to 256), kernel kind, with and without the in-kernel relative bias.

Run 7 of benchmarks/reports/gem_h200_2026-12-02.md: tests/test_kernels_rel_bias.py's GPU test at n = 4096 (the
long regime, D = 128) failed with OutOfResources -- the relative-bias forward's (128, 64, 8 warps, 3 stages)
asked 295,936 bytes on triton 3.6: Q 32 KiB + 3 stages of K and V (96 KiB) + the bias gathers that Triton's
pipeliner moves into shared memory (20 bytes per pair of the 128 x 64 tile: 160 KiB). Pure Python: no GPU, no
interpreter.
"""

from __future__ import annotations

import pytest

from gemray.kernels import config as kc
from gemray.kernels.config import DEFAULT, HEAD_DIM_BUCKETS, REGIMES, TILE_KINDS

REL_KINDS = ("fwd", "fwd_silu", "dq", "dkdv")  # the kinds the in-kernel bias runs in (never the DS_STORE ones)


def _launches(dims=HEAD_DIM_BUCKETS):
    for reg in REGIMES:
        for d in dims:
            for kind in TILE_KINDS:
                for rel in (False, True) if kind in REL_KINDS else (False,):
                    yield reg, d, kind, rel


@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_every_default_launch_fits_sm90_shared_memory_with_a_margin(elem_bytes):
    """bf16 / fp16 (2-byte) and fp32 inputs, every head dim 16 .. 256 (tile widths 16 .. 256), q/k and v widths
    equal or not: the tile config.tile picks fits the budget (limit - 2 KiB; with the bias 90% of that)."""
    dims = (16, 32, 50, 64, 100, 128, 200, 256)
    for reg, d, kind, rel in _launches(dims):
        for d_v in (d, 64, 256):
            tile = DEFAULT.tile(reg, kind, d, d_v, rel=rel, elem_bytes=elem_bytes)
            need = kc.smem_bytes(kind, tile, kc._pow2(d), kc._pow2(d_v), rel=rel, elem_bytes=elem_bytes)
            assert need <= kc.smem_budget(rel) <= kc.SMEM_LIMIT_SM90 - 2048, (reg, d, d_v, kind, rel, tile, need)
            assert tile[0] >= 16 and tile[1] >= 16 and tile[3] >= 1


def test_shipped_tiles_without_the_bias_are_kept():
    """The D <= 128 tiles (and D = 256's) meet their speed bars: in bf16 with equal q/k and v widths every tile
    without the bias is launched as shipped, none shrunk."""
    for reg, d, kind, rel in _launches():
        if not rel:
            assert DEFAULT.tile(reg, kind, d, rel=False) == DEFAULT.regime(reg).tiles.get(kind, d), (reg, d, kind)


def test_the_failing_rel_bias_forward_is_shrunk():
    """The long regime's relative-bias forward at D = 128 (run 7's OutOfResources): the shipped (128, 64, 8, 3)
    is over the limit by this model as on the device; the launched tile keeps BLOCK_M, 8 warps and 3 stages and
    halves the key tile. The D = 256 tiles of the GEM config need no change."""
    shipped = DEFAULT.long.tiles.get("fwd_silu", 128)
    assert shipped == (128, 64, 8, 3)
    assert kc.smem_bytes("fwd_silu", shipped, 128, rel=True) == 295_424 > kc.SMEM_LIMIT_SM90  # + 512 B barriers
    assert DEFAULT.tile("long", "fwd_silu", 128, rel=True) == (128, 32, 8, 3)
    assert DEFAULT.tile("long", "dkdv", 128, rel=True) == (32, 128, 8, 2)
    for reg in REGIMES:
        for kind in REL_KINDS:
            assert DEFAULT.tile(reg, kind, 256, rel=True) == DEFAULT.regime(reg).tiles.get(kind, 256)


# sm_90 compiles (python -m gemray.bench.sass_check --smem, triton 3.9 on the CPU host, bf16, causal): kind,
# tile, head dim, rel -> metadata.shared. Without the bias the model is exact; with it an upper bound.
_MEASURED = [
    ("fwd", (64, 64, 4, 3), 64, False, 57_344), ("fwd", (64, 64, 4, 3), 128, False, 114_688),
    ("dq", (64, 64, 8, 2), 64, False, 49_152), ("dq", (64, 64, 4, 2), 128, False, 98_304),
    ("dkdv", (64, 64, 8, 2), 64, False, 50_176), ("dkdv", (64, 64, 4, 2), 128, False, 99_328),
    ("fwd", (64, 64, 4, 3), 64, True, 123_904), ("fwd", (64, 64, 4, 3), 128, True, 164_864),
    ("fwd_silu", (128, 64, 8, 3), 128, True, 263_168), ("dq", (64, 64, 4, 2), 128, True, 81_920),
    ("dkdv", (64, 64, 4, 2), 128, True, 132_096), ("dkdv", (64, 128, 8, 2), 128, True, 196_608),
]


@pytest.mark.parametrize("kind,tile,d,rel,measured", _MEASURED)
def test_estimate_against_sm90_compiles(kind, tile, d, rel, measured):
    est = kc.smem_bytes(kind, tile, d, rel=rel)
    if rel:
        assert measured <= est + kc.SMEM_SLACK
    else:
        assert est == measured


# the dS-store kinds (sm_90 compiles, triton 3.9, 2026-12-05; bf16, causal, silu): kind, tile, head dim, dk_from_ds
# (the dK/dV launch without dK), measured shared bytes. The model bounds them within SMEM_SLACK; dkdv_ds counts
# DS_CONVERT_BYTES for the 3,072 bytes the D = 256 64 x 64 / 8-warp launch without dK adds over the rest of the model.
_MEASURED_DS = [
    ("dkdv_ds", (64, 64, 4, 2), 128, False, 106_496), ("dkdv_ds", (64, 64, 4, 2), 128, True, 106_496),
    ("dkdv_ds", (64, 64, 8, 2), 256, False, 204_800), ("dkdv_ds", (64, 64, 8, 2), 256, True, 208_896),
    ("dkdv_ds", (32, 64, 4, 2), 256, True, 135_168), ("dkdv_ds", (64, 64, 4, 2), 64, True, 57_344),
    ("dk_ds", (64, 64, 4, 2), 128, True, 49_168), ("dk_ds", (64, 64, 4, 2), 256, True, 81_936),
    ("dk_ds", (64, 128, 8, 2), 256, True, 98_320), ("dk_ds", (128, 64, 4, 3), 64, True, 98_328),
]


@pytest.mark.parametrize("kind,tile,d,no_dk,measured", _MEASURED_DS)
def test_ds_kinds_estimate_bounds_sm90_compiles(kind, tile, d, no_dk, measured):
    est = kc.smem_bytes(kind, tile, d)
    assert measured <= est + kc.SMEM_SLACK and est - measured <= kc.DS_CONVERT_BYTES + 1024, (est, measured)


def test_fit_tile_shrinks_in_order_and_refuses_what_cannot_fit():
    # the loop's axis first (the query-tile kernels stream BLOCK_N, dK/dV streams BLOCK_M), then stages
    assert kc.fit_tile("fwd", (128, 64, 8, 3), 128, rel=True) == (128, 32, 8, 3)
    assert kc.fit_tile("dkdv", (64, 128, 8, 2), 128, rel=True) == (32, 128, 8, 2)
    # fp32 at D = 256: Q alone is 128 KiB, so after the loop axis and the stages the held axis halves too
    assert kc.fit_tile("fwd", (128, 128, 8, 4), 256, elem_bytes=4) == (64, 32, 8, 2)
    # a tight limit: down to the held axis, at most 4 warps below 64 rows
    small = kc.fit_tile("fwd", (128, 128, 8, 3), 128, limit=40 * 1024)
    assert small == (32, 32, 4, 1) and kc.smem_bytes("fwd", small, 128) <= kc.smem_budget(False, 40 * 1024)
    with pytest.raises(ValueError, match="shared memory"):
        kc.fit_tile("fwd", (64, 64, 4, 2), 256, limit=8 * 1024)
    with pytest.raises(ValueError, match="unknown tile kind"):
        kc.smem_bytes("bwd", (64, 64, 4, 2), 128)


def test_sass_check_smem_lists_the_launched_tiles():
    """``python -m gemray.bench.sass_check --smem`` (the device-side check of this model under the device's
    Triton) compiles exactly the tiles config.tile launches, at the asked head dims, bias on and off."""
    from gemray.bench import sass_check as sc

    vs = sc.smem_variants(dims=(128,))
    got = {(v[0].split(" D=")[0], kind, rel): tile for kind, rel, d, tile, v in vs}
    assert got[("long", "fwd_silu", True)] == (128, 32, 8, 3) and got[("long", "dkdv", True)] == (32, 128, 8, 2)
    assert got[("xlong", "dq_ds", False)] == DEFAULT.xlong.tiles.get("dq_ds", 128)
    for kind, rel, d, tile, (name, fn, types, consts, warps, stages) in vs:
        assert d == 128 and consts["BLOCK_DQK"] == 128 and (warps, stages) == tile[2:]
        assert consts.get("REL", False) == rel
