"""Compile-only check of the jagged attention kernels for Hopper (sm_90), no GPU needed.

``python -m gemray.bench.sass_check [--all | --smem | --ws]`` compiles kernel variants with ``triton.compile(...,
target=GPUTarget("cuda", 90, 32))`` (ptxas and cuobjdump come with the triton wheel) and prints, per
variant: shared memory, registers, ptxas stack (local memory) bytes, whether the matrix products use
wgmma (HGMMA in SASS), and for each loop of the SASS (a backward branch and its target) the spill stores
and loads (STL / LDL) executed per iteration. Spills inside a loop cost every tile; spills outside the
loops (values kept across them) cost once per program. the kernel run reports (benchmarks/reports/kernels_h200_*.md) records what this showed.
The device may run another triton version: re-check there when a number matters. The relative-bias
variants take the int32 time-threshold table (``jagged_attention._kernel_thresholds``: up to 71 time buckets,
e.g. the GEM config's 64). ``--ws`` compiles the warp-specialized Gluon kernels instead
(kernels/ws_attention.py: the forwards and the silu backward's two launches; ptxas's spill figures for the whole
kernel, the partitions' setmaxnreg budgets, a SASS hash to show a change left a kernel's code as it was); they need the device's triton 3.6 (``PYTHONPATH=<dir holding triton 3.6>``): the CPU
stack's triton 3.9 removed a call they make.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gemray.kernels import jagged_attention as ja
from gemray.kernels.config import DEFAULT, KernelConfig

_FWD_TYPES = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", LSE="*fp32", Q_OFF="*i64", KV_OFF="*i64",
                  NT="*i64", WORK="*i32", BIAS="*bf16", alpha="fp32", inv_n="fp32",
                  TQ="*i64", TK="*i64", PB_TAB="*i32", TTHR="*i32", PW="*fp32", TW="*fp32")
_BWD_TYPES = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", LSE="*fp32", DELTA="*fp32", O="*bf16",
                  DK="*bf16", DV="*bf16", DQ="*bf16", Q_OFF="*i64", KV_OFF="*i64", NT="*i64", WORK="*i32",
                  BIAS="*fp32", DBIAS="*fp32", DS="*bf16", alpha="fp32", inv_n="fp32",
                  TQ="*i64", TK="*i64", PB_TAB="*i32", TTHR="*i32", PW="*fp32", TW="*fp32", DPW="*fp32",
                  DTW="*fp32")
_DQ_DS_TYPES = dict(DS="*bf16", K="*bf16", DQ="*bf16", Q_OFF="*i64", KV_OFF="*i64", NT="*i64", WORK="*i32",
                    dq_scale="fp32")
_DK_DS_TYPES = dict(DS="*bf16", Q="*bf16", DK="*bf16", Q_OFF="*i64", KV_OFF="*i64", NT="*i64", WORK="*i32",
                    dk_scale="fp32")
_BASE = dict(CAUSAL=True, HAS_TARGETS=False, ATT_BLOCK=0, WINDOW=0, Q_BCAST=False, BLOCK_DQK=128, BLOCK_DV=128,
             DOT_PREC=None, HAS_BIAS=False, CONTEXT=0, FAST=True, HEADS_INNER=False, TMA=False, REL=False)


def fwd_variant(act: int, bm: int, bn: int, warps: int, stages: int, tma: bool = False, rel: bool = False) -> tuple:
    """(name, jit fn, arg types, constexprs, warps, stages) of a bf16 D=128 causal forward (``tma``: tile
    loads through tensor descriptors; ``rel``: the in-kernel relative bias)."""
    return (f"fwd act={act} {bm}x{bn}/{warps}w/{stages}s{' tma' if tma else ''}{' rel' if rel else ''}",
            ja._gdpa_fwd, _FWD_TYPES,
            dict(_BASE, ACT=act, BLOCK_M=bm, BLOCK_N=bn, EVEN_D=True, TMA=tma, REL=rel), warps, stages)


def bwd_variant(act: int, part: int, dk: tuple[int, int], dq: tuple[int, int], warps: int, stages: int,
                tma: bool = False, store_ds: bool = False, rel: bool = False, no_dk: bool = False) -> tuple:
    """A bf16 D=128 causal backward: part 1 (dK/dV; with ``store_ds`` also storing dS^T for _gdpa_dq_ds, and
    with ``no_dk`` accumulating dV only, dK left to _gdpa_dk_ds) or 2 (dQ; softmax: it also stores delta, as in the
    two-launch backward); dk / dq = (BM, BN)."""
    dk = dk if part != 2 else (0, 0)
    dq = dq if part != 1 else (0, 0)
    return (f"bwd act={act} part={part} dkdv={dk[0]}x{dk[1]} dq={dq[0]}x{dq[1]}/{warps}w/{stages}s"
            f"{' tma' if tma else ''}{' store-ds' if store_ds else ''}{' no-dk' if no_dk else ''}"
            f"{' rel' if rel else ''}",
            ja._gdpa_bwd, _BWD_TYPES,
            dict(_BASE, ACT=act, PART=part, DK_BM=dk[0], DK_BN=dk[1], DQ_BM=dq[0], DQ_BN=dq[1],
                 STORE_DBIAS=False, STORE_DELTA=part == 2 and act == 0, TMA=tma, STORE_DS=store_ds, REL=rel,
                 P_PAD=128 if rel else 16, NT_PAD=128 if rel else 16, NO_DK=no_dk), warps, stages)


def dq_ds_variant(bm: int, bn: int, warps: int, stages: int, tma: bool = False) -> tuple:
    """The DS_STORE backward's dQ kernel (dQ = dS K from the stored dS^T), bf16 D=128, causal."""
    consts = {a: _BASE[a] for a in ("CAUSAL", "HAS_TARGETS", "CONTEXT", "BLOCK_DQK", "DOT_PREC", "HEADS_INNER")}
    return (f"dq_ds {bm}x{bn}/{warps}w/{stages}s{' tma' if tma else ''}", ja._gdpa_dq_ds, _DQ_DS_TYPES,
            dict(consts, BLOCK_M=bm, BLOCK_N=bn, TMA=tma), warps, stages)


def dk_ds_variant(bm: int, bn: int, warps: int, stages: int, tma: bool = False) -> tuple:
    """The dk_from_ds backward's dK kernel (dK = dS^T Q from the stored dS^T), bf16 D=128, causal; (BM, BN) =
    (query step, key tile)."""
    consts = {a: _BASE[a] for a in ("CAUSAL", "HAS_TARGETS", "CONTEXT", "Q_BCAST", "BLOCK_DQK", "DOT_PREC",
                                    "HEADS_INNER")}
    return (f"dk_ds {bm}x{bn}/{warps}w/{stages}s{' tma' if tma else ''}", ja._gdpa_dk_ds, _DK_DS_TYPES,
            dict(consts, BLOCK_M=bm, BLOCK_N=bn, TMA=tma), warps, stages)


def _loops(sass: str) -> list[tuple[int, int, int, int]]:
    """(instructions, HGMMA, STL, LDL) of every loop body (backward branch to a lower address). A backward
    branch whose range holds an EXIT is no loop: ptxas puts the slow path of an mbarrier wait (TMA loads,
    wgmma pipelining) after the kernel's EXIT and branches from there back into the loop, a range that spans
    the loop's tail, the epilogue and the exit (Triton kernels cannot return from inside a loop)."""
    ins = [(int(m.group(1), 16), m.group(2))
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    out = []
    for addr, text in ins:
        m = re.search(r"BRA 0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any(re.search(r"\bEXIT\b", t) for t in body):
                continue
            out.append((len(body), sum("HGMMA" in t for t in body), sum("STL" in t for t in body),
                        sum("LDL" in t for t in body)))
    return out


def _jit_hints(fn, sig: dict) -> dict:
    """The divisibility hints the JIT launcher gives a bench-shaped call (bf16 [T, H, 128] tensors): every
    pointer 16-byte aligned, every tensor stride and head dim a multiple of 16 (not stride_lh = T, which a
    heavy batch's T need not be). Without them every tile load compiles to 2-byte LDG + STS (no cp.async,
    no vector loads), which is not what the device runs."""
    hinted = [i for i, a in enumerate(fn.arg_names) if sig[a] != "constexpr" and (
        sig[a].startswith("*") or (a.startswith("stride_") and a != "stride_lh") or a in ("D_QK", "D_V"))]
    return {(i,): [["tt.divisibility", 16]] for i in hinted}


def check(variant: tuple) -> dict:
    """Compile one variant for sm_90 and return its resource and spill figures (raises on compile errors)."""
    name, fn, types, consts, warps, stages = variant
    sig = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts, _jit_hints(fn, sig)), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return dict(name=name, shared=k.metadata.shared, regs=int(m.group(1)) if m else -1,
                stack=int(m.group(2)) if m else -1, hgmma=sass.count("HGMMA"), loops=_loops(sass),
                stl=len(re.findall(r"\bSTL\b", sass)), ldl=len(re.findall(r"\bLDL\b", sass)))


def default_variants(full: bool = False, config: KernelConfig = DEFAULT) -> list[tuple]:
    """The D=128 tiles of every regime of ``config`` (and, with ``full``, the sweep's other candidates)."""
    seen, out = set(), []
    for reg in ("short", "medium", "long", "xlong"):
        rc = config.regime(reg)
        tiles, tma = rc.tiles, rc.tma_loads
        for act in (0, 1):
            bm, bn, w, s = tiles.get("fwd_silu" if act else "fwd", 128)
            out.append(fwd_variant(act, bm, bn, w, s, tma))
            if rc.ds_store:
                k, d = tiles.get("dkdv_ds", 128), tiles.get("dq_ds", 128)
                out.append(bwd_variant(act, 1, k[:2], (0, 0), k[2], k[3], tma=tma, store_ds=True))
                out.append(dq_ds_variant(d[0], d[1], d[2], d[3], tma))
            else:
                k, q = tiles.get("dkdv", 128), tiles.get("dq", 128)
                out.append(bwd_variant(act, 1, k[:2], q[:2], k[2], k[3], tma=tma))
                out.append(bwd_variant(act, 2, k[:2], q[:2], q[2], q[3], tma=tma))
            if reg == "long":  # the in-kernel relative bias (never with ds_store: the recomputing dQ kernel)
                k, q = tiles.get("dkdv", 128), tiles.get("dq", 128)
                out.append(fwd_variant(act, bm, bn, w, s, tma, rel=True))
                out.append(bwd_variant(act, 1, k[:2], q[:2], k[2], k[3], tma=tma, rel=True))
                out.append(bwd_variant(act, 2, k[:2], q[:2], q[2], q[3], tma=tma, rel=True))
    if full:
        from gemray.bench import kernels as bench

        for reg, kinds in bench.SWEEP.items():
            for bm, bn, w, s in kinds["dkdv"]:
                out.append(bwd_variant(0, 1, (bm, bn), (0, 0), w, s))
            for bm, bn, w, s in kinds["dq"]:
                out.append(bwd_variant(0, 2, (0, 0), (bm, bn), w, s))
            for bm, bn, w, s in kinds.get("dq_ds", ()):
                out.append(dq_ds_variant(bm, bn, w, s))
            for bm, bn, w, s in kinds.get("dk_ds", ()):
                out.append(dk_ds_variant(bm, bn, w, s))
            for bm, bn, w, s in kinds["dkdv_ds"]:
                out.append(bwd_variant(0, 1, (bm, bn), (0, 0), w, s, store_ds=True))
    for v in out:
        if v[0] not in seen:
            seen.add(v[0])
            yield v


# the D = 256 dK/dV candidates of benchmarks/attn_sweep_d256.py that --gem compiles (BLOCK_M, BLOCK_N, warps, stages)
GEM_DKDV = ((64, 64, 8, 2), (32, 64, 8, 2), (16, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (32, 128, 8, 2))
GEM_DK_DS = ((64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2))


def gem_variants(d: int = 256) -> list[tuple]:
    """The GEM config's attention backward at head dim ``d`` (silu, causal, bf16): the DS_STORE dK/dV launch's
    candidates (GEM_DKDV) with dK in the launch and without (dk_from_ds), each by pointers and through TMA
    descriptors, then the dK = dS^T Q launch's (GEM_DK_DS)."""
    out = []
    for bm, bn, w, s in GEM_DKDV:
        for no_dk in (False, True):
            for tma in (False, True):
                out.append(bwd_variant(1, 1, (bm, bn), (0, 0), w, s, tma=tma, store_ds=True, no_dk=no_dk))
    out += [dk_ds_variant(*t) for t in GEM_DK_DS]
    wide = []
    for name, fn, types, consts, warps, stages in out:
        c = dict(consts, BLOCK_DQK=d, **({"BLOCK_DV": d} if "BLOCK_DV" in consts else {}))
        wide.append((f"D={d} {name}", fn, types, c, warps, stages))
    return wide


# the fused sampled softmax's kernels (gemray.kernels.sampled_softmax) at the GEM head's width E = 64
_SSM_TYPES = dict(H="*{dt}", POS="*fp32", EN="*{dt}", NEG="*i64", TGT="*i64", ROW_OFF="*i64", LSE="*fp32",
                  G="*fp32", DH="*{dt}", DPOS="*fp32", DE="*{dt}", scale="fp32")


def ssm_variants(e: int = 64) -> list[tuple]:
    """The fused sampled softmax's forward / dH / dE kernels at head width ``e``, each at its default tile and warps
    (``sampled_softmax.DEFAULT_TILES``, 2 stages as Triton's default launch) in float32 (``FP32_PRODUCTS``) and
    bf16, plus the float32 dE kernel at 64 x 64 / 4 warps, a tile the defaults avoid (it spills)."""
    import torch

    from gemray.kernels import sampled_softmax as ssm

    kernels = {"fwd": ssm._ssm_fwd, "dh": ssm._ssm_bwd_dh, "de": ssm._ssm_bwd_de}
    runs = [(dtype, name, k, ssm.DEFAULT_TILES[dtype][k]) for dtype, name in ((torch.float32, "fp32"),
                                                                             (torch.bfloat16, "bf16"))
            for k in kernels] + [(torch.float32, "fp32", "de", (64, 64, 4))]
    out = []
    for dtype, name, k, (bm, br, warps) in runs:
        types = {a: v.format(dt=name) for a, v in _SSM_TYPES.items()}
        consts = dict(BLOCK_M=bm, BLOCK_R=br, BLOCK_E=ssm._block_e(e), DOT_PREC=ssm._dot_prec(dtype))
        fn = kernels[k]
        out.append((f"{fn.__name__} {name} E={e} {bm}x{br}/{warps}w/2s", fn, types, consts, warps, 2))
    return out


def smem_variants(config: KernelConfig = DEFAULT, dims: tuple[int, ...] = (64, 128, 256)) -> list[tuple]:
    """(kind, rel, variant) of every launch ``config`` makes on an sm_90 GPU in bf16, per regime and head dim
    (q / k = v width): the tiles ``config.tile`` picks (shrunk to fit shared memory where needed), each kernel
    kind with and without the in-kernel relative bias (never with the DS_STORE kinds), softmax and silu, tile
    loads as the regime's ``tma_loads``. Duplicates (the same compile) are listed once."""
    seen, out = set(), []
    for reg in ("short", "medium", "long", "xlong"):
        tma = config.regime(reg).tma_loads
        for d in dims:
            for act in (0, 1):
                for kind in ("fwd_silu" if act else "fwd", "dq", "dkdv", "dq_ds", "dkdv_ds", "dk_ds"):
                    for rel in ((False,) if kind.endswith("_ds") else (False, True)):
                        t = config.tile(reg, kind, d, rel=rel)
                        if kind.startswith("fwd"):
                            v = fwd_variant(act, *t, tma=tma, rel=rel)
                        elif kind == "dq_ds":
                            v = dq_ds_variant(*t, tma=tma)
                        elif kind == "dk_ds":
                            v = dk_ds_variant(*t, tma=tma)
                        else:
                            part = 2 if kind == "dq" else 1
                            v = bwd_variant(act, part, t[:2], t[:2], t[2], t[3], tma=tma,
                                            store_ds=kind == "dkdv_ds", rel=rel)
                        name, fn, types, consts, warps, stages = v
                        consts = dict(consts, BLOCK_DQK=d, **({} if kind in ("dq_ds", "dk_ds") else {"BLOCK_DV": d}))
                        v = (f"{reg} D={d} {name}", fn, types, consts, warps, stages)
                        key = (name, d)
                        if key not in seen:
                            seen.add(key)
                            out.append((kind, rel, d, t, v))
    return out


def check_smem(config: KernelConfig = DEFAULT, dims: tuple[int, ...] = (64, 128, 256)) -> int:
    """Compile every launch of :func:`smem_variants` for sm_90 and print its shared memory next to
    ``kconfig.smem_bytes``'s estimate and the budget ``fit_tile`` keeps it under; returns the number of launches
    over the sm_90 limit (232,448 bytes) or whose compile exceeds the estimate (the model would be wrong)."""
    from gemray.kernels import config as kconfig

    bad = 0
    for kind, rel, d, tile, v in smem_variants(config, dims):
        est = kconfig.smem_bytes(kind, tile, d, rel=rel)
        try:
            r = check(v)
        except Exception as e:  # report and go on
            bad += 1
            print(f"{v[0]}: COMPILE FAILED {e!r}"[:400], flush=True)
            continue
        over = r["shared"] > kconfig.SMEM_LIMIT_SM90 or r["shared"] > est + kconfig.SMEM_SLACK
        bad += over
        print(f"{v[0]}: smem {r['shared']} B (estimate {est}, budget {kconfig.smem_budget(rel)}), {r['regs']} regs, "
              f"stack {r['stack']} B{'  <-- OVER' if over else ''}", flush=True)
    return bad


_WS_PTRS = dict(O="*bf16", Q_OFF="*i64", KV_OFF="*i64", WORK="*i32")  # the Gluon forwards' pointers


def ws_fwd_variants() -> list[tuple]:
    """The warp-specialized Gluon forwards (kernels/ws_attention.py), bf16, as (name, kernel, arg types, constexprs):
    the softmax _ws_fwd at head dims 64 / 128 with its default tiles (two consumer warpgroups, 128-key tiles, 2
    stages) and ping-pong, the silu _ws_fwd_silu at 128 / 256 with every (BLOCK_N, STAGES) of (64, 2), (128, 2),
    (64, 3), (128, 3) that ws_attention.silu_tiles_fit allows, causal and not, tanh.approx silu (FAST) and, at
    D 256 causal, the exact one."""
    from gemray.kernels import ws_attention as ws

    out = []
    for d in (64, 128):
        for causal in (True, False):
            for pp in (False, True):
                out.append((f"_ws_fwd softmax D={d} causal={causal} 2wg/128/2s{' pingpong' if pp else ''}",
                            ws._ws_fwd, dict(_WS_PTRS, q_desc=(64, d), k_desc=(128, d), v_desc=(128, d),
                                             LSE="*fp32", qk_scale="fp32"),
                            dict(CAUSAL=causal, NUM_WG=2, BLOCK_N=128, HEAD_D=d, STAGES=2, PINGPONG=pp)))
    for d in (128, 256):
        for bn, stages in ((64, 2), (128, 2), (64, 3), (128, 3)):
            if not ws.silu_tiles_fit(d, (bn, stages)):
                continue
            for causal in (True, False):
                for fast in ((True, False) if (d, bn, stages, causal) == (256, 64, 2, True) else (True,)):
                    out.append((f"_ws_fwd_silu D={d} causal={causal} {bn}/{stages}s{'' if fast else ' exact silu'}",
                                ws._ws_fwd_silu, dict(_WS_PTRS, q_desc=(64, d), k_desc=(bn, d), v_desc=(bn, d),
                                                      o_desc=(64, d), alpha="fp32", inv_n="fp32"),
                                dict(CAUSAL=causal, BLOCK_N=bn, HEAD_D=d, STAGES=stages, FAST=fast)))
    return out


def ws_bwd_variants() -> list[tuple]:
    """The warp-specialized Gluon backward launches of the silu attention (kernels/ws_attention.py), bf16, as
    :func:`ws_fwd_variants`: the dV + dS^T launch _ws_dv_ds at head dims 128 / 256 with the default tiles
    (RegimeConfig.ws_bwd_tiles: 32 query rows a step, 2 slots), causal and not, tanh.approx silu; and the dS^T
    products _ws_ds_gemm (dK and dQ) at 128 / 256 with RegimeConfig.ws_dkdq_stages slots, causal and not."""
    from gemray.kernels import ws_attention as ws
    from gemray.kernels.config import RegimeConfig

    bm, stages = RegimeConfig.ws_bwd_tiles
    gemm_stages = RegimeConfig.ws_dkdq_stages
    ptrs = dict(Q_OFF="*i64", KV_OFF="*i64", WORK="*i32", stride_dsh="i64", alpha="fp32", inv_n="fp32",
                scale="fp32")
    out = []
    for d in (128, 256):
        for causal in (True, False):
            out.append((f"_ws_dv_ds D={d} causal={causal} {bm}/{stages}s", ws._ws_dv_ds,
                        dict(ptrs, q_desc=(bm, d), do_desc=(bm, d), k_desc=(64, d), v_desc=(64, d),
                             ds_desc=(64, bm), DS="*bf16", DV="*bf16"),
                        dict(CAUSAL=causal, BLOCK_M=bm, HEAD_D=d, STAGES=stages, FAST=True)))
            for dq in (False, True):
                out.append((f"_ws_ds_gemm {'dQ' if dq else 'dK'} D={d} causal={causal} {gemm_stages}s",
                            ws._ws_ds_gemm, dict(ptrs, b_desc=(64, d), DS="*bf16", OUT="*bf16"),
                            dict(DQ=dq, CAUSAL=causal, HEAD_D=d, STAGES=gemm_stages,
                                 A_LAYOUT=ws._smem_layout(64, 64, True))))
    return out


def check_ws(variant: tuple) -> dict:
    """Compile one Gluon variant of :func:`ws_fwd_variants` for sm_90: shared memory, the registers ptxas gives the
    launch (a warp-specialized kernel's partitions then move them with setmaxnreg: the values listed), ptxas's
    spill stores / loads and stack frame, HGMMA count and a hash of the SASS (addresses stripped: equal hashes =
    the same code). Tensor descriptors are typed with ws_attention's 128-byte-swizzle layout of their [rows, D]
    boxes; pointers 16-byte aligned and strides multiples of 16, as the JIT launcher's hints for the bench's
    tensors. The kernels are written for the device's triton (3.6, ``tma.async_copy_global_to_shared``); a newer
    CPU triton that removed that call fails to compile them: put triton 3.6 first on PYTHONPATH."""
    import hashlib

    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from gemray.kernels import ws_attention as ws

    name, fn, types, consts = variant
    sig = {}
    for a in fn.arg_names:
        t = "constexpr" if a in consts else types.get(a, "i32")
        if isinstance(t, tuple):  # a descriptor's box: its type string from a CPU tensor's descriptor
            rows, d = t
            x = torch.empty(64, 4 * d, dtype=torch.bfloat16)
            t = mangle_type(TensorDescriptor(x, [64, 4 * d], [4 * d, 1], [rows, d], ws._smem_layout(rows, d, True)))
        sig[a] = t
    hints = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or a.startswith("stride_")}
    k = triton.compile(GluonASTSource(fn, sig, consts, hints), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as f:
            f.write(k.asm["ptx"])
        ptxas = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "-arch=sm_90a", os.path.join(tmp, "k.ptx"),
                                "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True).stderr
        with open(os.path.join(tmp, "c.cubin"), "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", os.path.join(tmp, "c.cubin")],
                              capture_output=True, text=True, check=True).stdout
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    code = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip() for line in sass.splitlines()
            if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    return dict(name=name, shared=k.metadata.shared,
                regs=int(re.search(r"Used (\d+) registers", ptxas).group(1)),
                setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                              k.asm["ptx"])}),
                spill_stores=sum(int(a) for a, _ in spills), spill_loads=sum(int(b) for _, b in spills),
                stack=max((int(x) for x in re.findall(r"(\d+) bytes stack frame", ptxas)), default=0),
                warnings=[line for line in ptxas.splitlines() if "warning" in line],
                hgmma=sum("HGMMA" in c for c in code), instructions=len(code),
                sass_sha=hashlib.sha1("\n".join(code).encode()).hexdigest()[:12])

def main(argv: list[str] | None = None) -> int:
    """Print one line per compiled variant; exit code 1 when a variant fails to compile."""
    p = argparse.ArgumentParser(prog="python -m gemray.bench.sass_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--all", action="store_true", help="also every dK/dV and dQ candidate of the bench sweep")
    p.add_argument("--smem", action="store_true", help="instead: every launch of the default config at head dims "
                   "64 / 128 / 256, with and without the in-kernel relative bias, its shared memory against "
                   "gemray.kernels.config.smem_bytes and the sm_90 limit (exit code 1 if one is over)")
    p.add_argument("--dims", default="64,128,256", help="with --smem: the head dims (comma-separated)")
    p.add_argument("--gem", action="store_true", help="instead: the GEM config's DS_STORE backward at head dim 256 "
                   "(silu): the dK/dV candidates of benchmarks/attn_sweep_d256.py with dK in the launch and without "
                   "(dk_from_ds), by pointers and TMA, and the dK = dS^T Q launch's candidates")
    p.add_argument("--ssm", action="store_true", help="instead: the fused sampled softmax's forward / dH / dE "
                   "kernels at the GEM head's width (E = 64), float32 and bf16")
    p.add_argument("--ws", action="store_true", help="instead: the warp-specialized Gluon kernels (the forwards softmax "
                   "_ws_fwd and silu _ws_fwd_silu, the silu backward's _ws_dv_ds and _ws_ds_gemm; needs the device's "
                   "triton 3.6 first on PYTHONPATH): shared memory, registers, ptxas spills and stack, a SASS hash per "
                   "variant")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    if args.ws:
        bad = 0
        for v in ws_fwd_variants() + ws_bwd_variants():
            try:
                r = check_ws(v)
            except Exception as e:  # report and go on
                bad += 1
                print(f"{v[0]}: COMPILE FAILED {e!r}"[:400], flush=True)
                continue
            bad += bool(r["spill_stores"] or r["spill_loads"])
            print(f"{r['name']}: smem {r['shared']} B, {r['regs']} regs (setmaxnreg {r['setmaxnreg']}), spills "
                  f"{r['spill_stores']} B stored / {r['spill_loads']} B loaded, stack {r['stack']} B, {r['hgmma']} "
                  f"HGMMA, {r['instructions']} SASS instructions sha {r['sass_sha']}"
                  + "".join(f"; {w}" for w in r["warnings"]), flush=True)
        return 1 if bad else 0
    if args.smem:
        return 1 if check_smem(dims=tuple(int(x) for x in args.dims.split(","))) else 0
    bad = 0
    variants = gem_variants() if args.gem else ssm_variants() if args.ssm else default_variants(args.all)
    for v in variants:
        try:
            r = check(v)
        except Exception as e:  # report and go on: one bad variant must not hide the others
            bad += 1
            print(f"{v[0]}: COMPILE FAILED {e!r}"[:400], flush=True)
            continue
        loops = " ".join(f"[{n} instr, {h} HGMMA, {st} STL, {ld} LDL]" for n, h, st, ld in r["loops"])
        print(f"{r['name']}: smem {r['shared']} B, {r['regs']} regs, stack {r['stack']} B, "
              f"{r['hgmma']} HGMMA, {r['stl']} STL / {r['ldl']} LDL in all; loops {loops}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
