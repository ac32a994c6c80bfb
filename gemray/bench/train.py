"""``gemray bench train``: time real training steps of a config in one process, and say where the step goes.

The model, optimizer and data stream are the Trainer's own (:class:`gemray.train.Trainer`: ``setup`` with a
world-1 context instead of Ray Train's, ``build``, a fresh ``restore``), and every step is
:meth:`Trainer.train_step` on the next batch of the real pipeline (``ElasticTrainStream``, BBS and all; the
Parquet shards read with pyarrow in this process, ``data.reader = "arrow"``, so no Ray is started). Before step
1 the attention kernels are compiled for every length regime the config can reach
(:func:`gemray.train.warmup.warm_up_attention`, on CUDA with the Triton backend).

The steps run as ``Trainer.train_epoch`` runs them: on CUDA the host never waits for the device between steps
(the launch queue runs ahead; losses are read every ``train.log_every`` steps), the device is synchronised
only at the start and end of each phase (warm-up, measured, profiled). Per step it measures:

* ``data_s``: the host's wait for the next batch (``next()`` on the Trainer's train stream,
  :class:`gemray.pipelines.loader.TrainLoader`: with ``data.loader_workers`` = 0 BBS planning and collation run
  here, in the step's thread; with N >= 1, the default on CUDA ("auto"), N worker processes make the batches
  ahead and the loader's thread pins them, so data_s is the wait for a ready batch; on CUDA the device may still
  be busy meanwhile);
* ``step_s``: on CUDA the device time from the end of the previous step to the end of this one (CUDA events
  recorded after each ``train_step``: forward, backward, optimizer, and any wait for the host's launches); on
  the CPU ``train_step``'s wall time;
* ``host_s``: the host's time inside ``train_step`` (on CUDA: enqueueing; ``host_s`` near ``step_s`` means
  the step is host-bound);
* the step's model FLOPs (``gemray.train.throughput.batch_flops``), tokens, samples and ``max_len`` (the batch's
  longest sequence); on CUDA ``device_allocs``, the caching allocator's cudaMalloc calls since the previous step
  was enqueued (its batch's read and its own enqueueing: a step that reaches a new peak of some buffer size pays
  for them, a slow step's first suspect), ``host_allocs`` / ``host_alloc_ms``, the pinned host allocator's
  cudaHostAlloc calls in that window and their milliseconds (a batch pinned into new pages).

The result (:func:`run_bench`, the ``--json`` file; steps after the first ``warmup`` only):

``step_s`` {median, p90, max, mean}; ``data_s`` {median, max, mean}; ``host_s`` {median, mean}; ``wall_s``
(the measured window: synchronised device to synchronised device on CUDA, sum of data_s + step_s on the CPU);
``data_stall_pct`` (100 x sum data_s / wall_s: the host's share spent waiting for batches, an upper bound of
what the device waits); ``tokens_per_s`` / ``samples_per_s`` / ``model_tflops_per_s`` (sums over the
measured steps / wall_s); ``local_mfu`` (model FLOP/s / the device's dense bf16 peak;
null on CPU), ``local_mfu_compute`` (the same over step_s only: what a loader that never stalls would give);
``local_mfu_second_half`` (the same over the later half of the measured steps: the first ones may still be
settling); ``peak_memory`` ({allocated_bytes, reserved_bytes} from torch.cuda.max_memory_* on CUDA, {rss_bytes} on
CPU); ``allocator`` (CUDA: the caching allocator's events during the measured steps, from torch.cuda.memory_stats:
{alloc_retries: allocations that found the device full and freed the cache first, a device synchronisation each;
device_allocs / device_frees: cudaMalloc / cudaFree calls; host_allocs / host_alloc_us: the pinned host allocator's
cudaHostAlloc calls and their microseconds});
``compile_stall`` {max_over_median, flagged (> 2)}; ``slow_steps`` (:func:`slow_steps`: the steps over the time their
tokens and FLOPs predict by more than 10% of the median step, with their suspects; null under 10 steps); ``loader``
{workers (0 = in-process), in_process, prefetch_batches, pin_memory, cpu_cores};
``gc`` (Python's garbage-collection pauses during the measured steps: seconds, generation-2 collections, the
largest one step had; each step record has its own ``gc_s`` / ``gc_full``); ``jit_misses`` ({count, steps,
kernels}: launches of Triton / Gluon kernels that missed the JIT's kernel cache in the measured steps, i.e. compiled
or read triton's disk cache, :class:`JitMisses`; each step record has ``jit_misses`` / ``jit_kernels``);
``warmup_compile`` (the kernel warm-up's regimes and seconds); ``torch_compile`` (``train.compile``:
:func:`compile_report` -- the modules compiled, graphs, graph breaks, dynamo / AOT / inductor seconds, split into
before the measured steps and during them: compile time is never inside the measured figures unless a batch
recompiles there, which ``during_measured`` shows and the max/median stall flag catches); ``steps`` (per-step
records); with ``--profile`` a ``profile`` (:func:`profile_breakdown`); with ``--sync-debug`` (CUDA only) a
``sync_debug`` (:func:`sync_debug_step`: the host synchronisations one training step still makes, by site); with
``--host-profile N`` a ``host_profile`` (:func:`host_profile`: cProfile over N more steps).

Profile classification (:func:`classify_kernel`, first rule that matches, on the lower-cased name of each
device kernel; on CPU, where there are no kernels, on the self time of each operator):

1. communication: ``nccl`` (only the part not overlapped by a compute kernel on another stream counts as
   ``exposed_communication``; the rest is reported as ``overlapped_communication``);
2. embeddings_bwd / embeddings_fwd: FBGEMM table-batched embedding kernels and TorchRec's helpers (``embedding``,
   ``tbe``, ``fbgemm``, ``bounds_check_indices``, ``linearize_cache``, ``jagged``/``permute`` index ops of
   the KJT path are *not* matched); backward when the name has ``backward`` / ``bwd`` / ``grad``;
3. attention: our Triton and Gluon kernels (``_gdpa_``, ``_ws_fwd``, ``_ws_dv_ds``, ``_ws_ds_gemm``,
   ``_bwd_delta``), SDPA / flash / memory-efficient kernels (``flash``, ``fmha``, ``sdpa``, ``attention``,
   ``scaled_dot_product``);
4. optimizer: ``adam``, ``adagrad``, ``multi_tensor_apply``, ``foreach``, ``optimizer``, ``sgd``;
5. gemm: cuBLAS / CUTLASS / Hopper GEMM kernels (``gemm``, ``cublas``, ``cutlass``, ``nvjet``, ``xmma``,
   ``sm90_``, ``sm80_``, ``splitk``, ``matmul``) and the CPU operators ``aten::mm`` / ``addmm`` / ``bmm`` /
   ``baddbmm`` / ``_scaled_mm`` / ``linear`` / ``matmul``;
6. other: the rest (elementwise, norms, reductions, copies, memsets).

The rules go by kernel name alone: on the reference attention path (``model.attention_backend = "reference"``)
the attention is aten batched matmuls, softmax and masks, so its matmuls count as ``gemm`` and the rest as
``other``; compare the two paths' step times, not their ``attention`` rows.

``data_wait`` is the host-measured ``data_s`` of the profiled steps; ``gpu_idle`` the profiled wall time in which
no kernel ran (host-bound launches show up there).
"""

from __future__ import annotations

import logging
import statistics
import time
import traceback
import warnings
from contextlib import closing
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from gemray.config import JobConfig, usable_cpus
from gemray.train.gc import GcPauses
from gemray.train.throughput import batch_flops, mfu_or_none

log = logging.getLogger("gemray.bench.train")

#: the train step's profiler annotations (``gemray.train.trainer.forward_backward_step``)
PHASE_PREFIX = "gemray."
CATEGORIES = ("attention", "gemm", "embeddings_fwd", "embeddings_bwd", "optimizer", "data_wait",
              "exposed_communication", "other")
STALL_FACTOR = 2.0  # "no compile stalls": every measured step within 2x the median step

_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("embeddings", ("embedding", "tbe_", "_tbe", "fbgemm", "bounds_check_indices", "linearize_cache")),
    ("attention", ("_gdpa_", "gdpa", "_ws_fwd", "_ws_dv_ds", "_ws_ds_gemm", "_bwd_delta", "flash", "fmha", "sdpa",
                   "attention", "scaled_dot_product")),
    ("optimizer", ("adam", "adagrad", "multi_tensor_apply", "foreach", "optimizer", "sgd")),
    ("gemm", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "sm90_", "sm80_", "splitk", "matmul", "aten::mm",
              "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::linear")),
)


#: how many kernels the profile lists by time (enough to reach the small ones of "other": ~9 ms a GEM step were
#: past the first 30 in session 27)
TOP_KERNELS = 80


def classify_kernel(name: str) -> str:
    """The profile category of a device kernel (or, on CPU, an operator) by its name: "communication",
    "embeddings_fwd", "embeddings_bwd", "attention", "optimizer", "gemm" or "other" (module docstring: the
    rules in order)."""
    n = name.lower()
    for cat, keys in _RULES:
        if any(k in n for k in keys):
            if cat == "embeddings":
                return "embeddings_bwd" if any(k in n for k in ("backward", "bwd", "grad")) else "embeddings_fwd"
            return cat
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(a: float, b: float, merged: list[tuple[float, float]]) -> float:
    """Length of [a, b] covered by the sorted disjoint intervals ``merged``."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged if y > a and x < b)


def kernel_breakdown(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """Pure: seconds per category from device kernels ``(name, start_s, end_s)``. Communication kernels count as
    ``exposed_communication`` only where no compute kernel (any other category) runs at the same time; the
    overlapped rest goes to ``overlapped_communication``. Also ``gpu_busy`` (the union of all kernels)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    out["overlapped_communication"] = 0.0
    compute, comm = [], []
    for name, a, b in kernels:
        cat = classify_kernel(name)
        if cat == "communication":
            comm.append((a, b))
        else:
            out[cat] += b - a
            compute.append((a, b))
    merged = _union(compute)
    for a, b in comm:
        hidden = _covered(a, b, merged)
        out["overlapped_communication"] += hidden
        out["exposed_communication"] += (b - a) - hidden
    out["gpu_busy"] = sum(b - a for a, b in _union(compute + comm))
    return out


def idle_gaps(kernels: list[tuple[str, float, float]], host_ops: list[tuple[str, float, float, int]],
              phases: list[tuple[str, float, float]] = (), *, min_gap_s: float = 10e-6, top: int = 15,
              first_step_end: float | None = None) -> dict[str, Any]:
    """Pure: where the GPU's idle time goes, by what the host was doing while no kernel ran.

    kernels: device kernels ``(name, start_s, end_s)``; host_ops: host operators ``(name, start_s, end_s,
    thread)`` (nested per thread, as the profiler records them); phases: the train step's annotations
    ``(name, start_s, end_s)`` (``gemray.forward`` ...). Every gap of at least ``min_gap_s`` between the union of
    the kernels (from the first kernel's start to the last one's end) is charged to the innermost host operator
    containing the gap's midpoint, over all threads the one that started last (the op the device is waiting
    for: a sync, a slow host op, the launch of the next kernel), and to the phase containing it.

    Returns {"gaps": n, "idle_s": total, "by_host_op": [[name, seconds, gaps], ...] (``top``, largest first;
    "(no host op)" where none contains the midpoint), "by_phase": {phase or "(between phases)": seconds},
    "largest": [[start_s, seconds, host op, phase], ...] (``top``), "first_step_s": the idle seconds of the gaps
    whose midpoint lies before ``first_step_end`` (seconds, on the kernels' clock; None: 0.0)}."""
    import bisect

    merged = _union([(a, b) for _, a, b in kernels])
    gaps = [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)
            if merged[i + 1][0] - merged[i][1] >= min_gap_s]
    by_thread: dict[int, list[tuple[float, float, str]]] = {}
    for name, a, b, th in host_ops:
        by_thread.setdefault(th, []).append((a, b, name))
    starts, parents = {}, {}
    for th, evs in by_thread.items():
        evs.sort(key=lambda e: (e[0], -e[1]))  # a parent before the children that start with it
        starts[th] = [e[0] for e in evs]
        par, stack = [], []
        for j, (a, b, _) in enumerate(evs):
            while stack and evs[stack[-1]][1] < a:
                stack.pop()
            par.append(stack[-1] if stack else -1)
            stack.append(j)
        parents[th] = par
    by_op: dict[str, list[float]] = {}
    by_phase: dict[str, float] = {}
    largest = []
    first = 0.0
    for a, b in gaps:
        mid, dur = (a + b) / 2, b - a
        if first_step_end is not None and mid < first_step_end:
            first += dur
        best = None  # (start, name) of the innermost op containing mid, latest start over threads
        for th, evs in by_thread.items():
            i = bisect.bisect_right(starts[th], mid) - 1
            while i >= 0 and evs[i][1] < mid:  # up the nesting: the first op that still runs at mid
                i = parents[th][i]
            if i >= 0 and (best is None or evs[i][0] > best[0]):
                best = (evs[i][0], evs[i][2])
        op = best[1] if best else "(no host op)"
        phase = next((n for n, s0, e0 in phases if s0 <= mid <= e0), "(between phases)")
        acc = by_op.setdefault(op, [0.0, 0])
        acc[0] += dur
        acc[1] += 1
        by_phase[phase] = by_phase.get(phase, 0.0) + dur
        largest.append([a, dur, op, phase])
    largest.sort(key=lambda r: -r[1])
    return {"gaps": len(gaps), "idle_s": sum(b - a for a, b in gaps),
            "by_host_op": [[n, v[0], v[1]] for n, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]],
            "by_phase": dict(sorted(by_phase.items(), key=lambda kv: -kv[1])), "largest": largest[:top],
            "first_step_s": first}


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stall_check(step_s: list[float], factor: float = STALL_FACTOR) -> dict[str, Any]:
    """Pure: the "no compile stalls" check over the measured steps: max step / median step, flagged when > factor."""
    if not step_s:
        return {"max_over_median": None, "flagged": False, "factor": factor}
    med = statistics.median(step_s)
    r = max(step_s) / med if med > 0 else float("inf")
    return {"max_over_median": r, "flagged": r > factor, "factor": factor}


# a step over the time its tokens and FLOPs predict by this fraction of the median step is slow (slow_steps)
SLOW_STEP_EXCESS = 0.10


def slow_steps(records: list[dict[str, Any]], peak: float | None = None,
               excess: float = SLOW_STEP_EXCESS) -> dict[str, Any] | None:
    """Pure: the measured steps slower than their batch explains. A step's time is fitted as ``a * tokens + b *
    flops + c`` (per-token work: projections, norms, memory-bound kernels; FLOPs: the attention's quadratic part on
    top; c: fixed per-step cost), first by least trimmed squares over 60% of the steps (robust to the slow steps
    themselves, seeded: the same records give the same answer), then by least squares over the steps within
    ``excess`` x the median step of it until that set stops changing; the steps more than that over the fit are
    the slow steps: a fixed cost some batches pay on top of their work (a new allocator segment, a kernel-cache
    miss, a collection, the host falling behind), which the batch-to-batch spread of step times hides (session
    37's H100 runs: the same 5-9 of 30 batches ~20 ms over in all four runs,
    benchmarks/reports/gem_h200_2026-12-08.md). Records need ``step_s``, ``tokens`` and ``flops``; each slow step
    is listed with the suspects its record has (``device_allocs``, ``host_allocs``, ``jit_misses``, ``gc_s``).

    Returns None with fewer than 10 records (the trimmed fit of three coefficients needs some to spare), else
    {"excess": the threshold, "fit_ms": {"per_1k_tokens", "per_tflop", "fixed"} (ms; the tokens and the FLOPs of
    real batches go together, so the split between a and b is loose, the prediction is not), "steps": [{index (0 =
    the first measured step), step_ms, expected_ms, excess_ms, and the suspects present}], "excess_ms": their excess
    in all,
    "local_mfu_without": local MFU over the other steps' step times (None without a peak)}."""
    import numpy as np

    n = len(records)
    if n < 10:
        return None
    y = np.array([r["step_s"] for r in records], dtype=np.float64) * 1e3
    x = np.array([[r["tokens"] / 1e3, r["flops"] / 1e12, 1.0] for r in records], dtype=np.float64)
    # least trimmed squares (Rousseeuw's LTS, random starts + concentration steps): the fit of the ~60% of steps it
    # fits best, so up to ~40% slow steps cannot pull it up; the largest batches (the most leverage) are among the
    # slow ones as often as not, which a squares or least-absolute fit follows
    h = max(4, (3 * n + 4) // 5)
    rng = np.random.default_rng(0)
    best, coef = np.inf, None
    for _ in range(200):
        sub = rng.choice(n, size=3, replace=False)
        for _ in range(20):
            c, *_ = np.linalg.lstsq(x[sub], y[sub], rcond=None)
            nxt = np.sort(np.argsort((y - x @ c) ** 2)[:h])
            if np.array_equal(nxt, sub):
                break
            sub = nxt
        cost = np.sort((y - x @ c) ** 2)[:h].sum()
        if cost < best:
            best, coef = cost, c
    keep = np.ones(n, dtype=bool)
    for _ in range(n):  # then squares over the steps within the threshold, until that set stops changing
        pred = x @ coef
        slow = y - pred > excess * np.median(y)
        if (~slow).sum() < 3 or np.array_equal(~slow, keep):
            break
        keep = ~slow
        coef, *_ = np.linalg.lstsq(x[keep], y[keep], rcond=None)
    steps = []
    for i in np.flatnonzero(slow):
        r = records[i]
        item = {"index": int(i), "step_ms": float(y[i]), "expected_ms": float(pred[i]),
                "excess_ms": float(y[i] - pred[i])}
        item.update({k: r[k] for k in ("device_allocs", "host_allocs", "jit_misses") if k in r})
        if "gc_s" in r:
            item["gc_ms"] = r["gc_s"] * 1e3
        steps.append(item)
    rest = [r for r, s in zip(records, slow) if not s]
    return {"excess": excess,
            "fit_ms": {"per_1k_tokens": float(coef[0]), "per_tflop": float(coef[1]), "fixed": float(coef[2])},
            "steps": steps, "excess_ms": float(sum(s["excess_ms"] for s in steps)),
            "local_mfu_without": mfu_or_none(sum(r["flops"] for r in rest), sum(r["step_s"] for r in rest), peak)}


def summarize(records: list[dict[str, Any]], peak: float | None, wall_s: float | None = None) -> dict[str, Any]:
    """Pure: the bench's figures from the measured steps' records ({data_s, step_s, flops, tokens, samples,
    optionally host_s}); see the module docstring for the keys. wall_s: the measured window's wall seconds
    (CUDA: steps overlap the next batch's read, so the window is not the sum of the parts); None: the sum of
    data_s + step_s (the CPU, where nothing overlaps)."""
    step = [r["step_s"] for r in records]
    data = [r["data_s"] for r in records]
    host = [r["host_s"] for r in records if "host_s" in r]
    wall = sum(step) + sum(data) if wall_s is None else wall_s
    flops = sum(r["flops"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    samples = sum(r["samples"] for r in records)
    return {
        "measured_steps": len(records),
        "step_s": {"median": statistics.median(step) if step else 0.0, "p90": _percentile(step, 0.9),
                   "max": max(step, default=0.0), "mean": sum(step) / len(step) if step else 0.0},
        "data_s": {"median": statistics.median(data) if data else 0.0, "max": max(data, default=0.0),
                   "mean": sum(data) / len(data) if data else 0.0},
        "host_s": {"median": statistics.median(host) if host else None, "mean": sum(host) / len(host) if host
                   else None},
        "wall_s": wall,
        "data_stall_pct": 100.0 * sum(data) / wall if wall > 0 else 0.0,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "model_flops_per_step": flops / len(records) if records else 0.0,
        "model_tflops_per_s": flops / wall / 1e12 if wall > 0 else 0.0,
        "local_mfu": mfu_or_none(flops, wall, peak),
        "local_mfu_compute": mfu_or_none(flops, sum(step), peak),
        # the later half alone: whether the first measured steps were still settling (allocator growth, shapes
        # new to cuBLAS); on an H100 five warm-up steps left the next five 3-7 points low (2026-12-06)
        "local_mfu_second_half": mfu_or_none(sum(r["flops"] for r in records[len(records) // 2:]),
                                             sum(step[len(step) // 2:]), peak) if len(records) > 1 else None,
        "peak_flops": peak,
        "compile_stall": stall_check(step),
        "slow_steps": slow_steps(records, peak),
        # Python's collection pauses in the measured steps (records' gc_s / gc_full; absent in older records)
        "gc": {"seconds": sum(r.get("gc_s", 0.0) for r in records),
               "full_collections": sum(r.get("gc_full", 0) for r in records),
               "max_step_s": max((r.get("gc_s", 0.0) for r in records), default=0.0)},
        # Triton / Gluon launches that missed the JIT's kernel cache in the measured steps (records' jit_misses)
        "jit_misses": {"count": sum(r.get("jit_misses", 0) for r in records),
                       "steps": sum(1 for r in records if r.get("jit_misses")),
                       "kernels": sorted({k for r in records for k in r.get("jit_kernels", ())})},
    }


def _peak_memory(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                "reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    from gemray.checkpoint import peak_rss_bytes  # VmHWM: ru_maxrss can be a spawning parent's peak

    return {"rss_bytes": peak_rss_bytes()}


_ALLOCATOR_STATS = {"alloc_retries": "num_alloc_retries", "device_allocs": "num_device_alloc",
                    "device_frees": "num_device_free"}


# the pinned host allocator's (torch.cuda.host_memory_stats, torch >= 2.6): cudaHostAlloc calls that grew its pool
# (the loader's pin thread pins each batch; a batch larger than every cached block pins new pages) and their
# microseconds
_HOST_ALLOCATOR_STATS = {"host_allocs": "num_host_alloc", "host_alloc_us": "host_alloc_time.total"}


def _allocator_counts(device: torch.device) -> dict[str, int] | None:
    """CUDA: the caching allocators' cumulative event counts (``torch.cuda.memory_stats``; the pinned host
    allocator's from ``torch.cuda.host_memory_stats`` where this torch has it, else 0); None elsewhere."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    out = {k: int(stats.get(v, 0)) for k, v in _ALLOCATOR_STATS.items()}
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    out.update({k: int(host.get(v, 0)) for k, v in _HOST_ALLOCATOR_STATS.items()})
    return out


class JitMisses:
    """Launches of Triton / Gluon kernels that missed the JIT's in-memory kernel cache while entered (each one
    compiles, or reads triton's disk cache: tens of ms to seconds of host time in a training step), counted
    through triton's ``knobs.runtime.jit_cache_hook`` (triton >= 3.3; with none, nothing is counted).
    ``count``; ``names``: the kernels' names in order. A hook installed before is called on and its answer
    returned (a true answer makes the JIT skip the compile: that stays its decision)."""

    def __init__(self) -> None:
        self.count, self.names = 0, []
        self._runtime, self._prev = None, None

    def _hook(self, *args, **kwargs):
        self.count += 1
        self.names.append(getattr(kwargs.get("fn"), "name", "?"))
        return self._prev(*args, **kwargs) if self._prev is not None else None

    def __enter__(self) -> "JitMisses":
        try:
            from triton import knobs
            runtime = knobs.runtime
            self._prev = runtime.jit_cache_hook
        except (ImportError, AttributeError):  # an older triton: no hook to count with
            return self
        self._runtime = runtime
        runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook = self._prev
            self._runtime = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init_process_group(device: torch.device) -> bool:
    """A world-1 default process group for the Trainer's collectives (gloo on CPU, NCCL on CUDA); True when
    made here (the caller destroys it)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return True


def check_step_counts(steps: int, warmup: int, profile_steps: int, host_profile_steps: int) -> None:
    """Raise ValueError unless steps >= 1, warmup >= 0, profile_steps >= 1 and host_profile_steps >= 0 (the CLI
    calls it before any data is prepared, :func:`run_bench` again)."""
    if steps < 1 or warmup < 0 or profile_steps < 1 or host_profile_steps < 0:
        raise ValueError(f"bench train: expected --steps >= 1, --warmup >= 0, profile steps >= 1 and host-profile "
                         f"steps >= 0, got {steps}, {warmup}, {profile_steps}, {host_profile_steps}")


def bench_device(cfg: JobConfig) -> torch.device:
    """cuda:0 when the config asks for GPUs (``ray.use_gpu``) and one is here, else the CPU. Raises
    ValueError when ``ray.use_gpu`` is set and there is no CUDA device."""
    if cfg.ray.use_gpu:
        if not torch.cuda.is_available():
            raise ValueError("bench train: ray.use_gpu is true but no CUDA device is visible "
                               "(--set ray.use_gpu=false to bench on the CPU)")
        return torch.device("cuda", 0)
    return torch.device("cpu")


class _Batches:
    """The train stream's batches across epoch boundaries, timed: ``next()`` returns (batch, seconds waited).
    ``close()`` ends the current epoch's iterator (and its loader workers)."""

    def __init__(self, trainer: Any):
        self.trainer, self.epoch = trainer, 0
        self._it: Iterator | None = None
        self._ahead: tuple[Any, float] | None = None

    def peek(self) -> Any:
        """The batch the next ``next()`` returns (fetched now; the sparse-dist pipeline prefetches it)."""
        if self._ahead is None:
            self._ahead = self._fetch()
        return self._ahead[0]

    def next(self) -> tuple[Any, float]:
        if self._ahead is not None:
            out, self._ahead = self._ahead, None
            return out
        return self._fetch()

    def _fetch(self) -> tuple[Any, float]:
        t0 = time.perf_counter()
        for _ in range(2):
            if self._it is None:
                self._it = self.trainer.train_stream.iter_epoch(self.epoch, 0)
            try:
                batch, consumed = next(self._it)
                self.trainer.consumed = consumed
                return batch, time.perf_counter() - t0
            except StopIteration:
                self.epoch += 1
                self.trainer.epoch = self.epoch
                self._it = None
        raise ValueError("bench train: the train split yields no batches")

    def close(self) -> None:
        if self._it is not None:
            self._it.close()
            self._it = None
        self._ahead = None


def first_batch(trainer: Any) -> Any:
    """The first non-empty batch of the train stream's epoch 0 (CPU; a template for the kernel warm-up)."""
    with closing(trainer.train_stream.iter_epoch(0, 0)) as batches:  # its loader workers stop on return
        for batch, _ in batches:
            if batch.batch_size:
                return batch
    raise ValueError("bench train: the train split yields no batches")


def _run_steps(trainer: Any, batches: _Batches, n: int, device: torch.device, records: list[dict[str, Any]],
               phase: str, after_first: Callable[[], None] | None = None) -> float:
    """Run ``n`` training steps as training runs them and append one record per step; returns the phase's wall
    seconds (from a synchronised device to a synchronised device). ``after_first``: called once after the first
    step is enqueued (no synchronisation), e.g. to mark the device timeline.

    On CUDA the host does not wait for the device between steps (as ``Trainer.train_epoch``: the launch queue
    runs ahead and the next batch is read while the device works): ``step_s`` is the time between the device
    reaching the end of the previous step and the end of this one (CUDA events recorded after each
    ``train_step``), ``host_s`` the host's time inside ``train_step`` (enqueueing; ``host_s`` close to ``step_s``
    means the step is host-bound). On the CPU every operator runs as it is called: ``step_s`` = ``host_s``."""
    cuda = device.type == "cuda"
    _sync(device)
    t_phase = time.perf_counter()
    prev = None
    if cuda:
        prev = torch.cuda.Event(enable_timing=True)
        prev.record()
    marks = []
    # the allocators' counters so far (torch.cuda.memory_stats builds a ~200-key dict: read once per step, not twice)
    allocs = _allocator_counts(device) if cuda else None
    with GcPauses() as pauses, JitMisses() as jit:  # per step: a host stall's first suspects
        for _ in range(n):
            gc0, full0, jit0 = pauses.seconds, pauses.full, jit.count
            batch, data_s = batches.next()
            t0 = time.perf_counter()
            nxt = batches.peek() if getattr(trainer, "pipeline", None) is not None else None  # sparse-dist: prefetched
            loss = trainer.train_step(batch, next_batch=nxt)
            host_s = time.perf_counter() - t0
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append(ev)
            records.append({"phase": phase, "data_s": data_s, "host_s": host_s, "step_s": host_s,
                            "flops": trainer.last_step_flops, "tokens": batch.num_tokens, "samples": batch.batch_size,
                            "max_len": batch.max_len, "loss": loss, "gc_s": pauses.seconds - gc0,
                            "gc_full": pauses.full - full0, "jit_misses": jit.count - jit0,
                            "jit_kernels": sorted(set(jit.names[jit0:]))})
            if cuda:  # the allocators' cudaMalloc / cudaHostAlloc calls since the previous step was enqueued
                allocs0, allocs = allocs, _allocator_counts(device)
                records[-1].update({k: allocs[k] - allocs0[k] for k in ("device_allocs", "host_allocs")})
                records[-1]["host_alloc_ms"] = (allocs["host_alloc_us"] - allocs0["host_alloc_us"]) / 1e3
            if after_first is not None:
                after_first()
                after_first = None
    _sync(device)
    wall = time.perf_counter() - t_phase
    mine = records[len(records) - n:] if n else []
    for rec, ev in zip(mine, marks):
        rec["step_s"] = prev.elapsed_time(ev) / 1e3
        prev = ev
    if mine and mine[-1]["loss"] is None:  # CUDA: the trainer reads losses every log_every steps
        mine[-1]["loss"] = trainer.flush_losses()
    return wall


def host_profile(trainer: Any, batches: _Batches, steps: int, device: torch.device, top: int = 30) -> dict[str, Any]:
    """``steps`` more training steps under cProfile (the host side: Python, the dispatcher, launches; the device
    synchronised once at the end): {"steps", "wall_s", "host_s" (mean seconds per step in ``train_step``),
    "by_own": [[function, own seconds per step, calls per step], ...], "by_cumulative": [[function, cumulative
    seconds per step, calls per step], ...]} (``top`` each; function = "path:line(name)", paths shortened to the
    package). cProfile slows Python down: compare shares, not absolute times, with the unprofiled steps. From
    Python 3.12 on cProfile records every thread of the process (sys.monitoring), so the rows include the data
    loader's pin thread (its ``pin_memory`` calls, for one); ``host_s`` is the training thread's alone."""
    import cProfile
    import pstats

    records: list[dict[str, Any]] = []
    prof = cProfile.Profile()
    prof.enable()
    try:
        wall = _run_steps(trainer, batches, steps, device, records, "host_profile")
    finally:
        prof.disable()
    st = pstats.Stats(prof)

    def name(key):
        path, line, fn = key
        return f"{_short_path(path)}:{line}({fn})" if path != "~" else fn

    rows = [(name(k), v[2] / steps, v[3] / steps, v[1] / steps) for k, v in st.stats.items()]  # own, cum, calls
    return {"steps": steps, "wall_s": wall, "host_s": sum(r["host_s"] for r in records) / max(steps, 1),
            "by_own": [[n, o, c] for n, o, _, c in sorted(rows, key=lambda r: -r[1])[:top]],
            "by_cumulative": [[n, cu, c] for n, _, cu, c in sorted(rows, key=lambda r: -r[2])[:top]]}


def device_kernels(events: list[Any]) -> list[tuple[str, float, float]]:
    """(name, start_s, end_s) of the device activities (kernels, copies, memsets) among torch.profiler's
    ``FunctionEvent``s, without the GPU-side projections of annotations (``ProfilerStep#``, record_function
    ranges), which are spans, not work."""
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if getattr(e, "is_user_annotation", False) or "annotation" in str(getattr(e, "activity_type", "")).lower():
            continue
        if e.name.startswith("ProfilerStep"):
            continue
        out.append((e.name, e.time_range.start / 1e6, e.time_range.end / 1e6))
    return out


def kernel_launchers(launches: list[tuple[str, str, float]], top: int = 3) -> dict[str, list[list[Any]]]:
    """Pure: which host operator launched each device kernel. launches: ``(kernel name, launcher, seconds)``, one
    per launch, the launcher a short text naming the operator (and its callers, shapes) that ran the launch.
    Returns {kernel name: [[launcher, seconds], ...]} with each kernel's ``top`` launchers by their total seconds
    (largest first): so that a kernel known only by its generic name (``elementwise_kernel<...direct_copy...>``,
    an inductor ``triton_poi_fused_add_5``) can be traced to the model code that asks for it."""
    acc: dict[str, dict[str, float]] = {}
    for kernel, launcher, sec in launches:
        per = acc.setdefault(kernel, {})
        per[launcher] = per.get(launcher, 0.0) + sec
    return {k: [[n, s] for n, s in sorted(per.items(), key=lambda kv: -kv[1])[:top]] for k, per in acc.items()}


def _launcher(e: Any) -> str:
    """A profiler CPU event as ``op [shapes] <- parent <- grandparent`` (record_shapes: the op's input shapes)."""
    shapes = [list(s) for s in (getattr(e, "input_shapes", None) or []) if s]
    chain, p = [e.name + (f" {shapes[:3]}" if shapes else "")], getattr(e, "cpu_parent", None)
    while p is not None and len(chain) < 3:
        if not p.name.startswith("ProfilerStep"):
            chain.append(p.name)
        p = getattr(p, "cpu_parent", None)
    return " <- ".join(chain)


#: the kernel ``torch.cuda._sleep`` launches (ATen's Sleep.cu): the device-only profile's step marker
MARKER_KERNEL = "spin_kernel"


def steady_device_idle(kernels: list[tuple[str, float, float]], steps: int,
                       marker: str = MARKER_KERNEL) -> dict[str, float] | None:
    """Pure: the device's busy and idle seconds per step after the ``marker`` kernel, from a profile that recorded
    device activity only. kernels: ``(name, start_s, end_s)``; the window runs from the marker's end (the first
    step, which starts on an empty launch queue, is before it) to the last kernel's end and holds ``steps`` steps.
    Returns {"steps", "busy_s_per_step", "idle_s_per_step", "window_s"}, or None without a marker or kernels
    after it (or ``steps`` < 1)."""
    ends = [b for n, _, b in kernels if marker in n]
    if not ends or steps < 1:
        return None
    t0 = max(ends)
    after = [(max(a, t0), b) for n, a, b in kernels if b > t0 and marker not in n]
    if not after:
        return None
    window = max(b for _, b in after) - t0
    busy = sum(b - a for a, b in _union(after))
    return {"steps": steps, "busy_s_per_step": busy / steps, "idle_s_per_step": (window - busy) / steps,
            "window_s": window}


def device_only_idle(trainer: Any, batches: _Batches, steps: int, device: torch.device) -> dict[str, Any] | None:
    """``steps`` + 1 more training steps under torch.profiler recording device activity only (CUPTI: no host
    operators recorded, so the host runs at about its unprofiled speed, unlike :func:`profile_breakdown`'s
    steps, whose idle the profiler's host cost inflates); a marker kernel after the first step, whose launch
    queue starts empty. Returns :func:`steady_device_idle` of the steps after it, plus "step_s_mean" (their CUDA
    event times); None off CUDA; {"error": text} when the profile could not be read (the bench goes on)."""
    if device.type != "cuda" or steps < 1:
        return None
    from torch.profiler import ProfilerActivity, profile

    records: list[dict[str, Any]] = []
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _run_steps(trainer, batches, steps + 1, device, records, "device_only",
                       after_first=lambda: torch.cuda._sleep(1000))
        out = steady_device_idle(device_kernels(prof.events()), steps)
    except Exception as e:  # noqa: BLE001 - a diagnostic: report it, keep the bench's other results
        return {"error": f"{type(e).__name__}: {e}"}
    if out is None:
        return {"error": f"no {MARKER_KERNEL} marker or no kernels after it in the device-only profile"}
    out["step_s_mean"] = sum(r["step_s"] for r in records[1:]) / steps
    return out


def profile_breakdown(trainer: Any, batches: _Batches, steps: int, device: torch.device) -> dict[str, Any]:
    """Profile ``steps`` more training steps with torch.profiler and split their time by category (module
    docstring): {"steps", "wall_s", "per_step_s": {category: seconds per step}, "fraction": {category: share
    of the profiled wall time}, "gpu_idle_s" (seconds per step in which no kernel ran), "top_kernels": [[name,
    category, seconds per step], ...] (``TOP_KERNELS``), on CUDA also "kernel_launchers": {kernel name: [[the host
    operator that launched it with its input shapes and callers, seconds per step], ...]} of those kernels
    (:func:`kernel_launchers`), "top_host_ops": [[operator, host self seconds per step, calls per step], ...] (30:
    where the host's time inside the operators goes) and "device_busy_s_per_step"}. The profiler's host cost per
    operator inflates these steps' GPU idle: :func:`device_only_idle` measures an ordinary step's."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    records: list[dict[str, Any]] = []
    # record_shapes (CUDA): the launching operators' input shapes (kernel_launchers), a little more host time per
    # operator. Not on the CPU, which launches no kernels: there a DataLoader worker forked later in the same
    # process (the next run's) died of a segmentation fault after a shape-recording profile.
    with profile(activities=acts, record_shapes=device.type == "cuda") as prof:
        wall = _run_steps(trainer, batches, steps, device, records, "profile")
    events = prof.events()
    if device.type == "cuda":
        kernels = device_kernels(events)
        cats = kernel_breakdown(kernels)
        busy = cats.pop("gpu_busy")
        names = [(k[0], k[2] - k[1]) for k in kernels]
        host_ops: dict[str, list[float]] = {}
        spans, phases, launches = [], [], []
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CPU:
                continue
            for k in getattr(e, "kernels", None) or ():  # the kernels this operator launched (correlation ids)
                launches.append((k.name, _launcher(e), k.duration / 1e6))
            span = (e.name, e.time_range.start / 1e6, e.time_range.end / 1e6)
            if e.name.startswith(PHASE_PREFIX):
                phases.append(span)
            elif not e.name.startswith("ProfilerStep"):
                spans.append((*span, e.thread))
            if e.self_cpu_time_total > 0:
                acc = host_ops.setdefault(e.name, [0.0, 0])
                acc[0] += e.self_cpu_time_total / 1e6
                acc[1] += 1
        # the phase starts from a synchronised device (an empty launch queue, which training never has between
        # steps): the first step's gaps are reported apart, the steady state is the steps after it
        starts = sorted(s0 for n, s0, _ in phases if n == PHASE_PREFIX + "to_device")
        gaps = idle_gaps(kernels, spans, phases, first_step_end=starts[1] if len(starts) > 1 else None)
    else:  # no kernels: the operators' self CPU time
        cats = dict.fromkeys(CATEGORIES, 0.0)
        cats["overlapped_communication"] = 0.0
        names = []
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0:
                c = classify_kernel(e.name)
                c = "exposed_communication" if c == "communication" else c
                cats[c] += e.self_cpu_time_total / 1e6
                names.append((e.name, e.self_cpu_time_total / 1e6))
        busy = None
    cats["data_wait"] = sum(r["data_s"] for r in records)
    total: dict[str, float] = {}
    for name, s in names:
        total[name] = total.get(name, 0.0) + s
    top = sorted(total.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    out = {"steps": steps, "wall_s": wall,
           "step_wall_s": wall if busy is not None else sum(r["step_s"] + r["data_s"] for r in records),
           "per_step_s": {k: v / steps for k, v in cats.items()},
           "fraction": {k: (v / wall if wall > 0 else 0.0) for k, v in cats.items()},
           "gpu_idle_s": None if busy is None else max(0.0, wall - busy) / steps,
           "top_kernels": [[n, classify_kernel(n), s / steps] for n, s in top]}
    if busy is not None:
        out["device_busy_s_per_step"] = busy / steps
        named = {n for n, _ in top}
        out["kernel_launchers"] = {k: [[n, s / steps] for n, s in rows] for k, rows in
                                   kernel_launchers([x for x in launches if x[0] in named]).items()}
        out["top_host_ops"] = [[n, v[0] / steps, v[1] / steps]
                               for n, v in sorted(host_ops.items(), key=lambda kv: -kv[1][0])[:30]]
        out["idle"] = {"gaps_per_step": gaps["gaps"] / steps, "idle_s_per_step": gaps["idle_s"] / steps,
                       "by_host_op": [[n, sec / steps, k / steps] for n, sec, k in gaps["by_host_op"]],
                       "by_phase": {k: v / steps for k, v in gaps["by_phase"].items()},
                       "largest": gaps["largest"],
                       "steady_idle_s_per_step": ((gaps["idle_s"] - gaps["first_step_s"]) / (steps - 1)
                                                  if steps > 1 and len(starts) > 1 else None)}
    return out


def compile_snapshot() -> dict[str, Any]:
    """torch._dynamo's counters and compile-time sums now (for :func:`compile_report`)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"frames": int(counters["frames"].get("ok", 0)), "frames_total": int(counters["frames"].get("total", 0)),
            "graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "seconds": {k: float(sum(v)) for k, v in compilation_time_metrics.items()}}


def _compile_seconds(metrics: dict[str, float]) -> float:
    """Dynamo's frame compiles (their backends included) plus the lazily compiled backward graphs."""
    return sum(v for k, v in metrics.items() if k == "_compile.compile_inner" or "bw_compiler" in k)


def compile_report(enabled: bool, backend: str, modules: list[str], before: dict[str, Any],
                   after_warmup: dict[str, Any], after_measured: dict[str, Any]) -> dict[str, Any]:
    """Pure: the bench's ``torch_compile`` figures from three :func:`compile_snapshot` (before the build, after
    the warm-up steps, after the measured steps): totals up to the end of the warm-up and what the measured
    steps added (frames compiled, graph breaks, seconds: all 0 when no batch recompiled)."""
    def diff(a, b):
        keys = set(a["seconds"]) | set(b["seconds"])
        secs = {k: b["seconds"].get(k, 0.0) - a["seconds"].get(k, 0.0) for k in keys}
        return {"frames": b["frames"] - a["frames"], "graphs": b["graphs"] - a["graphs"],
                "graph_breaks": b["graph_breaks"] - a["graph_breaks"], "seconds": _compile_seconds(secs),
                "seconds_by_phase": {k: v for k, v in sorted(secs.items()) if v > 0}}

    return {"enabled": enabled, "backend": backend, "modules": list(modules),
            "until_measured": diff(before, after_warmup), "during_measured": diff(after_warmup, after_measured)}


def _short_path(path: str) -> str:
    for root in ("site-packages/", "/gemray/", "/kernels/", "/pipelines/"):
        i = path.rfind(root)
        if i >= 0:
            return (path[i + 1:] if root.startswith("/") else path[i + len(root):])
    return path


def _own_frame(stack: list[traceback.FrameSummary]) -> str | None:
    """The innermost frame of this project (gemray/, kernels/, pipelines/) in a stack, as "path:line"."""
    for f in reversed(stack):
        fn = f.filename.replace("\\", "/")
        if ("/gemray/" in fn or "/kernels/" in fn or "/pipelines/" in fn) and "/bench/train.py" not in fn:
            return f"{_short_path(fn)}:{f.lineno}"
    return None


def sync_debug_step(trainer: Any, batches: "_Batches", device: torch.device) -> dict[str, Any]:
    """One more training step under ``torch.cuda.set_sync_debug_mode("warn")``: every host synchronisation
    (``.item()``, ``.cpu()``, a blocking copy, ``nonzero`` / boolean-mask indexing, ...) raises a warning, all
    captured (``warnings.catch_warnings``, "always", a ``showwarning`` that also keeps the Python stack) and
    grouped by site. Returns {"step_s", "total", "sites": [{"site": "path:line" (the frame that called into
    torch), "frame": the innermost gemray / kernels / pipelines frame or None, "count", "message"}, ...]} most
    frequent first. The step is a real one, and an ordinary one: not a ``train.log_every`` step (which reads the
    pending losses: one more step runs first when the next would be one); its loss is read after it, outside the
    capture. Raises RuntimeError off CUDA (sync debug mode is a CUDA feature)."""
    if device.type != "cuda":
        raise RuntimeError(f"bench train --sync-debug needs a CUDA device (torch.cuda.set_sync_debug_mode); this "
                           f"run is on {device.type}")
    sites: dict[tuple[str, str | None], dict[str, Any]] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        stack = traceback.extract_stack()[:-1]
        site = f"{_short_path(str(filename))}:{lineno}"
        frame = _own_frame(stack)
        rec = sites.setdefault((site, frame), {"site": site, "frame": frame, "count": 0,
                                               "message": str(message).splitlines()[0][:200]})
        rec["count"] += 1

    if (trainer.epoch_step + 1) % trainer.cfg.train.log_every == 0:  # a log step reads the pending losses: not
        trainer.train_step(batches.next()[0])                       # the ordinary step this is to show
        _sync(device)
        trainer.flush_losses()
    batch, _ = batches.next()
    _sync(device)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = trainer.train_step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    step_s = time.perf_counter() - t0
    if loss is None:
        trainer.flush_losses()
    out = sorted(sites.values(), key=lambda r: (-r["count"], r["site"]))
    return {"step_s": step_s, "total": sum(r["count"] for r in out), "sites": out}


def run_bench(cfg: JobConfig, *, steps: int, warmup: int, profile: bool = False, profile_steps: int = 3,
              warm_up_kernels: bool = True, sync_debug: bool = False, host_profile_steps: int = 0) -> dict[str, Any]:
    """Build the config's model through the Trainer's phases in this process (world size 1) and time
    ``warmup`` + ``steps`` training steps on the real pipeline, then optionally ``profile_steps`` profiled
    ones, with ``sync_debug`` one step under CUDA's sync debug mode (:func:`sync_debug_step`), with
    ``host_profile_steps`` > 0 that many under cProfile (:func:`host_profile`). Returns the
    module docstring's dict. Raises ValueError for bad step counts (:func:`check_step_counts`) or a config that wants
    a GPU that is not here (:func:`bench_device`), RuntimeError when ``sync_debug`` is asked for off CUDA (before
    anything is built)."""
    from gemray.train.warmup import warm_up_attention
    from gemray.train.trainer import Trainer

    check_step_counts(steps, warmup, profile_steps, host_profile_steps)
    cfg.data.reader = "arrow"  # the same table, read in this process: no Ray
    cfg.train.ledger_dir = ""
    cfg.train.mfu_warmup_steps = warmup
    cfg.validate()
    idle = cfg.ineffective_settings_warning()
    if idle:  # as `gemray train` says it (gemray.controller.run): valid settings that change nothing here
        logging.getLogger("gemray.config").warning("%s", idle)
    device = bench_device(cfg)
    if sync_debug and device.type != "cuda":
        raise RuntimeError(f"bench train --sync-debug needs a CUDA device (torch.cuda.set_sync_debug_mode); this "
                           f"run is on {device.type} (ray.use_gpu = {cfg.ray.use_gpu})")
    from gemray.parallel.collectives import apply_collectives_env

    apply_collectives_env(cfg.parallel.collectives)  # before NCCL's communicator (eager: device_id)
    made_pg = _init_process_group(device)
    batches = trainer = None
    try:
        snap0 = compile_snapshot()
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        trainer.setup(context=(0, 1, device), sigterm=False)  # the bench polls no vote: SIGTERM ends it
        trainer.build()
        trainer.restore(from_ray=False)
        build_s = time.perf_counter() - t0
        compile_info = getattr(trainer, "warmup_compile", None)  # the Trainer's build ran it (CUDA + Triton)
        if compile_info is None or not compile_info.get("ran"):
            compile_info = (warm_up_attention(cfg, device, trainer.dmp.module, first_batch(trainer))
                            if warm_up_kernels else
                            {"ran": False, "why": "disabled", "regimes": [], "seconds": 0.0})
        trainer.begin_epoch(0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        batches = _Batches(trainer)
        records: list[dict[str, Any]] = []
        _run_steps(trainer, batches, warmup, device, records, "warmup")
        snap1 = compile_snapshot()
        alloc0 = _allocator_counts(device)
        wall = _run_steps(trainer, batches, steps, device, records, "measured")
        alloc1 = _allocator_counts(device)
        snap2 = compile_snapshot()
        measured = [r for r in records if r["phase"] == "measured"]
        out: dict[str, Any] = {
            "config": cfg.name, "device": trainer.device_name, "world_size": 1,
            "attention_backend": cfg.model.attention_backend,
            "precision": cfg.train.precision,
            "batch_size": cfg.data.batch_size, "max_seq_len": cfg.data.max_seq_len,
            "model": {"num_blocks": cfg.model.num_blocks, "width": cfg.model.width, "num_heads": cfg.model.num_heads,
                      "attention_dim": cfg.model.attention_dim, "linear_dim": cfg.model.linear_dim,
                      "tasks": list(cfg.model.tasks)},
            "warmup_steps": warmup, "build_s": build_s, "warmup_compile": compile_info,
            "torch_compile": compile_report(cfg.train.compile, cfg.train.compile_backend,
                                            list(getattr(trainer, "compiled", [])), snap0, snap1, snap2),
            **summarize(measured, trainer.peak_flops, wall if device.type == "cuda" else None),
            "peak_memory": _peak_memory(device),
            "allocator": {k: alloc1[k] - alloc0[k] for k in alloc1} if alloc1 else None,
            "loader": {"workers": trainer.train_stream.workers, "in_process": not trainer.train_stream.workers,
                       "prefetch_batches": trainer.train_stream.prefetch,
                       "pin_memory": trainer.train_stream.pin_memory,
                       "cpu_cores": usable_cpus()},
            "steps": records,
        }
        out["scaling_ratio"], out["e2e_mfu"] = 1.0, out["local_mfu"]  # world size 1 is its own reference
        if sync_debug:
            out["sync_debug"] = sync_debug_step(trainer, batches, device)
        if profile:
            out["profile"] = profile_breakdown(trainer, batches, profile_steps, device)
            idle = device_only_idle(trainer, batches, profile_steps, device)
            if idle is not None:
                out["profile"]["device_only"] = idle
        if host_profile_steps > 0:
            out["host_profile"] = host_profile(trainer, batches, host_profile_steps, device)
        return out
    finally:
        if batches is not None:
            batches.close()  # the loader's worker processes end with the bench
        if trainer is not None and trainer.gc is not None:
            trainer.gc.close()  # Python's automatic garbage collection back (train.gc_every_steps)
        if made_pg:
            dist.destroy_process_group()


def _slow_steps_line(slow: dict[str, Any], n: int) -> str:
    """The table's line for :func:`slow_steps`' result over ``n`` measured steps."""
    st = slow["steps"]
    head = (f"  slow steps      {len(st)} of {n} over the fit of step time on tokens and FLOPs by more than "
            f"{slow['excess']:.0%} of the median step")
    if not st:
        return head
    has = [f"{sum(1 for s in st if s.get(k))} with {what}" for k, what in
           (("device_allocs", "cudaMalloc"), ("host_allocs", "cudaHostAlloc"), ("jit_misses", "JIT misses"),
            ("gc_ms", "GC")) if any(k in s for s in st)]
    mfu = slow.get("local_mfu_without")
    return (f"{head}: +{slow['excess_ms'] / len(st):.1f} ms each on average (steps "
            f"{', '.join(str(s['index']) for s in st[:12])}{', ...' if len(st) > 12 else ''}"
            f"{'; ' + ', '.join(has) if has else ''})"
            + ("" if mfu is None else f"; local MFU without them {100 * mfu:.2f}%"))


def format_table(res: dict[str, Any]) -> str:
    """The bench result as the printed table (text)."""
    from gemray.pipelines.loader import describe_workers

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.2f}%"

    s, m = res["step_s"], res["peak_memory"]
    mem = ", ".join(f"{k.replace('_bytes', '')} {v / 2**30:.2f} GiB" for k, v in m.items())
    cs = res["compile_stall"]
    lines = [
        f"gemray bench train: {res['config']} on {res['device']} ({res['attention_backend']} attention, "
        f"batch {res['batch_size']}, max seq {res['max_seq_len']}), {res['measured_steps']} steps after "
        f"{res['warmup_steps']} warm-up",
        f"  step time       median {s['median'] * 1e3:.1f} ms  p90 {s['p90'] * 1e3:.1f} ms  max {s['max'] * 1e3:.1f} ms"
        + ("" if (res.get("host_s") or {}).get("median") in (None, s["median"]) else
           f"  (host {res['host_s']['median'] * 1e3:.1f} ms in train_step)"),
        f"  throughput      {res['tokens_per_s']:.0f} tokens/s  {res['samples_per_s']:.1f} samples/s  "
        f"{res['model_tflops_per_s']:.3f} model TFLOP/s",
        f"  local MFU       {pct(res['local_mfu'])} (compute only {pct(res['local_mfu_compute'])}; the later half "
        f"of the steps {pct(res.get('local_mfu_second_half'))})",
        f"  data stall      {res['data_stall_pct']:.2f}% of step time "
        f"(loader {describe_workers(res['loader'].get('workers', 0))}, {res['loader']['cpu_cores']} cores)",
        f"  peak memory     {mem}" + ("" if not res.get("allocator") else
                                          "; allocator during the steps: {alloc_retries} retries (cache freed "
                                          "when full), {device_allocs} cudaMalloc, {device_frees} cudaFree, "
                                          "{host_allocs} cudaHostAlloc"
                                          .format(**res["allocator"])),
        f"  compile stalls  max/median step {cs['max_over_median'] or 0:.2f}"
        + (f"  FLAGGED (> {cs['factor']:g}x)" if cs["flagged"] else "  ok"),
        *([] if "gc" not in res else [
            f"  GC pauses       {res['gc']['seconds'] * 1e3:.1f} ms in the measured steps "
            f"({res['gc']['full_collections']} full collections; at most {res['gc']['max_step_s'] * 1e3:.1f} ms "
            "in one step)"]),
        *([] if not res.get("slow_steps") else [_slow_steps_line(res["slow_steps"], res["measured_steps"])]),
        *([] if "jit_misses" not in res else [
            f"  kernel compiles {res['jit_misses']['count']} JIT cache misses in {res['jit_misses']['steps']} of the "
            "measured steps" + (f" ({', '.join(res['jit_misses']['kernels'][:6])})" if res['jit_misses']['count']
                                else "")]),
        f"  kernel warm-up  {res['warmup_compile'].get('seconds', 0.0):.1f} s over "
        f"{len(res['warmup_compile'].get('regimes', []))} regime(s)"
        + ("" if res["warmup_compile"].get("ran") else f" (skipped: {res['warmup_compile'].get('why')})"),
    ]
    tc = res.get("torch_compile")
    if tc and (tc["enabled"] or tc["modules"] or tc["until_measured"]["frames"]):
        u, d = tc["until_measured"], tc["during_measured"]
        lines.append(f"  torch.compile   {'on' if tc['enabled'] else 'off (train.compile)'}, {tc['backend']}, "
                     f"{len(tc['modules'])} module(s): {u['frames']} frame(s), {u['graph_breaks']} graph break(s), "
                     f"{u['seconds']:.1f} s before the measured steps; during them {d['frames']} frame(s), "
                     f"{d['seconds']:.1f} s" + ("" if d["frames"] == 0 else "  RECOMPILED"))
    sd = res.get("sync_debug")
    if sd is not None:
        lines.append(f"  host syncs      {sd['total']} in one step ({sd['step_s'] * 1e3:.1f} ms under sync debug mode)"
                     + ("" if sd["sites"] else ": none"))
        for r in sd["sites"]:
            lines.append(f"    {r['count']:4d}x {r['site']}" + (f"  (from {r['frame']})" if r["frame"] and
                                                                 r["frame"] != r["site"] else ""))
    p = res.get("profile")
    if p:
        lines.append(f"  profile ({p['steps']} steps, {p['wall_s'] / p['steps'] * 1e3:.1f} ms per step wall):")
        for k in (*CATEGORIES, "overlapped_communication"):
            lines.append(f"    {k:<26} {p['per_step_s'][k] * 1e3:9.2f} ms  {100 * p['fraction'][k]:6.2f}%")
        if p["gpu_idle_s"] is not None:
            lines.append(f"    {'gpu_idle':<26} {p['gpu_idle_s'] * 1e3:9.2f} ms")
        idle = p.get("idle")
        if idle:
            lines.append(f"    GPU idle between kernels: {idle['idle_s_per_step'] * 1e3:.2f} ms in "
                         f"{idle['gaps_per_step']:.0f} gaps per step; by step phase: " + ", ".join(
                             f"{k.removeprefix(PHASE_PREFIX)} {v * 1e3:.2f}" for k, v in idle["by_phase"].items()))
            steady = idle.get("steady_idle_s_per_step")
            if steady is not None:
                lines.append(f"    ... after the first profiled step (whose launch queue starts empty: the phase "
                             f"begins synchronised): {steady * 1e3:.2f} ms per step")
            dev = p.get("device_only")
            if dev and "error" not in dev:
                lines.append(f"    ... with the device's activity alone recorded ({dev['steps']} steps after a marker):"
                             " "
                             f"busy {dev['busy_s_per_step'] * 1e3:.2f} ms, idle {dev['idle_s_per_step'] * 1e3:.2f} ms "
                             f"per step (their mean step {dev['step_s_mean'] * 1e3:.1f} ms)")
            elif dev:
                lines.append(f"    ... device-only profile: {dev['error'][:120]}")
            lines.append("    ... by the host operator running meanwhile (ms per step, gaps per step):")
            for n, sec, k in idle["by_host_op"][:10]:
                lines.append(f"      {sec * 1e3:8.2f} {k:7.1f}  {n[:90]}")
        lines.append("    top device kernels (ms per step; <- the host operator that launched it, where known):")
        launchers = p.get("kernel_launchers") or {}
        for n, c, sec in p["top_kernels"][:20]:
            lines.append(f"      {sec * 1e3:8.2f}  {c:<15} {n[:90]}")
            for who, s_ in launchers.get(n, [])[:1]:
                lines.append(f"                <- {who[:150]} ({s_ * 1e3:.2f} ms)")
    hp = res.get("host_profile")
    if hp:
        lines.append(f"  host profile ({hp['steps']} steps under cProfile, {hp['host_s'] * 1e3:.1f} ms per step in "
                     f"train_step), own time per step:")
        for n, sec, calls in hp["by_own"][:15]:
            lines.append(f"      {sec * 1e3:8.2f} ms {calls:8.1f} calls  {n[:100]}")
    return "\n".join(lines)


__all__ = ["CATEGORIES", "bench_device", "check_step_counts", "classify_kernel", "compile_report", "compile_snapshot",
           "device_kernels", "device_only_idle", "first_batch", "format_table", "idle_gaps", "kernel_breakdown",
           "kernel_launchers", "profile_breakdown", "run_bench", "stall_check", "steady_device_idle", "summarize",
           "sync_debug_step"]
