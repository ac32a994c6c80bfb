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
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
TileByDim = tuple[tuple[int, Tile], ...]  # ((head-dim bucket, tile), ...) in increasing bucket order
WsTiles = tuple[int, int, int, bool, bool]  # Gluon forward: (consumer warpgroups, BLOCK_N, STAGES, ping-pong, persistent)

REGIMES = ("short", "medium", "long", "xlong")
# tile kinds: "fwd" the softmax / pointwise forward, "fwd_silu" the silu forward (swept separately), "dkdv" / "dq"
# the recomputing backward's two launches (dK/dV tiles the keys by BLOCK_N and loops over the queries by BLOCK_M),
# "dkdv_ds" / "dq_ds" the DS_STORE backward's dK/dV launch (also storing dS^T) and its dQ = dS K launch
TILE_KINDS = ("fwd", "fwd_silu", "dkdv", "dq", "dkdv_ds", "dq_ds")
HEAD_DIM_BUCKETS = (64, 128, 256)


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
    caps of :class:`KernelConfig`. ws_fwd: the softmax forward runs the warp-specialized Gluon kernel
    (kernels/ws_attention.py) where it applies, with ``ws_tiles`` (consumer warpgroups, BLOCK_N, STAGES,
    ping-pong, persistent grid)."""

    tiles: TileSet
    heads_inner: bool = False
    tma_loads: bool = False
    ds_store: bool = False
    ws_fwd: bool = False
    ws_tiles: WsTiles = (2, 128, 2, False, False)


# D=128 tiles: run 4's sweep winners (each timed on its regime's bench batch: short heavy B=128 N=1024, medium heavy
# B=256 N=4096, long uniform B=128 N=1024, xlong uniform B=64 N=4096), changed after runs 6-8 (medium dK/dV and dQ
# 64x64/4w/2, long forward 128x64/8w/3) and after run 15, the first sweep timed in device time (short dK/dV and dQ
# 64x64/4w/2). dkdv_ds / dq_ds: the best of runs 19-24 per regime; with the tables grouped by sequence (seq_order)
# run 34 moved dq_ds to 128x64/4w/3 in medium / long / xlong. D=64 / 256 entries are not measured (kept from run 3).
_SHORT = TileSet(
    fwd=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)),
    fwd_silu=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)),
    dkdv=_by_dim((64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
    dq=_by_dim((64, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)),
    dkdv_ds=_by_dim((64, 64, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
    dq_ds=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2)))
_MEDIUM = TileSet(
    fwd=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)),
    fwd_silu=_by_dim((64, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)),
    dkdv=_by_dim((64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
    dq=_by_dim((128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2)),
    dkdv_ds=_by_dim((64, 64, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
    dq_ds=_by_dim((128, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2)))
_LONG = TileSet(
    fwd=_by_dim((128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2)),
    fwd_silu=_by_dim((128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2)),
    dkdv=_by_dim((64, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2)),
    dq=_by_dim((128, 64, 8, 3), (128, 64, 8, 3), (64, 32, 4, 2)),
    dkdv_ds=_by_dim((64, 64, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
    dq_ds=_by_dim((128, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2)))
_XLONG = TileSet(
    fwd=_by_dim((128, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 2)),
    fwd_silu=_by_dim((128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2)),
    dkdv=_by_dim((64, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2)),
    dq=_by_dim((128, 64, 8, 3), (128, 64, 8, 3), (64, 32, 4, 2)),
    dkdv_ds=_by_dim((64, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 2)),
    dq_ds=_by_dim((128, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2)))

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


MODE_FIELDS = ("heads_inner", "tma_loads", "ds_store")


def apply_tiles(spec: Mapping, config: KernelConfig | None = None) -> KernelConfig:
    """``config`` (None: DEFAULT) with the tiles and launch modes of ``spec``: {regime: {kind: {"<head-dim
    bucket>": [BLOCK_M, BLOCK_N, num_warps, num_stages], ...}, "mode": {"heads_inner": bool, "tma_loads": bool,
    "ds_store": bool}}} -- the "chosen tiles" JSON the sweeps print (``gemray bench kernels --sweep``,
    benchmarks/attn_sweep_d256.py) and what ``model.kernel_tiles`` and ``gemray bench kernels --tiles`` read.
    A mode entry changes only the keys it names. Raises ValueError naming the entry for an unknown regime, tile
    kind, head-dim bucket or mode, or a tile that is not 4 positive ints."""
    config = resolve(config)
    if not isinstance(spec, Mapping):
        raise ValueError(f"kernel tiles: expected a JSON object {{regime: {{kind: ...}}}}, got {type(spec).__name__}")
    for reg, kinds in spec.items():
        if reg not in REGIMES:
            raise ValueError(f"kernel tiles: unknown regime {reg!r} (one of {list(REGIMES)})")
        if not isinstance(kinds, Mapping):
            raise ValueError(f"kernel tiles: {reg}: expected an object of tile kinds, got {kinds!r}")
        for kind, table in kinds.items():
            if kind == "mode":
                if not isinstance(table, Mapping) or set(table) - set(MODE_FIELDS):
                    raise ValueError(f"kernel tiles: {reg}.mode: expected an object with keys from {MODE_FIELDS}, "
                                     f"got {table!r}")
                config = config.with_regime(reg, **{k: bool(v) for k, v in table.items()})
                continue
            if kind not in TILE_KINDS:
                raise ValueError(f"kernel tiles: {reg}: unknown tile kind {kind!r} (one of {list(TILE_KINDS)} or "
                                 "'mode')")
            for d, tile in dict(table).items():
                if (not isinstance(tile, (list, tuple)) or len(tile) != 4
                        or not all(isinstance(x, int) and x > 0 for x in tile)):
                    raise ValueError(f"kernel tiles: {reg}.{kind}.{d}: expected [BLOCK_M, BLOCK_N, num_warps, "
                                     f"num_stages] (positive ints), got {tile!r}")
                if int(d) not in HEAD_DIM_BUCKETS:
                    raise ValueError(f"kernel tiles: {reg}.{kind}: head-dim bucket {d!r} not in {HEAD_DIM_BUCKETS}")
                config = config.with_tile(reg, kind, tuple(tile), int(d))
    return config


__all__ = ["DEFAULT", "HEAD_DIM_BUCKETS", "KernelConfig", "MODE_FIELDS", "REGIMES", "RegimeConfig", "TILE_KINDS", "Tile", "TileSet",
           "WsTiles", "apply_tiles", "lookup", "registered", "resolve"]
