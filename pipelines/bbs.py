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

Training (:class:`gemray.pipelines.stream.ElasticTrainStream`) uses the global form of the same idea: every
rank plans each step from the same ``world_size * batch_size`` samples of one world-size-independent epoch
order with the same seeded rng, so all ranks agree on the deal without talking (:func:`plan_global_step`). The
epoch's last step, with fewer samples, is spread evenly over all ranks (:func:`form_parts`) rather than filling
the first ranks' batches and leaving the others short or empty. :func:`plan_epoch` (one rank's own samples
in windows) is the per-rank plan of :class:`gemray.pipelines.stream.HistoryStream`, which the evaluation
splits use (unshuffled, no BBS).

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

__all__ = ["form_batches", "form_parts", "imbalance", "plan_epoch", "simulate_imbalance", "epoch_rng",
           "global_epoch_order", "plan_global_step", "global_steps_left"]


def _sorted_order(tokens: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """[S] int64: indices heaviest first (stable; with ``rng`` ties broken at random, one ``rng.permutation(S)``)."""
    if rng is not None:
        pre = rng.permutation(tokens.size)  # random tie-break; the stable sort keeps it among equal counts
        return pre[np.argsort(-tokens[pre], kind="stable")]
    return np.argsort(-tokens, kind="stable")


def _stratified_pick(order: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Split a sorted order into (``count`` samples taken every (S/count)-th, the rest in order), count >= 1: the
    pick's tokens stay proportional to its size and the rest keeps a representative mix."""
    s = order.size
    pick = np.floor((np.arange(count) + 0.5) * (s / count)).astype(np.int64)
    keep = np.ones(s, bool)
    keep[pick] = False
    return order[pick], order[keep]


def _deal(tokens: np.ndarray, order: np.ndarray, sub_batch_size: int, rooms: np.ndarray,
          load0: np.ndarray | None = None) -> list[np.ndarray]:
    """Deal the sub-batches of ``order`` (sorted heaviest first, a multiple of ``sub_batch_size`` long, rooms.sum()
    sub-batches) to len(rooms) batches: batch j takes rooms[j] of them (may be 0). Each sub-batch, heaviest
    first, goes to the lightest batch with room (LPT; ``load0`` [len(rooms)] tokens a batch starts with, default
    0), then sub-batches are swapped between the heaviest and the lightest non-empty batch while that lowers the
    heavier. Returns len(rooms) int64 index arrays (a batch's sub-batches heaviest first)."""
    num = rooms.size
    subs = [order[lo:lo + sub_batch_size] for lo in range(0, order.size, sub_batch_size)]
    weight = np.array([float(tokens[sb].sum()) for sb in subs])
    members: list[list[int]] = [[] for _ in range(num)]
    load = np.zeros(num) if load0 is None else np.asarray(load0, dtype=np.float64).copy()
    room = rooms.astype(np.int64).copy()
    for k in range(len(subs)):
        j = int(np.argmin(np.where(room > 0, load, np.inf)))
        members[j].append(k)
        load[j] += weight[k]
        room[j] -= 1
    # Then swap sub-batches between the heaviest and the lightest batch while that lowers the heavier of the
    # two (the capacity constraint can leave the batch holding the heaviest sub-batch high). Batches without a
    # sub-batch take no part (form_batches has none).
    live = np.flatnonzero(rooms > 0)
    for _ in range(4 * num if live.size else 0):
        h, lo_ = int(live[np.argmax(load[live])]), int(live[np.argmin(load[live])])
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
    return [np.concatenate([subs[k] for k in sorted(m)]).astype(np.int64) if m else np.empty(0, np.int64)
            for m in members]


def form_batches(token_counts: np.ndarray, batch_size: int, sub_batch_size: int,
                 rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Form token-balanced batches from one window of samples (BBS).

    token_counts: [S] int, tokens of each sample in the window (S >= 0).
    batch_size: samples per batch; must be a positive multiple of ``sub_batch_size`` (any such size, also one
        smaller than the configured batch; S need not be a multiple of it).
    rng: optional generator; when given, ties in token count are broken at random and the order of the
        full batches is shuffled (so the heaviest sub-batch is not always in batch 0). None: deterministic.
    Returns ceil(S / batch_size) int64 index arrays into ``token_counts``; together a permutation of
    range(S) (every index exactly once). All hold ``batch_size`` samples except the last when S is not
    a multiple of batch_size: that one holds S % batch_size samples, a stratified pick (every
    S/(S % batch_size)-th sample of the sorted order) so its tokens stay proportional to its size.
    To split S samples into a given number of near-equal parts instead, see :func:`form_parts`.
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
    order = _sorted_order(tokens, rng)
    short = np.empty(0, np.int64)
    rem = s % batch_size
    if rem:
        # The short batch takes a stratified sample of the sorted order (every (s/rem)-th sample), so
        # its tokens stay proportional to its size and the full batches keep a representative mix.
        short, order = _stratified_pick(order, rem)
    num_full = order.size // batch_size
    # Deal sub-batches heaviest first, each to the lightest batch that still has room (LPT with equal
    # capacities). With 2 sub-batches per batch this is exactly "pair sub-batch i with n-1-i".
    out = _deal(tokens, order, sub_batch_size, np.full(num_full, batch_size // sub_batch_size))
    if rng is not None and out:
        out = [out[j] for j in rng.permutation(len(out))]
    if rem:
        out.append(short.astype(np.int64))
    return out


def form_parts(token_counts: np.ndarray, num_parts: int, sub_batch_size: int,
               rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Deal one window of samples into exactly ``num_parts`` token-balanced parts of near-equal size (BBS for a
    window that is not ``num_parts`` full batches: the epoch's last, partial global step).

    token_counts: [S] int, tokens of each sample (S >= 0). num_parts: >= 1 (the world size).
    sub_batch_size: the dealing unit as in :func:`form_batches`; here g = min(sub_batch_size, S // num_parts),
        at least 1, so g = sub_batch_size whenever S >= num_parts * sub_batch_size.
    rng: optional generator breaking ties in token count at random (as in :func:`form_batches`); the parts are
        not shuffled. None: deterministic.
    The sorted samples make M = S // g sub-batches, dealt as :func:`form_batches` deals them: k = M // num_parts
    to every part and one more to parts 0 .. M % num_parts - 1. The S % g samples left over, a stratified pick of
    the sorted order (as form_batches' short batch), go to part M % num_parts (one of k sub-batches), counted in
    its load before the dealing. Returns ``num_parts`` int64 index arrays into ``token_counts``, together a
    permutation of range(S); their sizes differ by at most g <= sub_batch_size, and a part is empty only when
    S < num_parts (then parts 0 .. S-1 hold one sample each). Raises ValueError for a non-1-D input or
    num_parts / sub_batch_size < 1.
    """
    tokens = np.asarray(token_counts)
    if tokens.ndim != 1:
        raise ValueError(f"token_counts: expected a 1-D array [S], got shape {tokens.shape}")
    if num_parts < 1 or sub_batch_size < 1:
        raise ValueError(f"num_parts ({num_parts}) and sub_batch_size ({sub_batch_size}) must be >= 1")
    s = tokens.size
    g = max(1, min(sub_batch_size, s // num_parts))
    order = _sorted_order(tokens, rng) if s else np.empty(0, np.int64)
    short = np.empty(0, np.int64)
    rem = s % g
    if rem:
        short, order = _stratified_pick(order, rem)
    k, extra = divmod(order.size // g, num_parts)
    rooms = np.array([k + 1] * extra + [k] * (num_parts - extra), dtype=np.int64)
    load0 = np.zeros(num_parts)
    if rem:  # to the first part with k sub-batches (there is one: extra < num_parts)
        load0[extra] = float(tokens[short].sum())
    out = _deal(tokens, order, g, rooms, load0)
    if rem:
        out[extra] = np.concatenate([out[extra], short]).astype(np.int64)
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
    ``chunk = order[consumed : consumed + world_size * batch_size]`` (n samples) and splits it over the ranks:

    - a full chunk (n = world_size * batch_size): ``batch_size`` samples per rank; with ``bbs`` token-balanced
      by :func:`form_batches`, else consecutive slices.
    - the epoch's last, partial chunk (n < world_size * batch_size): spread over all ranks, so the step, which
      lasts as long as its slowest rank, is not one rank's full batch beside idle ones (it was: ML-1M, 2 ranks,
      batch 128 ended on 128 and 24 samples). With ``bbs`` :func:`form_parts` deals it into ``world_size``
      token-balanced parts in sub-batches of g = min(sub_batch_size, n // (world_size * batch_size /
      sub_batch_size)) samples (at least 1: each rank gets as many sub-batches as in a full step where n allows),
      so part sizes differ by at most g <= sub_batch_size; else consecutive slices of ceil(n / world_size) or
      floor(n / world_size) samples (``np.array_split``: sizes differ by at most 1). A rank's part is empty
      only when n < world_size (then n ranks get one sample each).

    With ``bbs`` the rng is seeded by (seed, epoch, consumed): the same on every rank, no communication.
    Returns (``world_size`` int64 index arrays into the samples, one per rank; the new ``consumed`` =
    consumed + n). Because every step consumes a prefix of ``order``, a restart at any world size resumes
    exactly at ``consumed``: every sample is trained once per epoch. Raises ValueError for consumed outside
    0..N, world_size or batch_size < 1, or (with ``bbs``) a batch_size that is not a positive multiple of
    sub_batch_size.
    """
    n = int(np.asarray(order).size)
    if not 0 <= consumed <= n:
        raise ValueError(f"plan_global_step: consumed={consumed} outside 0..{n}")
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"plan_global_step: world_size ({world_size}) and batch_size ({batch_size}) must be >= 1")
    if bbs and (sub_batch_size < 1 or batch_size % sub_batch_size):
        raise ValueError(f"batch_size ({batch_size}) must be a positive multiple of sub_batch_size "
                         f"({sub_batch_size})")
    chunk = np.asarray(order[consumed:consumed + world_size * batch_size], dtype=np.int64)
    if bbs:
        rng = np.random.default_rng([int(seed), int(epoch), int(consumed), 0xBB5])
        tokens = np.asarray(input_lengths)[chunk]
        if chunk.size == world_size * batch_size:
            idx = form_batches(tokens, batch_size, sub_batch_size, rng)
        else:  # dealt in as many sub-batches per rank as a full step has, where the chunk is large enough
            per_batch = batch_size // sub_batch_size
            unit = max(1, min(sub_batch_size, int(chunk.size) // (world_size * per_batch)))
            idx = form_parts(tokens, world_size, unit, rng)
        parts = [chunk[b] for b in idx]
    else:  # a full chunk: slices of batch_size, as before; a partial one: sizes differing by at most 1
        parts = np.array_split(chunk, world_size)
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
                       max_seq_len: int, sub_batch_size: int, bbs: bool, seed: int = 0, epoch: int = 0,
                       shuffle: bool = True, train_includes_valid: bool = False) -> dict[str, Any]:
    """Token imbalance across ranks for one epoch, with the exact plan the data path uses at ``world_size``.

    Reads only the ``item_ids`` list lengths from Parquet (pyarrow, no Ray). Train replays the elastic plan
    training runs (:class:`gemray.pipelines.stream.ElasticTrainStream`): every split-eligible sample in
    ascending user_id, :func:`global_epoch_order` (seed, epoch, ``shuffle``) and :func:`plan_global_step` step
    by step, the epoch's last, partial step included; ``train_includes_valid`` as ``data.train_includes_valid``.
    Valid/test replay the evaluation streams (:class:`gemray.pipelines.stream.HistoryStream`: the shards of
    each rank, :func:`plan_epoch`, never shuffled nor BBS'd), so ``bbs``, ``seed`` and ``shuffle`` only matter
    for train.
    Returns {"imbalance": float (see :func:`imbalance`), "last_step_imbalance": float (max/mean tokens across
    ranks of the epoch's last step with tokens; 1.0 when none has), "steps": int, "tokens_per_step_mean":
    float (mean tokens per rank-batch over non-empty steps), "world_size": int, "bbs": bool}.
    """
    check_split(split)
    manifest = load_manifest(prepared_dir)
    train = split == "train"
    if train:
        full = read_shard_lengths(manifest, assign_shards(manifest, 1, 0))  # every rank holds all train samples
        lengths = split_input_lengths(full, split, max_seq_len, train_includes_valid=train_includes_valid)
        order = global_epoch_order(lengths.size, seed=seed, epoch=epoch, shuffle=shuffle)
        rows, consumed = [], 0
        while consumed < order.size:
            parts, consumed = plan_global_step(order, lengths, consumed=consumed, world_size=world_size,
                                               batch_size=batch_size, bbs=bbs, sub_batch_size=sub_batch_size,
                                               seed=seed, epoch=epoch)
            rows.append([int(lengths[p].sum()) for p in parts])
        tokens = np.array(rows, dtype=np.int64).reshape(len(rows), world_size)
    else:
        steps = num_batches_for(manifest, world_size, batch_size)
        tokens = np.zeros((steps, world_size), dtype=np.int64)
        for rank in range(world_size):
            full = read_shard_lengths(manifest, assign_shards(manifest, world_size, rank))
            lengths = split_input_lengths(full, split, max_seq_len)
            plan = plan_epoch(lengths, num_batches=steps, batch_size=batch_size, bbs=False, sub_batch_size=1,
                              window_batches=1, shuffle=False, seed=seed, epoch=epoch, rank=rank)
            tokens[:, rank] = [int(lengths[b].sum()) for b in plan]
    busy = tokens.sum(axis=1) > 0
    last = imbalance(tokens[np.flatnonzero(busy)[-1:]])
    return {"imbalance": imbalance(tokens), "last_step_imbalance": last, "steps": int(tokens.shape[0]),
            "world_size": world_size, "bbs": bool(bbs and train),
            "tokens_per_step_mean": float(tokens[busy].mean()) if busy.any() else 0.0}
