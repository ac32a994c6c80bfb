"""``gemray bench kernels``: correctness (bf16, against the references) and speed of the jagged attention
kernels and their PyTorch baselines on one CUDA device, in one run.

Batches (H=4, D=128, bf16, causal): uniform lengths B=128 N=1024 and B=64 N=4096; heavy-tailed
(log-normal, median N/16, sigma 1, clipped to [1, N]) B=128 N=1024 and B=256 N=4096.
Useful TFLOP/s counts causal pairs only: forward = 4 * H * D * sum_b L_b (L_b + 1) / 2; forward+backward
= 3.5 x forward (the backward's 5 useful matmuls; recomputation is not counted). Padded baselines get the
same useful count (their padding work is not counted). Times are medians of ``triton.testing.do_bench``.

Variants per batch: ours ``jfa`` (softmax) and ``gdpa_silu`` (HSTU silu(alpha qk)/N); baselines
``varlen`` (torch.nn.attention.varlen.varlen_attn), ``sdpa_padded`` (F.scaled_dot_product_attention on
[B, H, n, D], is_causal), ``silu_padded`` (PyTorch matmul/silu/mask/matmul on padded tensors) and
``flex`` (FlexAttention, document + causal block mask over the packed batch, torch.compile).
Then cross-attention (64 candidates per user against the heavy history) and PMA (8 seeds) against
padded SDPA with a key-padding mask, block attention (block 64) at N=4096 vs N=16384, HSTU attention with the
relative position / time bias at GEM scale (B=32, N=4096, H=4, D=256: the in-kernel bias vs the former dense
[B, n, n] bias path, ``relbias``), and the fused
norm+FP8 quantize benchmark of gemray.kernels.norm_quant when it is importable.

Correctness: for every kernel and batch, the rows of a subset of sequences (the 6 longest, 6 random,
plus the shortest) are recomputed by the float32 PyTorch reference from the same bf16 inputs and the
same output gradient; forward and dq/dk/dv relative errors are reported (bf16: expect 1e-3 .. 1e-2).

Usage: ``gemray bench kernels [--out DIR] [--skip flex,norm,...] [--quick] [--sweep] [--sweep-budget S]
[--time-limit S] [--tiles JSON] [--precompile N [--precompile-only]] [--host-profile]`` (or ``python -m
gemray.bench.kernels ...``). Writes ``DIR/bench_kernels.jsonl`` (one record per measurement, written as it is made)
and prints a table.

Kernel configuration: every timed call gets an explicit ``gemray.kernels.config.KernelConfig`` (``--tiles`` and
the sweep build one from the default; nothing global is changed). The sweep prints the chosen tiles and modes as a
``--tiles`` JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from gemray.kernels import config as kconfig
from gemray.kernels.config import DEFAULT, KernelConfig

log = logging.getLogger("gemray.bench.kernels")

H, D = 4, 128
BATCHES = [("uniform", 128, 1024), ("heavy", 128, 1024), ("uniform", 64, 4096), ("heavy", 256, 4096)]


# ---------------------------------------------------------------------------------------------- helpers


def make_lengths(kind: str, b: int, n: int, seed: int = 0) -> list[int]:
    """Sequence lengths: "uniform" -> all n; "heavy" -> log-normal, median n/16, sigma 1, in [1, n]."""
    if kind == "uniform":
        return [n] * b
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, generator=g)
    return (torch.exp(math.log(n / 16) + z)).round().clamp(1, n).long().tolist()


def offsets_of(lengths: list[int], device: str = "cuda") -> torch.Tensor:
    return torch.tensor([0] + lengths, device=device, dtype=torch.int64).cumsum(0)


def causal_flops_fwd(lengths: list[int], h: int = H, d: int = D) -> float:
    return 4.0 * h * d * sum(ln * (ln + 1) / 2 for ln in lengths)


def _bench(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Recorder:
    """Collects result records, appends each to a JSONL file at once (partial runs still leave data)."""

    def __init__(self, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "bench_kernels.jsonl"
        self.rows: list[dict] = []

    def add(self, **rec) -> dict:
        self.rows.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        msg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items())
        print(msg, flush=True)
        return rec


def _sub_batch(x: torch.Tensor, off: torch.Tensor, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.cat([torch.arange(int(off[s]), int(off[s + 1]), device=x.device) for s in seqs])
    lens = [int(off[s + 1] - off[s]) for s in seqs]
    return rows, offsets_of(lens, str(x.device))


def _subset(lengths: list[int], seed: int = 0) -> list[int]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    g = torch.Generator().manual_seed(seed)
    rand = torch.randperm(len(lengths), generator=g)[:6].tolist()
    return sorted(set(order[:6]) | set(rand) | {order[-1]})


def check_self(fn, ref_fn, q, k, v, off, lengths, seqs=None) -> dict:
    """Kernel fn(q,k,v) on the whole batch vs ref_fn on float32 copies of a subset of its sequences.

    Outputs and gradients of a sequence depend only on that sequence's rows, so the subset's rows of the
    full-batch result must match the reference on the sub-batch. Returns relative errors.
    """
    seqs = _subset(lengths) if seqs is None else seqs
    qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(qq, kk, vv)
    do = torch.randn_like(out)
    out.backward(do)
    rows, sub_off = _sub_batch(q, off, seqs)
    rq, rk, rv = (x.detach()[rows].float().requires_grad_(True) for x in (q, k, v))
    expect = ref_fn(rq, rk, rv, sub_off)
    expect.backward(do[rows].float())
    return {"err_fwd": _rel(out[rows], expect), "err_dq": _rel(qq.grad[rows], rq.grad),
            "err_dk": _rel(kk.grad[rows], rk.grad), "err_dv": _rel(vv.grad[rows], rv.grad),
            "checked_seqs": len(seqs)}


def _time_fwd_bwd(fn, inputs) -> tuple[float, float]:
    """(fwd ms, fwd+bwd ms) of fn(*inputs) with a fixed random output gradient."""
    with torch.no_grad():
        t_fwd = _bench(lambda: fn(*inputs))
    out = fn(*inputs)
    do = torch.randn_like(out)
    del out

    def step():
        fn(*inputs).backward(do)

    t_fb = _bench(step, grad_to_none=list(inputs))
    return t_fwd, t_fb


def _graph_ms(fn, inputs, backward: bool = True) -> float:
    """Device ms per fwd+bwd step (fixed random output gradient; ``backward=False``: per no-grad forward) from
    replays of one CUDA graph holding the step, timed by do_bench (median): the launches' host work and the
    gaps between them are gone, so this is the kernels' time even where the eager step is bound by the host
    (the tool library's METHOD.md: "for many small launches, capture a graph and time its replays"). Warm-up
    on a side stream, as torch.cuda.graph asks; the captured backward writes each input's .grad (set to None
    before the capture)."""
    with torch.no_grad():
        do = torch.randn_like(fn(*inputs))

    def step():
        if backward:
            fn(*inputs).backward(do)
        else:
            with torch.no_grad():
                fn(*inputs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for x in inputs:
                x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in inputs:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    try:
        return _bench(graph.replay)
    finally:
        del graph
        for x in inputs:
            x.grad = None


def _graph_record(fn, inputs) -> dict:
    """{"graph_ms_fwd_bwd": ms} or, when the step cannot be captured, {"graph_error": why} (the eager
    figures stand on their own)."""
    try:
        return {"graph_ms_fwd_bwd": _graph_ms(fn, inputs)}
    except Exception as e:  # e.g. an op that syncs with the host cannot be captured
        torch.cuda.synchronize()
        return {"graph_error": repr(e)[:200]}


def _host_ms(fn, inputs, n: int = 20) -> float:
    """CPU time (ms) to enqueue one fwd+bwd step (no sync inside the loop): if it is close to the
    measured device time, the step is bound by host work (launch and autograd overhead), not the GPU."""
    out = fn(*inputs)
    do = torch.randn_like(out)
    del out
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*inputs).backward(do)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    for x in inputs:
        x.grad = None
    return (t1 - t0) / n * 1e3


def _host_ms_fwd(fn, inputs, n: int = 50) -> float:
    """CPU time (ms) to enqueue one forward without autograd (Python + launch overhead of the forward)."""
    with torch.no_grad():
        fn(*inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*inputs)
        t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e3


def launch_overhead(n: int = 300) -> dict:
    """Host microseconds per launch of a tiny Triton kernel (jagged_attention._bwd_delta, 5 runtime args +
    2 constexprs) and per tiny torch op, no sync in the loop: the floor under a host-bound step's time."""
    from gemray.kernels import jagged_attention as ja

    o = torch.randn(64, 1, 16, device="cuda")
    delta = torch.empty(1, 64, device="cuda")  # [H, T]

    def launch():
        ja._bwd_delta[(1, 1)](o, o, delta, 64, o.stride(0), o.stride(1), o.stride(0), o.stride(1),
                              delta.stride(0), 16, BLOCK_T=64, BLOCK_DV=16, num_warps=4)

    out = {}
    for name, fn in (("triton_launch_us", launch), ("torch_empty_like_us", lambda: torch.empty_like(o))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
    return out


def host_profile(activation: str = "softmax", kind: str = "heavy", b: int = 128, n: int = 1024,
                 device: str = "cpu", n_iter: int = 100, reps: int = 7, config: KernelConfig | None = None,
                 hopper: bool = False) -> dict:
    """Host cost of one jagged_attention_triton fwd+bwd with every Triton launch replaced by a stub that only
    counts it (runs on the CPU, no GPU or interpreter needed): Triton launches and aten ops per fwd+bwd
    (grads set to None each step, as do_bench does) and per no-grad forward, and the best-of-``reps``
    microseconds of the Python/torch work around the launches (fwd+bwd and forward alone), including the
    launch plan's lookup and the direct launches' own Python (jagged_attention._Launch; with the config's
    direct_launch off the JIT's own binding is not counted). The launcher's own host cost (one tiny launch:
    ``launch_overhead``) comes on top on the device. The calls are planned as on a GPU (the interpreter's
    tiles are not used even under TRITON_INTERPRET=1); ``hopper``: as on an sm_90 device (TMA loads and the
    DS_STORE backward where ``config`` enables them). Also reports ``python_us_fwd_bwd_op``: the same fwd+bwd
    through the custom ops (torch.ops.gemray.gdpa_fwd / gdpa_bwd), as torch.compile's graphs call them."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from gemray.kernels import jagged_attention as ja

    class _Ops(TorchDispatchMode):
        observes_eager_path = True  # counts the eager path's aten ops: the attention calls must not take the ops

        def __init__(self):
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func).replace("aten.", "")] += 1
            return func(*args, **(kwargs or {}))

    launches: Counter = Counter()

    class _Compiled:  # what a JIT launch returns; its run() is the direct launch (ja._Launch)
        def __init__(self, name):
            self.name, self.function, self.packed_metadata = name, None, None

        def run(self, *args):
            launches[self.name] += 1
            launches["(direct)"] += 1

    class _Param:
        def __init__(self, p: inspect.Parameter):
            self.name, self.is_constexpr = p.name, "constexpr" in str(p.annotation)

    class _Stub:  # a kernel: signature of the real one (JITFunction.params), launches only counted
        def __init__(self, name, real):
            fn = getattr(real, "fn", real)  # the Python function (a JITFunction or the interpreter's wrapper)
            self.name, self.params = name, [_Param(p) for p in inspect.signature(fn).parameters.values()]

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                name = self.name + (f" part {kwargs['PART']}" if "PART" in kwargs else "")
                launches[name] += 1
                return _Compiled(name)
            return run

    cfg = kconfig.resolve(config)
    names = ("_gdpa_fwd", "_gdpa_bwd", "_bwd_delta", "_gdpa_dq_ds", "_gdpa_dk_ds")
    saved = {k: getattr(ja, k) for k in names + ("_current_device", "_raw_stream", "_INTERPRET", "_tma_device")}
    try:
        for k in names:
            setattr(ja, k, _Stub(k, saved[k]))
        ja._current_device, ja._raw_stream = (lambda: 0), (lambda device: 0)
        ja._INTERPRET, ja._tma_device = False, (lambda device: hopper)
        if hopper:
            import triton

            saved_alloc = triton.set_allocator
            triton.set_allocator = lambda fn: None  # no CUDA allocator to set on the CPU
        torch.manual_seed(0)
        off = offsets_of(make_lengths(kind, b, n), device)
        t = int(off[-1])
        q, k, v = (torch.randn(t, H, D, device=device).requires_grad_(True) for _ in range(3))

        def fwd():
            return ja.jagged_attention_triton(q, k, v, off, n, activation=activation, config=cfg)

        do = torch.randn_like(fwd())

        def step():
            fwd().backward(do)
            q.grad = k.grad = v.grad = None

        for _ in range(3):
            step()
        launches.clear()
        with _Ops() as ops_fb:
            step()
        n_launch = dict(launches)
        with torch.no_grad(), _Ops() as ops_f:
            fwd()

        def best_us(fn) -> float:
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(n_iter):
                    fn()
                out.append((time.perf_counter() - t0) / n_iter * 1e6)
            return min(out)

        us_fb = best_us(step)
        with torch.no_grad():
            us_f = best_us(fwd)
        alpha = 1.0 / math.sqrt(D) if activation == "softmax" else 1.0

        def op_step():  # the same call through the custom ops (what a compiled graph runs)
            out, _ = ja.gdpa_fwd_op(q, k, v, off, off, None, None, n, n, activation, True, alpha,
                                    1.0 / max(n, 1), 0, 0, False, 0, cfg.name)
            out.backward(do)
            q.grad = k.grad = v.grad = None

        us_op = best_us(op_step)
    finally:
        for k_, fn in saved.items():
            setattr(ja, k_, fn)
        if hopper:
            triton.set_allocator = saved_alloc
        ja._LAUNCHERS.clear()
        ja._NO_DIRECT.clear()
    direct = n_launch.pop("(direct)", 0)
    return dict(activation=activation, batch=f"{kind} B={b} N={n}", config=cfg.name, launches=sum(n_launch.values()),
                direct_launches=direct,
                launch_kinds=n_launch, aten_ops=sum(ops_fb.ops.values()), aten_op_kinds=dict(ops_fb.ops),
                aten_ops_fwd=sum(ops_f.ops.values()), python_us_fwd_bwd=us_fb, python_us_fwd=us_f,
                python_us_fwd_bwd_op=us_op)


def _pad(x: torch.Tensor, off: torch.Tensor, n: int) -> torch.Tensor:
    """[T, H, D] -> [B, H, n, D] zero-padded (baselines only)."""
    from gemray.jagged import jagged_to_padded

    return jagged_to_padded(x, off, n).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------- sections


def bench_self(rec: Recorder, skip: set[str], quick: bool, config: KernelConfig = DEFAULT) -> None:
    from gemray.kernels import reference as ref
    from gemray.kernels.jagged_attention import jagged_attention_triton

    batches = BATCHES[:2] if quick else BATCHES
    for kind, b, n in batches:
        torch.manual_seed(0)
        lengths = make_lengths(kind, b, n)
        off = offsets_of(lengths)
        t = int(off[-1])
        nmax = max(lengths)
        flops = causal_flops_fwd(lengths)
        tag = f"{kind} B={b} N={n}"
        log.info("batch %s: T=%d, longest %d, padded fill %.1f%%", tag, t, nmax, 100.0 * t / (b * nmax))
        q, k, v = (torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
                   for _ in range(3))
        alpha_silu = 1.0 / math.sqrt(D)

        ours = {
            "jfa": (lambda a, bb, c: jagged_attention_triton(a, bb, c, off, n, activation="softmax", config=config),
                    lambda a, bb, c, o: ref.jagged_attention_ref(a, bb, c, o, n, activation="softmax")),
            "gdpa_silu": (lambda a, bb, c: jagged_attention_triton(a, bb, c, off, n, activation="silu",
                                                                   alpha=alpha_silu, config=config),
                          lambda a, bb, c, o: ref.jagged_attention_ref(a, bb, c, o, n, activation="silu",
                                                                       alpha=alpha_silu)),
        }
        for name, (fn, ref_fn) in ours.items():
            try:
                errs = check_self(fn, ref_fn, q, k, v, off, lengths)
                t_f, t_fb = _time_fwd_bwd(fn, (q, k, v))
                rec.add(section="self", batch=tag, variant=name, ms_fwd=t_f, ms_fwd_bwd=t_fb,
                        tflops_fwd=flops / t_f / 1e9, tflops_fwd_bwd=3.5 * flops / t_fb / 1e9,
                        host_ms_fwd_bwd=_host_ms(fn, (q, k, v)), host_ms_fwd=_host_ms_fwd(fn, (q, k, v)),
                        **_graph_record(fn, (q, k, v)), **errs)
            except Exception as e:  # a failing variant must not hide the others
                rec.add(section="self", batch=tag, variant=name, error=repr(e)[:300])
                traceback.print_exc()
        # the silu kernels with the exact sigmoid (exp2 + division, two MUFU ops per score) for comparison,
        # on the batch of the silu bar only (each batch would compile two more kernels)
        if tag == SILU_FWD_TARGET[0]:
            exact = config.replace(fast_act=False)
            try:
                def fn(a, bb, c):
                    return jagged_attention_triton(a, bb, c, off, n, activation="silu", alpha=alpha_silu,
                                                   config=exact)
                t_f, t_fb = _time_fwd_bwd(fn, (q, k, v))
                rec.add(section="self", batch=tag, variant="gdpa_silu_exact_sigmoid", ms_fwd=t_f,
                        ms_fwd_bwd=t_fb, tflops_fwd=flops / t_f / 1e9, tflops_fwd_bwd=3.5 * flops / t_fb / 1e9)
            except Exception as e:
                rec.add(section="self", batch=tag, variant="gdpa_silu_exact_sigmoid", error=repr(e)[:300])
                traceback.print_exc()

        baselines = {}
        if "varlen" not in skip:
            baselines["varlen"] = varlen_causal(off, nmax)
        if "sdpa" not in skip:
            baselines["sdpa_padded"] = "padded"
        if "silu_padded" not in skip:
            baselines["silu_padded"] = "padded"
        for name, fn in baselines.items():
            try:
                if fn == "padded":
                    pq, pk, pv = (_pad(x.detach(), off, nmax).requires_grad_(True) for x in (q, k, v))
                    if name == "sdpa_padded":
                        def f(a, bb, c):
                            return F.scaled_dot_product_attention(a, bb, c, is_causal=True)
                    else:
                        mask = torch.ones(nmax, nmax, device="cuda", dtype=torch.bool).tril()

                        def f(a, bb, c, mask=mask):
                            s = torch.matmul(a, bb.transpose(-1, -2)) * alpha_silu
                            return torch.matmul((F.silu(s) / n) * mask, c)
                    t_f, t_fb = _time_fwd_bwd(f, (pq, pk, pv))
                    extra = {}
                    del pq, pk, pv
                else:
                    if name == "varlen":  # cross-check our softmax kernel against FlashAttention's
                        with torch.no_grad():
                            ours_out = jagged_attention_triton(q, k, v, off, n, activation="softmax",
                                                               config=config)
                            rec.add(section="self", batch=tag, variant="jfa_vs_varlen_out",
                                    rel_diff=_rel(ours_out, fn(q, k, v)))
                    t_f, t_fb = _time_fwd_bwd(fn, (q, k, v))
                    extra = {"host_ms_fwd_bwd": _host_ms(fn, (q, k, v)), **_graph_record(fn, (q, k, v))}
                rec.add(section="self", batch=tag, variant=name, ms_fwd=t_f, ms_fwd_bwd=t_fb,
                        tflops_fwd=flops / t_f / 1e9, tflops_fwd_bwd=3.5 * flops / t_fb / 1e9, **extra)
            except torch.OutOfMemoryError as e:
                rec.add(section="self", batch=tag, variant=name, error="OOM " + str(e)[:120])
            except Exception as e:
                rec.add(section="self", batch=tag, variant=name, error=repr(e)[:300])
                traceback.print_exc()
            torch.cuda.empty_cache()


def bench_flex(rec: Recorder, quick: bool, deadline: float = float("inf")) -> None:
    """FlexAttention baseline, run last: its torch.compile per batch shape is the slowest step (a batch is
    skipped when fewer than 30 s are left before ``deadline``, a time.time() value)."""
    batches = BATCHES[:2] if quick else BATCHES
    for kind, b, n in batches:
        if time.time() + 30 > deadline:
            rec.add(section="self", batch=f"{kind} B={b} N={n}", variant="flex", error="skipped: time limit")
            continue
        torch.manual_seed(0)
        lengths = make_lengths(kind, b, n)
        off = offsets_of(lengths)
        t = int(off[-1])
        flops = causal_flops_fwd(lengths)
        tag = f"{kind} B={b} N={n}"
        q, k, v = (torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
                   for _ in range(3))
        try:
            t_f, t_fb = _flex_times(q, k, v, off, t)
            rec.add(section="self", batch=tag, variant="flex", ms_fwd=t_f, ms_fwd_bwd=t_fb,
                    tflops_fwd=flops / t_f / 1e9, tflops_fwd_bwd=3.5 * flops / t_fb / 1e9)
        except Exception as e:
            rec.add(section="self", batch=tag, variant="flex", error=repr(e)[:300])
            traceback.print_exc()
        torch.cuda.empty_cache()


def _flex_times(q, k, v, off, t) -> tuple[float, float]:
    from gemray.jagged import segment_ids
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = segment_ids(off)

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    bm = create_block_mask(mask_mod, 1, None, t, t, device="cuda", _compile=True)  # no T x T tensor
    flex = torch.compile(flex_attention, dynamic=False)

    def f(a, bb, c):
        return flex(a.transpose(0, 1).unsqueeze(0), bb.transpose(0, 1).unsqueeze(0),
                    c.transpose(0, 1).unsqueeze(0), block_mask=bm)

    fq, fk, fv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    return _time_fwd_bwd(f, (fq, fk, fv))


def bench_cross_pma(rec: Recorder, skip: set[str], config: KernelConfig = DEFAULT) -> None:
    from gemray.kernels import reference as ref
    from gemray.kernels.jagged_attention import jagged_cross_attention_triton, pma_triton

    torch.manual_seed(1)
    b, n, mq, s = 256, 4096, 64, 8
    lengths = make_lengths("heavy", b, n, seed=1)
    ko = offsets_of(lengths)
    qo = offsets_of([mq] * b)
    tk, nmax = int(ko[-1]), max(lengths)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(tk, H, D, **bf).requires_grad_(True) for _ in range(2))
    q = torch.randn(b * mq, H, D, **bf).requires_grad_(True)
    seeds = torch.randn(s, H, D, **bf).requires_grad_(True)
    pk, pv = (_pad(x.detach(), ko, nmax).requires_grad_(True) for x in (k, v))
    keymask = (torch.arange(nmax, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None])
    keymask = keymask[:, None, None, :]  # [B, 1, 1, n]
    pairs_cross = 4.0 * H * D * mq * sum(lengths)
    pairs_pma = 4.0 * H * D * s * sum(lengths)
    tag = f"heavy B={b} N={n}"

    # correctness on a subset of users (rows of a user depend only on that user)
    seqs = _subset(lengths)
    for act in ("softmax", "silu"):
        try:
            qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            out = jagged_cross_attention_triton(qq, qo, kk, vv, ko, mq, n, activation=act, config=config)
            do = torch.randn_like(out)
            out.backward(do)
            qrows, sub_qo = _sub_batch(q, qo, seqs)
            krows, sub_ko = _sub_batch(k, ko, seqs)
            rq = q.detach()[qrows].float().requires_grad_(True)
            rk, rv = (x.detach()[krows].float().requires_grad_(True) for x in (k, v))
            e = ref.jagged_cross_attention_ref(rq, sub_qo, rk, rv, sub_ko, mq, n, activation=act)
            e.backward(do[qrows].float())
            errs = dict(err_fwd=_rel(out[qrows], e), err_dq=_rel(qq.grad[qrows], rq.grad),
                        err_dk=_rel(kk.grad[krows], rk.grad), err_dv=_rel(vv.grad[krows], rv.grad))

            ss = seeds.detach().clone().requires_grad_(True)
            kk, vv = (x.detach().clone().requires_grad_(True) for x in (k, v))
            out = pma_triton(ss, kk, vv, ko, n, activation=act, config=config)
            do = torch.randn_like(out)
            # reference: all users' seeds-gradient contributions, so use the full batch in chunks of users
            out.backward(do)
            rs = seeds.detach().float().requires_grad_(True)
            rk, rv = (x.detach()[krows].float().requires_grad_(True) for x in (k, v))
            e = ref.pma_ref(rs, rk, rv, sub_ko, n, activation=act)
            e.backward(do[seqs].float())
            errs_p = dict(err_fwd=_rel(out[seqs], e), err_dk=_rel(kk.grad[krows], rk.grad),
                          err_dv=_rel(vv.grad[krows], rv.grad))
            # dseeds sums over all users: check it against the reference on the whole batch, chunked
            ds_ref = torch.zeros_like(rs)
            for c0 in range(0, b, 32):
                cs = list(range(c0, min(b, c0 + 32)))
                crow, c_off = _sub_batch(k, ko, cs)
                rs2 = seeds.detach().float().requires_grad_(True)
                e2 = ref.pma_ref(rs2, k.detach()[crow].float(), v.detach()[crow].float(), c_off, n,
                                 activation=act)
                e2.backward(do[cs].float())
                ds_ref += rs2.grad
            errs_p["err_dseeds"] = _rel(ss.grad, ds_ref)
            rec.add(section="cross", batch=tag, variant=f"check_cross_{act}", **errs)
            rec.add(section="pma", batch=tag, variant=f"check_pma_{act}", **errs_p)
        except Exception as e:
            rec.add(section="cross", batch=tag, variant=f"check_{act}", error=repr(e)[:300])
            traceback.print_exc()

    runs = {
        ("cross", "ours_softmax"): (lambda a, bb, c: jagged_cross_attention_triton(a, qo, bb, c, ko, mq, n,
                                                                                   activation="softmax",
                                                                                   config=config),
                                    (q, k, v), pairs_cross),
        ("cross", "ours_silu"): (lambda a, bb, c: jagged_cross_attention_triton(a, qo, bb, c, ko, mq, n,
                                                                                activation="silu", config=config),
                                 (q, k, v), pairs_cross),
        ("cross", "sdpa_padded"): (lambda a, bb, c: F.scaled_dot_product_attention(
            a, bb, c, attn_mask=keymask), (q.detach().view(b, mq, H, D).transpose(1, 2).contiguous()
                                           .requires_grad_(True), pk, pv), pairs_cross),
        ("pma", "ours_softmax"): (lambda a, bb, c: pma_triton(a, bb, c, ko, n, activation="softmax",
                                                              config=config),
                                  (seeds, k, v), pairs_pma),
        ("pma", "ours_silu"): (lambda a, bb, c: pma_triton(a, bb, c, ko, n, activation="silu", config=config),
                               (seeds, k, v), pairs_pma),
        ("pma", "sdpa_padded"): (lambda a, bb, c: F.scaled_dot_product_attention(
            a.transpose(0, 1).unsqueeze(0).expand(b, -1, -1, -1), bb, c, attn_mask=keymask),
            (seeds, pk, pv), pairs_pma),
    }
    for (section, name), (fn, inputs, flops) in runs.items():
        try:
            t_f, t_fb = _time_fwd_bwd(fn, inputs)
            rec.add(section=section, batch=tag, variant=name, ms_fwd=t_f, ms_fwd_bwd=t_fb,
                    tflops_fwd=flops / t_f / 1e9, tflops_fwd_bwd=3.5 * flops / t_fb / 1e9)
        except Exception as e:
            rec.add(section=section, batch=tag, variant=name, error=repr(e)[:300])
            traceback.print_exc()


def bench_block(rec: Recorder, config: KernelConfig = DEFAULT) -> None:
    from gemray.kernels import reference as ref
    from gemray.kernels.jagged_attention import jagged_block_attention_triton

    b, bs = 64, 64
    for n in (4096, 16384):
        torch.manual_seed(2)
        lengths = [n] * b
        off = offsets_of(lengths)
        t = int(off[-1])
        q, k, v = (torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
                   for _ in range(3))
        useful = 4.0 * H * D * b * (n // bs) * bs * (bs + 1) / 2
        for act in ("softmax", "silu"):
            tag = f"uniform B={b} N={n} block={bs}"
            fn = (lambda a, bb, c, act=act: jagged_block_attention_triton(a, bb, c, off, n, block_size=bs,
                                                                          activation=act, config=config))
            try:
                errs = {}
                if n == 4096:
                    errs = check_self(fn, lambda a, bb, c, o, act=act: ref.jagged_block_attention_ref(
                        a, bb, c, o, n, block_size=bs, activation=act), q, k, v, off, lengths, seqs=[0, 5])
                t_f, t_fb = _time_fwd_bwd(fn, (q, k, v))
                rec.add(section="block", batch=tag, variant=f"ours_{act}", n=n, ms_fwd=t_f, ms_fwd_bwd=t_fb,
                        tflops_fwd=useful / t_f / 1e9, tflops_fwd_bwd=3.5 * useful / t_fb / 1e9, **errs)
            except Exception as e:
                rec.add(section="block", batch=tag, variant=f"ours_{act}", error=repr(e)[:300])
                traceback.print_exc()


REL_BIAS_SHAPE = dict(b=32, n=4096, h=4, d=256, n_pos=128, n_time=128)  # GEM scale (NVIDIA's HSTU recipe)


def rel_bias_inputs(kind: str, b: int, n: int, h: int, d: int, n_pos: int, n_time: int, seed: int = 0,
                    lengths: list[int] | None = None):
    """A bench batch with the HSTU relative bias ingredients: (lengths, offsets, q, k, v [T, H, D] bf16, timestamps
    [T] int64 (1 s .. ~100 days apart), next-item query times [T] int64, pos_w [P], ts_w [NT] fp32), grads on.
    ``lengths``: the sequence lengths (default: ``make_lengths(kind, b, n, seed)``)."""
    from gemray.jagged import query_timestamps

    lengths = make_lengths(kind, b, n, seed) if lengths is None else list(lengths)
    off = offsets_of(lengths)
    t = int(off[-1])
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))
    gaps = torch.exp(torch.rand(t, device="cuda", generator=g) * 16).long()
    ts = 1_700_000_000 + torch.cumsum(gaps, 0)
    tq = query_timestamps(ts, off)
    pos_w = (torch.randn(n_pos, device="cuda", generator=g) * 0.1).requires_grad_(True)
    ts_w = (torch.randn(n_time, device="cuda", generator=g) * 0.1).requires_grad_(True)
    return lengths, off, q, k, v, ts, tq, pos_w, ts_w


def _peak_mib(fn, inputs) -> float:
    """Peak CUDA memory (MiB) above the inputs during one fwd+bwd of fn(*inputs)."""
    out = fn(*inputs)
    do = torch.randn_like(out)
    del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*inputs).backward(do)
    torch.cuda.synchronize()
    for x in inputs:
        x.grad = None
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_rel_bias(rec: Recorder, config: KernelConfig = DEFAULT, shape: dict | None = None) -> None:
    """HSTU attention with the relative position / time bias at GEM scale (B=32, max 4096, H=4, D=256; uniform
    and heavy-tailed lengths; silu and softmax): ``inkernel`` (gemray.ops.attention's Triton path: the kernels
    bucketise per tile, issue 17) vs ``dense`` (the former path: rel_bias.dense(offsets, n) [B, n, n] fp32 built
    per call, fed as attn_bias) vs ``nobias``. fwd / fwd+bwd ms, useful TFLOP/s (causal pairs), peak MiB of a
    fwd+bwd, and the in-kernel path's errors against the dense one (forward, dq, d pos_w, d ts_w)."""
    from gemray import ops
    from gemray.kernels.jagged_attention import jagged_attention_triton

    sh = dict(REL_BIAS_SHAPE, **(shape or {}))
    b, n, h, d = sh["b"], sh["n"], sh["h"], sh["d"]
    for kind in ("heavy", "uniform"):
        lengths, off, q, k, v, ts, tq, pos_w, ts_w = rel_bias_inputs(kind, b, n, h, d, sh["n_pos"], sh["n_time"])
        useful = causal_flops_fwd(lengths, h, d)
        tag = f"{kind} B={b} N={n} H={h} D={d}"
        for act in ("silu", "softmax"):
            def inkernel(a, bb, c, pw, tw, act=act):
                rel = ops.RelativeBiasInputs(ts, pw, tw, n, query_timestamps=tq)
                return ops.attention(a, bb, c, off, n, activation=act, rel_bias=rel, backend="triton", config=config)

            def dense(a, bb, c, pw, tw, act=act):
                rel = ops.RelativeBiasInputs(ts, pw, tw, n, query_timestamps=tq)
                bias = rel.dense(off, max(lengths))
                return jagged_attention_triton(a, bb, c, off, n, activation=act, attn_bias=bias, config=config)

            def nobias(a, bb, c, pw, tw, act=act):
                return jagged_attention_triton(a, bb, c, off, n, activation=act, config=config)

            inputs = (q, k, v, pos_w, ts_w)
            errs: dict = {}
            try:  # the in-kernel path against the dense one (the dense path is checked against the reference)
                outs = []
                for fn in (inkernel, dense):
                    o = fn(*inputs)
                    gd = torch.autograd.grad(o, (q, pos_w, ts_w), torch.ones_like(o) * 1e-2)
                    outs.append((o, *gd))
                errs = {f"err_{nm}": _rel(a, bb) for nm, a, bb in zip(("fwd", "dq", "dpos_w", "dts_w"), *outs)}
                del outs
            except Exception as e:
                errs = {"check_error": repr(e)[:300]}
                traceback.print_exc()
            for name, fn in (("inkernel", inkernel), ("dense", dense), ("nobias", nobias)):
                variant = f"relbias_{name}_{act}"
                try:
                    t_f, t_fb = _time_fwd_bwd(fn, inputs)
                    peak = _peak_mib(fn, inputs)
                    rec.add(section="relbias", batch=tag, variant=variant, n=n, ms_fwd=t_f, ms_fwd_bwd=t_fb,
                            tflops_fwd=useful / t_f / 1e9, tflops_fwd_bwd=3.5 * useful / t_fb / 1e9,
                            peak_mib_fwd_bwd=peak, **(errs if name == "inkernel" else {}))
                except Exception as e:
                    rec.add(section="relbias", batch=tag, variant=variant, error=repr(e)[:300])
                    traceback.print_exc()
                torch.cuda.empty_cache()


def bench_norm(rec: Recorder) -> None:
    try:
        from gemray.bench.norm_quant import bench_norm_quant
    except ImportError as e:
        rec.add(section="norm_quant", error=f"not importable: {e!r}"[:300])
        return
    try:
        for row in bench_norm_quant():
            rec.add(section="norm_quant", **{k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                                             for k, v in row.items()})
    except Exception as e:
        rec.add(section="norm_quant", error=repr(e)[:300])
        traceback.print_exc()


# Backward candidates shared by medium / long / xlong (run 6; why each, in the comment above "medium"). Run 7
# keeps run 6's winners and runners-up within 3% (the others lost by 2-10%) and times them with and without
# TMA loads: dK/dV 64x128/8w/2 (default), 64x128/8w/3 (long / xlong), 64x64/4w/2 (medium); dQ 128x64/8w/3
# (won everywhere), 64x64/4w/2 (two CTAs per SM: the TMA path may change the balance).
_DKDV_RUN6 = ((64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2))
_DQ_RUN6 = ((128, 64, 8, 3), (64, 64, 4, 2))
# DS_STORE backward (runs 19-24, an A/B script git keeps): dK/dV with the dS store, 64x64/4w/2 (medium / long) and
# 64x128/8w/3 (xlong; with 2 stages the store's wait showed: +1.2 ms on uniform B=64 N=4096); dQ = dS K, 64x64/4w/3
# (medium / long) and 256x64/8w/2 (xlong: each K tile read serves more dS rows), 128x64/4w/3 within 1% of both.
_DKDV_DS = ((64, 64, 4, 2), (64, 128, 8, 3), (64, 128, 8, 2))
_DQ_DS = ((64, 64, 4, 3), (256, 64, 8, 2), (128, 64, 4, 3))
# dK = dS^T Q (dk_from_ds, off in every regime): listed for the compile checks (sass_check --all), not timed by this
# D = 128 sweep (KERNELS), whose launch modes do not include it; benchmarks/attn_sweep_d256.py sweeps it at D = 256
_DK_DS = ((64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2))

SWEEP = {  # regime -> kernel -> candidate (BLOCK_M, BLOCK_N, num_warps, num_stages); the default goes first
    # From sm_90 compiles (the kernel run reports (benchmarks/reports/kernels_h200_*.md), run 4 plan; without divisibility hints, so spills are overstated):
    # 64x64 / 8 warps dK/dV and dQ keep their loops free of spill stores; BLOCK_M 32 gets no wgmma.
    "short": {
        "fwd": [(64, 64, 4, 3), (32, 64, 4, 3), (64, 32, 4, 3)],
        "fwd_silu": [(64, 64, 4, 3), (32, 64, 4, 3)],
        "dkdv": [(64, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2)],
        "dkdv_ds": list(_DKDV_DS),
        "dq_ds": list(_DQ_DS),
        "dk_ds": list(_DK_DS),
        "dq": [(64, 64, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
    },
    # Run 6 (sm_90 SASS from sass_check, now with the JIT's divisibility hints): dK/dV with 32-query steps under
    # 128-key tiles (the Triton fused-attention tutorial's BLOCK_M1 / BLOCK_N1 = 32 / 128, with 8 warps: 234
    # registers, no stack; with 4 warps the two 128x128 fp32 accumulators spill ~100 STL + ~150 LDL per step)
    # and 64x128 with 3 stages (0 STL / 0 LDL, 165 KB shared memory; 2 stages: 1-2 LDL per step); dQ with
    # 32-key steps under 128-query tiles (tutorial BLOCK_M2 / BLOCK_N2 = 128 / 32, 8 warps: 180 registers, no
    # spills; 4 warps spill 3-6 STL / 15-28 LDL per step); and 64x64 / 4 warps / 2 stages for both (~99 KB
    # shared memory, 253-255 registers x 128 threads: two CTAs fit one SM, so one CTA's matmuls can overlap the
    # other's softmax; every other candidate runs one CTA per SM; dQ 64x32/4w/2: 167 registers, 66 KB, three
    # CTAs per SM). Run 5's clear losers (dK/dV 64x64/8w: +38-54%, dQ 64x64/8w: +20-27%, dQ 128x128/8w: +4-6%)
    # are dropped from medium / long / xlong. xlong also tries the forward 64x64/4w/3 (won medium and long; 115 KB
    # shared memory: two CTAs per SM, where 128x128/8w/3 needs 229 KB).
    "medium": {
        "fwd": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)],
        "fwd_silu": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3)],
        "dkdv": list(_DKDV_RUN6),
        "dkdv_ds": list(_DKDV_DS),
        "dq_ds": list(_DQ_DS),
        "dk_ds": list(_DK_DS),
        "dq": list(_DQ_RUN6),
    },
    "long": {
        "fwd": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
        "fwd_silu": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
        "dkdv": list(_DKDV_RUN6),
        "dkdv_ds": list(_DKDV_DS),
        "dq_ds": list(_DQ_DS),
        "dk_ds": list(_DK_DS),
        "dq": list(_DQ_RUN6),
    },
    "xlong": {
        "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
        "fwd_silu": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
        "dkdv": list(_DKDV_RUN6),
        "dkdv_ds": list(_DKDV_DS),
        "dq_ds": list(_DQ_DS),
        "dk_ds": list(_DK_DS),
        "dq": list(_DQ_RUN6),
    },
}
# Launch modes (heads inner, TMA loads, dS stored) tried per regime; the regime's current mode is tried first.
# Run 6: heads inner won only "short" (-10%). Runs 7-8: TMA tile loads (forward and both backward launches) won only
# xlong (-2.5%, -1.3%; its default). Runs 19-24: the DS_STORE backward (dS^T stored by the dK/dV launch, dQ = dS K)
# won medium / long / xlong (-3 to -8%), lost short (+8% device time). The modes that lost everywhere (one-launch
# backward, inline delta, atomic dQ, query-rows-first dK/dV; runs 4-8) were deleted with their kernels.
_F = False
MODE_FIELDS = ("heads_inner", "tma_loads", "ds_store")  # the modes this sweep varies (kconfig's has dk_from_ds too)
BWD_MODES = [(_F, _F, _F), (_F, True, _F), (True, _F, _F), (True, True, _F), (_F, _F, True), (_F, True, True)]
# the launch-mode lists that runs 4-41 printed: [one launch, delta inline, atomic dQ, heads inner, TMA loads,
# query-rows dK/dV, dS stored] (2 to 7 entries, the missing ones off); entries 0, 1, 2, 5 name deleted modes
_LEGACY_MODE = ("one launch", "delta inline", "atomic dQ", "heads_inner", "tma_loads", "query-rows dK/dV", "ds_store")
_DELETED_KINDS = ("dkdv_atomic", "dkdv_qrows")  # tile kinds of deleted modes, ignored in a --tiles JSON


def get_mode(config: KernelConfig, which: str) -> tuple[bool, bool, bool]:
    """(heads inner, TMA loads, dS stored) of regime ``which`` in ``config``."""
    rc = config.regime(which)
    return (rc.heads_inner, rc.tma_loads, rc.ds_store)


def parse_mode(mode) -> tuple[bool, bool, bool]:
    """A launch mode from a --tiles JSON: {"heads_inner": b, "tma_loads": b, "ds_store": b} (missing keys off) or a
    list in the order runs 4-41 printed (see _LEGACY_MODE). Raises ValueError for a deleted mode switched on or an
    unknown key."""
    if isinstance(mode, dict):
        unknown = set(mode) - set(kconfig.MODE_FIELDS)
        if unknown:
            raise ValueError(f"unknown launch mode {sorted(unknown)} (modes: {kconfig.MODE_FIELDS})")
        return tuple(bool(mode.get(f, False)) for f in MODE_FIELDS)
    flags = [bool(m) for m in mode]
    if not 2 <= len(flags) <= len(_LEGACY_MODE):
        raise ValueError(f"a launch-mode list has 2-{len(_LEGACY_MODE)} entries, got {len(flags)}")
    flags += [False] * (len(_LEGACY_MODE) - len(flags))
    on = [_LEGACY_MODE[i] for i in (0, 1, 2, 5) if flags[i]]
    if on:
        raise ValueError(f"launch mode {on} was deleted (it lost in every regime: the kernel run reports (benchmarks/reports/kernels_h200_*.md) runs 4-11)")
    return (flags[3], flags[4], flags[6])


def set_mode(config: KernelConfig, which: str, mode) -> KernelConfig:
    """``config`` with regime ``which``'s launch mode set from (heads inner, TMA loads, dS stored) or anything
    :func:`parse_mode` reads."""
    inner, tma, ds = parse_mode(mode) if not (isinstance(mode, tuple) and len(mode) == 3) else mode
    return config.with_regime(which, heads_inner=bool(inner), tma_loads=bool(tma), ds_store=bool(ds))


def apply_tiles(tiles_json: str, config: KernelConfig = DEFAULT) -> KernelConfig:
    """``config`` with the tiles and launch modes of the "chosen tiles" JSON a bench run prints
    (``gemray.kernels.config.apply_tiles``'s format; ``--tiles``). Also read: the launch-mode lists and the tile
    kinds of deleted modes ("dkdv_atomic", "dkdv_qrows") that runs 5-41 printed (skipped with a log line).
    Raises json.JSONDecodeError / KeyError / ValueError for malformed JSON, an unknown regime or tile kind, a
    deleted mode switched on."""
    spec = json.loads(tiles_json)
    for which, kinds in spec.items():
        if which not in kconfig.REGIMES:
            raise KeyError(f"unknown regime {which!r} (one of {list(kconfig.REGIMES)})")
        for kind in [k for k in kinds if k in _DELETED_KINDS]:
            log.info("--tiles: %s %s skipped (its launch mode was deleted)", which, kind)
            del kinds[kind]
        if "mode" in kinds and not isinstance(kinds["mode"], dict):  # a dict is kconfig.apply_tiles' own format
            kinds["mode"] = dict(zip(MODE_FIELDS, parse_mode(kinds["mode"])))
    return kconfig.apply_tiles(spec, config)


def tiles_json(config: KernelConfig) -> str:
    """The D=128 tiles and launch modes of every regime of ``config`` as the JSON ``--tiles`` reads."""
    out = {}
    for r in kconfig.REGIMES:
        rc = config.regime(r)
        out[r] = {k: {"128": list(rc.tiles.get(k, 128))} for k in kconfig.TILE_KINDS}
        out[r]["mode"] = dict(zip(MODE_FIELDS, get_mode(config, r)), dk_from_ds=rc.dk_from_ds)
    return json.dumps(out)


SWEEP_BATCH = {"short": ("heavy", 128, 1024), "medium": ("heavy", 256, 4096), "long": ("uniform", 128, 1024),
               "xlong": ("uniform", 64, 4096)}


# what the sweep picks per regime, in order; "dkdv" / "dq" are timed only if the chosen mode does not store dS,
# "dkdv_ds" / "dq_ds" only if it does. The mode comes first (run 7): TMA loads change the forward too, so the
# forward tiles are timed under the chosen mode.
KERNELS = ("mode", "fwd", "fwd_silu", "dkdv", "dq", "dkdv_ds", "dq_ds")


def _mode_for(kern: str, mode: tuple) -> tuple[bool, bool, bool]:
    """The launch mode under which tile kind ``kern`` is used (so that it is compiled / timed): "dkdv_ds" /
    "dq_ds" need the dS store, "dkdv" / "dq" need it off; other kinds keep ``mode``."""
    inner, tma, ds = mode
    if kern in ("dkdv_ds", "dq_ds"):
        return (inner, tma, True)
    if kern in ("dkdv", "dq"):
        return (inner, tma, False)
    return tuple(mode)


def _sweep_items(config: KernelConfig, which: str) -> list[tuple[str, str, tuple]]:
    """(regime, kernel, candidate) items of the sweep for one regime, in the sweep's order (defaults first)."""
    items = []
    ds_tried = get_mode(config, which)[2] or any(m[2] for m in BWD_MODES)
    for kern in KERNELS:
        if kern in ("dkdv_ds", "dq_ds") and not ds_tried:
            continue  # never used: neither compiled nor timed
        if kern == "mode":
            default = get_mode(config, which)
            cands = [default] + [m for m in BWD_MODES if m != default]
        else:
            default = config.regime(which).tiles.get(kern, 128)
            cands = [default] + [c for c in SWEEP[which][kern] if c != default]
        items += [(which, kern, tuple(c)) for c in cands]
    return items


def batch_inputs(kind: str, b: int, n: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """A bench batch: (lengths, offsets [B+1] int64, q, k, v [T, H, D] random, requiring grad), seed 0."""
    torch.manual_seed(0)
    lengths = make_lengths(kind, b, n)
    off = offsets_of(lengths, device)
    t = int(off[-1])
    q, k, v = (torch.randn(t, H, D, device=device, dtype=dtype).requires_grad_(True) for _ in range(3))
    return lengths, off, q, k, v


def varlen_causal(off: torch.Tensor, max_len: int):
    """torch.nn.attention.varlen.varlen_attn as a causal (q, k, v) -> out callable on offsets ``off`` (its
    causal argument is ``is_causal`` or ``window_size`` depending on the torch version)."""
    from torch.nn.attention.varlen import varlen_attn

    cu = off.to(torch.int32)
    params = inspect.signature(varlen_attn).parameters
    causal_kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return lambda a, bb, c: varlen_attn(a, bb, c, cu, cu, max_len, max_len, **causal_kw)


def _sweep_inputs(which: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """(offsets, N, q, k, v) of regime ``which``'s sweep batch (requires grad)."""
    kind, b, n = SWEEP_BATCH[which]
    _, off, q, k, v = batch_inputs(kind, b, n, device, dtype)
    return off, n, q, k, v


def item_config(base: KernelConfig, which: str, kern: str, cand: tuple, under: tuple | None = None) -> KernelConfig:
    """The config a sweep item runs with: ``base`` with regime ``which`` in the launch mode that uses tile kind
    ``kern`` (derived from ``under``, a launch mode, or the regime's own), then the candidate applied (a mode for
    "mode", else the kind's D=128 tile)."""
    cfg = set_mode(base, which, _mode_for(kern, tuple(under) if under else get_mode(base, which)))
    if kern == "mode":
        return set_mode(cfg, which, cand)
    return cfg.with_tile(which, kern, tuple(cand))


def _precompile_worker(items: list, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                       tiles: str = "") -> int:
    """Run each sweep item once (forward, or forward+backward) so that its kernels land in the Triton disk
    cache (TRITON_CACHE_DIR); runs in a spawned process, results are discarded. An item (regime, kernel,
    candidate[, mode]) runs with :func:`item_config` of the default config (``tiles``: a --tiles JSON applied to
    it first). Returns the number of items that raised (each is printed)."""
    from gemray.kernels import jagged_attention as ja

    base = apply_tiles(tiles) if tiles else DEFAULT
    inputs = {}
    failed = 0
    for which, kern, cand, *under in items:
        if which == "section":  # a bench section run once per timing call: compiles exactly its variants
            try:
                _run_section_once(kern, base)
            except Exception as e:
                failed += 1
                print(f"precompile section {kern}: {e!r}"[:300], flush=True)
            continue
        try:
            cfg = item_config(base, which, kern, cand, under[0] if under else None)
            if which not in inputs:
                inputs[which] = _sweep_inputs(which, device, dtype)
            off, n, q, k, v = inputs[which]
            act = "silu" if kern == "fwd_silu" else "softmax"
            out = ja.jagged_attention_triton(q, k, v, off, n, activation=act,
                                             alpha=None if act == "softmax" else 1.0 / math.sqrt(D), config=cfg)
            if kern not in ("fwd", "fwd_silu"):
                out.backward(torch.ones_like(out))
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # reported again (and recorded) by the sweep itself
            failed += 1
            print(f"precompile {which} {kern} {cand}: {e!r}"[:300], flush=True)
    return failed


def _run_section_once(name: str, config: KernelConfig = DEFAULT) -> None:
    """Run bench section ``name`` ("cross", "block") with every timing replaced by one call (precompile)."""
    import tempfile

    g = globals()
    saved = {k: g[k] for k in ("_bench", "_host_ms", "_host_ms_fwd")}

    def once(fn, grad_to_none=None):
        fn()
        return 1.0

    g["_bench"] = once
    g["_host_ms"] = g["_host_ms_fwd"] = lambda fn, inputs, n=1: 1.0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rec = Recorder(Path(tmp))
            if name == "cross":
                bench_cross_pma(rec, {"sdpa"}, config)
            elif name == "block":
                bench_block(rec, config)
    finally:
        g.update(saved)


def precompile(workers: int, timeout_s: float = 240.0, tiles: str = "") -> float:
    """Compile every sweep candidate (and so the default variants the bench runs) in ``workers`` spawned
    processes sharing the Triton disk cache; the sweep then times instead of compiling. Bwd items first
    (slowest to compile), dealt round-robin. ``tiles``: the run's --tiles JSON. Returns the seconds spent."""
    import multiprocessing as mp

    t0 = time.time()
    base = apply_tiles(tiles) if tiles else DEFAULT
    items = [it for which in SWEEP_BATCH for it in _sweep_items(base, which)]
    # tiles are timed after the mode: compile each also under its regime's default mode with the TMA loads
    # switched (the mode the sweep is most likely to choose instead; other modes compile during the sweep)
    items += [it + ((lambda m: (m[0], not m[1], m[2]))(get_mode(base, it[0])),) for it in items if it[1] != "mode"]
    items.sort(key=lambda it: it[1] in ("fwd", "fwd_silu"))
    items = [("section", "cross", ()), ("section", "block", ())] + items
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_precompile_worker, args=(items[i::workers], "cuda", torch.bfloat16, tiles))
             for i in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout_s - (time.time() - t0)))
    for p in procs:
        if p.is_alive():
            p.terminate()
    return time.time() - t0


def sweep_tiles(rec: Recorder, budget_s: float = 150.0, config: KernelConfig = DEFAULT) -> KernelConfig:
    """Pick, per regime on that regime's bench batch (SWEEP_BATCH), the launch mode (heads inner, TMA loads, dS
    stored), the forward tiles (softmax "fwd" and silu "fwd_silu", timed forward only) and the backward tiles of
    the chosen mode (timed fwd+bwd, softmax); every candidate timed as CUDA-graph replays (device time: on the
    host-bound short batch the eager time measures the host, not the tiles; eager timing where a candidate cannot
    be captured). Starts from ``config`` and returns it with the winners. Candidates are tried in order (the
    default first) until ``budget_s`` seconds (compilation included) are spent; later candidates are then
    skipped."""
    from gemray.kernels import jagged_attention as ja

    t_start = time.time()
    n_reg = len(SWEEP_BATCH)
    for i_reg, which in enumerate(SWEEP_BATCH):
        off, n, q, k, v = _sweep_inputs(which)
        assert config.regime_of(q.shape[0], off.numel() - 1) == which, which
        reg_deadline = t_start + budget_s * (i_reg + 1) / n_reg  # every regime gets its share of the budget

        def fn(a, bb, c, cfg, act="softmax"):
            return ja.jagged_attention_triton(a, bb, c, off, n, activation=act,
                                              alpha=None if act == "softmax" else 1.0 / math.sqrt(D), config=cfg)

        def timed(kern, cfg):
            # device time (CUDA-graph replays): the eager time of a short batch is the host's, which picked
            # tiles by noise before (run 4's 32-row dQ tile without wgmma on the short regime)
            fwd_only = kern in ("fwd", "fwd_silu")
            act = "silu" if kern == "fwd_silu" else "softmax"
            try:
                return _graph_ms(lambda a, bb, c: fn(a, bb, c, cfg, act), (q, k, v), backward=not fwd_only)
            except Exception as e:  # not capturable: the eager time
                log.warning("sweep %s %s: graph capture failed (%r), timing eagerly", which, kern, e)
                torch.cuda.synchronize()
                if fwd_only:
                    with torch.no_grad():
                        return _bench(lambda: fn(q, k, v, cfg, act))
                return _time_fwd_bwd(lambda a, bb, c: fn(a, bb, c, cfg), (q, k, v))[1]

        def over_budget() -> bool:
            return time.time() > reg_deadline

        items = _sweep_items(config, which)
        for kern in KERNELS:
            mode = get_mode(config, which)
            if kern not in ("fwd", "fwd_silu", "mode") and _mode_for(kern, mode) != mode:
                rec.add(section="sweep", table=which, kernel=kern, skipped=f"unused in mode {list(mode)}")
                continue
            cands = [c for (_, kk, c) in items if kk == kern]
            best, best_ms = cands[0], float("inf")
            for cand in cands:
                if best_ms < float("inf") and over_budget():
                    rec.add(section="sweep", table=which, kernel=kern, cfg=list(cand), skipped="budget")
                    continue
                cfg = set_mode(config, which, cand) if kern == "mode" else config.with_tile(which, kern, cand)
                try:
                    ms = timed(kern, cfg)
                except Exception as e:  # e.g. out of shared memory for this tile
                    rec.add(section="sweep", table=which, kernel=kern, cfg=list(cand), error=repr(e)[:200])
                    continue
                rec.add(section="sweep", table=which, kernel=kern, cfg=list(cand), ms=ms)
                if ms < best_ms:
                    best, best_ms = cand, ms
            config = set_mode(config, which, best) if kern == "mode" else config.with_tile(which, kern, best)
            rec.add(section="sweep", table=which, kernel=kern, chosen=list(best), ms=best_ms,
                    elapsed_s=time.time() - t_start)
        del q, k, v
        torch.cuda.empty_cache()
    return config


TARGETS = {"uniform B=128 N=1024": 1.2, "heavy B=128 N=1024": 1.5, "uniform B=64 N=4096": 1.2,
           "heavy B=256 N=4096": 1.5}
SILU_FWD_TARGET = ("heavy B=256 N=4096", 300.0)


def print_summary(rows: list[dict]) -> None:
    """The issue's bars: JFA fwd+bwd speed-up over varlen_attn per batch, silu forward TFLOP/s."""
    for r in rows:
        if r.get("section") == "env" and "triton_launch_us" in r:
            print(f"\nhost: {r['triton_launch_us']:.1f} us per tiny Triton launch, "
                  f"{r['torch_empty_like_us']:.1f} us per torch.empty_like")
    ms = {(r.get("batch"), r.get("variant")): r.get("ms_fwd_bwd") for r in rows if r.get("section") == "self"}
    graph = {(r.get("batch"), r.get("variant")): r.get("graph_ms_fwd_bwd") for r in rows
             if r.get("section") == "self"}
    print("\n| batch | JFA ms fwd+bwd | varlen ms fwd+bwd | speed-up | bar | | graph replay JFA / varlen ms "
          "(speed-up) |")
    print("|---|---|---|---|---|---|---|")

    def fmt(x):
        return f"{x:.3f}" if x else "missing"

    for batch, bar in TARGETS.items():
        ours, base = ms.get((batch, "jfa")), ms.get((batch, "varlen"))
        g_ours, g_base = graph.get((batch, "jfa")), graph.get((batch, "varlen"))
        g = f"{fmt(g_ours)} / {fmt(g_base)}" + (f" ({g_base / g_ours:.2f}x)" if g_ours and g_base else "")
        if ours and base:
            print(f"| {batch} | {ours:.3f} | {base:.3f} | {base / ours:.2f}x | {bar}x | "
                  f"{'met' if base / ours >= bar else 'MISSED'} | {g} |")
        else:
            print(f"| {batch} | {fmt(ours)} | {fmt(base)} | n/a | {bar}x | | {g} |")
    batch, bar = SILU_FWD_TARGET
    silu = [r for r in rows if r.get("section") == "self" and r.get("batch") == batch
            and r.get("variant") == "gdpa_silu" and "tflops_fwd" in r]
    if silu:
        tf = silu[0]["tflops_fwd"]
        print(f"\nGDPA silu fwd on {batch}: {tf:.0f} TFLOP/s (bar {bar:.0f}: {'met' if tf >= bar else 'MISSED'}), "
              f"bwd rel err dq/dk/dv {silu[0].get('err_dq', float('nan')):.1e}/"
              f"{silu[0].get('err_dk', float('nan')):.1e}/{silu[0].get('err_dv', float('nan')):.1e}")


def print_sweep(rows: list[dict]) -> None:
    """One line per swept regime and kernel: every candidate's ms, the chosen one marked with *."""
    tried: dict[tuple, list[str]] = {}
    for r in rows:
        if r.get("section") != "sweep":
            continue
        key = (r["table"], r["kernel"])
        if "chosen" in r:
            tried.setdefault(key, []).append(f"=> {r['chosen']} ({r['elapsed_s']:.0f} s into the sweep)")
        elif "ms" in r:
            tried.setdefault(key, []).append(f"{r['cfg']} {r['ms']:.3f}")
        else:
            what = ("skipped" if r["skipped"] == "budget" else r["skipped"]) if "skipped" in r else "ERROR"
            tried.setdefault(key, []).append(f"{r.get('cfg', '')} {what}".strip())
    if tried:
        print("\nsweep (device ms from CUDA-graph replays; fwd kernels: forward only, others: fwd+bwd; "
              "mode = [heads inner, TMA loads, dS stored]):")
        for (reg, kern), items in tried.items():
            print(f"  {reg:6s} {kern:11s} " + " | ".join(items))


def print_table(rows: list[dict]) -> None:
    print("\n| section | batch | variant | ms fwd | ms fwd+bwd | TFLOP/s fwd | TFLOP/s fwd+bwd | host ms fwd+bwd "
          "(fwd) | err fwd/dq/dk/dv |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("section") in ("norm_quant", "sweep", "env", "tiles", "done"):
            continue
        errs = "/".join(f"{r[k]:.1e}" for k in ("err_fwd", "err_dq", "err_dk", "err_dv", "err_dseeds",
                                                 "err_dpos_w", "err_dts_w", "rel_diff") if k in r)
        if "error" in r:
            errs = "ERROR " + r["error"][:60]

        def fmt(key, spec):
            return format(r[key], spec) if key in r else ""

        host_fwd = f"({r['host_ms_fwd']:.3f})" if "host_ms_fwd" in r else ""

        print(f"| {r.get('section')} | {r.get('batch', '')} | {r.get('variant', '')} | {fmt('ms_fwd', '.3f')} "
              f"| {fmt('ms_fwd_bwd', '.3f')} | {fmt('tflops_fwd', '.0f')} | {fmt('tflops_fwd_bwd', '.0f')} "
              f"| {fmt('host_ms_fwd_bwd', '.3f')} {host_fwd} | {errs} |")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gemray bench kernels``; returns a process exit code (0 ok, 2 no CUDA)."""
    p = argparse.ArgumentParser(prog="gemray bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"), help="output folder")
    p.add_argument("--skip", default="",
                   help="comma list of: self,cross,block,relbias,norm,flex,varlen,sdpa,silu_padded")
    p.add_argument("--quick", action="store_true", help="only the two N=1024 batches")
    p.add_argument("--sweep", action="store_true", help="sweep tile configs first and use the best")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds for the whole run: later sections (flex last) are skipped when short of time")
    p.add_argument("--precompile", type=int, default=0, metavar="N",
                   help="first compile every sweep candidate in N processes (shared Triton disk cache)")
    p.add_argument("--precompile-only", action="store_true", help="only --precompile, then exit")
    p.add_argument("--host-profile", action="store_true",
                   help="only count launches / aten ops and time the host work of one fwd+bwd with the "
                   "launches stubbed (CPU is enough), then exit")
    p.add_argument("--sweep-budget", type=float, default=150.0, help="seconds the sweep may spend (compiles too)")
    p.add_argument("--tiles", default="", help='tiles and launch modes per regime over the default KernelConfig, '
                   'e.g. {"long": {"fwd": {"128": [128,64,8,3]}, "mode": {"heads_inner": true, "tma_loads": false, '
                   '"ds_store": true}}} (missing mode keys are off; the 2-7 entry mode lists of earlier runs are read '
                   'too, refused where they switch a deleted mode on)')
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = DEFAULT
    if args.tiles:  # pinned before anything runs (the host profile's launches follow the tiles too)
        try:
            config = apply_tiles(args.tiles)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # JSONDecodeError is a ValueError
            print(f"gemray bench kernels: --tiles: not a tiles JSON ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    if args.host_profile:
        rec = Recorder(Path(args.out))
        for act in ("softmax", "silu"):
            r = rec.add(section="host_profile", **host_profile(act, config=config))
            print(json.dumps(r), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("gemray bench kernels: needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    skip = {s for s in args.skip.split(",") if s}
    if args.precompile:
        secs = precompile(args.precompile, tiles=args.tiles)
        print(f"precompiled the sweep candidates in {secs:.0f} s ({args.precompile} processes)", flush=True)
        if args.precompile_only:
            return 0
    rec = Recorder(Path(args.out))
    rec.add(section="env", torch=torch.__version__, triton=triton.__version__,
            device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    rec.add(section="env", **launch_overhead())
    t0 = time.time()
    if args.sweep:
        config = sweep_tiles(rec, args.sweep_budget, config)
    chosen = tiles_json(config)
    rec.add(section="tiles", tiles=chosen, config=config.name)
    print("chosen tiles (pass back with --tiles):", chosen, flush=True)
    deadline = t0 + args.time_limit if args.time_limit > 0 else float("inf")

    def section(name: str, reserve_s: float) -> bool:
        """Run section ``name`` unless skipped or fewer than reserve_s seconds are left before the deadline."""
        if name in skip:
            return False
        if time.time() + reserve_s > deadline:
            rec.add(section=name, skipped=f"time limit ({args.time_limit:.0f} s)")
            return False
        return True

    if section("self", 0):
        bench_self(rec, skip, args.quick, config)
    if section("cross", 20):
        bench_cross_pma(rec, skip, config)
    if section("block", 15):
        bench_block(rec, config)
    if section("relbias", 30):
        bench_rel_bias(rec, config)
    if section("norm", 15):
        bench_norm(rec)
    if "self" not in skip and section("flex", 30):
        bench_flex(rec, args.quick, deadline)
    rec.add(section="done", seconds=time.time() - t0)
    print_sweep(rec.rows)
    print_table(rec.rows)
    print_summary(rec.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
