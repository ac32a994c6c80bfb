"""A/B of the backward with dS materialized (jagged_attention.DS_STORE) against the recomputing backward and
varlen_attn, one process.

Runs on the lent H200 from the package layout deploy/h200/kernels_bench.sh builds (``gemray`` importable):
``python3 ab_ds.py [--warm BATCH_INDEX]``. For each bench batch (bf16, H=4, D=128, causal softmax; heavy B=256
N=4096 also silu) it times fwd+bwd (``triton.testing.do_bench`` median, as the bench) of varlen_attn, of JFA
with the recomputing backward and of JFA with DS_STORE under several dQ-from-dS and dK/dV tiles, prints the
relative difference of each variant's dq / dk / dv from the recomputing backward's and the peak memory of one
fwd+bwd step, then CUDA-graph replays (device time) of the recomputing and the default DS_STORE backward.
``--warm I`` runs batch I's variants once (compiles them into TRITON_CACHE_DIR; run four in parallel first).
"""

from __future__ import annotations

import argparse

import torch

from gemray.kernels import bench
from gemray.kernels import jagged_attention as ja

# variant: (DS_STORE, dq_ds tiles or None = the regime's default, dkdv_ds tiles or None = default, launch-mode
# switches of the regime {jagged_attention dict name: value}). Runs 19-21 and 24 tried more (kernels/NOTES.md): dS
# stored by per-thread stores instead of TMA (-23 to -30%), a padded row stride, K loaded through tensor
# descriptors in the dQ launch (ties); run 27: head groups with each group's dQ launch on a side stream beside the
# next group's dK/dV (no gain: the dK/dV launch fills every SM first; the code was not kept); run 26: delta inline,
# the heads-inner grid and TMA loads under DS_STORE (none better). Run 34: the tiles again with the work tables
# grouped by sequence (jagged_attention.SEQ_ORDER).
VARIANTS = {
    "rec": (False, None, None, {}),
    "ds": (True, None, None, {}),
    "ds k64x64/4w/3": (True, None, (64, 64, 4, 3), {}),
    "ds k64x64/8w/2": (True, None, (64, 64, 8, 2), {}),
    "ds k32x64/4w/2": (True, None, (32, 64, 4, 2), {}),
    "ds tma": (True, None, None, {"TMA_LOADS": True}),
    "ds heads inner": (True, None, None, {"HEADS_INNER": True}),
}
_MODES = ("DELTA_INLINE", "HEADS_INNER", "TMA_LOADS")
CASES = [("uniform", 128, 1024, "softmax"), ("heavy", 128, 1024, "softmax"), ("uniform", 64, 4096, "softmax"),
         ("heavy", 256, 4096, "softmax"), ("heavy", 256, 4096, "silu")]


def _set(reg: str, variant: str, saved: dict) -> None:
    on, qt, kt, modes = VARIANTS[variant]
    ja.DS_STORE[reg] = on
    ja.TILES[reg]["dq_ds"][128] = qt or saved["dq_ds"]
    ja.TILES[reg]["dkdv_ds"][128] = kt or saved["dkdv_ds"]
    for name in _MODES:
        getattr(ja, name)[reg] = modes.get(name, saved[name])


def _grads(fn, q, k, v, do):
    for x in (q, k, v):
        x.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(q, k, v).backward(do)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    g = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    return g, peak


def profile_launches(variants: list[str], steps: int = 10) -> None:
    """Mean device time of each launch of a fwd+bwd step (torch.profiler, in launch order) per variant, on
    the three device-bound bench batches (causal softmax)."""
    from torch.profiler import ProfilerActivity, profile

    print("\n| batch | variant | launches (device ms each, in order) | sum ms |\n|---|---|---|---|")
    for kind, b, n, act in CASES:
        if act != "softmax" or (kind, b, n) == ("heavy", 128, 1024):
            continue
        lengths, off, q, k, v = bench.batch_inputs(kind, b, n)
        reg = ja.regime(q.shape[0], b)
        saved = {kk: ja.TILES[reg][kk][128] for kk in ("dq_ds", "dkdv_ds")} | {m: getattr(ja, m)[reg] for m in _MODES}
        do = torch.randn_like(q)
        for name in variants:
            _set(reg, name, saved)
            try:
                for _ in range(3):
                    ja.jagged_attention_triton(q, k, v, off, n, activation=act).backward(do)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        ja.jagged_attention_triton(q, k, v, off, n, activation=act).backward(do)
                    torch.cuda.synchronize()
            finally:
                _set(reg, "rec", saved)
            kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                              and (e.name.startswith("_gdpa") or e.name.startswith("_bwd"))),
                             key=lambda e: e.time_range.start)
            per = len(kernels) // steps
            sums = [0.0] * per
            for i, e in enumerate(kernels[:per * steps]):
                sums[i % per] += e.time_range.elapsed_us() / steps / 1000
            cells = ", ".join(f"{e.name} {t:.3f}" for e, t in zip(kernels[:per], sums))
            print(f"| {kind} B={b} N={n} | {name} | {cells} | {sum(sums):.3f} |", flush=True)
            for x in (q, k, v):
                x.grad = None
        del q, k, v
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warm", type=int, default=-1)
    p.add_argument("--profile", default="", help="comma-separated variants: per-launch device times only")
    p.add_argument("--cases", default="", help="comma-separated indices into CASES (default: all)")
    args = p.parse_args()
    if args.profile:
        profile_launches(args.profile.split(","))
        return
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    todo = [cases[args.warm]] if 0 <= args.warm < len(cases) else ([] if args.warm >= 0 else cases)
    if args.warm < 0:
        print("| batch | act | variant | fwd+bwd ms | vs varlen | vs rec | rel diff dq / dk / dv vs rec | peak GiB |")
        print("|---|---|---|---|---|---|---|---|")
    graphs = []
    for kind, b, n, act in todo:
        lengths, off, q, k, v = bench.batch_inputs(kind, b, n)
        reg = ja.regime(q.shape[0], b)
        saved = {kk: ja.TILES[reg][kk][128] for kk in ("dq_ds", "dkdv_ds")} | {m: getattr(ja, m)[reg] for m in _MODES}
        varlen = bench.varlen_causal(off, max(lengths))

        def jfa(a, bb, c):
            return ja.jagged_attention_triton(a, bb, c, off, n, activation=act,
                                              alpha=None if act == "softmax" else 0.05)

        do = torch.randn_like(q)
        base = None
        if act == "softmax" and args.warm < 0:
            _, base = bench._time_fwd_bwd(varlen, (q, k, v))
            print(f"| {kind} B={b} N={n} | {act} | varlen | {base:.3f} | 1.00x | - | - | - |", flush=True)
        ref_g, rec_ms = None, None
        for name in VARIANTS:
            try:
                _set(reg, name, saved)
                g, peak = _grads(jfa, q, k, v, do)
                if args.warm >= 0:
                    continue
                if ref_g is None:
                    ref_g = g
                diff = " / ".join(f"{bench._rel(a, r):.1e}" for a, r in zip(g, ref_g))
                _, t_fb = bench._time_fwd_bwd(jfa, (q, k, v))
                rec_ms = rec_ms or t_fb
                vs_varlen = f"{base / t_fb:.2f}x" if base else "-"
                print(f"| {kind} B={b} N={n} | {act} | {name} | {t_fb:.3f} | {vs_varlen} | {rec_ms / t_fb:.2f}x | "
                      f"{diff} | {peak:.2f} |", flush=True)
            except Exception as e:  # one failing variant must not hide the others
                print(f"| {kind} B={b} N={n} | {act} | {name} | ERROR {e!r} |"[:300], flush=True)
            finally:
                _set(reg, "rec", saved)
        if args.warm < 0:
            for name in ("rec", "ds"):
                _set(reg, name, saved)
                try:
                    graphs.append((f"{kind} B={b} N={n} {act}", name, f"{bench._graph_ms(jfa, (q, k, v)):.3f}"))
                except Exception as e:
                    graphs.append((f"{kind} B={b} N={n} {act}", name, f"ERROR {e!r}"[:120]))
                _set(reg, "rec", saved)
            if base:
                graphs.append((f"{kind} B={b} N={n} {act}", "varlen", f"{bench._graph_ms(varlen, (q, k, v)):.3f}"))
        del q, k, v
        torch.cuda.empty_cache()
    if graphs:
        print("\n| batch | variant | graph replay ms fwd+bwd |\n|---|---|---|")
        for row in graphs:
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
