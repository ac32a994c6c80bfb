"""The dense HSTU stack of configs/gem-h200.toml alone on one H200: where the compiled blocks' non-GEMM time goes.

`gemray bench train --profile` on gem-h200 (benchmarks/reports/gem_h200_2026-12-03.md) puts ~47 ms of a 167 ms step
in "other" kernels of the compiled blocks and ~44 ms in GEMMs; under FSDP2 (world 1) one fused backward kernel
took 29.9 ms instead of 7.8. This script rebuilds only that part (``NUM_BLOCKS`` HSTU blocks at width 1024, 4
heads x 256, silu, the swept D = 256 tiles, bf16 autocast, each block ``Module.compile(dynamic=True)``, the
former ``train.compile`` default; the ``auto`` variants compile with ``dynamic=None``, today's) on a gem-h200-like
batch (B = 128 log-normal lengths, mean ~1000, capped at 4096) and times a forward + backward of the stack per
variant, one after the other, with the top kernels of a profiled iteration; each variant's output and gradients
are checked against the first's.

Variants (``--variants``, comma separated; lab code: the model keeps the one that wins):
  base         gemray.model.hstu.HSTUBlock as it is (addmm with the uvqk bias; F.linear for W_o)
  bias_mm      the same math with both biases added by a function whose backward is ``ones[1, T] @ dY``
               (cuBLAS) instead of inductor's column-sum reduction over T
  linear       the uvqk weight stored [out, in] and applied with F.linear (torch's usual layout for cuBLAS)
  linear_mm    linear + bias_mm
  fsdp         base under FSDP2 fully_shard (world 1, NCCL, bf16 params / fp32 reduce, as parallel.dense=fsdp)
  fsdp_nocast  fsdp with cast_forward_inputs=False (the residual stream stays fp32 into each block)
  cdt          base with inductor's coordinate-descent tuning of its kernels
  fsdp_fp32    FSDP2 with fp32 parameters (MixedPrecisionPolicy(): autocast makes the bf16 copies, as under DDP)
  tower        the candidate tower (CandidateTower: cross-attention + PMA + MLP, 64 candidates per request) alone
  tower_mm     the tower with its nn.Linear biases added as in bias_mm
  ddp          base inside DDP (world 1, NCCL) as the model trains under parallel.dense=ddp: each block compiled
               inside DDP's forward, where dynamo's DDPOptimizer splits a compiled graph at DDP's bucket boundaries
  ddp_noopt    ddp with torch._dynamo.config.optimize_ddp = False (one graph per block, DDP's hooks fire per block)
  auto         base compiled with dynamic=None (automatic dynamic: only the dims seen changing, T and B, become
               symbolic; the parameters' sizes stay static), after a first call on a shorter batch
  fsdp_auto    fsdp with the same automatic dynamic shapes
  ddp_auto     ddp_noopt with the same automatic dynamic shapes
  fsdp_wrap    fsdp with each block compiled by a torch.compile wrapper made before fully_shard (torchtitan's
               order: FSDP2's hooks then run outside the compiled module)

``--stream bf16`` feeds the stack a bf16 residual stream (``model.fp32_residual = false``, as configs/gem-h200.toml
trains; the default fp32 is the model's default). The script times whichever gemray is installed: run from another
checkout's root after its ``. benchmarks/h200_env.sh`` to time that tree's blocks.

Runs on the H200 image as it is (no ray / torchrec / fbgemm: the model package's __init__, which imports
torchrec, is bypassed). From the repository root:
    . benchmarks/h200_env.sh && python3 benchmarks/hstu_block_h200.py --out $OUT
Results: stdout (one table) and $OUT/hstu_block.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types

import torch
import torch.nn.functional as F
from torch import nn


def _import_hstu():
    """gemray.model.hstu without gemray/model/__init__.py (it imports torchrec, absent from the image)."""
    import gemray

    if "gemray.model" not in sys.modules:
        m = types.ModuleType("gemray.model")
        m.__path__ = [os.path.join(gemray.__path__[0], "model")]
        sys.modules["gemray.model"] = m
    import gemray.model.hstu as hstu

    return hstu


class _AddBias(torch.autograd.Function):
    """y [T, N] + b [N] (b cast to y's dtype, as addmm under autocast); backward: dY, ones[1, T] @ dY (one cuBLAS
    GEMM: a bandwidth-bound pass over dY, instead of a column reduction over T)."""

    @staticmethod
    def forward(ctx, y, b):
        ctx.b_dtype = b.dtype
        return y + b.to(y.dtype)

    @staticmethod
    def backward(ctx, g):
        ones = g.new_ones(1, g.shape[0])
        return g, (ones @ g).reshape(-1).to(ctx.b_dtype)


class MMBiasLinear(nn.Module):
    """nn.Linear's parameters and math, the bias added by _AddBias (its gradient by one GEMM)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x):
        return _AddBias.apply(F.linear(x, self.weight), self.bias)


class VariantBlock(nn.Module):
    """HSTUBlock's math (gemray.model.hstu, no relative bias) with the uvqk layout / bias handling of a variant;
    weights copied from ``ref``."""

    def __init__(self, ref, layout: str, bias_mm: bool):
        super().__init__()
        self.ref_attrs = (ref.d, ref.h, ref.a, ref.v, ref.max_seq_len, ref.activation, ref.backend, ref.kernel_config)
        self.layout, self.bias_mm = layout, bias_mm
        w = ref.uvqk_weight.detach()
        self.uvqk_weight = nn.Parameter(w.t().contiguous() if layout == "linear" else w.clone())
        self.uvqk_bias = nn.Parameter(ref.uvqk_bias.detach().clone())
        self.o_weight = nn.Parameter(ref.o_weight.detach().clone())
        self.o_bias = nn.Parameter(ref.o_bias.detach().clone())

    def forward(self, x, offsets, timestamps, *unused):
        from gemray import ops

        d, h, a, v, n, act, backend, kc = self.ref_attrs
        T = x.shape[0]
        x_norm = F.layer_norm(x, (d,), eps=1e-6)
        if self.layout == "linear":
            pre = F.linear(x_norm, self.uvqk_weight, None if self.bias_mm else self.uvqk_bias)
        else:
            pre = (x_norm @ self.uvqk_weight) if self.bias_mm else torch.addmm(self.uvqk_bias, x_norm,
                                                                               self.uvqk_weight)
        if self.bias_mm:
            pre = _AddBias.apply(pre, self.uvqk_bias)
        uvqk = F.silu(pre)
        u, vv, q, k = torch.split(uvqk, [h * v, h * v, h * a, h * a], 1)
        attn = ops.attention(q.reshape(T, h, a), k.reshape(T, h, a), vv.reshape(T, h, v), offsets, n,
                             activation=act, causal=True, rel_bias=None, backend=backend, config=kc)
        y = F.layer_norm(attn.reshape(T, h * v), (h * v,), eps=1e-6) * u
        if self.bias_mm:
            return x + _AddBias.apply(F.linear(y, self.o_weight), self.o_bias)
        return x + F.linear(y, self.o_weight, self.o_bias)


def lengths_like_gem(batch: int, seed: int) -> torch.Tensor:
    """[B] int64 log-normal lengths, mean ~1000, in [16, 4096] (configs/gem-h200.toml's synthetic spec)."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(1024) - 0.5
    return torch.exp(torch.randn(batch, generator=g) + mu).clamp(16, 4096).long()


def build(variant: str, hstu, cfg, num_blocks: int, device):
    torch.manual_seed(0)
    if variant.startswith("tower"):
        from gemray.model.ranking import CandidateTower

        tower = CandidateTower(cfg, 4096, device=device)
        if variant == "tower_mm":
            for name in ("q", "kv", "out", "pool"):
                setattr(tower, name, MMBiasLinear(getattr(tower, name)))
        tower.compile(dynamic=True)
        return nn.ModuleList([tower])
    refs = [hstu.HSTUBlock(cfg, 4096, device=device) for _ in range(num_blocks)]
    if variant in ("bias_mm", "linear", "linear_mm"):
        blocks = [VariantBlock(r, "linear" if variant.startswith("linear") else "addmm", variant.endswith("mm"))
                  for r in refs]
    else:
        blocks = refs
    stack = nn.ModuleList(blocks).to(device)
    dynamic = None if variant in ("auto", "fsdp_auto", "ddp_auto") else True
    import torch._dynamo.config as dcfg

    dcfg.optimize_ddp = variant == "ddp"
    if variant == "fsdp_wrap":
        stack = nn.ModuleList(torch.compile(b, dynamic=True) for b in stack)
    if variant.startswith(("fsdp", "ddp")):
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("nccl", rank=0, world_size=1)
    if variant.startswith("ddp"):
        for b in stack:
            b.compile(dynamic=dynamic)
        return DDPStack(stack, device)
    if variant.startswith("fsdp"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("nccl", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,))
        mp = (MixedPrecisionPolicy() if variant == "fsdp_fp32" else
              MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   cast_forward_inputs=variant != "fsdp_nocast"))
        for b in stack:
            fully_shard(b, mesh=mesh, mp_policy=mp)
    import torch._inductor.config as icfg

    icfg.coordinate_descent_tuning = variant == "cdt"
    if variant != "fsdp_wrap":
        for b in stack:
            b.compile(dynamic=dynamic)
    return stack


class DDPStack(nn.Module):
    """The blocks in one module under DDP (world 1), iterated like the plain stack (``step`` calls the DDP
    module's forward once for the whole stack, as the model's DDP root wraps every block)."""

    def __init__(self, stack: nn.ModuleList, device):
        super().__init__()
        from torch.nn.parallel import DistributedDataParallel as DDP

        class _Seq(nn.Module):
            def __init__(self, blocks):
                super().__init__()
                self.blocks = blocks

            def forward(self, x, offsets, ts):
                for b in self.blocks:
                    x = b(x, offsets, ts)
                return x

        self.inner = stack
        self.ddp = DDP(_Seq(stack), device_ids=[device.index or 0])

    def __iter__(self):
        return iter([self])

    def forward(self, x, offsets, ts):
        return self.ddp(x, offsets, ts)


TOWER_INPUTS: dict = {}


def step(stack, x0, offsets, ts):
    from gemray.model.ranking import CandidateTower

    x = x0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for b in stack:
            if isinstance(b, CandidateTower):
                ti = TOWER_INPUTS
                x = b(x0, offsets, ti["candidates"], ti["candidate_offsets"], ti["context"],
                      max_candidates=ti["max_candidates"])
            else:
                x = b(x, offsets, ts)
    loss = x.float().square().mean()
    loss.backward()
    return x


def grads_of(stack):
    out = []
    if isinstance(stack, DDPStack):
        stack = stack.inner
    for b in stack:
        b = getattr(b, "_orig_mod", b)  # fsdp_wrap: the block inside its torch.compile wrapper
        names = ("uvqk_weight", "uvqk_bias", "o_weight", "o_bias")
        if not hasattr(b, "uvqk_weight"):  # the tower: every parameter, in order
            out += [p.grad.detach().float().clone() for p in b.parameters() if p.grad is not None]
            continue
        for name in names:
            g = getattr(b, name).grad
            if hasattr(g, "full_tensor"):
                g = g.full_tensor()
            if name == "uvqk_weight" and isinstance(b, VariantBlock) and b.layout == "linear":
                g = g.t()
            out.append(g.detach().float().clone())
    return out


def top_kernels(stack, x0, offsets, ts, n: int = 12):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(stack, x0, offsets, ts)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.key and not e.key.startswith(("ProfilerStep", "aten::", "cuda")):
            rows.append((t / 1e3, e.key[:90]))
    rows.sort(reverse=True)
    return rows[:n]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--variants", default="base,bias_mm,linear,linear_mm,fsdp,fsdp_nocast,cdt")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--deadline-s", type=float, default=400.0)
    p.add_argument("--stream", choices=("fp32", "bf16"), default="fp32",
                   help="the residual stream's dtype into the stack: fp32 (model.fp32_residual = true) or bf16 "
                        "(false, as configs/gem-h200.toml trains)")
    args = p.parse_args()
    t_start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    hstu = _import_hstu()
    from gemray.config import load_config

    cfg = load_config("configs/gem-h200.toml").model
    dev = torch.device("cuda")
    L = lengths_like_gem(args.batch, 0)
    offsets = torch.zeros(L.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(L, 0)
    T = int(offsets[-1])
    offsets = offsets.to(dev)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(T, cfg.width, generator=g).to(dev, torch.bfloat16 if args.stream == "bf16" else torch.float32)
    ts = torch.arange(T, dtype=torch.int64, device=dev)
    n_cand = 64
    TOWER_INPUTS.update(candidates=torch.randn(args.batch * n_cand, cfg.width, generator=g).to(dev),
                        candidate_offsets=torch.arange(0, args.batch * n_cand + 1, n_cand, device=dev),
                        context=torch.randn(args.batch, cfg.width, generator=g).to(dev), max_candidates=n_cand)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: {args.blocks} HSTU block(s) width {cfg.width}, "
          f"{cfg.num_heads} heads x {cfg.attention_dim}, B={args.batch}, T={T}, max {int(L.max())}, {args.stream} stream",
          flush=True)
    results, base_out, base_grads = [], None, None
    for variant in args.variants.split(","):
        if time.monotonic() - t_start > args.deadline_s:
            print(f"{variant}: skipped (deadline {args.deadline_s:.0f} s)", flush=True)
            continue
        t0 = time.monotonic()
        torch._dynamo.reset()  # each variant compiles afresh (the blocks share one code object's cache entries)
        try:
            stack = build(variant, hstu, cfg, args.blocks, dev)
            xin = x0.clone().requires_grad_(variant.startswith("tower"))  # the tower's history: the encoder's states
            if variant in ("auto", "fsdp_auto", "ddp_auto"):  # a first, shorter batch: T and B become dynamic
                step(stack, xin[: int(offsets[-2])], offsets[:-1], ts[: int(offsets[-2])])
                for b in stack:
                    b.zero_grad(set_to_none=True)
            out = step(stack, xin, offsets, ts)  # compiles
            torch.cuda.synchronize()
            compile_s = time.monotonic() - t0
            gr = grads_of(stack)
            if base_out is None or variant in ("tower", "base"):  # the first of each family is the reference
                base_out, base_grads = out.detach().float(), gr
                err = 0.0
            else:
                errs = [((out.detach().float() - base_out).norm() / base_out.norm()).item()]
                errs += [((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(gr, base_grads)]
                err = max(errs)
            for _ in range(2):
                for b in stack:
                    b.zero_grad(set_to_none=True)
                step(stack, xin, offsets, ts)
            torch.cuda.synchronize()
            times = []
            for _ in range(args.iters):
                for b in stack:
                    b.zero_grad(set_to_none=True)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                step(stack, xin, offsets, ts)
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            times.sort()
            med = times[len(times) // 2]
            kern = top_kernels(stack, xin, offsets, ts)
            r = {"variant": variant, "median_ms": med, "per_block_ms": med / args.blocks, "min_ms": times[0],
                 "compile_s": compile_s, "max_rel_err_vs_first": err, "top_kernels_ms": kern,
                 "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            print(f"== {variant}: fwd+bwd {med:.2f} ms ({med / args.blocks:.2f} per block), compile {compile_s:.0f} s, "
                  f"max rel err vs first {err:.1e}", flush=True)
            for t, k in kern:
                print(f"   {t:8.2f}  {k}", flush=True)
            del stack
        except Exception as e:  # noqa: BLE001 - a lab script: report the variant's failure, go on
            r = {"variant": variant, "error": f"{type(e).__name__}: {e}"[:500]}
            print(f"== {variant}: FAILED {r['error']}", flush=True)
        results.append(r)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    print(f"{'variant':12s} {'ms':>8s} {'per blk':>8s} {'vs base':>8s} {'compile':>8s} {'rel err':>8s}")
    base = next((r["median_ms"] for r in results if "median_ms" in r), None)
    for r in results:
        if "median_ms" in r:
            print(f"{r['variant']:12s} {r['median_ms']:8.2f} {r['per_block_ms']:8.2f} {r['median_ms'] / base:8.3f} "
                  f"{r['compile_s']:8.0f} {r['max_rel_err_vs_first']:8.1e}")
        else:
            print(f"{r['variant']:12s} {r['error']}")
    with open(os.path.join(args.out, "hstu_block.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "T": T, "blocks": args.blocks, "stream": args.stream,
                   "results": results}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
