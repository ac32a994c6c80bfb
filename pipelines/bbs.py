"""Base batch shuffling (BBS): token-balanced batches without cross-rank communication. Numpy (and pyarrow for
the shard lengths that :func:`simulate_imbalance` reads through :mod:`gemray.pipelines.shards`).

Jagged batches of user histories carry very different token counts (ML-1M history lengths run from 20
to 2,314), so in data-parallel training the rank that drew the heaviest batch sets every step's pace.
BBS (as in Meta's GEM / "base batch" balancing for generative recommenders) balances *locally*: each
rank takes a window of its own samples, sorts them by token count, cuts the sorted order into
sub-batches of ``sub_batch_size`` and deals the sub-batches, heaviest first, each to the currently
lightest batch with room (heaviest with lightest: with two sub-batches per batch, sub-batch i pairs
with sub-batch n-1-i), then swaps sub-batches between the heaviest and lightest batch while that helps. Every batch of the window then carries nearly the window's mean tokens
per batch; since every rank's samples are a random draw from the same data, all ranks' step-t batches
land near the same total, with no communication at all.

Shape key: S samples in a window, W = window size, R ranks (world_size), T steps.

Worked example (batch_size 4, sub_batch_size 2, token counts [1, 9, 2, 8, 3, 7, 4, 6])::

    sorted (heaviest first): 9 8 7 6 4 3 2 1 -> sub-batches [9 8] [7 6] [4 3] [2 1]
    heaviest-with-lightest over 2 batches: batch 0 = [9 8] + [2 1] = 20 tokens, batch 1 = [7 6] + [4 3] = 20 tokens
    (without BBS, consecutive batches: [1 9 2 8] = 20, [3 7 4 6] = 20 here, but e.g. sorted input
    [9 8 7 6 4 3 2 1] would give 30 vs 10)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .movielens import load_manifest
from .schema import check_split, split_input_lengths
from .shards import assign_shards, num_batches_for, read_shard_lengths

__all__ = ["form_batches", "imbalance", "plan_epoch", "simulate_imbalance", "epoch_rng", "global_epoch_order",
           "plan_global_step", "global_steps_left"]


def form_batches(token_counts: np.ndarray, batch_size: int, sub_batch_size: int,
                 rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Form token-balanced batches from one window of samples (BBS).

    token_counts: [S] int, tokens of each sample in the window (S >= 0).
    batch_size: samples per batch; must be a positive multiple of ``sub_batch_size``.
    rng: optional generator; when given, ties in token count are broken at random and the order of the
        full batches is shuffled (so the heaviest sub-batch is not always in batch 0). None: deterministic.
    Returns ceil(S / batch_size) int64 index arrays into ``token_counts``; together a permutation of
    range(S) (every index exactly once). All hold ``batch_size`` samples except the last when S is not
    a multiple of batch_size: that one holds S % batch_size samples, a stratified pick (every
    S/(S % batch_size)-th sample of the sorted order) so its tokens stay proportional to its size.
    Raises ValueError for non-positive sizes or a batch_size that is not a multiple of sub_batch_size.
    """
    tokens = np.asarray(token_counts)
    if tokens.ndim != 1:
        raise ValueError(f"token_counts: expected a 1-D array [S], got shape {tokens.shape}")
    if batch_size < 1 or sub_batch_size < 1 or batch_size % sub_batch_size:
        raise ValueError(f"batch_size ({batch_size}) must be a positive multiple of sub_batch_size "
                         f"({sub_batch_size})")
    s = tokens.size
    if s == 0:
        return []
    if rng is not None:
        pre = rng.permutation(s)  # random tie-break; the stable sort keeps it among equal counts
        order = pre[np.argsort(-tokens[pre], kind="stable")]
    else:
        order = np.argsort(-tokens, kind="stable")
    short = np.empty(0, np.int64)
    rem = s % batch_size
    if rem:
        # The short batch takes a stratified sample of the sorted order (every (s/rem)-th sample), so
        # its tokens stay proportional to its size and the full batches keep a representative mix.
        pick = np.floor((np.arange(rem) + 0.5) * (s / rem)).astype(np.int64)
        keep = np.ones(s, bool)
        keep[pick] = False
        short, order = order[pick], order[keep]
    num_full = order.size // batch_size
    # Deal sub-batches heaviest first, each to the lightest batch that still has room (LPT with equal
    # capacities). With 2 sub-batches per batch this is exactly "pair sub-batch i with n-1-i".
    per_batch = batch_size // sub_batch_size
    subs = [order[lo:lo + sub_batch_size] for lo in range(0, order.size, sub_batch_size)]
    weight = np.array([float(tokens[sb].sum()) for sb in subs])
    members: list[list[int]] = [[] for _ in range(num_full)]
    load = np.zeros(num_full)
    room = np.full(num_full, per_batch)
    for k in range(len(subs)):
        j = int(np.argmin(np.where(room > 0, load, np.inf)))
        members[j].append(k)
        load[j] += weight[k]
        room[j] -= 1
    # Then swap sub-batches between the heaviest and the lightest batch while that lowers the heavier
    # of the two (the capacity constraint can leave the batch holding the heaviest sub-batch high).
    for _ in range(4 * num_full):
        h, lo_ = int(np.argmax(load)), int(np.argmin(load))
        gap = load[h] - load[lo_]
        wa, wb = weight[members[h]], weight[members[lo_]]
        delta = wa[:, None] - wb[None, :]
        ok = (delta > 0) & (delta < gap)
        if not ok.any():
            break
        a, b = np.unravel_index(np.argmin(np.where(ok, np.abs(delta - gap / 2), np.inf)), delta.shape)
        members[h][a], members[lo_][b] = members[lo_][b], members[h][a]
        load[h] -= delta[a, b]
        load[lo_] += delta[a, b]
    batches = [[subs[k] for k in sorted(m)] for m in members]
    out = [np.concatenate(b).astype(np.int64) for b in batches]
    if rng is not None and out:
        out = [out[j] for j in rng.permutation(len(out))]
    if rem:
        out.append(short.astype(np.int64))
    return out


def imbalance(tokens_per_rank_per_step: np.ndarray) -> float:
    """Load imbalance of data-parallel steps: mean over steps of max/mean tokens across ranks.

    tokens_per_rank_per_step: [T, R] tokens each rank processes at each step. 1.0 = perfect balance;
    2.0 = on average the busiest rank has twice the mean. Steps where no rank has any token are skipped
    (nobody waits); returns 1.0 when no step has tokens. Raises ValueError for a non-2-D input or
    negative counts.
    """
    x = np.asarray(tokens_per_rank_per_step, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"tokens_per_rank_per_step: expected [steps, world_size], got shape {x.shape}")
    if (x < 0).any():
        raise ValueError("tokens_per_rank_per_step: negative token counts")
    mean = x.mean(axis=1) if x.shape[1] else np.zeros(x.shape[0])
    busy = mean > 0
    if not busy.any():
        return 1.0
    return float((x[busy].max(axis=1) / mean[busy]).mean())


def epoch_rng(seed: int, epoch: int, rank: int) -> np.random.Generator:
    """The generator behind a rank's epoch order: a function of (seed, epoch, rank) only."""
    return np.random.default_rng([int(seed), int(epoch), int(rank)])


def global_epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """[N] int64: the epoch's global sample order, a function of (seed, epoch) only (never of world size).

    Elastic training consumes this order as a growing prefix (see :func:`plan_global_step`), so the data
    position of an epoch is one integer, ``consumed``, valid at any world size. ``shuffle=False``: 0..N-1.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples: expected >= 0, got {num_samples}")
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch), 0x6E4A]).permutation(num_samples).astype(np.int64)


def global_steps_left(num_samples: int, consumed: int, world_size: int, batch_size: int) -> int:
    """Steps left in the epoch: ceil((N - consumed) / (world_size * batch_size)); same on every rank."""
    if world_size < 1 or batch_size < 1 or not 0 <= consumed <= num_samples:
        raise ValueError(f"global_steps_left: bad arguments num_samples={num_samples}, consumed={consumed}, "
                         f"world_size={world_size}, batch_size={batch_size}")
    return -(-(num_samples - consumed) // (world_size * batch_size))


def plan_global_step(order: np.ndarray, input_lengths: np.ndarray, *, consumed: int, world_size: int,
                     batch_size: int, bbs: bool, sub_batch_size: int, seed: int, epoch: int
                     ) -> tuple[list[np.ndarray], int]:
    """One global step of the elastic plan: the next ``world_size * batch_size`` samples of ``order``.

    order: [N] int64 from :func:`global_epoch_order`; input_lengths: [N] model-input tokens per sample.
    consumed: samples of ``order`` already trained this epoch (a prefix). The step takes
    ``chunk = order[consumed : consumed + world_size * batch_size]`` and, with ``bbs``, balances it over
    the ranks with :func:`form_batches` (rng seeded by (seed, epoch, consumed): the same on every rank,
    no communication), else cuts it into consecutive slices. Returns (``world_size`` int64 index arrays
    into the samples, one per rank, some possibly empty at the epoch's end; the new ``consumed``).
    Because every step consumes a prefix of ``order``, a restart at any world size resumes exactly at
    ``consumed``: every sample is trained once per epoch. Raises ValueError for consumed outside 0..N.
    """
    n = int(np.asarray(order).size)
    if not 0 <= consumed <= n:
        raise ValueError(f"plan_global_step: consumed={consumed} outside 0..{n}")
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"plan_global_step: world_size ({world_size}) and batch_size ({batch_size}) must be >= 1")
    chunk = np.asarray(order[consumed:consumed + world_size * batch_size], dtype=np.int64)
    if bbs:
        rng = np.random.default_rng([int(seed), int(epoch), int(consumed), 0xBB5])
        parts = [chunk[b] for b in form_batches(np.asarray(input_lengths)[chunk], batch_size, sub_batch_size, rng)]
    else:
        parts = [chunk[k:k + batch_size] for k in range(0, chunk.size, batch_size)]
    parts.extend(np.empty(0, np.int64) for _ in range(world_size - len(parts)))
    return [p.astype(np.int64, copy=False) for p in parts], consumed + int(chunk.size)


def plan_epoch(input_lengths: np.ndarray, *, num_batches: int, batch_size: int, bbs: bool,
               sub_batch_size: int, window_batches: int, shuffle: bool, seed: int, epoch: int,
               rank: int) -> list[np.ndarray]:
    """One rank's batch plan for one epoch: which of its samples go into each step's batch.

    input_lengths: [S] int, model-input tokens of each of the rank's samples (in the rank's canonical
        order, i.e. ascending user_id).
    num_batches: steps in the epoch, identical on every rank (>= ceil(S / batch_size)); the plan is
        padded with empty batches so every rank yields the same number of steps.
    shuffle: permute samples with :func:`epoch_rng` (seed, epoch, rank) before windowing.
    bbs: form each window of ``batch_size * window_batches`` samples with :func:`form_batches`;
        otherwise cut consecutive batches of ``batch_size``.
    Returns ``num_batches`` int64 index arrays into ``input_lengths``, together covering every sample
    exactly once. Raises ValueError when the samples do not fit in ``num_batches`` batches.
    """
    lengths = np.asarray(input_lengths, dtype=np.int64)
    s = lengths.size
    if batch_size < 1 or window_batches < 1:
        raise ValueError(f"batch_size ({batch_size}) and window_batches ({window_batches}) must be >= 1")
    need = -(-s // batch_size)
    if need > num_batches:
        raise ValueError(f"rank {rank}: {s} samples need {need} batches of {batch_size}, "
                         f"more than num_batches={num_batches}")
    rng = epoch_rng(seed, epoch, rank) if shuffle else None
    order = rng.permutation(s) if rng is not None else np.arange(s, dtype=np.int64)
    batches: list[np.ndarray] = []
    if bbs:
        w = batch_size * window_batches
        for k in range(0, s, w):
            win = order[k:k + w]
            batches.extend(win[b] for b in form_batches(lengths[win], batch_size, sub_batch_size, rng))
    else:
        batches = [order[k:k + batch_size] for k in range(0, s, batch_size)]
    batches.extend(np.empty(0, np.int64) for _ in range(num_batches - len(batches)))
    return [b.astype(np.int64, copy=False) for b in batches]


def simulate_imbalance(prepared_dir: str | Path, *, split: str = "train", world_size: int, batch_size: int,
                       max_seq_len: int, sub_batch_size: int, window_batches: int, bbs: bool,
                       seed: int = 0, epoch: int = 0) -> dict[str, Any]:
    """Token imbalance across ranks for one epoch, with the stream's exact shard assignment and plan.

    Reads only the ``item_ids`` list lengths from Parquet (pyarrow, no Ray). Train uses the shuffled
    plan of :class:`gemray.pipelines.stream.HistoryStream`; valid/test are never shuffled nor BBS'd
    there, so ``bbs`` and ``seed`` only matter for train.
    Returns {"imbalance": float (see :func:`imbalance`), "steps": int, "tokens_per_step_mean": float
    (mean tokens per rank-batch over non-empty steps), "world_size": int, "bbs": bool}.
    """
    check_split(split)
    manifest = load_manifest(prepared_dir)
    steps = num_batches_for(manifest, world_size, batch_size)
    train = split == "train"
    tokens = np.zeros((steps, world_size), dtype=np.int64)
    for rank in range(world_size):
        full = read_shard_lengths(manifest, assign_shards(manifest, world_size, rank))
        lengths = split_input_lengths(full, split, max_seq_len)
        plan = plan_epoch(lengths, num_batches=steps, batch_size=batch_size, bbs=bbs and train,
                          sub_batch_size=sub_batch_size, window_batches=window_batches, shuffle=train,
                          seed=seed, epoch=epoch, rank=rank)
        tokens[:, rank] = [int(lengths[b].sum()) for b in plan]
    busy = tokens.sum(axis=1) > 0
    return {"imbalance": imbalance(tokens), "steps": steps, "world_size": world_size, "bbs": bool(bbs and train),
            "tokens_per_step_mean": float(tokens[busy].mean()) if busy.any() else 0.0}
