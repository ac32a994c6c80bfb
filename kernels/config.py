"""The attention kernels' configuration: one immutable, hashable value passed to every call.

What a jagged attention call launches (tiles, grid order, tile loads, backward structure, the Gluon forward) used
to be decided from mutable module globals that benchmarks and tests edited at run time. It is now a frozen
:class:`KernelConfig` passed explicitly (``config=`` on the public entry points of
``gemray.kernels.jagged_attention`` and ``gemray.ops.attention``; ``None`` means :data:`DEFAULT`). A benchmark
sweep builds a new config per candidate (``cfg.with_tile(...)``, ``cfg.with_regime(...)``) instead of editing
globals, and a launch plan cached for one config is never used for another: the plan key holds the config's
:attr:`KernelConfig.name`.

Regimes: a call's tile regime comes from the batch's mean sequence length T / B (host ints, no sync):
``"short"`` / ``"medium"`` / ``"long"`` below ``regime_mean_len[0] / [1] / [2]``, else ``"xlong"``; each regime has
its own :class:`RegimeConfig` (tiles per kernel kind and the launch modes that are on in some regime).

Passing a config through ``torch.library`` custom ops (``gemray::gdpa_fwd`` / ``gemray::gdpa_bwd``, whose
arguments may only be tensors, numbers, bools, strings and lists): every config gets a stable name when it is
built -- ``"default"`` for a config equal to :data:`DEFAULT`, else ``"kc-"`` plus 16 hex digits of the SHA-1 of
its ``repr`` (the same content gives the same name in every process) -- and is entered in a registry under it.
The ops take the name (``config: str``) and look the config up with :func:`lookup`. A compiled or exported
graph therefore carries the name; in another process a non-default config must be built once (same content,
same name) before that graph runs, or :func:`lookup` raises. The registry only maps names to immutable values:
no call's behaviour changes after a config is built.

The defaults below are the H200 sweep winners recorded in the kernel run reports (benchmarks/reports/kernels_h200_*.md) (runs 4-41); the comments say which
run chose each. This module imports neither triton nor the kernels (gemray.ops reads it on any machine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
TileByDim = tuple[tuple[int, Tile], ...]  # ((head-dim bucket, tile), ...) in increasing bucket order
WsTiles = tuple[int, int, int, bool, bool]  # Gluon forward: (consumer warpgroups, BLOCK_N, STAGES, ping-pong, persistent)

REGIMES = ("short", "medium", "long", "xlong")
# tile kinds: "fwd" the softmax / pointwise forward, "fwd_silu" the silu forward (swept separately), "dkdv" / "dq"
# the recomputing backward's two launches (dK/dV tiles the keys by BLOCK_N and loops over the queries by BLOCK_M),
# "dkdv_ds" / "dq_ds" the DS_STORE backward's dK/dV launch (also storing dS^T) and its dQ = dS K launch, "dk_ds" its
# dK = dS^T Q launch (key tile, query loop over the stored dS^T; with the regime's dk_from_ds)
TILE_KINDS = ("fwd", "fwd_silu", "dkdv", "dq", "dkdv_ds", "dq_ds", "dk_ds")
HEAD_DIM_BUCKETS = (64, 128, 256)


def _pow2(d: int) -> int:
    """The kernels' tile width of a head dim d: the next power of two >= d, at least 16."""
    return max(16, 1 << (d - 1).bit_length())


def _by_dim(d64: Tile, d128: Tile, d256: Tile) -> TileByDim:
    return ((64, d64), (128, d128), (256, d256))


@dataclass(frozen=True)
class TileSet:
    """One regime's tiles per kernel kind, each by head-dim bucket: ``fwd`` [(64, tile), (128, tile), (256, tile)]
    etc.; a call with head dim d uses the smallest bucket >= d. A tile is (BLOCK_M, BLOCK_N, num_warps,
    num_stages)."""

    fwd: TileByDim
    fwd_silu: TileByDim
    dkdv: TileByDim
    dq: TileByDim
    dkdv_ds: TileByDim
    dq_ds: TileByDim
    # the mirror of dq_ds's D = 256 tile (no sweep yet: dk_from_ds is off in every regime by default)
    dk_ds: TileByDim = _by_dim((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2))

    @staticmethod
    def uniform(tile: Tile) -> "TileSet":
        """Every kind and head-dim bucket with the same tile (the interpreter's tiles)."""
        row = tuple((b, tuple(tile)) for b in HEAD_DIM_BUCKETS)
        return TileSet(*(row for _ in TILE_KINDS))

    def get(self, kind: str, d: int) -> Tile:
        """The tile of ``kind`` for head dim ``d``. Raises ValueError for d > the largest bucket (256) or an
        unknown kind."""
        if kind not in TILE_KINDS:
            raise ValueError(f"unknown tile kind {kind!r} (one of {TILE_KINDS})")
        for bucket, tile in getattr(self, kind):
            if d <= bucket:
                return tile
        raise ValueError(f"gdpa: head dim {d} > {getattr(self, kind)[-1][0]} is not supported")

    def with_tile(self, kind: str, tile: Tile, d: int = 128) -> "TileSet":
        """A copy with ``kind``'s tile of bucket ``d`` replaced."""
        if kind not in TILE_KINDS:
            raise ValueError(f"unknown tile kind {kind!r} (one of {TILE_KINDS})")
        row = getattr(self, kind)
        if d not in dict(row):
            raise ValueError(f"head-dim bucket {d} not in {[b for b, _ in row]}")
        return dataclasses.replace(self, **{kind: tuple((b, tuple(tile) if b == d else t) for b, t in row)})


@dataclass(frozen=True)
class RegimeConfig:
    """What the calls of one length regime launch.

    tiles: :class:`TileSet`. heads_inner: grid (items * H,) with the head varying fastest instead of (items, H)
    (CUDA dispatches blockIdx.x fastest, so (items, H) starts each head's longest items only after the previous
    heads' items), forward and backward. tma_loads: tile loads of the loops through tensor descriptors made on
    the device (Hopper's TMA), where the call allows it. ds_store: the backward stores dS^T from its dK/dV launch
    and computes dQ = dS K from it (five matmuls per tile pair instead of seven) where the scratch fits the
    caps of :class:`KernelConfig`. dk_from_ds (with ds_store): the dK/dV launch accumulates dV only and a fourth
    launch computes dK = dS^T Q from the stored tiles (``dk_ds`` tiles) -- the same five matmuls per tile pair, one
    accumulator fewer in the dK/dV program (at head dim 256 its two [BLOCK_N, 256] fp32 accumulators fill the 255
    registers and spill, sm_90 compiles 2026-12-05) for one more read of the dS scratch; not timed yet, off by
    default. ws_fwd: the softmax forward runs the warp-specialized Gluon kernel
    (kernels/ws_attention.py) where it applies, with ``ws_tiles`` (consumer warpgroups, BLOCK_N, STAGES,
    ping-pong, persistent grid). ws_bwd (with ds_store and dk_from_ds): the silu backward's dV + dS^T launch runs
    the warp-specialized Gluon kernel (ws_attention.backward_dv_ds: 128 keys a program, two consumer warpgroups,
    a TMA loader warp) where it applies, with ``ws_bwd_tiles`` (query rows per step, STAGES). ws_dkdq (with ws_bwd,
    where that launch runs): dQ and dK from its stored dS^T run the warp-specialized Gluon products
    (ws_attention.ds_gemm: 128 output rows a program, two consumer warpgroups, a TMA loader warp, ``ws_dkdq_stages``
    ring slots) instead of the Triton dq_ds / dk_ds launches: 1.566 -> 1.298 ms for the two on a gem-h200 layer and
    -2.43 ms a step paired (H100, 2026-12-07); on in configs/kernel-tiles-h200.json. ws_fwd_silu: the silu forward
    (head dims 128 / 256) runs the warp-specialized Gluon kernel (ws_attention.forward_silu: 128 query rows a
    program in two consumer warpgroups, a TMA loader warp streaming key / value tiles) where it applies, instead of
    _gdpa_fwd, with ``ws_fwd_silu_tiles`` (BLOCK_N key rows per tile, STAGES ring slots; a choice that does not fit
    sm_90's shared memory or the consumers' registers at the call's head dim, ``ws_attention.silu_tiles_fit``, leaves
    the call to _gdpa_fwd): 1.204 -> 0.864 ms on a gem-h200 layer (423 -> 590 TFLOP/s over valid pairs, output
    bit-identical) and -2.38 / -2.58 ms a step paired in two pairs (H100, 2026-12-07); on in
    configs/kernel-tiles-h200.json where ws_bwd is, off by default."""

    tiles: TileSet
    heads_inner: bool = False
    tma_loads: bool = False
    ds_store: bool = False
    dk_from_ds: bool = False
    ws_fwd: bool = False
    ws_tiles: WsTiles = (2, 128, 2, False, False)
    ws_bwd: bool = False
    ws_bwd_tiles: tuple[int, int] = (32, 2)
    ws_dkdq: bool = False
    ws_dkdq_stages: int = 4
    ws_fwd_silu: bool = False
    ws_fwd_silu_tiles: tuple[int, int] = (64, 2)


# D=128 tiles: run 4's sweep winners (each timed on its regime's bench batch: short heavy B=128 N=1024, medium heavy
# B=256 N=4096, long uniform B=128 N=1024, xlong uniform B=64 N=4096), changed after runs 6-8 (medium dK/dV and dQ
# 64x64/4w/2, long forward 128x64/8w/3) and after run 15, the first sweep timed in device time (short dK/dV and dQ
# 64x64/4w/2). dkdv_ds / dq_ds: the best of runs 19-24 per regime; with the tables grouped by sequence (seq_order)
# run 34 moved dq_ds to 128x64/4w/3 in medium / long / xlong. D=64 / 256 entries are not timed (kept from run 3),
# except D=256's fwd / fwd_silu / dq / dkdv: 8 warps instead of 4 (2026-12-02, from sm_90 compiles, not yet timed):
# at 4 warps the dK/dV accumulators alone (2 x 64 x 256 fp32 over 128 threads) exceed 255 registers -- with the
# relative bias its query loop spilled 128 STL / 171-209 LDL per iteration (stack 1,432-1,512 B), at 8 warps 0-18 /
# 43-60 (392-464 B); without the bias its stack 1,128-1,136 -> 168-272 B; the forward's spills go (with the bias:
# stack 120-248 -> 0 B; without: 242-254 -> 172-179 registers), the bias-free dq's stack 8-24 -> 0 B.
_SHORT = TileSet(
    fwd=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 32, 8, 2)),
    fwd_silu=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 32, 8, 2)),
    dkdv=_by_dim((64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 8, 2)),
    dq=_by_dim((64, 64, 8, 2), (64, 64, 4, 2), (64, 32, 8, 2)),
    dkdv_ds=_by_dim((64, 64, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
    dq_ds=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2)))
_MEDIUM = TileSet(
    fwd=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 32, 8, 2)),
    fwd_silu=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 32, 8, 2)),
    dkdv=_by_dim((64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 8, 2)),
    dq=_by_dim((128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 8, 2)),
    dkdv_ds=_by_dim((64, 64, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
    dq_ds=_by_dim((128, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2)))
_LONG = TileSet(
    fwd=_by_dim((128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 8, 2)),
    fwd_silu=_by_dim((128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 8, 2)),
    dkdv=_by_dim((64, 128, 8, 2), (64, 128, 8, 2), (32, 64, 8, 2)),
    dq=_by_dim((128, 64, 8, 3), (128, 64, 8, 3), (64, 32, 8, 2)),
    dkdv_ds=_by_dim((64, 64, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
    dq_ds=_by_dim((128, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2)))
_XLONG = TileSet(
    fwd=_by_dim((128, 64, 4, 3), (128, 128, 8, 3), (64, 32, 8, 2)),
    fwd_silu=_by_dim((128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 8, 2)),
    dkdv=_by_dim((64, 128, 8, 2), (64, 128, 8, 2), (32, 64, 8, 2)),
    dq=_by_dim((128, 64, 8, 3), (128, 64, 8, 3), (64, 32, 8, 2)),
    dkdv_ds=_by_dim((64, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 2)),
    dq_ds=_by_dim((128, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2)))

# ------------------------------------------------------------------------------------------------------------
# Shared memory per launch: the model behind fit_tile, so that no shipped (regime, head dim, kernel) can ask more
# than a Hopper block may have (run 7 of benchmarks/reports/gem_h200_2026-12-02.md: the relative-bias forward of
# the long regime at D = 128 asked 295,936 bytes on triton 3.6 and failed to launch).
# ------------------------------------------------------------------------------------------------------------
SMEM_LIMIT_SM90 = 232_448  # bytes of shared memory one block may opt into on sm_90 (H100 / H200): 227 KiB
SMEM_SLACK = 2048  # mbarriers and reduction scratch that smem_bytes does not count (measured: <= 512 B)
DS_CONVERT_BYTES = 4096  # dkdv_ds: a layout-conversion buffer some compiles add (sm_90, triton 3.9, 2026-12-05)
REL_SMEM_FRACTION = 0.9  # the in-kernel bias's gather buffers depend on Triton's pipeliner: a 10% margin
REL_PAIR_BYTES = 20  # per (query, key) pair of a tile: the pipelined bias gathers (position bucket i32, upper time
#                      threshold i64, pos_w / ts_w values f32), one buffer each (sm_90 compiles, triton 3.6 / 3.9)
_LOOP_AXIS = {"fwd": 1, "fwd_silu": 1, "dq": 1, "dq_ds": 1, "dkdv": 0, "dkdv_ds": 0, "dk_ds": 0}  # the tile axis the loop
#            streams (BLOCK_N of the query-tile kernels, BLOCK_M of the key-tile ones); the other one is held


def smem_bytes(kind: str, tile: Tile, d_qk: int, d_v: int | None = None, *, rel: bool = False,
               elem_bytes: int = 2) -> int:
    """Estimated shared memory (bytes) of one program of a kernel kind (one of TILE_KINDS) with ``tile`` =
    (BLOCK_M, BLOCK_N, num_warps, num_stages), tile widths ``d_qk`` / ``d_v`` (the kernels' BLOCK_DQK / BLOCK_DV,
    powers of two; d_v defaults to d_qk), ``elem_bytes`` per q / k / v / dO element (2: bf16 / fp16, 4: fp32) and
    ``rel`` (the in-kernel relative bias).

    What Triton keeps in shared memory on sm_90: the tiles a tl.dot reads that stay fixed over the loop (held
    once), and every tile the loop loads, num_stages copies (the software pipeliner's buffers):

    * fwd / fwd_silu (query tile, key loop): Q [BM, Dqk] held; K [BN, Dqk] + V [BN, Dv] per stage;
    * dq (query tile, key loop): Q [BM, Dqk] + dO [BM, Dv] held; K + V [BN, D] per stage;
    * dkdv (key tile, query loop): K [BN, Dqk] + V [BN, Dv] held; Q [BM, Dqk] + dO [BM, Dv] + lse / delta
      [BM] fp32 per stage; dkdv_ds adds the dS^T tile [BN, BM] staged for its TMA store and DS_CONVERT_BYTES
      (with dk_from_ds, D = 256, 64 x 64 / 8 warps compiled to 3,072 bytes over the rest of this model);
    * dq_ds (query tile, key loop over the stored dS^T): dS^T [BN, BM] + K [BN, Dqk] per stage;
    * dk_ds (key tile, query loop over the stored dS^T): dS^T [BN, BM] + Q [BM, Dqk] per stage;
    * rel: the loop's key (or query) times [BN] (or [BM]) int64 and REL_PAIR_BYTES per pair of the tile for the
      bias gathers, which the pipeliner also moves into shared memory (one buffer each).

    Checked against sm_90 compiles (``python -m gemray.bench.sass_check --smem``): equal to the byte for the
    kernels without the bias (triton 3.9); with it an upper bound (triton 3.9 keeps K / V in num_stages - 1
    buffers and fewer gathers in the dK/dV kernel; triton 3.6's failing forward above is this model + 512 B).
    Raises ValueError for an unknown kind."""
    if kind not in TILE_KINDS:
        raise ValueError(f"unknown tile kind {kind!r} (one of {TILE_KINDS})")
    bm, bn, _warps, stages = tile
    d_v = d_qk if d_v is None else d_v
    e, s = elem_bytes, max(1, stages)
    if kind in ("fwd", "fwd_silu"):
        held, per_stage = bm * d_qk * e, bn * (d_qk + d_v) * e
    elif kind == "dq":
        held, per_stage = bm * (d_qk + d_v) * e, bn * (d_qk + d_v) * e
    elif kind in ("dkdv", "dkdv_ds"):
        held, per_stage = bn * (d_qk + d_v) * e, bm * (d_qk + d_v) * e + 2 * bm * 4
        if kind == "dkdv_ds":
            held += bn * bm * e + DS_CONVERT_BYTES
    elif kind == "dk_ds":
        held, per_stage = 0, bn * bm * e + bm * d_qk * e
    else:  # dq_ds
        held, per_stage = 0, bn * bm * e + bn * d_qk * e
    total = held + s * per_stage
    if rel:
        total += (bm if _LOOP_AXIS[kind] == 0 else bn) * 8 + bm * bn * REL_PAIR_BYTES
    return total


def smem_budget(rel: bool, limit: int = SMEM_LIMIT_SM90) -> int:
    """The most smem_bytes a launch may have on a device allowing ``limit`` bytes per block: limit - SMEM_SLACK,
    and REL_SMEM_FRACTION of that with the in-kernel bias (whose model is a bound, not an exact count)."""
    budget = limit - SMEM_SLACK
    return int(budget * REL_SMEM_FRACTION) if rel else budget


def fit_tile(kind: str, tile: Tile, d_qk: int, d_v: int | None = None, *, rel: bool = False, elem_bytes: int = 2,
             limit: int = SMEM_LIMIT_SM90) -> Tile:
    """``tile``, or the nearest smaller one whose :func:`smem_bytes` fits :func:`smem_budget` (the launch's tile:
    a tile that fits is returned unchanged). Shrinks in this order until it fits: the loop's tile axis (halved down
    to 32), num_stages (down to 2), the held axis (halved down to 32, with at most 4 warps below 64 rows), then
    num_stages 1 and both axes down to 16. Raises ValueError when even (16, 16, w, 1) does not fit."""
    budget = smem_budget(rel, limit)
    t = list(tile)
    loop, held = _LOOP_AXIS[kind], 1 - _LOOP_AXIS[kind]

    def fits() -> bool:
        return smem_bytes(kind, tuple(t), d_qk, d_v, rel=rel, elem_bytes=elem_bytes) <= budget

    for axis, floor, is_stage in ((loop, 32, False), (3, 2, True), (held, 32, False), (3, 1, True),
                                  (loop, 16, False), (held, 16, False)):
        while not fits() and t[axis] > floor:
            t[axis] = t[axis] - 1 if is_stage else t[axis] // 2
            if axis == held and not is_stage and t[held] < 64:
                t[2] = min(t[2], 4)
    if not fits():
        raise ValueError(f"gdpa: no {kind} tile fits {budget} bytes of shared memory at head dims {d_qk} / "
                         f"{d_v if d_v is not None else d_qk} ({elem_bytes}-byte elements, rel_bias={rel})")
    return tuple(t)


_REGISTRY: dict[str, "KernelConfig"] = {}
_DEFAULT_DIGEST: list[str] = []  # the default config's digest, once DEFAULT is built


@dataclass(frozen=True)
class KernelConfig:
    """The jagged attention kernels' configuration (immutable, hashable; see the module docstring).

    Fields:
        short / medium / long / xlong: :class:`RegimeConfig` of each length regime. Defaults: heads_inner on for
            short only (runs 6 and 15: -10% there, slower elsewhere); tma_loads on for xlong only (runs 7-8:
            -2.5% / -1.3%, lost or tied elsewhere; never used for block / window attention); ds_store on for
            medium / long / xlong (runs 19-24: -5 to -8% fwd+bwd; +8% device time on the short batch, one launch
            more); ws_fwd (the Gluon forward) on for medium / long / xlong (runs 28-30: 12-19% faster; it loses
            on the short batch), two consumer warpgroups, 128-key tiles, 2 stages, no ping-pong (run 30: no
            consistent gain), no persistent grid (run 37: slower).
        regime_mean_len: the mean-length bounds of short / medium / long (tokens), default (256, 1024, 2048).
        seq_order_fwd / seq_order_dkdv / seq_order_dq: the work tables of the forwards / of the DS_STORE
            backward's dK/dV and dQ launches hold whole sequences longest first, each sequence's tiles together
            (programs running at once share their sequence's rows in L2) instead of every item by cost; on
            everywhere (runs 32-34: L2 hit rates of 20-38% under the cost order, -3 to -7% fwd+bwd grouped).
        ds_max_bytes / ds_max_fraction: caps on the DS_STORE scratch (H * Tk * W * itemsize bytes, W = max_q_len
            rounded up to 64): at most 16 GiB and 1/8 of the device's memory; over either, the backward
            recomputes dS.
        ds_scratch_nan: fill the DS_STORE scratch with NaN before the backward (tests: a dS entry read without
            being written makes dQ non-finite); one fill per backward, off by default.
        fast_act: silu on 16-bit CUDA inputs through ``tanh.approx.f32`` (one MUFU op per score; run 3-4); off
            gives the exact sigmoid (the bench compares both).
        direct_launch: once a launch configuration has compiled, call the compiled kernel's launcher directly
            instead of the JIT's per-call binding (run 18: host time of short heavy batches).
        interpret_tiles: the tiles every regime uses under TRITON_INTERPRET=1 (small, so CPU tests are quick;
            tests set unequal ones to exercise tile-edge logic).
    """

    short: RegimeConfig = RegimeConfig(_SHORT, heads_inner=True)
    medium: RegimeConfig = RegimeConfig(_MEDIUM, ds_store=True, ws_fwd=True)
    long: RegimeConfig = RegimeConfig(_LONG, ds_store=True, ws_fwd=True)
    xlong: RegimeConfig = RegimeConfig(_XLONG, tma_loads=True, ds_store=True, ws_fwd=True)
    regime_mean_len: tuple[int, int, int] = (256, 1024, 2048)
    seq_order_fwd: bool = True
    seq_order_dkdv: bool = True
    seq_order_dq: bool = True
    ds_max_bytes: int = 16 << 30
    ds_max_fraction: float = 0.125
    ds_scratch_nan: bool = False
    fast_act: bool = True
    direct_launch: bool = True
    interpret_tiles: TileSet = field(default_factory=lambda: TileSet.uniform((16, 16, 4, 1)))

    def __post_init__(self):
        if len(self.regime_mean_len) != 3 or list(self.regime_mean_len) != sorted(self.regime_mean_len):
            raise ValueError(f"regime_mean_len must be 3 increasing bounds, got {self.regime_mean_len}")
        if self.ds_max_bytes < 0 or not 0 <= self.ds_max_fraction <= 1:
            raise ValueError(f"ds_max_bytes ({self.ds_max_bytes}) must be >= 0 and ds_max_fraction "
                             f"({self.ds_max_fraction}) in [0, 1]")
        digest = hashlib.sha1(repr(self).encode()).hexdigest()
        name = "default" if _DEFAULT_DIGEST and digest == _DEFAULT_DIGEST[0] else f"kc-{digest[:16]}"
        object.__setattr__(self, "_name", name)  # not a field: outside eq / hash / repr
        _REGISTRY.setdefault(name, self)

    @property
    def name(self) -> str:
        """The config's stable name: "default" for a config equal to DEFAULT, else "kc-<16 hex digits>" of its
        content; what the custom ops take (see :func:`lookup`)."""
        return self._name

    def regime(self, reg: str) -> RegimeConfig:
        """The :class:`RegimeConfig` of regime ``reg`` (one of REGIMES). Raises ValueError for another name."""
        if reg not in REGIMES:
            raise ValueError(f"unknown regime {reg!r} (one of {REGIMES})")
        return getattr(self, reg)

    def regime_of(self, total: int, batch: int) -> str:
        """The regime of a batch of ``batch`` sequences and ``total`` tokens (host ints): its mean length
        against ``regime_mean_len``."""
        mean = total / max(1, batch)
        for name, bound in zip(REGIMES, self.regime_mean_len):
            if mean < bound:
                return name
        return "xlong"

    def tile(self, reg: str, kind: str, d_qk: int, d_v: int | None = None, *, rel: bool = False,
             elem_bytes: int = 2, limit: int = SMEM_LIMIT_SM90) -> Tile:
        """The tile a GPU launch of ``kind`` uses in regime ``reg`` at head dims ``d_qk`` / ``d_v`` (the
        regime's tile of d_qk's bucket, through :func:`fit_tile` at the kernel's tile widths, the next powers of
        two >= 16): the shipped tile wherever it fits the device's ``limit`` bytes of shared memory per block;
        with ``rel`` (the in-kernel relative bias, whose gathers need shared memory too) often a smaller one.
        Raises ValueError as TileSet.get / fit_tile."""
        d_v = d_qk if d_v is None else d_v
        base = self.regime(reg).tiles.get(kind, d_qk)
        return fit_tile(kind, base, _pow2(d_qk), _pow2(d_v), rel=rel, elem_bytes=elem_bytes, limit=limit)

    def with_regime(self, reg: str, **changes) -> "KernelConfig":
        """A copy with regime ``reg``'s RegimeConfig fields changed (``heads_inner=True``, ``tiles=...``)."""
        return dataclasses.replace(self, **{reg: dataclasses.replace(self.regime(reg), **changes)})

    def with_all_regimes(self, **changes) -> "KernelConfig":
        """A copy with the same RegimeConfig fields changed in every regime (e.g. ``ds_store=False``)."""
        return dataclasses.replace(self, **{r: dataclasses.replace(self.regime(r), **changes) for r in REGIMES})

    def with_tile(self, reg: str, kind: str, tile: Tile, d: int = 128) -> "KernelConfig":
        """A copy with regime ``reg``'s ``kind`` tile of head-dim bucket ``d`` replaced."""
        return self.with_regime(reg, tiles=self.regime(reg).tiles.with_tile(kind, tile, d))

    def forcing(self, reg: str) -> "KernelConfig":
        """A copy in which every regime is ``reg``'s (tests and benches: a regime's tiles and modes on any
        batch)."""
        return dataclasses.replace(self, **{r: self.regime(reg) for r in REGIMES})

    def replace(self, **changes) -> "KernelConfig":
        """``dataclasses.replace`` of this config (e.g. ``fast_act=False``)."""
        return dataclasses.replace(self, **changes)


DEFAULT = KernelConfig()
_DEFAULT_DIGEST.append(hashlib.sha1(repr(DEFAULT).encode()).hexdigest())
_REGISTRY.pop(DEFAULT._name, None)
object.__setattr__(DEFAULT, "_name", "default")
_REGISTRY["default"] = DEFAULT


def lookup(name: str) -> KernelConfig:
    """The config registered under ``name`` (:attr:`KernelConfig.name`). Raises ValueError naming the known
    configs when none is (a graph made in another process with a config not built in this one)."""
    cfg = _REGISTRY.get(name)
    if cfg is None:
        raise ValueError(f"unknown kernel config {name!r}: build it here first (KernelConfig(...) with the same "
                         f"content registers it); known: {sorted(_REGISTRY)[:8]}")
    return cfg


def resolve(config: KernelConfig | None) -> KernelConfig:
    """``config``, or DEFAULT for None. Raises TypeError for anything else."""
    if config is None:
        return DEFAULT
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a gemray.kernels.config.KernelConfig or None, got {type(config).__name__}")
    return config


def registered() -> Mapping[str, KernelConfig]:
    """A read-only view of the registry (name -> config)."""
    return MappingProxyType(_REGISTRY)


MODE_FIELDS = ("heads_inner", "tma_loads", "ds_store", "dk_from_ds", "ws_bwd", "ws_dkdq", "ws_fwd_silu")


def _as_json(value) -> str:
    """``value`` as it reads in the JSON a user wrote (``true``, ``"x"``, ``[64, 64, 4]``) for the messages of
    :func:`apply_tiles`; ``repr`` for a value JSON cannot hold."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def apply_tiles(spec: Mapping, config: KernelConfig | None = None) -> KernelConfig:
    """``config`` (None: DEFAULT) with the tiles and launch modes of ``spec``: {regime: {kind: {"<head-dim
    bucket>": [BLOCK_M, BLOCK_N, num_warps, num_stages], ...}, "mode": {"heads_inner": bool, "tma_loads": bool,
    "ds_store": bool, "dk_from_ds": bool, "ws_bwd": bool, "ws_dkdq": bool, "ws_fwd_silu": bool}}} -- the "chosen
    tiles" JSON the sweeps print (``gemray bench kernels --sweep``,
    benchmarks/attn_sweep_d256.py) and what ``model.kernel_tiles`` and ``gemray bench kernels --tiles`` read.
    A mode entry changes only the keys it names. Raises ValueError naming the entry for an unknown regime, tile
    kind, head-dim bucket or mode, a mode value that is not a JSON boolean, or a tile that is not 4 positive ints
    (booleans are not ints here); the offending value is shown as JSON (``true``, not Python's ``True``)."""
    config = resolve(config)
    if not isinstance(spec, Mapping):
        raise ValueError(f"kernel tiles: expected a JSON object {{regime: {{kind: ...}}}}, got {type(spec).__name__}")
    for reg, kinds in spec.items():
        if reg not in REGIMES:
            raise ValueError(f"kernel tiles: unknown regime {_as_json(reg)} (one of {_as_json(REGIMES)})")
        if not isinstance(kinds, Mapping):
            raise ValueError(f"kernel tiles: {reg}: expected an object of tile kinds, got {_as_json(kinds)}")
        for kind, table in kinds.items():
            if kind == "mode":
                if not isinstance(table, Mapping) or set(table) - set(MODE_FIELDS):
                    raise ValueError(f"kernel tiles: {reg}.mode: expected an object with keys from "
                                     f"{_as_json(MODE_FIELDS)}, got {_as_json(table)}")
                # JSON true / false only: bool("false") is True, so a quoted value would silently do the opposite
                for k, v in table.items():
                    if not isinstance(v, bool):
                        raise ValueError(f"kernel tiles: {reg}.mode.{k}: expected true or false, got {_as_json(v)}")
                config = config.with_regime(reg, **dict(table))
                continue
            if kind not in TILE_KINDS:
                raise ValueError(f"kernel tiles: {reg}: unknown tile kind {_as_json(kind)} (one of "
                                 f"{_as_json(TILE_KINDS)} or \"mode\")")
            if not isinstance(table, Mapping):
                raise ValueError(f"kernel tiles: {reg}.{kind}: expected an object {{head-dim bucket: tile}}, got "
                                 f"{_as_json(table)}")
            for d, tile in table.items():
                if (not isinstance(tile, (list, tuple)) or len(tile) != 4
                        or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in tile)):
                    raise ValueError(f"kernel tiles: {reg}.{kind}.{d}: expected [BLOCK_M, BLOCK_N, num_warps, "
                                     f"num_stages] (positive ints), got {_as_json(tile)}")
                if not str(d).isdigit() or int(d) not in HEAD_DIM_BUCKETS:
                    raise ValueError(f"kernel tiles: {reg}.{kind}: head-dim bucket {_as_json(d)} not in "
                                     f"{_as_json(HEAD_DIM_BUCKETS)}")
                config = config.with_tile(reg, kind, tuple(tile), int(d))
    return config


__all__ = ["DEFAULT", "HEAD_DIM_BUCKETS", "KernelConfig", "MODE_FIELDS", "REGIMES", "RegimeConfig", "SMEM_LIMIT_SM90",
           "TILE_KINDS", "Tile", "TileSet", "WsTiles", "apply_tiles", "fit_tile", "lookup", "registered", "resolve",
           "smem_budget", "smem_bytes"]
