"""Triton jagged attention kernels (gemray.kernels.jagged_attention) against the PyTorch references.

CPU: run under TRITON_INTERPRET=1 (set below when no CUDA device is present), float32, relative error of
forward and of every gradient < 1e-4 (the bound asked for is 1e-3). Batches include empty sequences,
length 1, all-equal lengths and one sequence much longer than the rest (several tiles, so the causal
diagonal, the unmasked interior and the partial last tile are all exercised).
GPU (@pytest.mark.gpu): the same patterns at realistic sizes in bf16 on CUDA.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemray.kernels import reference as ref  # noqa: E402
from gemray.kernels.config import DEFAULT, KernelConfig, TileSet  # noqa: E402
from gemray.kernels.jagged_attention import (  # noqa: E402
    _work_table, gdpa_triton, jagged_attention_triton, jagged_block_attention_triton,
    jagged_cross_attention_triton, pma_triton)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
ACTS = ("softmax", "silu", "gelu", "none")

BATCHES = {
    "mixed": [0, 1, 5, 37, 3, 0, 16],  # empty, length 1, one much longer than the rest
    "equal": [8, 8, 8, 8],
    "one_token": [1],
    "long_tail": [70, 2, 0],
}


def _offsets(lengths, device="cpu"):
    return torch.tensor([0] + list(lengths), device=device).cumsum(0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values in the kernel's result"
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _leaf(*shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32, device=device) * scale).to(dtype).requires_grad_(True)


def _check(kernel_fn, ref_fn, tensors, tol):
    """Forward and all gradients of kernel_fn(*tensors) vs ref_fn on float32 copies (same grad_output)."""
    out = kernel_fn(*tensors)
    ref_t = [t.detach().float().requires_grad_(True) for t in tensors]
    expect = ref_fn(*ref_t)
    assert out.shape == expect.shape, (out.shape, expect.shape)
    if expect.numel() and expect.norm() > 0:
        assert _rel(out, expect) < tol, f"forward rel err {_rel(out, expect):.2e}"
    do = torch.randn_like(expect)
    grads = torch.autograd.grad(out, tensors, do.to(out.dtype))
    ref_grads = torch.autograd.grad(expect, ref_t, do)
    for name, g, gr in zip(("q", "k", "v", "bias"), grads, ref_grads):
        assert g.shape == gr.shape
        if gr.norm() > 1e-6 * do.norm():
            assert _rel(g, gr) < tol, f"d{name} rel err {_rel(g, gr):.2e}"
        else:  # e.g. softmax over one key: dq = dk = 0 up to rounding
            assert float(g.detach().float().norm()) < tol * float(do.norm()), f"d{name} should be ~0" 
    return out, expect


# ---------------------------------------------------------------------------------------------- CPU tests


@cpu_only
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_self_attention_causal_matches_reference(batch, activation):
    torch.manual_seed(1)
    lengths = BATCHES[batch]
    off = _offsets(lengths)
    t, h, d = int(off[-1]), 2, 16
    max_len = max(lengths) + 3
    q, k, v = _leaf(t, h, d), _leaf(t, h, d), _leaf(t, h, 24)
    _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, max_len, activation=activation),
           lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, max_len, activation=activation),
           (q, k, v), 1e-4)


@cpu_only
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("pattern", ["causal", "full", "targets"])
def test_self_attention_patterns_all_activations(activation, pattern):
    torch.manual_seed(2)
    lengths = BATCHES["mixed"]
    off = _offsets(lengths)
    t, h, d = int(off[-1]), 2, 25  # 25: the model's default attention_dim, not a power of two
    causal = pattern != "full"
    nt = torch.tensor([0, 1, 2, 5, 3, 0, 16]) if pattern == "targets" else None
    alpha = 0.3 if activation != "softmax" else None
    q, k, v = _leaf(t, h, d), _leaf(t, h, d), _leaf(t, h, d)
    _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 40, activation=activation, causal=causal,
                                                   alpha=alpha, num_targets=nt),
           lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, 40, activation=activation, causal=causal,
                                                    alpha=alpha, num_targets=nt),
           (q, k, v), 1e-4)


@cpu_only
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("per_head", [False, True])
def test_attn_bias_matches_reference_with_dbias(activation, per_head):
    """attn_bias [B, n', n'] (shared) or [B, H, n', n'] (n' > longest): output and d(q, k, v, bias)."""
    torch.manual_seed(12)
    lengths = [0, 1, 5, 37, 3, 16]
    off = _offsets(lengths)
    t, h, d = int(off[-1]), 2, 16
    nt = torch.tensor([0, 1, 2, 5, 0, 3])
    shape = (len(lengths), h, 40, 40) if per_head else (len(lengths), 40, 40)
    q, k, v, bias = _leaf(t, h, d), _leaf(t, h, d), _leaf(t, h, d), _leaf(*shape)
    _check(lambda a, b, c, e: jagged_attention_triton(a, b, c, off, 40, activation=activation, attn_bias=e,
                                                      num_targets=nt),
           lambda a, b, c, e: ref.jagged_attention_ref(a, b, c, off, 40, activation=activation, attn_bias=e,
                                                       num_targets=nt),
           (q, k, v, bias), 1e-4)


@cpu_only
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("ctx", [1, 5, 20])
def test_contextual_prefix_matches_reference(activation, ctx):
    """Bidirectional prefix of ctx positions (ctx=20 spans two interpreter tiles) with targets."""
    torch.manual_seed(13)
    lengths = [0, 1, 5, 37, 3, 16]
    off = _offsets(lengths)
    t, h, d = int(off[-1]), 2, 16
    nt = torch.tensor([0, 0, 0, 6, 0, 0])
    q, k, v = _leaf(t, h, d), _leaf(t, h, d), _leaf(t, h, d)
    _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 40, activation=activation, num_targets=nt,
                                                   contextual_len=ctx),
           lambda a, b, c: ref.jagged_contextual_attention_ref(a, b, c, off, 40, contextual_len=ctx,
                                                               activation=activation, num_targets=nt),
           (q, k, v), 1e-4)
    # short sequences whose targets reach into the prefix (lengths 1, 2, 5 with 1, 1, 4 targets): the prefix
    # positions still see each other, as in the reference
    nt_short = torch.tensor([0, 1, 4, 6, 2, 0])
    lengths_short = [0, 1, 5, 37, 2, 16]
    off_s = _offsets(lengths_short)
    qs, ks, vs = _leaf(int(off_s[-1]), h, d), _leaf(int(off_s[-1]), h, d), _leaf(int(off_s[-1]), h, d)
    _check(lambda a, b, c: jagged_attention_triton(a, b, c, off_s, 40, activation=activation, num_targets=nt_short,
                                                   contextual_len=ctx),
           lambda a, b, c: ref.jagged_contextual_attention_ref(a, b, c, off_s, 40, contextual_len=ctx,
                                                               activation=activation, num_targets=nt_short),
           (qs, ks, vs), 1e-4)
    if ctx == 1:  # a prefix of one position is plain causal attention
        _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 40, activation=activation,
                                                       contextual_len=1),
               lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, 40, activation=activation),
               (q, k, v), 1e-4)


@cpu_only
@pytest.mark.parametrize("activation", ACTS)
def test_cross_attention_matches_reference(activation):
    torch.manual_seed(3)
    q_len = [2, 1, 3, 0, 4, 1]
    kv_len = [0, 5, 1, 6, 37, 8]  # an empty history: its queries get 0
    qo, ko = _offsets(q_len), _offsets(kv_len)
    h, d = 2, 16
    q, k, v = _leaf(int(qo[-1]), h, d), _leaf(int(ko[-1]), h, d), _leaf(int(ko[-1]), h, 32)
    out, _ = _check(
        lambda a, b, c: jagged_cross_attention_triton(a, qo, b, c, ko, 4, 40, activation=activation),
        lambda a, b, c: ref.jagged_cross_attention_ref(a, qo, b, c, ko, 4, 40, activation=activation),
        (q, k, v), 1e-4)
    assert out[:2].abs().max() == 0  # sequence 0 has no keys


@cpu_only
def test_cross_attention_dense_kv_view():
    """A dense kv [B, Nk, H, D] goes in as a view with uniform offsets (no copy)."""
    torch.manual_seed(4)
    b, nk, h, d = 3, 9, 2, 16
    kv = torch.randn(b, nk, h, d)
    k_flat = kv.view(b * nk, h, d)
    assert k_flat.data_ptr() == kv.data_ptr()
    ko = torch.arange(b + 1) * nk
    qo = _offsets([2, 0, 5])
    q = torch.randn(int(qo[-1]), h, d)
    out = jagged_cross_attention_triton(q, qo, k_flat, k_flat, ko, 5, nk, activation="softmax")
    # dense equivalent: padded softmax attention per sequence
    for i in (0, 2):  # sequence 1 has no queries
        qi = q[qo[i]:qo[i + 1]].transpose(0, 1)  # [H, Lq, D]
        ki = kv[i].transpose(0, 1)
        expect = torch.softmax(qi @ ki.transpose(-1, -2) / math.sqrt(d), -1) @ ki
        assert _rel(out[qo[i]:qo[i + 1]].transpose(0, 1), expect) < 1e-5


@cpu_only
@pytest.mark.parametrize("activation", ACTS)
def test_pma_matches_reference(activation):
    torch.manual_seed(5)
    kv_len = [0, 1, 7, 37, 7]
    ko = _offsets(kv_len)
    s, h, d = 3, 2, 16
    seeds, k, v = _leaf(s, h, d), _leaf(int(ko[-1]), h, d), _leaf(int(ko[-1]), h, 16)
    out, _ = _check(lambda a, b, c: pma_triton(a, b, c, ko, 40, activation=activation),
                    lambda a, b, c: ref.pma_ref(a, b, c, ko, 40, activation=activation),
                    (seeds, k, v), 1e-4)
    assert out.shape == (5, s, h, 16)
    assert out[0].abs().max() == 0  # empty history


@cpu_only
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("mode", ["block_causal", "block_full", "window_causal", "window_full"])
def test_block_attention_matches_reference(activation, mode):
    torch.manual_seed(6)
    lengths = [0, 1, 9, 53, 8, 20]
    off = _offsets(lengths)
    t, h, d = int(off[-1]), 2, 16
    kw = dict(block_size=8, window=0) if mode.startswith("block") else dict(block_size=0, window=6)
    causal = mode.endswith("causal")
    q, k, v = _leaf(t, h, d), _leaf(t, h, d), _leaf(t, h, d)
    _check(lambda a, b, c: jagged_block_attention_triton(a, b, c, off, 60, activation=activation,
                                                         causal=causal, **kw),
           lambda a, b, c: ref.jagged_block_attention_ref(a, b, c, off, 60, activation=activation,
                                                          causal=causal, **kw),
           (q, k, v), 1e-4)


@cpu_only
@pytest.mark.parametrize("tiles", [(16, 32, 4, 1), (32, 16, 4, 1)])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_unequal_tiles(tiles, activation):
    """BLOCK_M != BLOCK_N: the causal/target tile ranges must still cover every valid pair exactly once."""
    cfg = DEFAULT.replace(interpret_tiles=TileSet.uniform(tiles))
    torch.manual_seed(8)
    lengths = [0, 1, 33, 70, 17]
    off = _offsets(lengths)
    nt = torch.tensor([0, 1, 5, 20, 0])
    t = int(off[-1])
    q, k, v = _leaf(t, 2, 16), _leaf(t, 2, 16), _leaf(t, 2, 16)
    _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 70, activation=activation, num_targets=nt,
                                                   config=cfg),
           lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, 70, activation=activation, num_targets=nt),
           (q, k, v), 1e-4)
    _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 70, activation=activation, num_targets=nt,
                                                   contextual_len=19, config=cfg),
           lambda a, b, c: ref.jagged_contextual_attention_ref(a, b, c, off, 70, contextual_len=19,
                                                               activation=activation, num_targets=nt),
           (q, k, v), 1e-4)


# (activation, heads inner, TMA loads, dS stored): the launch modes the sweep can pick, each with softmax and a
# pointwise activation
_F = False
BWD_MODES = [("softmax", _F, _F, _F), ("silu", _F, _F, _F), ("softmax", True, _F, _F), ("silu", True, _F, _F),
             ("softmax", _F, True, _F), ("silu", _F, True, _F), ("softmax", True, True, _F),
             ("softmax", _F, _F, True), ("silu", _F, _F, True), ("gelu", _F, _F, True), ("softmax", _F, True, True),
             ("softmax", True, True, True)]


def _mode_config(inner: bool, tma: bool, ds: bool, base: KernelConfig = DEFAULT,
                 tiles: tuple = (16, 32, 4, 1)) -> KernelConfig:
    """``base`` with the same launch mode in every regime (the dS scratch filled with NaN when ``ds``: an entry
    read without being written makes dQ non-finite) and ``tiles`` under the interpreter (unequal, so that key and
    query tiles differ)."""
    cfg = base.with_all_regimes(heads_inner=inner, tma_loads=tma, ds_store=ds)
    return cfg.replace(ds_scratch_nan=ds, interpret_tiles=TileSet.uniform(tiles))


@cpu_only
@pytest.mark.parametrize("activation,inner,tma,ds", BWD_MODES)
def test_backward_launch_modes(activation, inner, tma, ds):
    """The backward as two launches (dQ, which writes softmax's delta, then dK/dV) or with dS stored by the dK/dV
    launch and dQ = dS K from it (ds_store; softmax's delta from its own launch), each with the (items, H) or the
    heads-inner (items * H,) grid (heads_inner, forward too), and tile loads by pointers or through tensor
    descriptors (tma_loads, forward too), matches the reference: targets + bias (dbias) + unequal tiles (self),
    cross-attention and PMA."""
    torch.manual_seed(14)
    _check_mode_cases(activation, config=_mode_config(inner, tma, ds))


def _check_mode_cases(activation: str, extra=None, config: KernelConfig | None = None) -> None:
    """The backward-mode tests' cases, float32 against the reference (1e-4): self-attention with targets and a
    per-sequence bias (dbias), ``extra(off, nt, q, k, v)`` (more self-attention checks on the same batch),
    cross-attention and PMA, on lengths [0, 1, 33, 70, 17] (H=2, Dqk 16, Dv 8), all with ``config``."""
    lengths = [0, 1, 33, 70, 17]
    off = _offsets(lengths)
    nt = torch.tensor([0, 1, 5, 20, 0])
    t = int(off[-1])
    q, k, v, bias = _leaf(t, 2, 16), _leaf(t, 2, 16), _leaf(t, 2, 8), _leaf(len(lengths), 72, 72)
    _check(lambda a, b, c, e: jagged_attention_triton(a, b, c, off, 70, activation=activation, num_targets=nt,
                                                      attn_bias=e, config=config),
           lambda a, b, c, e: ref.jagged_attention_ref(a, b, c, off, 70, activation=activation, num_targets=nt,
                                                       attn_bias=e),
           (q, k, v, bias), 1e-4)
    if extra is not None:
        extra(off, nt, q, k, v)
    qo = _offsets([3, 0, 40, 1, 2])
    qc = _leaf(int(qo[-1]), 2, 16)
    _check(lambda a, b, c: jagged_cross_attention_triton(a, qo, b, c, off, 40, 70, activation=activation,
                                                         config=config),
           lambda a, b, c: ref.jagged_cross_attention_ref(a, qo, b, c, off, 40, 70, activation=activation),
           (qc, k, v), 1e-4)
    _check(lambda a, b, c: pma_triton(a, b, c, off, 70, activation=activation, config=config),
           lambda a, b, c: ref.pma_ref(a, b, c, off, 70, activation=activation), (_leaf(3, 2, 16), k, v), 1e-4)


@cpu_only
@pytest.mark.parametrize("activation,causal,ds", [("softmax", True, False), ("softmax", False, True),
                                                  ("silu", True, True), ("gelu", False, False), ("silu", True, "dk"),
                                                  ("softmax", False, "dk")])
def test_random_jagged_batches(activation, causal, ds):
    """Forward and dq/dk/dv match the float32 reference (rel err < 1e-3) on random jagged batches that include
    empty and length-1 sequences and one of the maximal length, with unequal tiles, for the recomputing and the
    dS-storing backward (ds "dk": also dK from the stored dS, dk_from_ds)."""
    cfg = _mode_config(False, False, bool(ds)).with_all_regimes(dk_from_ds=ds == "dk")
    for seed in (0, 1, 2):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 60, (6,), generator=g).tolist() + [0, 1]
        n = max(lengths) + 4
        lengths.append(n)
        lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
        off = _offsets(lengths)
        t = int(off[-1])
        torch.manual_seed(seed)
        q, k, v = _leaf(t, 2, 16), _leaf(t, 2, 16), _leaf(t, 2, 24)
        _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, n, activation=activation, causal=causal,
                                                       config=cfg),
               lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, n, activation=activation, causal=causal),
               (q, k, v), 1e-3)


def _new_bwd_plans(cfg: KernelConfig, seen: set) -> list:
    """The backward plans made under ``cfg`` that are not in ``seen`` (ids), read from the launch-plan cache."""
    from gemray.kernels import jagged_attention as ja

    out = []
    for key, (_, plan) in list(ja._CACHE.items()):
        if key[0] == "fwd plan" and key[1] == cfg.name:
            out += [bp for bp in plan.bwd.values() if id(bp) not in seen]
    seen.update(id(bp) for bp in out)
    return out


def _ds_config(tiles: dict | None = None) -> KernelConfig:
    """ds_store on in every regime with its scratch filled with NaN; optional per-kind tiles under the interpreter;
    a "dk_ds" tile among them also turns on dk_from_ds (dK = dS^T Q from the scratch, its own launch)."""
    cfg = _mode_config(False, False, True, tiles=(16, 16, 4, 1))
    if "dk_ds" in (tiles or {}):
        cfg = cfg.with_all_regimes(dk_from_ds=True)
    for kind, tile in (tiles or {}).items():
        cfg = cfg.replace(interpret_tiles=cfg.interpret_tiles.with_tile(kind, tile, 64))
    return cfg


# DS_STORE's dK/dV tiles (query step, key tile) and dQ-from-dS tiles (query tile, key step): equal, and the dQ tiles
# reaching pairs no dK/dV program visited (query tile 32 > key tile 16: rows 0-15 of key tile 16-31 are never
# written)
DS_TILES = [{"dkdv_ds": (16, 16, 4, 1), "dq_ds": (16, 16, 4, 1)},
            {"dkdv_ds": (16, 16, 4, 1), "dq_ds": (32, 16, 4, 1)},
            {"dkdv_ds": (32, 16, 4, 1), "dq_ds": (16, 32, 4, 1)},
            # dk_from_ds: dK = dS^T Q from the scratch, with its (query step, key tile): equal to the dK/dV launch's;
            # a key tile of 32 (its tile at key 0 reads queries 0-15 of keys 16-31, which the dK/dV launch's key tile
            # 16 never visits); a query step of 32 (its key tile 16 starts at query 0, the dK/dV launch's at 16)
            {"dkdv_ds": (16, 16, 4, 1), "dq_ds": (16, 16, 4, 1), "dk_ds": (16, 16, 4, 1)},
            {"dkdv_ds": (16, 16, 4, 1), "dq_ds": (16, 16, 4, 1), "dk_ds": (16, 32, 4, 1)},
            {"dkdv_ds": (16, 16, 4, 1), "dq_ds": (32, 16, 4, 1), "dk_ds": (32, 16, 4, 1)}]


@cpu_only
@pytest.mark.parametrize("tiles", range(len(DS_TILES)))
@pytest.mark.parametrize("activation", ["softmax", "silu", "gelu"])
def test_ds_store_matches_reference(tiles, activation):
    """ds_store (dK/dV launch stores dS^T, dQ = dS K from it; with a dk_ds tile also dK = dS^T Q from it,
    dk_from_ds): forward and dq/dk/dv (and dbias) match the float32 reference with targets + bias, the contextual
    prefix, cross-attention, PMA and non-causal rows, on batches with empty, length-1 and one long sequence; the
    scratch starts as NaN (ds_scratch_nan), so an entry read without being written fails the test."""
    cfg = _ds_config(DS_TILES[tiles])
    seen: set = set()
    _new_bwd_plans(cfg, seen)
    torch.manual_seed(30 + tiles)

    def contextual_and_full(off, nt, q, k, v):
        made = [bp.ds_shape for bp in _new_bwd_plans(cfg, seen)]
        assert made == [(2, q.shape[0], 128)], made  # H, Tk, W = max_q_len 70 rounded up to 64
        _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 70, activation=activation, num_targets=nt,
                                                       contextual_len=19, config=cfg),
               lambda a, b, c: ref.jagged_contextual_attention_ref(a, b, c, off, 70, contextual_len=19,
                                                                   activation=activation, num_targets=nt),
               (q, k, v), 1e-4)
        _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 70, activation=activation, causal=False,
                                                       config=cfg),
               lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, 70, activation=activation, causal=False),
               (q, k, v), 1e-4)

    _check_mode_cases(activation, contextual_and_full, config=cfg)
    plans = _new_bwd_plans(cfg, seen)
    assert plans and all(bp.ds_shape is not None for bp in plans)
    want = ["bwd", "dq_ds", "dk_ds"] if "dk_ds" in DS_TILES[tiles] else ["bwd", "dq_ds"]
    assert all([kind for _, _, kind in bp.steps] == want for bp in plans), [bp.steps for bp in plans]


@cpu_only
def test_ds_store_falls_back_where_it_does_not_apply(monkeypatch):
    """Block attention, a buffer over ds_max_bytes, and a buffer that cannot be allocated take the recomputing
    backward (no scratch), with the same results."""
    from gemray.kernels import jagged_attention as ja

    torch.manual_seed(33)
    off = _offsets([0, 1, 33, 70, 17])
    t = int(off[-1])
    q, k, v = _leaf(t, 2, 16), _leaf(t, 2, 16), _leaf(t, 2, 16)
    cap = 2 * t * 128 * 4  # H * Tk * W * itemsize of this batch's scratch

    def run(cfg):
        seen = {id(bp) for bp in _new_bwd_plans(cfg, set())}
        _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 70, activation="softmax", config=cfg),
               lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, 70, activation="softmax"), (q, k, v), 1e-4)
        return [bp.ds_shape for bp in _new_bwd_plans(cfg, seen)]

    cfg = _ds_config()
    seen = {id(bp) for bp in _new_bwd_plans(cfg, set())}
    _check(lambda a, b, c: jagged_block_attention_triton(a, b, c, off, 70, block_size=16, activation="softmax",
                                                         config=cfg),
           lambda a, b, c: ref.jagged_block_attention_ref(a, b, c, off, 70, block_size=16, activation="softmax"),
           (q, k, v), 1e-4)
    assert [bp.ds_shape for bp in _new_bwd_plans(cfg, seen)] == [None]
    assert run(cfg.replace(ds_max_bytes=cap - 1)) == [None]
    assert run(cfg.replace(ds_max_bytes=cap)) == [(2, t, 128)]

    refused = []

    def no_memory(shape, like, nan=False):  # a stand-in allocator: under the caps, but the allocation fails
        refused.append(shape)
        raise torch.OutOfMemoryError("test: out of memory")

    monkeypatch.setattr(ja, "_ds_buffer", no_memory)
    # the plan with the scratch is made (and refused at allocation), then the recomputing one
    assert run(cfg.replace(ds_max_bytes=cap + 1)) == [(2, t, 128), None] and refused == [(2, t, 128)]


# -------------------------------------------------------- the model's call: HSTU block through gemray.ops
# gemray.model.hstu.HSTUBlock calls gemray.ops.attention(q, k, v, offsets, max_len, activation="silu",
# causal=True, rel_bias=RelativeBiasInputs(...)) with H=2, Dqk=Dv=25 (not a power of two), max_len 200;
# the Triton backend computes the bias in the kernels from the ingredients (RelBias). The reference backend
# (grouped reference with the bias ingredients) is the spec; gradients include the two bias weight vectors.
MODEL_H, MODEL_D, MODEL_MAX_LEN = 2, 25, 200


def _model_inputs(lengths, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    off = _offsets(lengths, device)
    t = int(off[-1])
    qkv = [(torch.randn(t, MODEL_H, MODEL_D, generator=g) * 0.5).to(device=device, dtype=dtype).requires_grad_(True)
           for _ in range(3)]
    gaps = torch.exp(torch.rand(t, generator=g) * 16).long()  # 1 s .. ~100 days between events
    ts = (1_000_000_000 + torch.cumsum(gaps, 0)).to(device)
    # bias weights much larger than the model's init (std 0.02) so that a wrong bias shows in the output
    pos_w = (torch.randn(128, generator=g) * 0.5).to(device).requires_grad_(True)
    ts_w = (torch.randn(64, generator=g) * 0.5).to(device).requires_grad_(True)
    return off, qkv, ts, (pos_w, ts_w)


def _check_model_call(lengths, dtype, device, activation, tol, seed=15, buckets=True, config=None):
    """ops.attention(backend=TRITON) vs ops.attention(backend=REFERENCE) on float32 copies (on the CPU the
    TRITON backend runs the interpreter: the same ops code path as on the GPU). With ``buckets`` the Triton side
    gets precomputed ``ops.relative_bias_buckets`` as HSTUEncoder passes them (the bias is then gathered from
    them); the reference side always bucketises from the timestamps."""
    from gemray import ops

    off, (q, k, v), ts, (pos_w, ts_w) = _model_inputs(lengths, dtype, device, seed)
    pre = (ops.relative_bias_buckets(ts, off, max(lengths), pos_w.numel(), ts_w.numel(), MODEL_MAX_LEN)
           if buckets else None)
    rel = ops.RelativeBiasInputs(ts, pos_w, ts_w, MODEL_MAX_LEN, pre)
    out = ops.attention(q, k, v, off, MODEL_MAX_LEN, activation=activation, causal=True, rel_bias=rel,
                        backend=ops.AttentionBackend.TRITON, config=config)
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v, pos_w, ts_w)]
    rel_ref = ops.RelativeBiasInputs(ts, leaves[3], leaves[4], MODEL_MAX_LEN)
    expect = ops.attention(*leaves[:3], off, MODEL_MAX_LEN, activation=activation, causal=True,
                           rel_bias=rel_ref, backend=ops.AttentionBackend.REFERENCE)
    assert out.shape == expect.shape and out.dtype == dtype
    assert _rel(out, expect) < tol, f"forward rel err {_rel(out, expect):.2e}"
    do = torch.randn_like(expect)
    grads = torch.autograd.grad(out, (q, k, v, pos_w, ts_w), do.to(out.dtype))
    ref_grads = torch.autograd.grad(expect, leaves, do)
    for name, g, gr in zip(("q", "k", "v", "pos_w", "ts_w"), grads, ref_grads):
        assert gr.norm() > 0, name
        assert _rel(g, gr) < tol, f"d{name} rel err {_rel(g, gr):.2e}"


def _check_model_contextual(lengths, dtype, device, ctx, tol, seed=16):
    off, (q, k, v), _, _ = _model_inputs(lengths, dtype, device, seed)
    _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, MODEL_MAX_LEN, activation="silu",
                                                   contextual_len=ctx),
           lambda a, b, c: ref.jagged_contextual_attention_ref(a, b, c, off, MODEL_MAX_LEN, contextual_len=ctx,
                                                               activation="silu"),
           (q, k, v), tol)


MODEL_LENGTHS_CPU = [200, 1, 0, 57, 133, 16]
# the rel-bias model calls (the interpreter's slowest tests): the full length (the bucketing's last position),
# length 1, an empty sequence and a partial tile; 133 and 16 add no other case and ~30% of the time
MODEL_LENGTHS_REL_BIAS_CPU = [200, 1, 0, 57]


@cpu_only
@pytest.mark.parametrize("activation,buckets", [("silu", True), ("silu", False), ("softmax", True)])
def test_model_call_rel_bias_fp32(activation, buckets):
    _check_model_call(MODEL_LENGTHS_REL_BIAS_CPU, torch.float32, "cpu", activation, 1e-4, buckets=buckets)


@cpu_only
def test_model_call_rel_bias_16bit():
    """16-bit q/k/v (autocast-style: the bias weights stay fp32) against the fp32 reference. fp16 stands in
    for bf16 here: triton 3.9's interpreter computes garbage for bf16 tiles (1e10 relative error on a plain
    silu batch, also before this test existed); bf16 runs in test_gpu_model_call_rel_bias."""
    _check_model_call(MODEL_LENGTHS_REL_BIAS_CPU, torch.float16, "cpu", "silu", 2e-2)


@cpu_only
@pytest.mark.parametrize("ctx", [7, 40])
def test_model_shape_contextual_prefix(ctx):
    _check_model_contextual(MODEL_LENGTHS_CPU, torch.float32, "cpu", ctx, 1e-4)


def test_bench_bookkeeping():
    from gemray.bench import kernels as bench
    from gemray.kernels import config as kconfig

    lens = bench.make_lengths("heavy", 256, 4096)
    assert len(lens) == 256 and min(lens) >= 1 and max(lens) <= 4096
    med = sorted(lens)[128]
    assert 4096 / 16 / 2 < med < 4096 / 16 * 2  # median about N/16
    assert bench.make_lengths("uniform", 3, 7) == [7, 7, 7]
    assert bench.causal_flops_fwd([1, 2], h=1, d=1) == 4.0 * (1 + 3)
    # every regime has a sweep batch of that regime and sweep candidates for every tile kind
    for reg, (kind, b, n) in bench.SWEEP_BATCH.items():
        assert DEFAULT.regime_of(sum(bench.make_lengths(kind, b, n)), b) == reg
        assert set(bench.SWEEP[reg]) == set(kconfig.TILE_KINDS)
    # every kind is swept but dk_ds (dk_from_ds is not among this sweep's launch modes; attn_sweep_d256.py sweeps it)
    assert set(bench.KERNELS) == set(kconfig.TILE_KINDS) - {"dk_ds"} | {"mode"}
    # launch modes: the new dict form, and the lists runs 4-41 printed (2-7 entries, deleted modes off)
    assert bench.get_mode(DEFAULT, "short") == (True, False, False)
    assert bench.get_mode(DEFAULT, "xlong") == (False, True, True)
    assert bench.parse_mode({"tma_loads": True}) == (False, True, False)
    assert bench.parse_mode([False, False]) == (False, False, False)
    assert bench.parse_mode([False, False, False, True]) == (True, False, False)
    assert bench.parse_mode([False, False, False, False, True, False, True]) == (False, True, True)
    for deleted in ([True, False], [False, True], [False, False, True], [False, False, False, False, False, True]):
        with pytest.raises(ValueError, match="deleted"):
            bench.parse_mode(deleted)
    with pytest.raises(ValueError, match="unknown launch mode"):
        bench.parse_mode({"atomic_dq": False})
    cfg = bench.set_mode(DEFAULT, "short", [False, False, False, False, True])
    assert bench.get_mode(cfg, "short") == (False, True, False) and bench.get_mode(DEFAULT, "short")[0]
    # the tile kinds of the dS-store backward are compiled / timed with it on, the others with it off
    assert bench._mode_for("dq_ds", (False, False, False)) == (False, False, True)
    assert bench._mode_for("dkdv", (False, True, True)) == (False, True, False)
    assert bench._mode_for("fwd", (True, True, True)) == (True, True, True)
    # --tiles JSON: what tiles_json prints reads back to the same config; deleted kinds are skipped
    assert bench.apply_tiles(bench.tiles_json(DEFAULT)) == DEFAULT
    pinned = bench.apply_tiles('{"long": {"fwd": {"128": [64, 64, 4, 2]}, "dkdv_atomic": {"128": [64, 64, 8, 2]}, '
                               '"mode": [false, false, false, true, false, false, true]}}')
    assert pinned.long.tiles.get("fwd", 128) == (64, 64, 4, 2) and bench.get_mode(pinned, "long") == (True, False, True)
    assert pinned.name != DEFAULT.name and pinned.short == DEFAULT.short
    for bad in ('{"huge": {}}', '{"long": {"dkdv_fast": {}}}', '{"long": {"mode": [true, false]}}', "{"):
        with pytest.raises((KeyError, ValueError)):
            bench.apply_tiles(bad)


@cpu_only
def test_bench_precompile_worker_runs_every_item(monkeypatch):
    """The sweep's precompile worker runs each (regime, kernel, candidate[, mode]) once with the item's config
    (interpreter, tiny batch: the code path, not the compile); item_config puts a tile kind under the mode that
    uses it."""
    from gemray.bench import kernels as bench

    monkeypatch.setattr(bench, "SWEEP_BATCH", {"short": ("heavy", 3, 32)})
    monkeypatch.setattr(bench, "H", 1)
    monkeypatch.setattr(bench, "D", 16)
    items = bench._sweep_items(DEFAULT, "short")
    assert {kern for _, kern, _ in items} == set(bench.KERNELS)
    cfg = bench.item_config(DEFAULT, "short", "dq_ds", (32, 64, 4, 3))
    assert bench.get_mode(cfg, "short") == (True, False, True) and cfg.short.tiles.get("dq_ds", 128) == (32, 64, 4, 3)
    assert bench.get_mode(bench.item_config(DEFAULT, "short", "mode", (False, True, False)), "short") == \
        (False, True, False)
    picked = ([it for it in items if it[1] == "fwd_silu"][:1] + [it for it in items if it[1] == "mode"][-2:]
              + [it + ((True, True, False),) for it in items if it[1] == "dq"][:1]
              + [it + ((False, True, False),) for it in items if it[1] == "fwd"][:1]
              + [it for it in items if it[1] == "dq_ds"][:1])
    # (a dQ tile under the heads-inner grid with TMA loads, a forward tile with TMA loads)
    assert any(it[1] == "mode" and it[2][2] for it in picked)  # a dS-store mode is among them
    assert bench._precompile_worker(picked, device="cpu", dtype=torch.float32) == 0


@pytest.mark.parametrize("activation,launches", [
    ("softmax", ["_gdpa_fwd", "_gdpa_bwd part 2", "_gdpa_bwd part 1"]),
    ("silu", ["_gdpa_fwd", "_gdpa_bwd part 2", "_gdpa_bwd part 1"])])
@pytest.mark.parametrize("direct", [False, True])
def test_host_profile_launches_and_ops(activation, launches, direct):
    """bench.host_profile (launches stubbed, runs on the CPU) counts what one fwd+bwd enqueues: the two-launch
    backward has no delta launch (the dQ launch writes delta) and allocates only o, lse + delta (softmax) and dq /
    dk / dv. ``direct`` (the config's direct_launch): the counted step's launches are direct ones (ja._Launch),
    the same kinds; off, every launch takes the JIT. The custom-op path is timed too."""
    from gemray.bench import kernels as bench
    from gemray.kernels import jagged_attention as ja

    r = bench.host_profile(activation, "heavy", 8, 64, n_iter=1, reps=1, config=DEFAULT.replace(direct_launch=direct))
    assert sorted(r["launch_kinds"]) == sorted(launches) and r["launches"] == len(launches)
    assert r["direct_launches"] == (len(launches) if direct else 0)
    assert not ja._LAUNCHERS and not ja._NO_DIRECT  # the stubs' entries are dropped afterwards
    ours = {k: n for k, n in r["aten_op_kinds"].items() if k != "detach.default"}  # detach: autograd's
    # o and (softmax) the [H, T] lse; dk, dv, dq and (softmax) the [H, T] delta
    assert sum(ours.values()) == (2 if activation == "softmax" else 1) + 3 + (activation == "softmax"), ours
    assert "zeros.default" not in ours, ours
    assert r["aten_ops_fwd"] == (2 if activation == "softmax" else 1)
    assert r["python_us_fwd_bwd"] > 0 and r["python_us_fwd_bwd_op"] > 0


@pytest.mark.parametrize("activation,launches,dk", [
    ("softmax", ["_gdpa_fwd", "_bwd_delta", "_gdpa_bwd part 1", "_gdpa_dq_ds"], False),
    ("silu", ["_gdpa_fwd", "_gdpa_bwd part 1", "_gdpa_dq_ds"], False),
    ("silu", ["_gdpa_fwd", "_gdpa_bwd part 1", "_gdpa_dq_ds", "_gdpa_dk_ds"], True)])
def test_host_profile_ds_store(activation, launches, dk):
    """The ds_store backward enqueues (softmax) delta, dK/dV with the dS store, then dQ from dS (and with
    dk_from_ds dK from dS), as direct launches, and allocates one dS buffer more than the two-launch backward."""
    from gemray.bench import kernels as bench

    cfg = DEFAULT.with_all_regimes(ds_store=True, dk_from_ds=dk)
    r = bench.host_profile(activation, "heavy", 8, 64, n_iter=1, reps=1, config=cfg, hopper=True)
    assert sorted(r["launch_kinds"]) == sorted(launches) and r["direct_launches"] == len(launches)
    ours = {k: n for k, n in r["aten_op_kinds"].items() if k != "detach.default"}
    assert sum(ours.values()) == (3 if activation == "softmax" else 1) + 3 + 1, ours


def test_kernel_config_is_immutable_hashable_and_named():
    """KernelConfig: frozen and hashable; equal content gives equal configs and the same stable name ("default"
    for the default's content, "kc-<digest>" otherwise), registered for the custom ops' lookup; the builders
    return new configs and leave the original alone; bad values and names raise."""
    import dataclasses

    from gemray.kernels import config as kconfig

    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.fast_act = False
    assert KernelConfig() == DEFAULT and KernelConfig().name == "default" and hash(KernelConfig()) == hash(DEFAULT)
    a = DEFAULT.with_tile("long", "fwd", (64, 64, 4, 2))
    b = DEFAULT.with_tile("long", "fwd", (64, 64, 4, 2))
    assert a == b and a.name == b.name and a.name.startswith("kc-") and len(a.name) == 19 and a != DEFAULT
    assert kconfig.lookup(a.name) == a and kconfig.lookup("default") is DEFAULT
    assert DEFAULT.long.tiles.get("fwd", 128) == (128, 64, 8, 3) and a.long.tiles.get("fwd", 128) == (64, 64, 4, 2)
    assert a.long.tiles.get("fwd", 64) == DEFAULT.long.tiles.get("fwd", 64)  # other buckets kept
    assert {DEFAULT: 1, a: 2}[b] == 2
    assert DEFAULT.forcing("xlong").short == DEFAULT.xlong
    assert all(not DEFAULT.with_all_regimes(ds_store=False).regime(r).ds_store for r in kconfig.REGIMES)
    assert [DEFAULT.regime_of(t, 1) for t in (255, 256, 1023, 1024, 2047, 2048)] == \
        ["short", "medium", "medium", "long", "long", "xlong"]
    assert DEFAULT.regime_of(0, 0) == "short"
    with pytest.raises(ValueError, match="unknown kernel config"):
        kconfig.lookup("kc-0000000000000000")
    with pytest.raises(ValueError, match="regime"):
        DEFAULT.regime("huge")
    with pytest.raises(ValueError, match="head dim 300"):
        DEFAULT.short.tiles.get("fwd", 300)
    with pytest.raises(ValueError, match="tile kind"):
        DEFAULT.short.tiles.get("dkdv_atomic", 128)
    with pytest.raises(ValueError, match="regime_mean_len"):
        KernelConfig(regime_mean_len=(1024, 256, 2048))
    with pytest.raises(TypeError, match="KernelConfig"):
        kconfig.resolve({"fast_act": False})


def test_no_module_level_kernel_knobs():
    """The kernel modules hold no mutable module-level knobs: every upper-case global is an immutable value (the
    configuration lives in KernelConfig), and kernels/knobs.py is gone."""
    import importlib.util
    from collections.abc import Mapping
    from types import MappingProxyType

    from gemray.kernels import config as kconfig
    from gemray.kernels import jagged_attention as ja
    from gemray.kernels import norm_quant as nq

    assert importlib.util.find_spec("gemray.kernels.knobs") is None
    mods = [ja, nq, kconfig] + ([ja.ws] if ja.ws is not None else [])
    for mod in mods:
        for name, value in vars(mod).items():
            if name.isupper() and not name.startswith("_"):
                assert not isinstance(value, (dict, list, set, bytearray)), (mod.__name__, name, type(value))
                assert not isinstance(value, Mapping) or isinstance(value, MappingProxyType), (mod.__name__, name)


@cpu_only
def test_launch_plans_are_reused_and_remade_for_another_config():
    """A batch's forward plan (tiles, tables, launches) is made once and reused by later calls and layers (same
    offsets object), its backward plan too; another config gets its own plans (its results still match the
    reference), as does another offsets object."""
    from gemray.kernels import jagged_attention as ja

    torch.manual_seed(40)
    off = _offsets([0, 1, 37, 5])
    t = int(off[-1])
    q, k, v = _leaf(t, 2, 16), _leaf(t, 2, 16), _leaf(t, 2, 16)

    def plans(cfg):  # the forward plans of this offsets object under cfg, from the launch-plan cache
        return [p for key, (refs, p) in ja._CACHE.items() if key[0] == "fwd plan" and key[1] == cfg.name
                and refs[0]() is off]

    def run(cfg):
        _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 37, activation="softmax", config=cfg),
               lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, 37, activation="softmax"), (q, k, v), 1e-4)

    run(DEFAULT)
    first = plans(DEFAULT)
    run(DEFAULT)
    assert len(first) == 1 and plans(DEFAULT) == first and len(first[0].bwd) == 1
    assert first[0].launch[0].consts["BLOCK_M"] == DEFAULT.interpret_tiles.get("fwd", 16)[0] == 16
    tall = DEFAULT.replace(interpret_tiles=TileSet.uniform((32, 16, 4, 1)))
    run(tall)
    assert len(plans(tall)) == 1 and plans(tall)[0] is not first[0]
    assert plans(tall)[0].launch[0].consts["BLOCK_M"] == 32
    grouped_off = DEFAULT.replace(seq_order_fwd=False)
    run(grouped_off)
    assert plans(grouped_off)[0] is not first[0] and plans(DEFAULT) == first
    off2 = off.clone()  # another offsets object gets its own plan (counting entries fails once the LRU is full)
    jagged_attention_triton(q, k, v, off2, 37, activation="softmax")
    mine = [p for key, (refs, p) in ja._CACHE.items() if key[0] == "fwd plan" and refs[0]() is off2]
    assert len(mine) == 1 and mine[0] is not first[0]


def test_bench_host_profile_writes_its_records(tmp_path, capsys):
    """``gemray bench kernels --host-profile --out DIR`` (CPU is enough) prints one JSON line per activation and
    appends the same records to DIR/bench_kernels.jsonl (it wrote nothing there before)."""
    import json

    from gemray.bench import kernels as bench

    assert bench.main(["--host-profile", "--out", str(tmp_path)]) == 0
    recs = [json.loads(line) for line in (tmp_path / "bench_kernels.jsonl").read_text().splitlines()]
    assert [(r["section"], r["activation"]) for r in recs] == [("host_profile", "softmax"), ("host_profile", "silu")]
    assert all(r["launches"] == 3 and r["python_us_fwd_bwd"] > 0 for r in recs)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == recs


def test_bench_report_tables(capsys):
    """The summary compares JFA against varlen_attn per batch and flags missed bars."""
    from gemray.bench import kernels as bench

    rows = [dict(section="self", batch="heavy B=128 N=1024", variant="jfa", ms_fwd=0.1, ms_fwd_bwd=0.5,
                 tflops_fwd=1.0, tflops_fwd_bwd=2.0, host_ms_fwd_bwd=0.4, host_ms_fwd=0.1, graph_ms_fwd_bwd=0.2),
            dict(section="self", batch="heavy B=128 N=1024", variant="varlen", ms_fwd_bwd=1.0, graph_ms_fwd_bwd=0.3),
            dict(section="self", batch="uniform B=128 N=1024", variant="jfa", ms_fwd_bwd=1.0),
            dict(section="self", batch="uniform B=128 N=1024", variant="varlen", ms_fwd_bwd=1.1),
            dict(section="sweep", table="short", kernel="fwd", cfg=[64, 64, 4, 3], ms=0.2),
            dict(section="sweep", table="short", kernel="fwd", chosen=[64, 64, 4, 3], ms=0.2, elapsed_s=3.0),
            dict(section="sweep", table="short", kernel="dkdv_ds", skipped="unused in mode [True, False, "
                 "False]"),
            dict(section="sweep", table="short", kernel="dq", cfg=[64, 64, 8, 2], skipped="budget")]
    bench.print_sweep(rows)
    bench.print_table(rows)
    bench.print_summary(rows)
    out = capsys.readouterr().out
    assert "| heavy B=128 N=1024 | 0.500 | 1.000 | 2.00x | 1.5x | met | 0.200 / 0.300 (1.50x) |" in out
    assert "| uniform B=128 N=1024 | 1.000 | 1.100 | 1.10x | 1.2x | MISSED | missing / missing |" in out
    assert "0.400 (0.100)" in out and "=> [64, 64, 4, 3]" in out
    assert "dkdv_ds     unused in mode" in out and "[64, 64, 8, 2] skipped" in out


@cpu_only
def test_bench_subset_check_runs_on_cpu():
    """bench.check_self (the GPU run's correctness check) compares the right rows: tiny CPU batch."""
    from gemray.bench import kernels as bench

    torch.manual_seed(9)
    lengths = [3, 0, 20, 1]
    off = _offsets(lengths)
    t = int(off[-1])
    q, k, v = torch.randn(t, 2, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    errs = bench.check_self(lambda a, b, c: jagged_attention_triton(a, b, c, off, 20, activation="silu"),
                            lambda a, b, c, o: ref.jagged_attention_ref(a, b, c, o, 20, activation="silu"),
                            q, k, v, off, lengths, seqs=[0, 2, 3])
    assert all(errs[key] < 1e-4 for key in ("err_fwd", "err_dq", "err_dk", "err_dv")), errs


@cpu_only
def test_block_attention_is_local():
    """Changing keys outside a query's block must not change its output (catches a wrong key range)."""
    torch.manual_seed(7)
    off = _offsets([40])
    q, k, v = torch.randn(40, 1, 16), torch.randn(40, 1, 16), torch.randn(40, 1, 16)
    out = jagged_block_attention_triton(q, k, v, off, 40, block_size=16, activation="softmax")
    k2, v2 = k.clone(), v.clone()
    k2[16:32] += 5.0
    v2[16:32] -= 3.0
    out2 = jagged_block_attention_triton(q, k2, v2, off, 40, block_size=16, activation="softmax")
    assert torch.equal(out[:16], out2[:16]) and torch.equal(out[32:], out2[32:])
    assert not torch.allclose(out[16:32], out2[16:32])


@cpu_only
def test_all_empty_batch_keeps_graph():
    off = torch.zeros(3, dtype=torch.int64)
    q, k, v = _leaf(0, 2, 16), _leaf(0, 2, 16), _leaf(0, 2, 16)
    out = jagged_attention_triton(q, k, v, off, 4, activation="silu")
    assert out.shape == (0, 2, 16)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_work_table_longest_first_covers_every_tile():
    lengths = torch.tensor([3, 0, 70, 17, 1])
    block = 16
    n_tiles = math.ceil(70 / block)
    t = torch.arange(n_tiles)
    cost = (t[None, :] + 1).expand(5, -1)
    table, nt = _work_table(lengths, 70, block, cost)
    assert nt == n_tiles and table.dtype == torch.int32
    items = [int(x) for x in table if x >= 0]
    expected = {(b, m) for b in range(5) for m in range(n_tiles) if m * block < int(lengths[b])}
    assert {(i // nt, i % nt) for i in items} == expected and len(items) == len(expected)
    costs = [i % nt + 1 for i in items]
    assert costs == sorted(costs, reverse=True)  # longest first
    assert all(x < 0 for x in table[len(items):])  # invalid items sorted last
    trimmed, _ = _work_table(lengths, 70, block, cost, total=int(lengths.sum()))
    assert len(trimmed) < len(table) and torch.equal(trimmed[:len(items)], table[:len(items)])


@pytest.mark.parametrize("direction", [1, -1])
def test_work_table_grouped_by_sequence(direction):
    """SEQ_ORDER's table: the same valid items as the cost order, whole sequences longest first (ties: lower
    index first), each sequence's tiles contiguous, last tile first for query tiles (+1) or first tile first
    for key tiles (-1); invalid items last; the trim keeps every valid item."""
    lengths = torch.tensor([3, 0, 70, 17, 1, 70])
    block = 16
    cost = (torch.arange(5)[None, :] + 1).expand(6, -1)
    table, nt = _work_table(lengths, 70, block, cost, total=int(lengths.sum()), grouped=direction)
    items = [(int(x) // nt, int(x) % nt) for x in table if x >= 0]
    expected = {(b, m) for b in range(6) for m in range(nt) if m * block < int(lengths[b])}
    assert set(items) == expected and len(items) == len(expected)
    seqs = [b for i, (b, _) in enumerate(items) if i == 0 or items[i - 1][0] != b]
    assert seqs == [2, 5, 3, 0, 4]  # each sequence once (contiguous), longest first, ties by index
    for b in seqs:
        tiles = [m for bb, m in items if bb == b]
        assert tiles == sorted(tiles, reverse=direction > 0)
    assert all(x < 0 for x in table[len(items):])


class _FakeParam:
    def __init__(self, name, constexpr):
        self.name, self.is_constexpr = name, constexpr


class _FakeKernel:
    """A JIT kernel as ja._Launch sees it: kernel[grid](*args, **kw) compiles (recorded in ``jit``) and returns
    a compiled kernel whose run() is the launcher (recorded in ``direct``)."""

    def __init__(self, names, n_consts, returns_compiled=True):
        self.params = [_FakeParam(n, i >= len(names) - n_consts) for i, n in enumerate(names)]
        self.jit, self.direct, self.returns_compiled = [], [], returns_compiled

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.jit.append((grid, args, kw))
            if not self.returns_compiled:
                return None
            fake = self

            class Compiled:
                function, packed_metadata = "fn", "meta"

                def run(self, *a):
                    fake.direct.append(a)
            return Compiled()
        return run


def test_direct_launch_reuses_compiled_kernel_only_for_same_specialization(monkeypatch):
    """ja._Launch: the first launch of a configuration goes through the JIT; an identical one calls the compiled
    kernel's launcher with grid, stream, every argument in signature order (constexprs last, in signature order
    whatever order they were passed in); a scalar that changes (1 is specialized), a tensor of another dtype or
    alignment, other constexprs, warps or device, take the JIT again; kernels whose launch returns no compiled
    kernel, an installed launch hook, a launch made with direct=False (the config's direct_launch off), all use
    the JIT."""
    import triton  # here, not at the top: TRITON_INTERPRET must be set before triton is first imported

    from gemray.kernels import jagged_attention as ja

    monkeypatch.setattr(ja, "_INTERPRET", False)
    monkeypatch.setattr(ja, "_current_device", lambda: 0)
    monkeypatch.setattr(ja, "_raw_stream", lambda device: 1000 + device)
    monkeypatch.setattr(ja, "_LAUNCHERS", type(ja._LAUNCHERS)())
    monkeypatch.setattr(ja, "_NO_DIRECT", set())
    kern = _FakeKernel(["X", "Y", "n", "s", "A", "B"], 2)
    x, y = torch.randn(64), torch.randn(64)

    def go(xt=x, n=5, s=1.5, consts=None, warps=4, grid=(3, 2), direct=True):
        ja._Launch(kern, grid, [n, s], consts or dict(B=7, A=True), warps, 2, direct)([xt, y])

    go()
    assert len(kern.jit) == 1 and not kern.direct
    assert kern.jit[0][2] == dict(B=7, A=True, num_warps=4, num_stages=2)
    go(grid=(9, 4))
    assert len(kern.jit) == 1 and len(kern.direct) == 1
    assert kern.direct[0] == (9, 4, 1, 1000, "fn", "meta", None, None, None, x, y, 5, 1.5, True, 7)
    go(grid=(5,))
    assert kern.direct[1][:3] == (5, 1, 1)
    for change in (dict(n=1), dict(n=16), dict(xt=x.double()), dict(xt=x[1:]), dict(consts=dict(B=8, A=True)),
                   dict(warps=8)):
        jit_before, direct_before = len(kern.jit), len(kern.direct)
        go(**change)
        assert len(kern.jit) == jit_before + 1 and len(kern.direct) == direct_before, change
        go(**change)  # now compiled: direct
        assert len(kern.jit) == jit_before + 1 and len(kern.direct) == direct_before + 1, change
    monkeypatch.setattr(ja, "_current_device", lambda: 1)
    go()
    assert kern.direct[-1][3] != 1001 and len(kern.jit) == 8
    go()
    assert kern.direct[-1][3] == 1001

    n_jit = len(kern.jit)
    go(direct=False)
    assert len(kern.jit) == n_jit + 1
    hook = triton.knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # triton's HookChain: a profiler's hook makes every launch go through the JIT
        def h(meta):
            return None
        hook.add(h)
        try:
            go()
            assert len(kern.jit) == n_jit + 2
        finally:
            hook.remove(h)

    stub = _FakeKernel(["X", "Y", "n", "s", "A", "B"], 2, returns_compiled=False)
    for _ in range(2):
        ja._Launch(stub, (1,), [5, 1.5], dict(A=True, B=7), 4, 2)([x, y])
    assert len(stub.jit) == 2 and not stub.direct and stub in ja._NO_DIRECT
    missing = _FakeKernel(["X", "Y", "n", "s", "A", "B"], 2)  # a constexpr left to its default: JIT only
    for _ in range(2):
        ja._Launch(missing, (1,), [5, 1.5], dict(A=True), 4, 2)([x, y])
    assert len(missing.jit) == 2 and not missing.direct

    # a plan's launch object: its first launch takes the JIT, the next ones the launcher it kept (no signature
    # built: the plan's key fixes the tensors' dtypes and alignment), on the device it was compiled for only
    planned = _FakeKernel(["X", "Y", "n", "s", "A", "B"], 2)
    launch = ja._Launch(planned, (2, 3), [5, 1.5], dict(A=True, B=7), 4, 2)
    launch.planned([x, y])
    launch.planned([x, y])
    assert len(planned.jit) == 1 and planned.direct[-1][:4] == (2, 3, 1, 1001)
    monkeypatch.setattr(ja, "_current_device", lambda: 0)
    launch.planned([x, y])
    assert len(planned.jit) == 2 and len(planned.direct) == 1


def test_bad_arguments_raise():
    off = _offsets([2, 3])
    q = torch.randn(5, 2, 16)
    with pytest.raises(ValueError, match="activation"):
        jagged_attention_triton(q, q, q, off, 4, activation="relu")
    with pytest.raises(ValueError, match="attn_bias"):
        jagged_attention_triton(q, q, q, off, 4, attn_bias=torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match="int64"):
        jagged_attention_triton(q, q, q, off.int(), 4)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        jagged_attention_triton(q[0], q, q, off, 4)
    with pytest.raises(ValueError, match="num_targets"):
        gdpa_triton(q, q, q, off, off, 4, 4, causal=False, num_targets=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="alpha"):
        jagged_attention_triton(q, q, q, off, 4, alpha=-1.0)
    with pytest.raises(ValueError, match="contextual_len"):
        gdpa_triton(q, q, q, off, off, 4, 4, causal=False, contextual_len=2)
    with pytest.raises(ValueError, match="block_size"):
        jagged_block_attention_triton(q, q, q, off, 4, block_size=0)


@cpu_only
@pytest.mark.parametrize("case,match", [
    ("last_past_rows", r"q_offsets\[-1\]=12 but the tensor it indexes has 8 rows"),
    ("last_short_of_rows", r"q_offsets\[-1\]=6 but the tensor it indexes has 8 rows"),
    ("first_not_zero", r"q_offsets\[0\] must be 0, got 2"),
    ("decreasing", "must not decrease: sequence 1 has length -2"),
    ("too_long", "sequence 1 has length 5 > max_q_len 4"),
    ("targets", r"num_targets\[1\]=6 outside \[0, its length 5\]"),
    ("bias", r"attn_bias \(2, 3, 3\) is smaller than the longest sequences \(5 queries, 5 keys\)")])
def test_bad_batches_raise_naming_the_field(case, match):
    """Offsets that do not cover the rows (which read and wrote out of bounds: a crash or uninitialized rows),
    that do not start at 0 or decrease, sequences longer than max_len, targets outside a sequence and a bias
    too small are refused on the host with the field and the sequence named (the new-user check got a
    segfault, garbage rows, or torch._assert_async's 'Expected Tensor with single nonzero value')."""
    q = torch.randn(8, 2, 16)
    offsets = {"last_past_rows": [0, 3, 12], "last_short_of_rows": [0, 3, 6], "first_not_zero": [2, 5, 8],
               "decreasing": [0, 5, 3, 8]}.get(case, [0, 3, 8])
    off = torch.tensor(offsets)
    kw = {"targets": dict(num_targets=torch.tensor([0, 6])),
          "bias": dict(attn_bias=torch.zeros(2, 3, 3))}.get(case, {})
    max_len = 4 if case == "too_long" else 8
    with pytest.raises(ValueError, match=match):
        jagged_attention_triton(q, q, q, off, max_len, activation="softmax", **kw)


@cpu_only
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_bf16_under_the_interpreter_matches_reference(activation):
    """bf16 on the CPU interpreter (whose bf16 tl.dot is wrong, triton-lang/triton#11584) runs in float32:
    forward and gradients within bf16 rounding of the float32 reference, gradients in bf16."""
    torch.manual_seed(5)
    off = _offsets([0, 1, 5, 37, 3])
    q, k, v = (_leaf(int(off[-1]), 2, 16, dtype=torch.bfloat16) for _ in range(3))
    out = jagged_attention_triton(q, k, v, off, 37, activation=activation)
    assert out.dtype == torch.bfloat16
    want = ref.jagged_attention_ref(q.float(), k.float(), v.float(), off, 37, activation=activation)
    assert _rel(out.float(), want) < 1e-2
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all()


# ---------------------------------------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (compiled)")


def _check_gpu_jfa(off, max_len, activation, tensors, config=None, **kw):
    """_check of jagged_attention_triton (with ``config``) against jagged_attention_ref (same arguments) at the GPU
    tests' bf16 tolerance; alpha 0.05 for the pointwise activations (keeps bf16 scores in range), the default for
    softmax."""
    kw = dict(kw, activation=activation, alpha=0.05 if activation != "softmax" else None)
    return _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, max_len, config=config, **kw),
                  lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, max_len, **kw), tensors, 2e-2)


def _heavy_lengths(b, n):
    """b log-normal lengths with median n/16, clipped to [1, n]."""
    lens = torch.distributions.LogNormal(math.log(n / 16), 1.0).sample((b,))
    return lens.clamp(1, n).long().tolist()


@gpu
@needs_cuda
@pytest.mark.parametrize("activation,pattern", [(a, "causal") for a in ACTS] + [
    ("softmax", "targets"), ("silu", "targets"), ("softmax", "full"), ("silu", "full")])
def test_gpu_self_attention_bf16(activation, pattern):
    torch.manual_seed(10)
    lengths = _heavy_lengths(32, 2048) + [0, 1, 2048]
    off = _offsets(lengths, "cuda")
    t, h, d = int(off[-1]), 4, 128
    nt = (torch.tensor(lengths, device="cuda") // 8) if pattern == "targets" else None
    q, k, v = (_leaf(t, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    _check_gpu_jfa(off, 2048, activation, (q, k, v), causal=pattern != "full", num_targets=nt)


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_gpu_attn_bias_bf16(activation):
    torch.manual_seed(12)
    lengths = _heavy_lengths(16, 1024) + [0, 1, 1024]
    off = _offsets(lengths, "cuda")
    t, h, d = int(off[-1]), 4, 128
    q, k, v = (_leaf(t, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    bias = _leaf(len(lengths), 1024, 1024, device="cuda")
    _check(lambda a, b, c, e: jagged_attention_triton(a, b, c, off, 1024, activation=activation, attn_bias=e),
           lambda a, b, c, e: ref.jagged_attention_ref(a, b, c, off, 1024, activation=activation, attn_bias=e),
           (q, k, v, bias), 2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_gpu_cross_pma_block_bf16(activation):
    torch.manual_seed(11)
    h, d = 4, 128
    kv_len = _heavy_lengths(32, 2048) + [0, 2048]
    ko = _offsets(kv_len, "cuda")
    qo = _offsets([64] * len(kv_len), "cuda")
    bf = dict(dtype=torch.bfloat16, device="cuda")
    q, k, v = _leaf(int(qo[-1]), h, d, **bf), _leaf(int(ko[-1]), h, d, **bf), _leaf(int(ko[-1]), h, d, **bf)
    _check(lambda a, b, c: jagged_cross_attention_triton(a, qo, b, c, ko, 64, 2048, activation=activation),
           lambda a, b, c: ref.jagged_cross_attention_ref(a, qo, b, c, ko, 64, 2048, activation=activation),
           (q, k, v), 2e-2)
    seeds = _leaf(8, h, d, **bf)
    _check(lambda a, b, c: pma_triton(a, b, c, ko, 2048, activation=activation),
           lambda a, b, c: ref.pma_ref(a, b, c, ko, 2048, activation=activation), (seeds, k, v), 2e-2)
    _check(lambda a, b, c: jagged_block_attention_triton(a, b, c, ko, 2048, block_size=64,
                                                         activation=activation),
           lambda a, b, c: ref.jagged_block_attention_ref(a, b, c, ko, 2048, block_size=64,
                                                          activation=activation),
           (_leaf(int(ko[-1]), h, d, **bf), k, v), 2e-2)


def _model_lengths_gpu(b=128, seed=17):
    """b lengths uniform in [1, 200] plus an empty sequence and a full one (the model's max_len)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, MODEL_MAX_LEN + 1, (b,), generator=g).tolist() + [0, MODEL_MAX_LEN]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "softmax"])
@pytest.mark.parametrize("mode", ["default", "ds_store"])
def test_gpu_model_call_rel_bias(dtype, activation, mode):
    """The model's call at its shapes (H=2, D=25, max_len 200, dense relative bias) on the GPU, with the default
    config (this batch's regime, short: the recomputing backward) or with ds_store in every regime (the dK/dV
    launch stores dS and writes dbias); fp32 within 1e-3 of the reference, bf16 2e-2."""
    cfg = DEFAULT if mode == "default" else DEFAULT.with_all_regimes(ds_store=True).replace(ds_scratch_nan=True)
    _check_model_call(_model_lengths_gpu(), dtype, "cuda", activation, 1e-3 if dtype == torch.float32 else 2e-2,
                      config=cfg)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_model_shape_contextual_prefix(dtype):
    _check_model_contextual(_model_lengths_gpu(seed=18), dtype, "cuda", 12,
                            1e-3 if dtype == torch.float32 else 2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("activation,inner,tma,ds", BWD_MODES)
def test_gpu_backward_launch_modes(activation, inner, tma, ds):
    """Each launch mode at bench-like sizes in bf16, with the short and the medium regime's tiles (the regime is
    forced through the config; between them they cover every tile shape and warp count of the defaults)."""
    torch.manual_seed(19)
    lengths = _heavy_lengths(24, 2048) + [0, 1, 2048, 1000]
    off = _offsets(lengths, "cuda")
    t, h, d = int(off[-1]), 4, 128
    q, k, v = (_leaf(t, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    for reg in ("short", "medium"):
        cfg = DEFAULT.forcing(reg).with_all_regimes(heads_inner=inner, tma_loads=tma, ds_store=ds)
        _check_gpu_jfa(off, 2048, activation, (q, k, v), config=cfg.replace(ds_scratch_nan=ds))


@gpu
@needs_cuda
@pytest.mark.parametrize("dk", [False, True])
@pytest.mark.parametrize("activation,pattern", [("softmax", "causal"), ("silu", "causal"), ("softmax", "targets"),
                                                ("softmax", "full"), ("gelu", "causal")])
def test_gpu_ds_store_bf16(activation, pattern, dk):
    """ds_store at bench-like sizes in bf16 with each regime's tiles (the regime is forced through the config),
    the scratch filled with NaN, with dK in the dK/dV launch or from the stored dS (dk_from_ds): matches the
    reference as the recomputing backward does."""
    torch.manual_seed(21)
    lengths = _heavy_lengths(24, 2048) + [0, 1, 2048, 1000]
    off = _offsets(lengths, "cuda")
    t, h, d = int(off[-1]), 4, 128
    nt = (torch.tensor(lengths, device="cuda") // 8) if pattern == "targets" else None
    q, k, v = (_leaf(t, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    made = []
    for reg in ("short", "medium", "long", "xlong"):
        cfg = DEFAULT.forcing(reg).with_all_regimes(ds_store=True, dk_from_ds=dk).replace(ds_scratch_nan=True)
        seen: set = set()
        _new_bwd_plans(cfg, seen)
        _check_gpu_jfa(off, 2048, activation, (q, k, v), causal=pattern != "full", num_targets=nt, config=cfg)
        made += [bp.ds_shape for bp in _new_bwd_plans(cfg, seen) if bp.ds_shape is not None]
    assert len(made) == 4


@gpu
@needs_cuda
@pytest.mark.parametrize("dk", [False, True])
def test_gpu_gem_head_dim_256_ds_store(dk):
    """The GEM config's attention (4 heads x 256, silu, causal, bf16) on gem-like lengths up to 4096 with its
    shipped tiles (configs/kernel-tiles-h200.json), dK in the dK/dV launch or from the stored dS (dk_from_ds, with
    the dK/dV tiles the sweep would try: 64x64/8w and 32x128/8w; with dk_from_ds the shipped ws_bwd runs the Gluon
    dV + dS^T launch instead), the scratch NaN-filled: within the bf16 tolerance of the reference."""
    from pathlib import Path

    from gemray.model.hstu import kernel_config_of

    torch.manual_seed(25)
    lengths = _heavy_lengths(12, 4096) + [0, 1, 4096]
    off = _offsets(lengths, "cuda")
    t, h, d = int(off[-1]), 4, 256
    q, k, v = (_leaf(t, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    base = kernel_config_of(str(Path(__file__).resolve().parents[1] / "configs" / "kernel-tiles-h200.json"))
    tiles = [(64, 64, 8, 2), (32, 128, 8, 2)] if dk else [None]
    for tile in tiles:
        for reg in ("medium", "long"):
            cfg = base.forcing(reg).with_all_regimes(ds_store=True, dk_from_ds=dk).replace(ds_scratch_nan=True)
            if tile is not None:
                cfg = cfg.with_all_regimes(tiles=cfg.regime(reg).tiles.with_tile("dkdv_ds", tile, 256))
            seen: set = set()
            _new_bwd_plans(cfg, seen)
            _check_gpu_jfa(off, 4096, "silu", (q, k, v), config=cfg)
            plans = _new_bwd_plans(cfg, seen)
            assert plans and all([kind for _, _, kind in bp.steps][-1] == ("dk_ds" if dk else "dq_ds")
                                 for bp in plans)


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_gpu_direct_launch_matches_jit_launch(activation):
    """direct_launch (ja._Launch calls the compiled kernel's launcher once a configuration is compiled): the
    output and gradients of repeated fwd+bwd steps, on two batches, equal bitwise those of JIT launches (the
    kernels have no atomics), and the direct path was taken."""
    from gemray.kernels import jagged_attention as ja

    torch.manual_seed(23)
    batches = []
    for lengths in (_heavy_lengths(48, 1024) + [0, 1, 1024], [512] * 8 + [3]):
        off = _offsets(lengths, "cuda")
        t = int(off[-1])
        batches.append((off, *(_leaf(t, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))))

    def steps(cfg):
        out = []
        torch.manual_seed(24)
        for off, q, k, v in batches * 2:
            o = jagged_attention_triton(q, k, v, off, 1024, activation=activation,
                                        alpha=0.05 if activation != "softmax" else None, config=cfg)
            out += [o.detach().clone(), *torch.autograd.grad(o, (q, k, v), torch.randn_like(o))]
        torch.cuda.synchronize()
        return out

    want = steps(DEFAULT.replace(direct_launch=False))
    ja._LAUNCHERS.clear()
    got = steps(DEFAULT)
    assert len(ja._LAUNCHERS) >= 3  # forward, dQ and dK/dV of at least one regime were launched directly
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_sass_check_compiles_for_hopper_without_a_gpu():
    """gemray.bench.sass_check compiles for sm_90 on the CPU machine (ptxas from the triton wheel) and
    reads the SASS: the softmax forward uses wgmma with no spills in its loops; a 32-row dQ tile gets no
    wgmma (warpgroup MMAs need 64 rows; run 4's sweep still picked it for the host-bound short batch)."""
    import json
    import subprocess
    import sys

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton wheel without ptxas")
    code = ("import json; from gemray.bench import sass_check as s; "
            "print(json.dumps([s.check(s.fwd_variant(0, 128, 64, 8, 3)), "
            "s.check(s.bwd_variant(0, 2, (0, 0), (32, 64), 4, 3))]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # JITFunction, not the interpreter
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    fwd, dq32 = json.loads(out.stdout.strip().splitlines()[-1])
    assert fwd["hgmma"] > 0 and fwd["loops"] and all(st == 0 for _, _, st, _ in fwd["loops"])
    assert dq32["hgmma"] == 0 and dq32["loops"]


def test_sass_check_lists_the_gluon_kernels():
    """``sass_check --ws`` compiles the softmax Gluon forward at head dims 64 / 128 (causal or not, with and without
    ping-pong) and the silu one at 128 / 256 with only the tiles ws_attention.silu_tiles_fit allows (at D 256: 64
    keys, 2 stages), causal and not, and the exact silu once; and the silu backward's dV + dS^T launch and dS^T
    products at 128 / 256, causal and not, at the shipped tiles (the compile itself needs the device's triton 3.6)."""
    from gemray.bench import sass_check as s
    from gemray.kernels import config as kconfig
    from gemray.kernels import ws_attention as ws

    variants = s.ws_fwd_variants()
    soft = [c for _, fn, _, c in variants if fn is ws._ws_fwd]
    silu = [c for _, fn, _, c in variants if fn is ws._ws_fwd_silu]
    assert {(c["HEAD_D"], c["CAUSAL"], c["PINGPONG"]) for c in soft} == {
        (d, causal, pp) for d in (64, 128) for causal in (True, False) for pp in (True, False)}
    assert {(c["BLOCK_N"], c["STAGES"]) for c in silu if c["HEAD_D"] == 256} == {(64, 2)}
    assert {(c["BLOCK_N"], c["STAGES"]) for c in silu if c["HEAD_D"] == 128} == {(64, 2), (128, 2), (64, 3), (128, 3)}
    assert all(ws.silu_tiles_fit(c["HEAD_D"], (c["BLOCK_N"], c["STAGES"])) for c in silu)
    assert {c["CAUSAL"] for c in silu} == {True, False} and [c["HEAD_D"] for c in silu if not c["FAST"]] == [256]
    assert len({name for name, *_ in variants}) == len(variants)
    bwd = s.ws_bwd_variants()  # the silu backward's two Gluon launches, at the shipped tiles
    dv = [c for _, fn, _, c in bwd if fn is ws._ws_dv_ds]
    gemm = [c for _, fn, _, c in bwd if fn is ws._ws_ds_gemm]
    assert {(c["HEAD_D"], c["CAUSAL"]) for c in dv} == {(d, causal) for d in (128, 256) for causal in (True, False)}
    assert {(c["BLOCK_M"], c["STAGES"]) for c in dv} == {kconfig.RegimeConfig.ws_bwd_tiles}
    assert {(c["HEAD_D"], c["CAUSAL"], c["DQ"]) for c in gemm} == {
        (d, causal, dq) for d in (128, 256) for causal in (True, False) for dq in (True, False)}
    assert {c["STAGES"] for c in gemm} == {kconfig.RegimeConfig.ws_dkdq_stages}
    assert len({name for name, *_ in variants + bwd}) == len(variants) + len(bwd)

@cpu_only
def test_tma_loads_only_where_they_apply():
    """TMA tile loads are used only in regimes that enable them (the default: xlong), for full attention rows
    (block / window attention visit one or two tiles per program: making the descriptors would cost more than it
    saves) and for 16-byte aligned rows; elsewhere the pointer loads run."""
    from gemray.kernels import jagged_attention as ja

    full = ja._spec(0, True, 1.0, 1.0, 0, 0, False, 64, 64, 0)
    x = torch.randn(10, 2, 16)
    xlong, long = DEFAULT.xlong, DEFAULT.long
    assert ja._use_tma(xlong, True, full, x, x)
    assert not ja._use_tma(long, True, full, x, x)  # regime without TMA
    assert not ja._use_tma(xlong, False, full, x, x)  # head dim not a tile width
    assert not ja._use_tma(xlong, True, ja._spec(0, True, 1.0, 1.0, 8, 0, False, 64, 64, 0), x, x)  # block
    assert not ja._use_tma(xlong, True, ja._spec(0, True, 1.0, 1.0, 0, 8, False, 64, 64, 0), x, x)  # window
    odd = torch.randn(10, 2, 17)[:, :, :15]  # rows of 17 floats: not 16-byte aligned
    assert not ja._use_tma(xlong, True, full, x, odd)


# (consumer warpgroups, BLOCK_N, STAGES, ping-pong, persistent grid)
WS_TILES = [(2, 128, 2, False, False), (2, 128, 2, True, True), (2, 128, 2, False, True), (1, 128, 2, False, False),
            (2, 64, 3, True, True)]


def _ws_spy(monkeypatch, name: str, tiles_of) -> list:
    """The list the launches of ws_attention.<name> are recorded in (``tiles_of(args, kwargs)`` each), through a spy
    that still runs the kernel: a test can assert the Gluon path ran, with which tiles."""
    from gemray.kernels import ws_attention as ws

    calls, real = [], getattr(ws, name)

    def spy(*args, **kw):
        calls.append(tiles_of(args, kw))
        return real(*args, **kw)

    monkeypatch.setattr(ws, name, spy)
    return calls


def _ws_on(monkeypatch, tiles) -> tuple[KernelConfig, list]:
    """A config with the warp-specialized Gluon forward and ``tiles`` in every regime, and the list its launches
    are recorded in (a spy on ws_attention.forward)."""
    cfg = DEFAULT.with_all_regimes(ws_fwd=True, ws_tiles=tiles)
    return cfg, _ws_spy(monkeypatch, "forward", lambda args, kw: args[-1])


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", WS_TILES)
@pytest.mark.parametrize("pattern,d", [("causal", 128), ("full", 128), ("causal", 64)])
def test_gpu_ws_forward_bf16(monkeypatch, tiles, pattern, d):
    """The warp-specialized Gluon forward (forced in every regime) on a heavy-tailed bf16 batch with empty,
    length-1, tile-edge and maximal sequences: forward and gradients (the Triton backward, fed the Gluon
    forward's lse) match the reference."""
    cfg, calls = _ws_on(monkeypatch, tiles)
    torch.manual_seed(23)
    lengths = _heavy_lengths(24, 2048) + [0, 1, 2048, 63, 64, 65, 127, 128, 129]
    off = _offsets(lengths, "cuda")
    q, k, v = (_leaf(int(off[-1]), 4, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    _check_gpu_jfa(off, 2048, "softmax", (q, k, v), causal=pattern == "causal", config=cfg)
    assert calls == [tiles]


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", WS_TILES)
def test_gpu_ws_cross_bf16(monkeypatch, tiles):
    """Cross-attention through the Gluon forward: query and key lengths differ per sequence, some key lengths
    are 0 (those rows get o = 0)."""
    cfg, calls = _ws_on(monkeypatch, tiles)
    torch.manual_seed(24)
    kv_len = _heavy_lengths(24, 2048) + [0, 2048, 1, 0]
    q_len = [(x * 7) % 300 for x in range(len(kv_len))]
    ko, qo = _offsets(kv_len, "cuda"), _offsets(q_len, "cuda")
    bf = dict(dtype=torch.bfloat16, device="cuda")
    q, k, v = _leaf(int(qo[-1]), 4, 128, **bf), _leaf(int(ko[-1]), 4, 128, **bf), _leaf(int(ko[-1]), 4, 128, **bf)
    _check(lambda a, b, c: jagged_cross_attention_triton(a, qo, b, c, ko, max(q_len), 2048, activation="softmax",
                                                         config=cfg),
           lambda a, b, c: ref.jagged_cross_attention_ref(a, qo, b, c, ko, max(q_len), 2048, activation="softmax"),
           (q, k, v), 2e-2)
    assert calls == [tiles]


def test_ws_forward_not_taken_where_it_does_not_apply(monkeypatch):
    """With the Gluon forward switched on everywhere, the calls it cannot run (the interpreter / CPU, silu,
    targets, bias, block attention, float32) still give the reference's results through the Triton path."""
    from gemray.kernels import jagged_attention as ja

    cfg, calls = _ws_on(monkeypatch, WS_TILES[0])
    lengths = [0, 1, 5, 37, 3]
    off = _offsets(lengths)
    q, k, v = (_leaf(int(off[-1]), 2, 16) for _ in range(3))
    nt = torch.tensor([0, 1, 2, 3, 1])
    for kw in (dict(activation="softmax"), dict(activation="silu"), dict(activation="softmax", num_targets=nt)):
        out = jagged_attention_triton(q, k, v, off, 37, config=cfg, **kw)
        want = ref.jagged_attention_ref(q, k, v, off, 37, **kw)
        assert _rel(out, want) < 1e-4
    assert calls == []
    spec = ja._spec(0, True, 0.25, 1.0, 0, 0, False, 37, 37, 0)
    assert not ja._use_ws_fwd(cfg.long, spec, None, None, q, k, v)  # CPU tensors


# (BLOCK_N, STAGES) of the warp-specialized silu forward; (128, 2) at head dim 128 only (silu_tiles_fit)
WS_SILU_TILES = [(64, 2), (128, 2), (64, 3)]


def _ws_silu_on(monkeypatch, tiles, bwd: str = "triton") -> tuple[KernelConfig, list]:
    """A config with the Gluon silu forward and ``tiles`` in every regime (``bwd`` "ws": with the Gluon dV + dS^T
    launch and dQ / dK products behind it, the dS^T scratch NaN-filled; "triton": the default backward), and the
    list its launches are recorded in (a spy on ws_attention.forward_silu: (tiles, causal, fast))."""
    cfg = DEFAULT.with_all_regimes(ws_fwd_silu=True, ws_fwd_silu_tiles=tiles)
    if bwd == "ws":
        cfg = cfg.with_all_regimes(ds_store=True, dk_from_ds=True, ws_bwd=True, ws_dkdq=True).replace(
            ds_scratch_nan=True)
    return cfg, _ws_spy(monkeypatch, "forward_silu", lambda args, kw: (args[11], args[8], kw["fast"]))


def test_ws_silu_tiles_fit():
    """ws_attention.silu_tiles_fit: BLOCK_N 64 / 128 with the score tile and the [64, D] accumulator within the
    consumers' registers (no 128-key tiles at D 256) and the query tile + STAGES key / value slots under sm_90's
    227 KiB of shared memory (D 256: 2 stages of 64 keys, 192 KiB; 3 do not fit)."""
    from gemray.kernels import ws_attention as ws

    assert ws.silu_tiles_fit(256, (64, 2)) and not ws.silu_tiles_fit(256, (64, 3))
    assert not ws.silu_tiles_fit(256, (128, 1))  # registers: [64, 128] scores beside the [64, 256] accumulator
    assert ws.silu_tiles_fit(128, (128, 2)) and ws.silu_tiles_fit(128, (128, 3))
    assert not ws.silu_tiles_fit(128, (128, 4))
    assert ws.silu_tiles_fit(128, (64, 5)) and not ws.silu_tiles_fit(128, (64, 7))
    assert not ws.silu_tiles_fit(128, (32, 2)) and not ws.silu_tiles_fit(128, (64, 0))
    assert DEFAULT.long.ws_fwd_silu_tiles == (64, 2) and ws.silu_tiles_fit(256, DEFAULT.long.ws_fwd_silu_tiles)


@pytest.mark.parametrize("d", [128, 256])
def test_ws_silu_forward_plan(monkeypatch, d):
    """The forward plan with eligibility forced (the Gluon kernels need an sm_90 GPU): silu takes the Gluon forward
    where the regime's ws_fwd_silu is on and its tiles fit the head dim (a 128-query-row table, the tiles, the fast
    silu for bf16), and _gdpa_fwd where it is off (default), where the tiles do not fit, for softmax (ws_fwd off)
    and with the in-kernel relative bias; _forward hands the plan's launch to ws_attention.forward_silu with the
    call's causal flag, alpha and 1/N, and returns no lse."""
    from gemray.kernels import jagged_attention as ja
    from gemray.kernels import ws_attention as ws

    monkeypatch.setattr(ja, "_interpreting", lambda: False)
    monkeypatch.setattr(ws, "eligible", lambda *a: True)
    off = _offsets([0, 1, 200, 129, 64])
    t = int(off[-1])
    q = torch.randn(t, 2, d, dtype=torch.bfloat16)
    spec = ja._spec(1, True, 0.1, 1 / 200, 0, 0, False, 200, 200, 0)
    on = DEFAULT.with_all_regimes(ws_fwd_silu=True, ws_fwd=False)
    plan = ja._make_fwd_plan(q, q, q, None, off, off, None, spec, t, on)
    assert plan.launch is None and not plan.tma
    tiles, table, n_tiles, fast = plan.ws
    want, want_n = ja._q_table(spec, off, off, 128, t, grouped=on.seq_order_fwd)
    assert tiles == (64, 2) and fast is True and n_tiles == want_n == 2 and torch.equal(table, want)
    assert ja._make_fwd_plan(q, q, q, None, off, off, None, spec, t, DEFAULT).ws is None  # off by default
    big = on.with_all_regimes(ws_fwd_silu_tiles=(128, 2))  # fits at D 128 only
    assert (ja._make_fwd_plan(q, q, q, None, off, off, None, spec, t, big).ws is not None) is (d == 128)
    softmax = ja._spec(0, True, 0.1, 1.0, 0, 0, False, 200, 200, 0)
    assert ja._make_fwd_plan(q, q, q, None, off, off, None, softmax, t, on).ws is None
    gelu = ja._spec(2, True, 0.1, 1 / 200, 0, 0, False, 200, 200, 0)
    assert ja._make_fwd_plan(q, q, q, None, off, off, None, gelu, t, on).ws is None
    calls = []

    def fake(q_, k_, v_, o, q_off, kv_off, table_, n, causal, alpha, inv_n, tiles_, fast=None):
        calls.append((table_ is table, n, causal, alpha, inv_n, tiles_, fast))
        o.fill_(3.0)

    monkeypatch.setattr(ws, "forward_silu", fake)
    o, lse = ja._forward(q, q, q, None, off, off, None, spec, t, on, plan)
    assert lse is None and o.shape == (t, 2, d) and o.dtype == torch.bfloat16 and bool((o == 3.0).all())
    assert calls == [(True, 2, True, 0.1, 1 / 200, (64, 2), True)]


def test_ws_silu_forward_not_taken_where_it_does_not_apply(monkeypatch):
    """With the Gluon silu forward switched on everywhere, the calls it cannot run (the interpreter / CPU, softmax,
    targets, float32) still give the reference's output and gradients through the Triton path."""
    from gemray.kernels import jagged_attention as ja

    cfg, calls = _ws_silu_on(monkeypatch, WS_SILU_TILES[0])
    soft = _ws_spy(monkeypatch, "forward", lambda args, kw: args[-1])
    off = _offsets([0, 1, 5, 37, 3])
    nt = torch.tensor([0, 1, 2, 3, 1])
    for kw in (dict(activation="silu"), dict(activation="silu", causal=False), dict(activation="softmax"),
               dict(activation="silu", num_targets=nt)):
        _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 37, config=cfg, **kw),
               lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, 37, **kw),
               tuple(_leaf(int(off[-1]), 2, 16) for _ in range(3)), 1e-4)
    assert calls == [] and soft == []
    spec = ja._spec(1, True, 0.25, 1.0, 0, 0, False, 37, 37, 0)
    q = _leaf(int(off[-1]), 2, 128)
    assert not ja._use_ws_fwd(cfg.long, spec, None, None, q, q, q)  # CPU tensors


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", WS_SILU_TILES)
@pytest.mark.parametrize("bwd", ["triton", "ws"])
@pytest.mark.parametrize("pattern,d", [("causal", 256), ("full", 256), ("causal", 128)])
def test_gpu_ws_silu_forward_bf16(monkeypatch, tiles, bwd, pattern, d):
    """The warp-specialized Gluon silu forward (forced in every regime) on a heavy-tailed bf16 batch with empty,
    length-1, tile-edge (63 / 64 / 65 / 127 / 128 / 129) and maximal sequences: the output and all three gradients
    (the Triton backward, or the Gluon dV + dS^T launch and dQ / dK products) match the float32 reference, and the
    output agrees with the Triton forward's to bf16 rounding. Tiles that do not fit the head dim leave the call to
    _gdpa_fwd (no Gluon launch)."""
    from gemray.kernels import ws_attention as ws

    cfg, calls = _ws_silu_on(monkeypatch, tiles, bwd)
    torch.manual_seed(27)
    lengths = _heavy_lengths(24, 2048) + [0, 1, 2048, 63, 64, 65, 127, 128, 129, 0]
    off = _offsets(lengths, "cuda")
    q, k, v = (_leaf(int(off[-1]), 4, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    causal = pattern == "causal"
    out, _ = _check_gpu_jfa(off, 2048, "silu", (q, k, v), causal=causal, config=cfg)
    fits = ws.silu_tiles_fit(d, tiles)
    assert calls == ([(tiles, causal, True)] if fits else [])
    triton_out = jagged_attention_triton(q, k, v, off, 2048, activation="silu", alpha=0.05, causal=causal)
    assert _rel(out, triton_out) < 4e-3
    assert bool(torch.isfinite(out.float()).all())


@gpu
@needs_cuda
@pytest.mark.parametrize("bwd", ["triton", "ws"])
@pytest.mark.parametrize("d", [256, 128])
def test_gpu_ws_silu_cross_bf16(monkeypatch, bwd, d):
    """Cross-attention (silu, not causal) through the Gluon silu forward: query and key lengths differ per sequence,
    either may be 0 or exceed the other; output and gradients match the float32 reference."""
    cfg, calls = _ws_silu_on(monkeypatch, WS_SILU_TILES[0], bwd)
    torch.manual_seed(28)
    kv_len = _heavy_lengths(24, 2048) + [0, 2048, 1, 0, 130, 64]
    q_len = [(x * 7) % 300 for x in range(len(kv_len) - 2)] + [700, 0]
    ko, qo = _offsets(kv_len, "cuda"), _offsets(q_len, "cuda")
    bf = dict(dtype=torch.bfloat16, device="cuda")
    q, k, v = _leaf(int(qo[-1]), 4, d, **bf), _leaf(int(ko[-1]), 4, d, **bf), _leaf(int(ko[-1]), 4, d, **bf)
    _check(lambda a, b, c: jagged_cross_attention_triton(a, qo, b, c, ko, max(q_len), 2048, activation="silu",
                                                         config=cfg),
           lambda a, b, c: ref.jagged_cross_attention_ref(a, qo, b, c, ko, max(q_len), 2048, activation="silu"),
           (q, k, v), 2e-2)
    assert calls == [(WS_SILU_TILES[0], False, True)]

# (query rows per step, STAGES) of the warp-specialized silu backward's dV + dS^T launch
WS_BWD_TILES = [(32, 2), (16, 4)]  # (64, 1) spills (392 B of stack, sm_90 compile); (32, 3) exceeds shared memory


def _ws_bwd_on(monkeypatch, tiles, dkdq: bool = False) -> tuple[KernelConfig, list]:
    """A config whose every regime stores dS^T (NaN-filled scratch: an entry read but never written shows), computes
    dK from it and runs the Gluon dV + dS^T launch with ``tiles`` (``dkdq``: and the Gluon dQ / dK products), and
    the list its launches are recorded in (spies on ws_attention.backward_dv_ds: its tiles, and ds_gemm: ("dq" |
    "dk", stages))."""
    cfg = DEFAULT.with_all_regimes(ds_store=True, dk_from_ds=True, ws_bwd=True, ws_bwd_tiles=tiles,
                                   ws_dkdq=dkdq).replace(ds_scratch_nan=True)
    calls = _ws_spy(monkeypatch, "backward_dv_ds", lambda args, kw: kw["tiles"])
    real = _ws_spy(monkeypatch, "ds_gemm", lambda args, kw: ("dq" if kw["dq"] else "dk", kw["stages"]))
    return cfg, calls, real


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles,dkdq", [(t, False) for t in WS_BWD_TILES] + [(WS_BWD_TILES[0], True),
                                                                           (WS_BWD_TILES[1], True)])
@pytest.mark.parametrize("pattern,d", [("causal", 256), ("full", 256), ("causal", 128)])
def test_gpu_ws_backward_bf16(monkeypatch, tiles, dkdq, pattern, d):
    """The warp-specialized Gluon dV + dS^T launch (forced in every regime, with the stored dS^T's dQ and dK
    launches: Triton's, or with ``dkdq`` the Gluon products, which read only what the dV + dS^T launch wrote) on a
    heavy-tailed bf16 silu batch with empty, length-1, tile-edge (63 / 64 / 65 / 127 / 128 / 129) and maximal
    sequences, the dS^T scratch NaN-filled: the forward and all three gradients match the float32 reference."""
    cfg, calls, gemms = _ws_bwd_on(monkeypatch, tiles, dkdq)
    torch.manual_seed(25)
    lengths = _heavy_lengths(24, 2048) + [0, 1, 2048, 63, 64, 65, 127, 128, 129, 0]
    off = _offsets(lengths, "cuda")
    q, k, v = (_leaf(int(off[-1]), 4, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    _check_gpu_jfa(off, 2048, "silu", (q, k, v), causal=pattern == "causal", config=cfg)
    assert calls == [tiles]
    assert gemms == ([("dq", 4), ("dk", 4)] if dkdq else [])


@gpu
@needs_cuda
@pytest.mark.parametrize("dkdq", [False, True])
def test_gpu_ws_backward_cross_bf16(monkeypatch, dkdq):
    """Cross-attention (silu, D 256) through the Gluon dV + dS^T launch (and with ``dkdq`` the Gluon dQ / dK
    products): query and key lengths differ per sequence, either may be 0 or exceed the other, the dS^T scratch
    NaN-filled; output and gradients match the float32 reference."""
    cfg, calls, gemms = _ws_bwd_on(monkeypatch, WS_BWD_TILES[0], dkdq)
    torch.manual_seed(26)
    kv_len = _heavy_lengths(24, 2048) + [0, 2048, 1, 0, 130, 64]
    q_len = [(x * 7) % 300 for x in range(len(kv_len) - 2)] + [700, 0]
    ko, qo = _offsets(kv_len, "cuda"), _offsets(q_len, "cuda")
    bf = dict(dtype=torch.bfloat16, device="cuda")
    q, k, v = _leaf(int(qo[-1]), 4, 256, **bf), _leaf(int(ko[-1]), 4, 256, **bf), _leaf(int(ko[-1]), 4, 256, **bf)
    _check(lambda a, b, c: jagged_cross_attention_triton(a, qo, b, c, ko, max(q_len), 2048, activation="silu",
                                                         config=cfg),
           lambda a, b, c: ref.jagged_cross_attention_ref(a, qo, b, c, ko, max(q_len), 2048, activation="silu"),
           (q, k, v), 2e-2)
    assert calls == [WS_BWD_TILES[0]]
    assert gemms == ([("dq", 4), ("dk", 4)] if dkdq else [])


def test_ws_backward_not_taken_where_it_does_not_apply(monkeypatch):
    """With the Gluon backward switched on everywhere, the calls it cannot run (the interpreter / CPU, softmax,
    targets) still give the reference's gradients through the Triton launches."""
    from gemray.kernels import jagged_attention as ja

    cfg, calls, gemms = _ws_bwd_on(monkeypatch, WS_BWD_TILES[0], dkdq=True)
    lengths = [0, 1, 5, 37, 3]
    off = _offsets(lengths)
    nt = torch.tensor([0, 1, 2, 3, 1])
    for kw in (dict(activation="silu"), dict(activation="softmax"), dict(activation="silu", num_targets=nt)):
        _check(lambda a, b, c: jagged_attention_triton(a, b, c, off, 37, config=cfg, **kw),
               lambda a, b, c: ref.jagged_attention_ref(a, b, c, off, 37, **kw),
               tuple(_leaf(int(off[-1]), 2, 16) for _ in range(3)), 1e-4)
    assert calls == [] and gemms == []
    spec = ja._spec(1, True, 0.25, 1.0, 0, 0, False, 37, 37, 0)
    q = _leaf(int(off[-1]), 2, 16)
    assert not ja._use_ws_bwd(cfg.long, spec, None, None, q, q, q, q)  # CPU tensors


@pytest.mark.parametrize("dkdq", [False, True])
def test_ws_backward_plan_steps(monkeypatch, dkdq):
    """The backward plan where the Gluon dV + dS^T launch takes the call (eligibility forced: it needs an sm_90
    GPU): dQ and dK from the stored dS^T are the Triton dq_ds / dk_ds launches, or with ws_dkdq the Gluon products
    (dQ over 128-query tiles, dK over the dV + dS^T launch's own 128-key tiles, the gradient's scale alpha / N and
    the regime's stages), in that order."""
    from gemray.kernels import jagged_attention as ja

    monkeypatch.setattr(ja, "_use_ws_bwd", lambda *a: True)
    monkeypatch.setattr(ja, "_use_ds_store", lambda *a: True)
    cfg = DEFAULT.with_all_regimes(ds_store=True, dk_from_ds=True, ws_bwd=True, ws_dkdq=dkdq, ws_dkdq_stages=3)
    off = _offsets([0, 1, 200, 129, 64])
    t = int(off[-1])
    q = torch.randn(t, 2, 128, dtype=torch.bfloat16)
    spec = ja._spec(1, True, 0.1, 1 / 200, 0, 0, False, 200, 200, 0)
    fwd = ja._make_fwd_plan(q, q, q, None, off, off, None, spec, t, cfg)
    steps = ja._make_bwd_plan(fwd, q, q, q, None, q, off, off, None, spec, False, True, cfg).steps
    kinds = [kind for _, _, kind in steps]
    if not dkdq:
        assert kinds == ["ws_dv_ds", "dq_ds", "dk_ds"]
        return
    assert kinds == ["ws_dv_ds", "ws_dq", "ws_dk"]
    (_, k_table, _), (dq, q_table, _), (dk, dk_table, _) = steps
    assert dk_table is k_table  # the key tiles whose dS^T rows the dV + dS^T launch wrote
    want_q, ntq = ja._q_table(spec, off, off, 128, t, grouped=cfg.seq_order_dq)
    assert torch.equal(q_table, want_q) and dq["n_tiles"] == ntq == 2
    for launch, is_dq in ((dq, True), (dk, False)):
        assert launch["dq"] is is_dq and launch["causal"] and launch["stages"] == 3
        assert launch["scale"] == pytest.approx(0.1 / 200)


@pytest.mark.parametrize("case,ok", [
    ("base", True), ("d128", True), ("softmax", False), ("not_plain", False), ("fp32", False), ("d64", False),
    ("d_mismatch", False), ("head_stride", False), ("misaligned_rows", False), ("sm80", False), ("cpu", False),
    ("unaligned", False)])
def test_ws_bwd_eligible_rules(case, ok):
    """ws_attention.supports_bwd, the pure rule behind eligible_bwd: sm_90, 16-bit silu over plain full rows, equal
    head dims 128 / 256, unit and contiguous head strides (q, k, v, dO), 16-byte aligned rows and bases."""
    from gemray.kernels import ws_attention as ws

    args = dict(device_type="cuda", capability=(9, 0), act=1, plain=True, dtype=torch.bfloat16,
                dims=(256, 256, 256), strides=((4096, 256, 1),) * 4, aligned=True)
    args.update({"d128": dict(dims=(128, 128, 128), strides=((512, 128, 1),) * 4), "softmax": dict(act=0),
                 "not_plain": dict(plain=False), "fp32": dict(dtype=torch.float32),
                 "d64": dict(dims=(64, 64, 64), strides=((256, 64, 1),) * 4),
                 "d_mismatch": dict(dims=(256, 256, 128)),
                 "head_stride": dict(strides=((4096, 256, 1), (4096, 512, 1), (4096, 256, 1), (4096, 256, 1))),
                 "misaligned_rows": dict(strides=((1027, 256, 1),) * 4), "sm80": dict(capability=(8, 0)),
                 "cpu": dict(device_type="cpu"), "unaligned": dict(aligned=False)}.get(case, {}))
    assert ws.supports_bwd(**args) is ok


@pytest.mark.parametrize("case,ok", [
    ("base", True), ("d64", True), ("softmax_d256", False), ("silu", True), ("silu_d256", True), ("silu_d64", False),
    ("gelu", False), ("silu_not_plain", False), ("silu_d_mismatch", False), ("silu_fp16", True),
    ("silu_fp32", False), ("not_plain", False), ("fp32", False), ("d96", False), ("d_mismatch", False),
    ("head_stride", False), ("misaligned_rows", False), ("sm80", False), ("cpu", False), ("unaligned", False)])
def test_ws_eligible_rules(case, ok):
    """ws_attention.supports, the pure rule behind eligible: sm_90, 16-bit softmax (head dims 64 / 128) or silu (128
    / 256) over plain full rows, equal head dims, unit and contiguous head strides, 16-byte aligned rows and bases."""
    from gemray.kernels import ws_attention as ws

    args = dict(device_type="cuda", capability=(9, 0), act=0, plain=True, dtype=torch.bfloat16,
                dims=(128, 128, 128), strides=((512, 128, 1),) * 3, aligned=True)
    d256 = dict(dims=(256, 256, 256), strides=((1024, 256, 1),) * 3)
    d64 = dict(dims=(64, 64, 64), strides=((256, 64, 1),) * 3)
    args.update({"d64": d64, "softmax_d256": d256, "silu": dict(act=1), "silu_d256": dict(act=1, **d256),
                 "silu_d64": dict(act=1, **d64), "gelu": dict(act=2), "silu_not_plain": dict(act=1, plain=False),
                 "silu_d_mismatch": dict(act=1, dims=(256, 256, 128), strides=d256["strides"]),
                 "silu_fp16": dict(act=1, dtype=torch.float16), "silu_fp32": dict(act=1, dtype=torch.float32),
                 "unaligned": dict(aligned=False),
                 "not_plain": dict(plain=False), "fp32": dict(dtype=torch.float32),
                 "d96": dict(dims=(96, 96, 96), strides=((384, 96, 1),) * 3),
                 "d_mismatch": dict(dims=(128, 128, 64)),
                 "head_stride": dict(strides=((512, 128, 1), (1024, 256, 1), (512, 128, 1))),
                 "misaligned_rows": dict(strides=((517, 128, 1),) * 3), "sm80": dict(capability=(8, 0)),
                 "cpu": dict(device_type="cpu")}.get(case, {}))
    assert ws.supports(**args) is ok
