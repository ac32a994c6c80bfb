"""A/B of the warp-specialized Gluon forward (kernels/ws_attention.py) against the Triton forward and
varlen_attn, one process.

Runs on the lent H200 from the package layout deploy/h200/ab_ws.sh builds (``gemray`` importable):
``python3 ab_ws.py [--warm BATCH_INDEX]``. First a check on a mixed jagged batch (lengths 0, 1, the
maximum and log-normal ones; self and cross attention, causal and not, D=128 and 64): the relative
difference of o and lse of every tile choice from the Triton forward's. Then, per bench batch (bf16, H=4,
D=128, causal softmax), forward and fwd+bwd (``triton.testing.do_bench`` median, as the bench) of
varlen_attn and of JFA under each of VARIANTS (Triton or Gluon forward, work order of the launches), and
CUDA-graph replays (device time) of the forward alone.
"""

from __future__ import annotations

import argparse
import math

import torch

from gemray.kernels import bench
from gemray.kernels import jagged_attention as ja
from gemray.kernels import ws_attention as ws

TILES = [(2, 128, 2, False, False), (2, 128, 2, False, True)]
# A/B variants: (Gluon forward tiles or None = the Triton forward, jagged_attention.SEQ_ORDER entries). Runs 28-30
# also timed (1, 128, 2), (2, 64, 2) and (2, 64, 3) tiles and the ping-pong schedule; run 33 the work order
# (kernels/NOTES.md "Runs 28-38").
_ORDER = {"fwd": True, "dkdv": True, "dq": True}
VARIANTS = {
    "triton": (None, _ORDER),
    "ws": ((2, 128, 2, False, False), _ORDER),
    "ws persistent": ((2, 128, 2, False, True), _ORDER),
    "ws persistent, ping-pong": ((2, 128, 2, True, True), _ORDER),
    "ws persistent, 64-key tiles 3 stages": ((2, 64, 3, False, True), _ORDER),
}
CASES = [("uniform", 128, 1024), ("heavy", 128, 1024), ("uniform", 64, 4096), ("heavy", 256, 4096)]


def _set(tiles, order=None) -> None:
    for kind in ja.SEQ_ORDER:
        ja.SEQ_ORDER[kind] = bool((order or {}).get(kind, False))
    for r in ws.WS_FWD:
        ws.WS_FWD[r] = tiles is not None
        if tiles is not None:
            ws.WS_FWD_TILES[r] = tiles


def check() -> None:
    torch.manual_seed(3)
    print("| tiles | D | pattern | rel diff o vs Triton | rel diff grads vs Triton (dq / dk / dv) |")
    print("|---|---|---|---|---|")
    lens_q = bench.make_lengths("heavy", 40, 2048) + [0, 1, 2048, 64, 65, 127, 128, 129]
    lens_k = [max(0, x + (i % 5) * 37 - 60) for i, x in enumerate(lens_q)]
    for d in (128, 64):
        for pattern in ("causal", "full", "cross"):
            lq = lens_q
            lk = lens_k if pattern == "cross" else lens_q
            q_off = bench.offsets_of(lq, "cuda")
            kv_off = q_off if pattern != "cross" else bench.offsets_of(lk, "cuda")
            q = torch.randn(int(q_off[-1]), 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(int(kv_off[-1]), 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            causal = pattern == "causal"
            do = torch.randn_like(q)

            def run():
                spec = ja._spec(0, causal, 1.0 / math.sqrt(d), 1.0, 0, 0, False, max(lq), max(lk), 0)
                o = ja._GDPA.apply(q, k, v, None, (q_off, kv_off, None, spec, q.shape[0]))
                o.backward(do)
                g = [x.grad.clone() for x in (q, k, v)]
                for x in (q, k, v):
                    x.grad = None
                return o.detach(), g

            _set(None)
            o_ref, g_ref = run()
            for tiles in TILES:
                _set(tiles)
                try:
                    o, g = run()
                    diff = " / ".join(f"{bench._rel(a, b):.1e}" for a, b in zip(g, g_ref))
                    print(f"| {tiles} | {d} | {pattern} | {bench._rel(o, o_ref):.1e} | {diff} |", flush=True)
                except Exception as e:
                    print(f"| {tiles} | {d} | {pattern} | ERROR {e!r} |"[:400], flush=True)
            _set(None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warm", type=int, default=-1)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    if args.check:
        check()
        return
    todo = [CASES[args.warm]] if args.warm >= 0 else CASES
    if args.warm < 0:
        print("| batch | variant | fwd ms | fwd+bwd ms | fwd+bwd vs varlen | fwd graph ms |\n|---|---|---|---|---|---|")
    for kind, b, n in todo:
        lengths, off, q, k, v = bench.batch_inputs(kind, b, n)
        varlen = bench.varlen_causal(off, max(lengths))

        def jfa(a, bb, c):
            return ja.jagged_attention_triton(a, bb, c, off, n, activation="softmax")

        base = None
        if args.warm < 0:
            tf, base = bench._time_fwd_bwd(varlen, (q, k, v))
            print(f"| {kind} B={b} N={n} | varlen | {tf:.3f} | {base:.3f} | 1.00x | - |", flush=True)
        for name, (tiles, order) in VARIANTS.items():
            try:
                _set(tiles, order)
                if args.warm >= 0:
                    jfa(q, k, v).backward(torch.randn_like(q))
                    continue
                tf, tfb = bench._time_fwd_bwd(jfa, (q, k, v))
                g = bench._graph_ms(jfa, (q, k, v), backward=False)
                print(f"| {kind} B={b} N={n} | {name} | {tf:.3f} | {tfb:.3f} | {base / tfb:.2f}x | {g:.3f} |",
                      flush=True)
            except Exception as e:
                print(f"| {kind} B={b} N={n} | {name} | ERROR {e!r} |"[:400], flush=True)
            finally:
                _set(None)
                for x in (q, k, v):
                    x.grad = None
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
