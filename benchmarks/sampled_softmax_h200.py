"""The retrieval head's "uniform_shared" sampled softmax at GEM scale on the lent H200: fused kernel vs padded.

Why: at configs/gem-h200.toml's shapes (B = 128 sequences, histories up to 4096, T ~ 127k tokens, R = 512 shared
negatives per sequence, E = 64, temperature 0.05) the padded formulation moves [M, R+1] fp32 tensors ~20 times
per step; ``gemray.kernels.sampled_softmax`` keeps the logits in registers. This script times, on one log-normal
batch like the step's (CUDA events via ``triton.testing.do_bench``, median ms):

* ``triton``: ``sampled_softmax_lse_triton`` fwd and fwd+bwd (fp32 inputs, IEEE products; and bf16 inputs);
* ``reference``: ``reference.sampled_softmax_lse_ref`` (the kernel's spec: index_copy pad -> bmm -> index_select
  -> mask -> logsumexp) fwd and fwd+bwd, fp32;
* with TorchRec / FBGEMM importable (the staged GPU stack), the whole head's loss fwd+bwd, ``kernel="triton"``
  vs ``kernel="reference"`` (the former path: FBGEMM jagged_to_padded_dense -> bmm -> dense_to_jagged).

    . benchmarks/h200_env.sh && python3 benchmarks/sampled_softmax_h200.py --out $OUT
    . benchmarks/h200_env.sh && python3 benchmarks/sampled_softmax_h200.py --sweep --out $OUT

Prints one table and the errors of the kernel against the reference; writes $OUT/sampled_softmax.json. With
``--sweep``: each of the three kernels alone (forward, dH, dE) on float32 inputs, for every tl.dot precision
("ieee", "tf32x3", "tf32") and tile / warps of ``SWEEP_TILES``, timed and compared with a float64 reference (the
same lse / gradient inputs for all, so each error is that kernel's); writes $OUT/sampled_softmax_sweep.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from gemray.kernels import reference as ref
from gemray.kernels import sampled_softmax as ssm
from gemray.kernels.sampled_softmax import sampled_softmax_lse_triton

TEMP = 0.05
#: (BLOCK_M, BLOCK_R, num_warps) candidates of the sweep, for each kernel
SWEEP_TILES = [(32, 32, 4), (32, 64, 4), (64, 32, 4), (64, 64, 4), (64, 64, 8), (128, 64, 8), (64, 128, 4),
               (64, 128, 8), (128, 128, 8)]


def _batch(B: int, R: int, E: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(B, generator=g) * 1.2 + 6.0).clamp(2, 4096).long()
    lengths[0] = 4096
    rows = (lengths - 1).clamp(min=0)
    row_offsets = F.pad(rows.cumsum(0), (1, 0)).cuda()
    M = int(rows.sum())
    h = F.normalize(torch.randn(M, E, generator=g), dim=-1).cuda()
    pos = (h * F.normalize(torch.randn(M, E, generator=g), dim=-1).cuda()).sum(-1)
    e_neg = F.normalize(torch.randn(B, R, E, generator=g), dim=-1).cuda()
    neg_ids = torch.randint(1, 100_000, (B, R), generator=g).cuda()
    target_ids = torch.randint(1, 100_000, (M,), generator=g).cuda()
    return lengths, (h, pos, e_neg, neg_ids, target_ids, row_offsets, int(rows.max())), M


def _fwd_bwd(fn, args, dtype=None):
    h, pos, e_neg, *rest = args
    if dtype is not None:
        h, e_neg = h.to(dtype), e_neg.to(dtype)
    h, pos, e_neg = (x.detach().requires_grad_() for x in (h, pos, e_neg))
    g = torch.randn(h.shape[0], device=h.device) / h.shape[0]

    def fwd():
        with torch.no_grad():
            return fn(h, pos, e_neg, *rest, TEMP)

    def both():
        lse = fn(h, pos, e_neg, *rest, TEMP)
        return torch.autograd.grad(lse, (h, pos, e_neg), g)

    return fwd, both


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--negatives", type=int, default=512)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--sweep", action="store_true", help="each kernel alone over precisions and tiles (float32)")
    a = ap.parse_args()
    lengths, args, M = _batch(a.batch, a.negatives, a.dim)
    print(f"B={a.batch} R={a.negatives} E={a.dim} T={int(lengths.sum())} M={M} max_len={int(lengths.max())}")
    if a.sweep:
        return _sweep(args, Path(a.out))
    res = {}
    for name, fn, dt in (("triton_fp32", sampled_softmax_lse_triton, None),
                         ("triton_bf16", sampled_softmax_lse_triton, torch.bfloat16),
                         ("reference_fp32", ref.sampled_softmax_lse_ref, None)):
        fwd, both = _fwd_bwd(fn, args, dt)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        res[name] = {"fwd_ms": do_bench(fwd), "fwd_bwd_ms": do_bench(both)}
        both()
        res[name]["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    # errors against the reference (fp32)
    outs = {}
    for name, fn, dt in (("triton_fp32", sampled_softmax_lse_triton, None),
                         ("triton_bf16", sampled_softmax_lse_triton, torch.bfloat16),
                         ("reference_fp32", ref.sampled_softmax_lse_ref, None)):
        h, pos, e_neg, *rest = args
        if dt is not None:
            h, e_neg = h.to(dt), e_neg.to(dt)
        h, pos, e_neg = (x.detach().requires_grad_() for x in (h, pos, e_neg))
        lse = fn(h, pos, e_neg, *rest, TEMP)
        outs[name] = (lse, *torch.autograd.grad(lse.sum(), (h, pos, e_neg)))
    for name in ("triton_fp32", "triton_bf16"):
        res[name]["rel_err"] = {k: _rel(x, y) for k, x, y in zip(("lse", "dh", "dpos", "de"), outs[name],
                                                                    outs["reference_fp32"])}
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except ImportError:
        print("(TorchRec / FBGEMM not importable: the whole-head comparison is skipped)")
    else:
        res.update(_head(lengths, a))
    print(f"{'variant':<22}{'fwd ms':>10}{'fwd+bwd ms':>12}{'peak MiB':>10}  rel err")
    for k, v in res.items():
        print(f"{k:<22}{v.get('fwd_ms', float('nan')):>10.3f}{v['fwd_bwd_ms']:>12.3f}"
              f"{v.get('peak_extra_mib', float('nan')):>10.0f}  {v.get('rel_err', '')}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampled_softmax.json").write_text(json.dumps(res, indent=1))


def _sweep(args, out: Path) -> None:
    """Each kernel alone on float32 inputs: median ms and the max relative error against float64 (module docstring)."""
    h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows = args
    B, R, E = e_neg.shape
    g = torch.randn(h.shape[0], device=h.device) / h.shape[0]
    hd, pd, ed = (x.double().detach().requires_grad_() for x in (h, pos, e_neg))
    lse64 = ref.sampled_softmax_lse_ref(hd, pd, ed, neg_ids, target_ids, row_offsets, max_rows, TEMP)
    dh64, dpos64, de64 = torch.autograd.grad(lse64, (hd, pd, ed), g.double())
    hk, ek, nk, tk, ro = ssm._prep(h, e_neg, neg_ids, target_ids, row_offsets)
    pos, lse_in, scale = pos.contiguous(), lse64.float().contiguous(), 1.0 / TEMP
    rows, best = [], {}
    for kernel in ("fwd", "dh", "de"):
        for prec in ("ieee", "tf32x3", "tf32"):
            for tile in SWEEP_TILES:
                lse = torch.empty_like(lse_in)
                dh, dpos, de = torch.empty_like(hk), torch.empty_like(pos), torch.empty_like(ek)
                if kernel == "fwd":
                    fn = lambda: ssm.launch_fwd(hk, pos, ek, nk, tk, ro, lse, max_rows, scale, tile, prec)  # noqa: E731
                elif kernel == "dh":
                    fn = lambda: ssm.launch_dh(hk, pos, ek, nk, tk, ro, lse_in, g, dh, dpos, max_rows, scale,  # noqa: E731
                                               tile, prec)
                else:
                    fn = lambda: ssm.launch_de(hk, ek, nk, tk, ro, lse_in, g, de, scale, tile, prec)  # noqa: E731
                try:
                    fn()
                    torch.cuda.synchronize()
                    ms = do_bench(fn)
                except Exception as exc:  # a tile that does not compile: reported, the sweep goes on
                    rows.append(dict(kernel=kernel, prec=prec, tile=list(tile), error=repr(exc)[:200]))
                    print(f"{kernel:4s} {prec:7s} {tile}: FAILED {exc!r}"[:300])
                    continue
                err = (_rel(lse, lse64) if kernel == "fwd" else max(_rel(dh, dh64), _rel(dpos, dpos64))
                       if kernel == "dh" else _rel(de, de64))
                rows.append(dict(kernel=kernel, prec=prec, tile=list(tile), ms=ms, rel_err=err))
                print(f"{kernel:4s} {prec:7s} {str(tile):14s} {ms:8.3f} ms  rel err {err:.2e}", flush=True)
                if (kernel, prec) not in best or ms < best[kernel, prec][0]:
                    best[kernel, prec] = (ms, tile, err)
    print("fastest tile per kernel and precision:")
    for (kernel, prec), (ms, tile, err) in best.items():
        print(f"  {kernel:4s} {prec:7s} {ms:8.3f} ms at {tile} (rel err {err:.2e})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampled_softmax_sweep.json").write_text(json.dumps(rows, indent=1))


def _head(lengths, a) -> dict:
    from gemray.model.heads import RetrievalHead

    g = torch.Generator().manual_seed(1)
    B, R, D = a.batch, a.negatives, a.dim
    offsets = F.pad(lengths.cumsum(0), (1, 0)).cuda()
    T = int(offsets[-1])
    states = F.normalize(torch.randn(T, D, generator=g), dim=-1).cuda()
    item_ids = torch.randint(1, 100_000, (T,), generator=g).cuda()
    item_emb = torch.randn(T, D, generator=g).cuda()
    neg_ids = torch.randint(1, 100_000, (B, R), generator=g).cuda()
    neg_emb = torch.randn(B * R, D, generator=g).cuda()
    host = dict(max_len=int(lengths.max()), num_next=int((lengths - 1).clamp(min=0).sum()))
    out, losses = {}, {}
    for kernel in ("triton", "reference"):
        head = RetrievalHead("uniform_shared", R, TEMP, kernel=kernel)
        xs = [x.detach().requires_grad_() for x in (states, item_emb, neg_emb)]

        def both():
            loss = head(xs[0], offsets, item_ids, xs[1], neg_ids, xs[2], **host)[0]
            return (loss.detach(), *torch.autograd.grad(loss, xs))

        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out[f"head_{kernel}"] = {"fwd_bwd_ms": do_bench(both)}
        losses[kernel] = both()
        out[f"head_{kernel}"]["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    out["head_triton"]["rel_err"] = {k: _rel(x, y) for k, x, y in zip(("loss", "dstates", "ditem", "dneg"),
                                                                       losses["triton"], losses["reference"])}
    return out


if __name__ == "__main__":
    main()
