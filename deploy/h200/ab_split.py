"""A/B of the JFA length classes (jagged_attention.SPLIT_LEN) against one class and varlen_attn, same process.

Runs on the lent H200 from the package layout deploy/h200/kernels_bench.sh builds (``gemray`` importable):
``python3 ab_split.py [--warm BATCH_INDEX]``. For each bench batch (bf16, H=4, D=128, causal softmax) it times
fwd+bwd (``triton.testing.do_bench`` median, as the bench) of varlen_attn, of JFA with one class and of JFA
with each candidate split length (the long class runs the tiles of its length's regime, or of the regime named
after the "@"), checks each variant's output against varlen_attn's, and prints one table. It also times 20
back-to-back steps between two events (no L2 flush between steps) to compare with do_bench's per-step figure.
``--warm I`` runs batch I's variants once (compiles them into TRITON_CACHE_DIR; run four in parallel first).
"""

from __future__ import annotations

import argparse

import torch

from gemray.kernels import bench
from gemray.kernels import jagged_attention as ja

# (batch, [split variants]); "1024@xlong": split 1024, long class with the xlong regime's tiles and mode
VARIANTS = [
    (("uniform", 128, 1024), []),
    (("heavy", 128, 1024), ["256", "512", "256@long"]),
    (("uniform", 64, 4096), []),
    (("heavy", 256, 4096), ["1024", "2048", "1024@xlong", "512@long", "768@long"]),
]


def _apply(split: str, reg: str) -> None:
    """Set SPLIT_LEN for the batch regime ``reg`` from ``split`` ("0" = one class)."""
    length, _, long_reg = split.partition("@")
    ja.SPLIT_LEN = {r: int(length) if r == reg else 0 for r in ja.SPLIT_LEN}
    ja.regime = _REGIME if not long_reg else (lambda total, batch, lr=long_reg: lr if batch == 1 else _REGIME(total, batch))


_REGIME = ja.regime


def _back_to_back(fn, inputs, do, steps: int = 20) -> float:
    for _ in range(3):
        fn(*inputs).backward(do)
    torch.cuda.synchronize()
    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        fn(*inputs).backward(do)
    z.record()
    torch.cuda.synchronize()
    for x in inputs:
        x.grad = None
    return a.elapsed_time(z) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warm", type=int, default=-1)
    args = p.parse_args()
    todo = [VARIANTS[args.warm]] if args.warm >= 0 else VARIANTS
    if args.warm < 0:
        print("| batch | variant | classes | fwd ms | fwd+bwd ms | back-to-back ms | vs varlen | rel diff vs varlen |")
        print("|---|---|---|---|---|---|---|---|")
    for (kind, b, n), splits in todo:
        lengths, off, q, k, v = bench.batch_inputs(kind, b, n)
        reg = _REGIME(q.shape[0], b)
        varlen = bench.varlen_causal(off, max(lengths))

        def jfa(a, bb, c):
            return ja.jagged_attention_triton(a, bb, c, off, n, activation="softmax")

        do = torch.randn_like(q)
        with torch.no_grad():
            ref_out = varlen(q, k, v)
        base = None
        for name in ["varlen", "0"] + splits:
            fn = varlen if name == "varlen" else jfa
            if name != "varlen":
                _apply(name, reg)
            try:
                if args.warm >= 0:
                    fn(q, k, v).backward(do)
                    torch.cuda.synchronize()
                    continue
                with torch.no_grad():
                    diff = bench._rel(fn(q, k, v), ref_out)
                classes = "-" if name == "varlen" else "+".join(
                    f"{r}[{lo},{hi or ''})" for r, lo, hi in ja._classes(
                        ja._spec(0, True, 1.0, 1.0, 0, 0, False, n, n, 0), reg, True))
                t_f, t_fb = bench._time_fwd_bwd(fn, (q, k, v))
                b2b = _back_to_back(fn, (q, k, v), do)
                if name == "varlen":
                    base = t_fb
                ratio = f"{base / t_fb:.2f}x" if base else "-"
                print(f"| {kind} B={b} N={n} | {name if name == 'varlen' else 'jfa split ' + name} | {classes} | "
                      f"{t_f:.3f} | {t_fb:.3f} | {b2b:.3f} | {ratio} | {diff:.1e} |", flush=True)
            except Exception as e:  # one failing variant must not hide the others
                print(f"| {kind} B={b} N={n} | {name} | ERROR {e!r} |"[:300], flush=True)
            finally:
                _apply("0", reg)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
