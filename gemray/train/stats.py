"""Per-epoch training statistics, reducible over ranks at any step boundary, and the rank-0 progress meter."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class EpochStats:
    """Running global statistics of one epoch, reducible at any step boundary (for mid-epoch checkpoints).

    Local part: per-step token and sample counts of this rank, loss and target sums, wall seconds, model
    FLOPs (``gemray.train.throughput.batch_flops``) and, for the steps after the warm-up, their FLOPs and
    seconds again (the MFU window). :meth:`reduce` (collective) folds them into the global part ``g``:
    {"loss_sum", "target_sum", "samples", "tokens", "imb_sum", "imb_steps", "train_s", "flops" (all ranks),
    "mfu_flops" / "mfu_rank_s" (FLOPs and step seconds of the measured steps, summed over ranks)}, which is
    identical on every rank and is what a checkpoint stores (``saved`` restores it on resume).
    """

    KEYS = ("loss_sum", "target_sum", "samples", "tokens", "imb_sum", "imb_steps", "train_s", "flops", "mfu_flops",
            "mfu_rank_s")

    def __init__(self, saved: dict[str, float] | None = None):
        self.g = {k: float((saved or {}).get(k, 0.0)) for k in self.KEYS}
        self._clear()

    def _clear(self) -> None:
        self.tokens: list[int] = []
        self.samples: list[int] = []
        self.loss_sum = self.target_sum = 0.0
        self.flops = self.mfu_flops = self.mfu_s = 0.0
        self.t0 = time.perf_counter()

    def add(self, loss: float, num_targets: float, tokens: int, samples: int, flops: float = 0.0,
            seconds: float | None = None) -> None:
        """One step of this rank: mean loss over its ``num_targets`` predicted positions, its token and
        sample (sequence) counts, its model FLOPs, and its wall ``seconds`` when the step is measured for
        MFU (None: a warm-up step, outside the MFU window)."""
        self.loss_sum += loss * num_targets
        self.target_sum += num_targets
        self.tokens.append(tokens)
        self.samples.append(samples)
        self.flops += flops
        if seconds is not None:
            self.mfu_flops += flops
            self.mfu_s += seconds

    def reduce(self, device: torch.device, world: int) -> dict[str, float]:
        """Collective: fold every rank's steps since the last reduce into the global sums; returns them.

        Every rank must have added the same number of steps (the trainer's collective discipline).
        """
        wall = time.perf_counter() - self.t0
        local = torch.tensor([self.tokens, self.samples], dtype=torch.int64, device=device).reshape(2, -1)
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        per_rank = torch.stack([g[0].cpu() for g in gathered], dim=1).to(torch.float64)  # [steps, world]
        mean = per_rank.mean(dim=1)
        busy = mean > 0
        sums = torch.tensor([self.loss_sum, self.target_sum, self.flops, self.mfu_flops, self.mfu_s],
                            dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        wall_t = torch.tensor([wall], dtype=torch.float64, device=device)
        dist.all_reduce(wall_t, op=dist.ReduceOp.MAX)
        sums = sums.cpu()
        self.g["loss_sum"] += float(sums[0])
        self.g["target_sum"] += float(sums[1])
        self.g["flops"] += float(sums[2])
        self.g["mfu_flops"] += float(sums[3])
        self.g["mfu_rank_s"] += float(sums[4])
        self.g["samples"] += float(sum(int(g[1].sum()) for g in gathered))
        self.g["tokens"] += float(per_rank.sum())
        self.g["imb_sum"] += float((per_rank[busy].max(dim=1).values / mean[busy]).sum()) if bool(busy.any()) else 0.0
        self.g["imb_steps"] += float(busy.sum())
        self.g["train_s"] += float(wall_t.cpu())
        self._clear()
        return dict(self.g)

    def result(self, peak_flops: float | None = None) -> dict[str, float | None]:
        """The epoch's figures from the global sums (call after :meth:`reduce`): ``train_loss`` (mean over
        predicted positions), ``samples_per_s`` / ``tokens_per_s`` (global, training seconds only),
        ``token_imbalance`` (mean over steps with tokens of max/mean tokens across ranks), ``train_s``,
        ``model_tflops_per_s`` (global model FLOPs / training seconds / 1e12), ``local_mfu`` (the measured
        steps' FLOPs / their seconds / ``peak_flops``, i.e. the ranks' mean MFU weighted by time; None
        without a peak or without measured steps) and the sums behind it, ``mfu_flops`` / ``mfu_rank_s``
        (so a run's figure can be formed over epochs) and ``peak_flops``."""
        g, w = self.g, max(self.g["train_s"], 1e-9)
        local = (g["mfu_flops"] / g["mfu_rank_s"] / peak_flops
                 if peak_flops and g["mfu_rank_s"] > 0 else None)
        return {"train_loss": g["loss_sum"] / g["target_sum"] if g["target_sum"] else 0.0,
                "samples_per_s": g["samples"] / w, "tokens_per_s": g["tokens"] / w,
                "token_imbalance": g["imb_sum"] / g["imb_steps"] if g["imb_steps"] else 1.0, "train_s": w,
                "model_tflops_per_s": g["flops"] / w / 1e12, "local_mfu": local, "mfu_flops": g["mfu_flops"],
                "mfu_rank_s": g["mfu_rank_s"], "peak_flops": peak_flops}


class ThroughputMeter:
    """This rank's samples/s, tokens/s, model TFLOP/s and local MFU since the last :meth:`rates` call (for the
    progress log lines). peak_flops: the device's dense bf16 peak (FLOP/s), None on CPU (MFU then None)."""

    def __init__(self, peak_flops: float | None = None) -> None:
        self.peak_flops = peak_flops
        self._reset()

    def _reset(self) -> None:
        self.t0, self.samples, self.tokens, self.flops = time.perf_counter(), 0, 0, 0.0

    def add(self, samples: int, tokens: int, flops: float = 0.0) -> None:
        self.samples += samples
        self.tokens += tokens
        self.flops += flops

    def rates(self) -> tuple[float, float]:
        """(samples/s, tokens/s) since the last call (or construction), then start counting anew."""
        r = self.rates_full()
        return r["samples_per_s"], r["tokens_per_s"]

    def rates_full(self) -> dict[str, float | None]:
        """{"samples_per_s", "tokens_per_s", "tflops_per_s", "mfu" (None without a peak)} since the last call
        (or construction), then start counting anew."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"samples_per_s": self.samples / dt, "tokens_per_s": self.tokens / dt,
               "tflops_per_s": self.flops / dt / 1e12,
               "mfu": self.flops / dt / self.peak_flops if self.peak_flops else None}
        self._reset()
        return out


def progress_line(epoch: int, step: int, steps: int, global_step: int, loss: float, samples_per_s: float,
                  tokens_per_s: float, *, done: int, elapsed_s: float, tflops_per_s: float | None = None,
                  mfu: float | None = None, lr: float | None = None) -> str:
    """Pure: the per-epoch progress line of rank 0, e.g.
    ``epoch 1 step 40/120 (global 40) loss 5.1234, lr 1.00e-03, 812 samples/s, 30144 tokens/s (rank 0), ETA
    0:01:05``.

    epoch: 1-based; step / steps: steps of this epoch done / in all (a resumed epoch counts from its saved
    position); samples_per_s / tokens_per_s: this rank's rates since the previous line; done / elapsed_s:
    steps this attempt ran in the epoch and their seconds, whose mean gives the ETA of the remaining
    ``steps - step`` steps (evaluation not included; "?" before the first step); tflops_per_s / mfu (a
    fraction of the device's peak, None: unknown): model FLOP rate of this rank, added when tflops_per_s is
    given (ThroughputMeter.rates_full); lr: the base dense learning rate of the last step (``train.lr`` x the
    warm-up factor, before the per-group ``lr_base_fan_in`` multipliers), shown after the loss when given."""
    eta = "?"
    if done > 0 and elapsed_s > 0:
        s = int(round((steps - step) * elapsed_s / done))
        eta = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return (f"epoch {epoch} step {step}/{steps} (global {global_step}) loss {loss:.4f}, "
            + ("" if lr is None else f"lr {lr:.2e}, ")
            + f"{samples_per_s:.0f} samples/s, {tokens_per_s:.0f} tokens/s (rank 0), "
            + ("" if tflops_per_s is None else
               f"{tflops_per_s:.3f} TFLOP/s, MFU {'n/a' if mfu is None else f'{100 * mfu:.2f}%'}, ")
            + f"ETA {eta}")



#: What :func:`epoch_summary` shows of an epoch's record, in order: (key, format with the value as {}).
_EPOCH_FIELDS = (("train_loss", "train loss {:.4g}"), ("samples_per_s", "{:.4g} samples/s"),
                 ("tokens_per_s", "{:.0f} tokens/s"), ("token_imbalance", "token imbalance {:.3f}"),
                 ("model_tflops_per_s", "{:.3g} TFLOP/s"))


def epoch_summary(epochs: int, metrics: dict) -> str:
    """Pure: rank 0's one-line summary of a finished epoch for the console, e.g.
    ``epoch 5/10 done in 157.6 s (global step 120): train loss 3.037, 59.95 samples/s, 6473 tokens/s, token
    imbalance 1.030, 0.00708 TFLOP/s; valid hr@10 0.1889, ndcg@10 0.1015; ctr: NE 0.9300, AUC 0.6100 +/- 0.0040,
    calibration 1.0700, log loss 0.5200, base rate 0.2000, 640 examples``.

    epochs: ``train.epochs``; metrics: the epoch's record as ``train_fn`` reports it (``epoch``, ``global_step``,
    ``epoch_s``, the ``EpochStats.result()`` fields, the ``valid_*`` figures on evaluation epochs). Shown: the
    fields of ``_EPOCH_FIELDS`` present, the local MFU when known (not None), and the history-filtered
    validation figures (not the ``*_unfiltered`` ones nor ``valid_targets_in_history``): the retrieval figures as
    ``key value``, then each ranking task as ``gemray.train.evaluation.ranking_summary`` writes it (as the test line
    and ``gemray evaluate`` do); every field stays in metrics.json's ``history``."""
    from gemray.config import ModelConfig
    from gemray.train.evaluation import ranking_summary

    m = metrics
    head = f"epoch {m['epoch']}/{epochs} done"
    if isinstance(m.get("epoch_s"), (int, float)):
        head += f" in {m['epoch_s']:.1f} s"
    parts = [fmt.format(m[k]) for k, fmt in _EPOCH_FIELDS if isinstance(m.get(k), (int, float))]
    if isinstance(m.get("local_mfu"), (int, float)):
        parts.append(f"MFU {100 * m['local_mfu']:.2f}%")
    line = f"{head} (global step {m.get('global_step')}): " + ", ".join(parts)
    valid = {k[len("valid_"):]: v for k, v in m.items() if k.startswith("valid_") and isinstance(v, (int, float))
             and not k.endswith("_unfiltered") and k != "valid_targets_in_history"}
    tasks = tuple(f"{t}_" for t in ModelConfig.RANKING_TASKS)
    retrieval = ", ".join(f"{k} {v:.4f}" for k, v in valid.items() if not k.startswith(tasks))
    parts = ([retrieval] if retrieval else []) + ranking_summary(valid)
    if parts:
        line += "; valid " + "; ".join(parts)
    return line
