"""The jagged batch: B variable-length user histories stored back to back, no padding.

Shape key: B sequences, T = offsets[-1] total tokens, L_b = offsets[b+1] - offsets[b]; with ranking data,
C = candidate_offsets[-1] candidates in all.

A ``JaggedBatch`` is what ``gemray.pipelines`` yields and what the model consumes. Sequence b occupies
rows ``offsets[b]:offsets[b+1]`` of every per-token tensor. Example (B=3, lengths 2, 0, 3)::

    offsets   = [0, 2, 2, 5]
    item_ids  = [7, 3, 9, 9, 1]        # user 0: 7, 3; user 1: empty; user 2: 9, 9, 1

Batches of GEM-style data (``gemray prepare synthetic``) also carry side features, request context and
each request's jagged candidate list with click / convert labels; for MovieLens those fields are None.
Example (B=2, candidates 2 and 1)::

    features          = {"category": [4, 4, 1, 2, 2]}     # [T], aligned with item_ids
    context           = {"hour": [21, 9]}                  # [B]
    candidate_offsets = [0, 2, 3]                          # [B+1]
    candidate_ids     = [12, 5, 40]                        # [C]
    labels            = [[1., 0.], [0., 0.], [1., 1.]]     # [C, 2]: click, convert

Padded conversions exist for references and tests only; the model path stays jagged.

Host shape facts (:class:`HostShape`): token / candidate counts, the longest sequence, the positions with a next
item. On a CPU batch they are plain arithmetic on the offsets; read from a CUDA tensor each would block the host
until the device catches up (a host sync per read). ``JaggedBatch.to(device)`` computes them from the CPU
offsets before the copy and carries them (``host``), so the model's training step reads them without a sync;
:meth:`JaggedBatch.host_shape` gives them for any batch (None: a device batch made without them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

# Feature names of the KeyedJaggedTensor given to the TorchRec EmbeddingCollection.
ITEM_FEATURE = "item_id"
RATING_FEATURE = "rating"
TIME_FEATURE = "time_gap"
# Column order of JaggedBatch.labels (the names of gemray.pipelines.schema.LABEL_NAMES).
LABEL_NAMES = ("click", "convert")

#: Batch-to-batch variation of a batch's token count that memory-sized plans allow for: a later batch may hold
#: this many times the tokens of the batch a plan was made from. One value for the kernel warm-up
#: (``gemray.train.warmup.warmup_token_budget``) and the activation-checkpointing planner
#: (``gemray.parallel.activation_checkpoint``: it plans for a batch this much larger than the one it probed).
TOKEN_HEADROOM = 1.25


def headroom_tokens(tokens: int, headroom: float = TOKEN_HEADROOM) -> int:
    """Pure: the most tokens (int) a batch like one of ``tokens`` tokens is assumed to hold: ``tokens`` x
    ``headroom`` (default ``TOKEN_HEADROOM``), rounded down, at least 1."""
    return max(1, int(tokens * headroom))


@dataclass(frozen=True)
class HostShape:
    """Host ints of a batch's jagged layout (see the module docstring), computed once from CPU offsets.

    num_tokens: T; max_len: the longest sequence (0 for B = 0); num_next: M = sum(max(L_b - 1, 0)), the
    positions that have a next item; num_candidates: C (0 without candidates); max_candidates: the most
    candidates of one request (0 without)."""

    num_tokens: int
    max_len: int
    num_next: int
    num_candidates: int = 0
    max_candidates: int = 0

    @classmethod
    def of(cls, offsets: torch.Tensor, candidate_offsets: torch.Tensor | None = None) -> "HostShape":
        """From CPU offsets [B+1] (and candidate offsets [B+1]); raises ValueError for tensors on another
        device (reading them would sync)."""
        for name, t in (("offsets", offsets), ("candidate_offsets", candidate_offsets)):
            if t is not None and t.device.type != "cpu":
                raise ValueError(f"HostShape.of: {name} must be a CPU tensor, got one on {t.device}")
        lengths = (offsets[1:] - offsets[:-1]).tolist()
        cands = [] if candidate_offsets is None else (candidate_offsets[1:] - candidate_offsets[:-1]).tolist()
        return cls(num_tokens=int(offsets[-1]) if offsets.numel() else 0, max_len=max(lengths, default=0),
                   num_next=sum(max(n - 1, 0) for n in lengths), num_candidates=sum(cands),
                   max_candidates=max(cands, default=0))


@dataclass
class JaggedBatch:
    """A batch of jagged user histories.

    user_ids:   [B] int64, the dataset's user id of each row.
    offsets:    [B+1] int64, offsets[0] == 0, non-decreasing, offsets[-1] == T.
    item_ids:   [T] int64, dense item ids in 1..num_items (0 is never used: reserved for padding).
    ratings:    [T] int64, rating in half stars (1..10; ML-1M's 4 stars -> 8).
    timestamps: [T] int64, unix seconds, non-decreasing within each sequence.
    targets:    [B] int64 or None. Evaluation batches: the held-out next item of each sequence
                (leave-one-out). Training batches: None (every position predicts the next item).
    target_timestamps: [B] int64 or None: unix seconds of each target (evaluation batches). It is the
                request time a server knows when it asks for the next item; HSTU's time bias uses it as
                the last position's query time (see ``query_timestamps``).

    Optional GEM fields (None when the data has none, e.g. MovieLens):

    features:   dict name -> [T] int64, per-token side features aligned with item_ids (e.g. the item's
                category, author), dense 1..cardinality, 0 = missing (manifest ``features``, level "token").
    context:    dict name -> [B] int64, per-request context of each row (e.g. hour-of-day bucket, device),
                dense 1..cardinality, 0 = missing (manifest ``features``, level "request").
    candidate_offsets: [B+1] int64, row b's candidates are ``candidate_ids[candidate_offsets[b]:
                candidate_offsets[b+1]]`` (0 for a row whose request belongs to another split).
    candidate_ids: [C] int64 dense item ids shown at each row's request.
    labels:     [C, 2] float32 0/1 per candidate: column 0 click, column 1 convert (1 only where clicked);
                see ``LABEL_NAMES``.
    The three candidate fields are all set or all None.

    host:       HostShape or None: the layout's host ints, set by ``to()`` when a CPU batch moves to another
                device (module docstring); not a tensor, never moved.
    """

    user_ids: torch.Tensor
    offsets: torch.Tensor
    item_ids: torch.Tensor
    ratings: torch.Tensor
    timestamps: torch.Tensor
    targets: torch.Tensor | None = None
    target_timestamps: torch.Tensor | None = None
    features: dict[str, torch.Tensor] | None = None
    context: dict[str, torch.Tensor] | None = None
    candidate_offsets: torch.Tensor | None = None
    candidate_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    host: Optional[HostShape] = None

    @property
    def batch_size(self) -> int:
        return int(self.offsets.numel() - 1)

    def host_shape(self) -> HostShape | None:
        """The batch's :class:`HostShape`: ``host`` when set, else computed from CPU offsets (no sync), else None
        (a device batch without it: callers then read the device, one sync per value)."""
        if self.host is not None:
            return self.host
        if self.offsets.device.type == "cpu" and (self.candidate_offsets is None
                                                  or self.candidate_offsets.device.type == "cpu"):
            return HostShape.of(self.offsets, self.candidate_offsets)
        return None

    @property
    def num_tokens(self) -> int:
        if self.host is not None:
            return self.host.num_tokens
        return int(self.offsets[-1])

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64 sequence lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def max_len(self) -> int:
        if self.host is not None:
            return self.host.max_len
        return int(self.lengths.max()) if self.batch_size else 0

    @property
    def num_candidates(self) -> int:
        """C, the candidates of all rows together (0 without ranking data)."""
        if self.candidate_offsets is None:
            return 0
        return self.host.num_candidates if self.host is not None else int(self.candidate_offsets[-1])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "JaggedBatch":
        """A copy with every tensor (those inside ``features`` / ``context`` too) on ``device``; moving a CPU batch
        to another device also records its :class:`HostShape` (``host``) from the CPU offsets first."""
        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device, non_blocking=non_blocking)
            if isinstance(v, dict):
                return {k: move(x) for k, x in v.items()}
            return v

        host = self.host
        if host is None and torch.device(device).type != "cpu":
            host = self.host_shape()
        out = JaggedBatch(**{f.name: move(getattr(self, f.name)) for f in fields(self) if f.name != "host"})
        out.host = host
        return out

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        """Mark every CUDA tensor as used on ``stream`` (for a batch copied to the device on a side stream and
        consumed on another: the caching allocator then keeps its memory until ``stream``'s work is done)."""
        for f in fields(self):
            v = getattr(self, f.name)
            for t in (v.values() if isinstance(v, dict) else [v]):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(stream)

    def pin_memory(self) -> "JaggedBatch":
        """A copy in page-locked host memory (needs CUDA), so that ``to(cuda, non_blocking=True)`` overlaps."""
        def pin(v):
            if isinstance(v, torch.Tensor):
                return v.pin_memory()
            if isinstance(v, dict):
                return {k: pin(x) for k, x in v.items()}
            return v

        return JaggedBatch(**{f.name: pin(getattr(self, f.name)) for f in fields(self)})  # host: kept as is

    def is_pinned(self) -> bool:
        """Whether every CPU tensor holding data is in page-locked memory (``pin_memory()``'s result, e.g. from the
        loader's pin thread), so that ``to(cuda, non_blocking=True)`` may go without pinning again. Empty tensors
        are skipped (nothing to copy; CUDA reports them unpinned): a batch without data counts as pinned."""
        for f in fields(self):
            v = getattr(self, f.name)
            for t in (v.values() if isinstance(v, dict) else [v]):
                if isinstance(t, torch.Tensor) and t.numel() and not (t.device.type == "cpu" and t.is_pinned()):
                    return False
        return True

    def validate(self) -> "JaggedBatch":
        """Check the invariants above; raises ValueError naming the broken field."""
        o = self.offsets
        if o.dtype != torch.int64 or o.dim() != 1 or o.numel() < 1:
            raise ValueError(f"offsets: expected 1-D int64 [B+1], got {o.dtype} {tuple(o.shape)}")
        if int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()):
            raise ValueError("offsets: must start at 0 and be non-decreasing")
        t = int(o[-1])
        for name in ("item_ids", "ratings", "timestamps"):
            v = getattr(self, name)
            if v.dim() != 1 or v.numel() != t:
                raise ValueError(f"{name}: expected [T={t}], got {tuple(v.shape)}")
        if self.user_ids.numel() != self.batch_size:
            raise ValueError(f"user_ids: expected [B={self.batch_size}], got {tuple(self.user_ids.shape)}")
        if self.targets is not None and self.targets.numel() != self.batch_size:
            raise ValueError(f"targets: expected [B={self.batch_size}], got {tuple(self.targets.shape)}")
        if self.target_timestamps is not None and self.target_timestamps.numel() != self.batch_size:
            raise ValueError(f"target_timestamps: expected [B={self.batch_size}], got "
                             f"{tuple(self.target_timestamps.shape)}")
        for group, n, key in (("features", t, "T"), ("context", self.batch_size, "B")):
            for name, v in (getattr(self, group) or {}).items():
                if v.dtype != torch.int64 or v.dim() != 1 or v.numel() != n:
                    raise ValueError(f"{group}[{name!r}]: expected int64 [{key}={n}], got {v.dtype} {tuple(v.shape)}")
        self._validate_candidates()
        return self

    def _validate_candidates(self) -> None:
        parts = {"candidate_offsets": self.candidate_offsets, "candidate_ids": self.candidate_ids,
                 "labels": self.labels}
        if all(v is None for v in parts.values()):
            return
        missing = [k for k, v in parts.items() if v is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: None while the other candidate fields are set (all or none)")
        co, ids, lab = self.candidate_offsets, self.candidate_ids, self.labels
        if co.dtype != torch.int64 or co.dim() != 1 or co.numel() != self.batch_size + 1:
            raise ValueError(f"candidate_offsets: expected int64 [B+1={self.batch_size + 1}], got {co.dtype} "
                             f"{tuple(co.shape)}")
        if int(co[0]) != 0 or bool((co[1:] < co[:-1]).any()):
            raise ValueError("candidate_offsets: must start at 0 and be non-decreasing")
        c = int(co[-1])
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() != c:
            raise ValueError(f"candidate_ids: expected int64 [C={c}], got {ids.dtype} {tuple(ids.shape)}")
        if lab.dtype != torch.float32 or tuple(lab.shape) != (c, len(LABEL_NAMES)):
            raise ValueError(f"labels: expected float32 [C={c}, {len(LABEL_NAMES)}], got {lab.dtype} "
                             f"{tuple(lab.shape)}")
        if c and bool(((lab != 0) & (lab != 1)).any()):
            raise ValueError("labels: expected 0/1 values")
        if c and bool((lab[:, 1] > lab[:, 0]).any()):
            raise ValueError("labels: convert == 1 where click == 0 (conversions happen only after a click)")

    def with_(self, **changes) -> "JaggedBatch":
        return replace(self, **changes)


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """[B] int -> [B+1] int64 offsets (exclusive cumulative sum)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def segment_ids(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[B+1] offsets -> [T] int64 index of the sequence each token belongs to.

    total: T when the caller knows it on the host (e.g. a tensor's ``shape[0]``): then no host sync on CUDA
    (``repeat_interleave`` needs the output size; without it, it reads the device)."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                   output_size=total)


def positions(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[B+1] offsets -> [T] int64 position of each token inside its sequence (0-based); total: as
    ``segment_ids``."""
    seg = segment_ids(offsets, total)
    return torch.arange(seg.numel(), device=offsets.device) - offsets[:-1][seg]


def next_item_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """[B+1] token offsets -> [B+1] int64 offsets of the positions that have a next item (sequence b has
    max(L_b - 1, 0) of them), the rows of ``next_item_index``; on the device, no host sync."""
    rows = (offsets[1:] - offsets[:-1] - 1).clamp(min=0)
    return torch.cat([rows.new_zeros(1), torch.cumsum(rows, 0)])


def next_item_index(offsets: torch.Tensor, num_next: int | None = None) -> torch.Tensor:
    """[B+1] offsets -> [M] int64 token indices t that have a next item t+1 in the same sequence, by sequence then
    position. num_next: M when known on the host (``HostShape.num_next``): then no host sync (the count of such
    positions is what a device tensor would have to be read for)."""
    lengths = offsets[1:] - offsets[:-1]
    rows = (lengths - 1).clamp(min=0)                                       # [B] positions with a next item
    if num_next is None:
        num_next = int(rows.sum()) if rows.numel() else 0
    seg = torch.repeat_interleave(torch.arange(rows.numel(), device=offsets.device), rows, output_size=num_next)
    row_start = torch.cumsum(rows, 0) - rows                                # [B] first row of each sequence
    return offsets[:-1][seg] + (torch.arange(num_next, device=offsets.device) - row_start[seg])


def query_timestamps(timestamps: torch.Tensor, offsets: torch.Tensor,
                     last: torch.Tensor | None = None) -> torch.Tensor:
    """The time each position's prediction is made for: the timestamp of the next item of its sequence.

    timestamps: [T] int64 unix seconds; offsets: [B+1] int64; last: optional [B] int64 query time of
    each sequence's last position (the held-out target's time at evaluation); without it the last
    position keeps its own timestamp (in training it predicts nothing). Returns [T] int64.
    As generative-recommenders' RelativeBucketedTimeAndPositionBasedBias, whose time bias buckets
    ``ts[i+1] - ts[j]`` with the target's timestamp scattered after the history (arXiv:2402.17152).
    No host sync: the last positions are written by one scatter into a [T+1] buffer whose extra slot takes the
    writes of empty sequences.
    """
    T = timestamps.numel()
    out = torch.empty(T + 1, dtype=timestamps.dtype, device=timestamps.device)
    out[:T] = timestamps
    if T > 1:
        out[:T - 1] = timestamps[1:]
    lengths = offsets[1:] - offsets[:-1]
    has = lengths > 0
    ends = torch.where(has, offsets[1:] - 1, T)                             # [B], T = the spare slot
    own = timestamps[(offsets[1:] - 1).clamp(min=0)] if T else torch.zeros_like(ends, dtype=timestamps.dtype)
    vals = own if last is None else last.to(timestamps.dtype)
    out.scatter_(0, ends, vals.to(timestamps.dtype))
    return out[:T]


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int,
                     padding_value: float = 0.0) -> torch.Tensor:
    """values [T, *F] -> padded [B, max_len, *F]; rows past a sequence's length hold ``padding_value``.

    Sequences longer than ``max_len`` raise ValueError (no silent truncation). Reference/test use only.
    """
    b = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    if b and int(lengths.max()) > max_len:
        raise ValueError(f"jagged_to_padded: a sequence of length {int(lengths.max())} > max_len {max_len}")
    out = values.new_full((b, max_len, *values.shape[1:]), padding_value)
    seg = segment_ids(offsets)
    out[seg, positions(offsets)] = values
    return out


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """padded [B, N, *F] -> values [T, *F] keeping the first L_b rows of each sequence."""
    seg = segment_ids(offsets)
    return padded[seg, positions(offsets)]
