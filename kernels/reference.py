"""Plain-PyTorch references (the spec the Triton kernels in ``gemray.kernels`` must match).

Shape key: B sequences, T = offsets[-1] total tokens, H heads, Dqk per-head query/key width, Dv per-head
value width, N = ``max_len`` (the longest sequence the caller allows; also the HSTU normaliser), n = the
padded length the reference actually uses (the batch's longest sequence, n <= N).

Attention follows HSTU (Zhai et al. 2024, "Actions Speak Louder than Words", arXiv:2402.17152, eq. 2):
pointwise ``silu(alpha * q.k + bias) / N`` instead of a softmax, causal, computed over jagged sequences.
The reference pads (index_copy / index_select) to [B, H, n, n] and uses batched matmuls: fast enough for CPU training at B=128, N=200.

Relative attention bias follows generative-recommenders' ``RelativeBucketedTimeAndPositionBasedBias``
(learned weight per bucketed relative position plus one per bucketed time difference), with one change:
the time difference of query i and key j is ``ts[i] - ts[j]`` (the query's own timestamp, so training and
evaluation see the same thing), not generative-recommenders' ``ts[i+1] - ts[j]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "softmax", "gelu", "none")

# generative-recommenders' time bucketisation: floor(ln(max(|dt|, 1)) / 0.301), i.e. log base ~1.35.
_TIME_LOG_DIVISOR = 0.301


def _flat_index(offsets: torch.Tensor, n: int, total: int | None = None) -> torch.Tensor:
    """[B+1] offsets -> [T] int64 row of each token in a [B*n] padded layout. total: T when known on the host
    (then no host sync on CUDA)."""
    lengths = offsets[1:] - offsets[:-1]
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)
    pos = torch.arange(seg.numel(), device=offsets.device) - offsets[:-1][seg]
    return seg * n + pos


def _pad(values: torch.Tensor, offsets: torch.Tensor, n: int,
         index: torch.Tensor | None = None) -> torch.Tensor:
    """values [T, F] -> [B, n, F] zero-padded; differentiable, any dtype (fbgemm's CPU op lacks float64)."""
    B = offsets.numel() - 1
    idx = _flat_index(offsets, n) if index is None else index
    out = values.new_zeros((B * n, values.shape[1])).index_copy(0, idx, values)
    return out.view(B, n, values.shape[1])


def _unpad(padded: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """padded [B, n, F] -> [T, F]; differentiable."""
    B, n, F_ = padded.shape
    idx = _flat_index(offsets, n) if index is None else index
    return padded.reshape(B * n, F_).index_select(0, idx)


def valid_attn_mask_ref(lengths: torch.Tensor, n: int, *, causal: bool = True,
                        num_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Which (query i, key j) pairs may interact, from index arithmetic only.

    lengths: [B] int64 sequence lengths (<= n); num_targets: optional [B] int64, 0 <= num_targets <= length.
    Returns [B, n, n] bool. Pair (i, j) is valid when both i, j < length and: j <= i (causal) or always
    (non-causal). With ``num_targets``, the last num_targets[b] tokens are targets: they see the history
    and themselves but not each other, and history tokens never see targets (as generative-recommenders'
    ``_get_valid_attn_mask``: target ids are clamped to ``length - num_targets``).
    Padding rows (i >= length) get only their diagonal so that a softmax over them stays finite; their
    outputs are dropped when un-padding.
    """
    dev = lengths.device
    ids = torch.arange(n, device=dev)
    L = lengths.view(-1, 1, 1)
    row = ids.view(1, n, 1)
    col = ids.view(1, 1, n)
    inside = (row < L) & (col < L)
    if num_targets is not None:
        hist = (lengths - num_targets).view(-1, 1, 1)
        rid = torch.minimum(row, hist)
        cid = torch.minimum(col, hist)
    else:
        rid, cid = row, col
    if causal:
        rel = (rid - cid) > 0
    else:
        rel = rid != cid
    diag = row == col
    valid = inside & (rel | diag)
    return valid | (diag & (row >= L))


def check_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                         max_len: int, *, activation: str, attn_bias: torch.Tensor | None,
                         alpha: float | None, num_targets: torch.Tensor | None) -> float:
    """Validate ``jagged_attention_ref`` arguments (shapes, dtypes, lengths <= max_len, targets, bias size);
    return alpha with its default filled in. Raises ValueError naming the bad argument.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"jagged_attention_ref: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"jagged_attention_ref: expected q,k [T,H,Dqk] and v [T,H,Dv], got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    n = _check_jagged("jagged_attention_ref", q, offsets)
    T, H, Dqk = q.shape
    B = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    if n > max_len:
        raise ValueError(f"jagged_attention_ref: a sequence of length {n} > max_len {max_len}")
    if num_targets is not None:
        if num_targets.shape != (B,):
            raise ValueError(f"jagged_attention_ref: num_targets must be [B={B}], got {tuple(num_targets.shape)}")
        if bool(((num_targets < 0) | (num_targets > lengths)).any()):
            raise ValueError("jagged_attention_ref: num_targets must satisfy 0 <= num_targets[b] <= length[b]")
    if attn_bias is not None:
        if attn_bias.dim() not in (3, 4) or attn_bias.shape[0] != B or (
                attn_bias.dim() == 4 and attn_bias.shape[1] != H) or attn_bias.shape[-1] < n \
                or attn_bias.shape[-2] < n:
            raise ValueError(f"jagged_attention_ref: attn_bias must be [B={B}, n', n'] or [B, H={H}, n', n'] "
                             f"with n' >= {n}, got {tuple(attn_bias.shape)}")
    if alpha is None:
        alpha = 1.0 / math.sqrt(Dqk) if activation == "softmax" else 1.0
    return float(alpha)


def jagged_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                         max_len: int, *, activation: str = "silu", causal: bool = True,
                         attn_bias: torch.Tensor | None = None, alpha: float | None = None,
                         num_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Jagged multi-head attention (HSTU pointwise or softmax), reference implementation.

    Args:
        q: [T, H, Dqk] float; k: [T, H, Dqk]; v: [T, H, Dv] (same dtype and device).
        offsets: [B+1] int64, offsets[0] == 0, non-decreasing, offsets[-1] == T.
        max_len: N, the longest allowed sequence; "silu"/"gelu"/"none" divide by N (HSTU; as
            generative-recommenders, a constant so the scale does not depend on the batch).
        activation: "silu": ``silu(alpha*qk + bias) / N`` (HSTU); "gelu": ``gelu(alpha*qk + bias) / N``;
            "none": ``(alpha*qk + bias) / N``; "softmax": ``softmax(alpha*qk + bias)`` over valid keys.
        causal: query i sees keys j <= i of its own sequence (else every key of its sequence).
        attn_bias: optional float [B, n', n'] (shared by heads) or [B, H, n', n'], padded, added to the
            scaled logits; n' may be N or anything between the batch's longest sequence and N (the
            reference uses the top-left [n, n] block, n = longest sequence).
        alpha: logit scale; default 1/sqrt(Dqk) for "softmax" and 1.0 otherwise (generative-recommenders'
            ML-1M HSTU uses no scaling).
        num_targets: optional [B] int64: the last num_targets[b] tokens of sequence b are targets that
            attend to the history and themselves but not to each other (see ``valid_attn_mask_ref``).

    Returns:
        [T, H, Dv], same dtype as v. Differentiable in q, k, v and attn_bias.

    Raises:
        ValueError: bad shapes/dtypes, unknown activation, a sequence longer than max_len, bias too small.
    """
    alpha = check_attention_args(q, k, v, offsets, max_len, activation=activation, attn_bias=attn_bias,
                                 alpha=alpha, num_targets=num_targets)
    if attn_bias is None:
        bias_fn = None
    elif attn_bias.dim() == 3:
        bias_fn = lambda seqs, m: attn_bias[:, :m, :m][seqs].unsqueeze(1)  # noqa: E731
    else:
        bias_fn = lambda seqs, m: attn_bias[:, :, :m, :m][seqs]  # noqa: E731
    return jagged_attention_grouped_ref(q, k, v, offsets, max_len, activation=activation, causal=causal,
                                        alpha=alpha, num_targets=num_targets, bias_fn=bias_fn)


def length_groups(lengths: torch.Tensor, min_group: int = 16, max_groups: int = 8
                  ) -> list[tuple[torch.Tensor, int]]:
    """Split sequences into groups of similar length so that padding each group to its own longest
    sequence wastes little: sort by length, cut into up to ``max_groups`` equal-count chunks of at least
    ``min_group`` sequences. Returns [(sequence indices [G] int64, padded length n_g)], skipping groups
    whose sequences are all empty. Pure bookkeeping: results do not depend on the grouping.
    """
    B = lengths.numel()
    if B == 0:
        return []
    order = torch.argsort(lengths, stable=True)
    num = max(1, min(max_groups, B // max(min_group, 1)))
    bounds = [round(i * B / num) for i in range(num + 1)]
    srt = lengths[order].tolist()
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo and srt[hi - 1] > 0:
            out.append((order[lo:hi], int(srt[hi - 1])))
    return out


_LAYOUT_CACHE: dict = {}


def _group_layouts(offsets: torch.Tensor, lengths: torch.Tensor, groups: list, causal: bool,
                   num_targets: torch.Tensor | None) -> list:
    """Per group: (seqs, n, tok [Tg] rows in q/k/v, flat [Tg] rows in the [G*n] padding, valid [G,1,n,n]).

    Cached for the last batch seen (key: lengths, causal, num_targets), so the blocks of one forward and
    its backward build the index bookkeeping and masks once.
    """
    key = (offsets.device, tuple(lengths.tolist()), causal,
           None if num_targets is None else tuple(num_targets.tolist()),
           tuple((seqs.numel(), n) for seqs, n in groups))
    hit = _LAYOUT_CACHE.get("key")
    if hit == key:
        return _LAYOUT_CACHE["value"]
    starts = offsets[:-1]
    value = []
    for seqs, n in groups:
        Lg = lengths[seqs]
        G = seqs.numel()
        seg = torch.repeat_interleave(torch.arange(G, device=offsets.device), Lg)
        og = torch.zeros(G + 1, dtype=torch.int64, device=offsets.device)
        torch.cumsum(Lg, 0, out=og[1:])
        pos = torch.arange(seg.numel(), device=offsets.device) - og[:-1][seg]
        tok = starts[seqs][seg] + pos            # [Tg] rows of this group's tokens in q/k/v
        flat = seg * n + pos                      # [Tg] rows in the [G*n] padded layout
        nt = num_targets[seqs] if num_targets is not None else None
        valid = valid_attn_mask_ref(Lg, n, causal=causal, num_targets=nt).unsqueeze(1)  # [G, 1, n, n]
        value.append((seqs, n, tok, flat, valid))
    _LAYOUT_CACHE["key"], _LAYOUT_CACHE["value"] = key, value
    return value


def jagged_attention_grouped_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                 max_len: int, *, activation: str, causal: bool, alpha: float,
                                 num_targets: torch.Tensor | None = None, bias_fn=None,
                                 min_group: int = 16, max_groups: int = 8) -> torch.Tensor:
    """The computation of ``jagged_attention_ref`` (arguments already checked there), padded per length
    group (``length_groups``) instead of to the batch's longest sequence: same result, ~2x less work on
    MovieLens-like length mixes.

    bias_fn: optional ``(seqs [G] int64, n_g) -> [G, 1 or H, n_g, n_g]`` bias of those sequences, top-left
    n_g block (lets a caller build a relative bias per group instead of one [B, n, n] tensor).
    Returns [T, H, Dv]; every input (q, k, v, bias) stays in the graph even when T == 0.
    """
    T, H, Dqk = q.shape
    Dv = v.shape[2]
    lengths = offsets[1:] - offsets[:-1]
    groups = length_groups(lengths, min_group, max_groups)
    if T == 0 or not groups:
        out = v * 0.0 + (q.sum() + k.sum()) * 0.0
        if bias_fn is not None:
            out = out + bias_fn(torch.arange(lengths.numel(), device=q.device), 0).sum() * 0.0
        return out
    q2, k2, v2 = q.reshape(T, H * Dqk), k.reshape(T, H * Dqk), v.reshape(T, H * Dv)
    outs, toks = [], []
    for seqs, n, tok, flat, valid in _group_layouts(offsets, lengths, groups, causal, num_targets):
        G = seqs.numel()

        def pad(x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros((G * n, x.shape[1])).index_copy(0, flat, x.index_select(0, tok))

        pq = pad(q2).view(G, n, H, Dqk).transpose(1, 2)   # [G, H, n, Dqk]
        pk = pad(k2).view(G, n, H, Dqk).transpose(1, 2)
        pv = pad(v2).view(G, n, H, Dv).transpose(1, 2)    # [G, H, n, Dv]
        logits = torch.matmul(pq, pk.transpose(-1, -2))   # [G, H, n, n]
        if alpha != 1.0:
            logits = logits * alpha
        if bias_fn is not None:
            logits = logits + bias_fn(seqs, n).to(logits.dtype)
        if activation == "softmax":
            attn = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
        else:
            act = {"silu": F.silu, "gelu": F.gelu, "none": lambda x: x}[activation]
            attn = act(logits) * (valid.to(logits.dtype) / max_len)
        out = torch.matmul(attn, pv).transpose(1, 2).reshape(G * n, H * Dv)
        outs.append(out.index_select(0, flat))
        toks.append(tok)
    out = torch.cat(outs)
    full = out.new_zeros((T, H * Dv)).index_copy(0, torch.cat(toks), out)
    return full.view(T, H, Dv)


def time_bucket_ref(seconds: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log-bucketise time spans: ``clamp(floor(ln(max(|s|, 1)) / 0.301), 0, num_buckets - 1)``.

    seconds: int64 or float tensor of any shape (unix-second differences). Returns int64, same shape, in
    [0, num_buckets). The 0.301 divisor is generative-recommenders' (ML-1M configs): ~1.35x per bucket,
    so one year (3.2e7 s) lands in bucket 57.
    """
    s = seconds.abs().to(torch.float64).clamp(min=1.0)
    return torch.clamp((torch.log(s) / _TIME_LOG_DIVISOR).floor().to(torch.int64), 0, num_buckets - 1)


def position_bucket_ref(distance: torch.Tensor, num_buckets: int, max_len: int) -> torch.Tensor:
    """Bucketise relative positions |i - j| (T5-style): exact below num_buckets // 2, log-spaced above.

    distance: int64 tensor (any shape). Returns int64 in [0, num_buckets). Distances up to ``max_len``
    use all buckets; larger ones share the last. With num_buckets >= max_len every distance is exact.
    """
    d = distance.abs()
    if num_buckets >= max_len:
        return d.clamp(max=num_buckets - 1)
    exact = num_buckets // 2
    span = num_buckets - exact
    log_ratio = torch.log(d.clamp(min=exact).to(torch.float64) / exact) / math.log(max(max_len, exact + 1) / exact)
    large = exact + (log_ratio * (span - 1)).floor().to(torch.int64)
    return torch.where(d < exact, d, large.clamp(max=num_buckets - 1))


def relative_bias_ref(timestamps: torch.Tensor, offsets: torch.Tensor, n: int, pos_weights: torch.Tensor,
                      ts_weights: torch.Tensor, max_len: int) -> torch.Tensor:
    """Dense relative attention bias from its ingredients (HSTU "rab^{p,t}").

    timestamps: [T] int64 unix seconds; offsets: [B+1] int64; n: padded size (>= longest sequence);
    pos_weights: [P] float (one per relative-position bucket, ``position_bucket_ref(i-j, P, max_len)``);
    ts_weights: [Q] float (one per time bucket, ``time_bucket_ref(ts[i] - ts[j], Q)``); shared by heads.
    Returns [B, n, n] float: ``pos_weights[pb(i-j)] + ts_weights[tb(ts_i - ts_j)]``. Entries outside a
    sequence hold finite garbage: the attention mask removes them.
    """
    B = offsets.numel() - 1
    ts = _pad(timestamps.view(-1, 1).to(torch.float64), offsets, n).view(B, n) if n else \
        timestamps.new_zeros((B, 0), dtype=torch.float64)
    ids = torch.arange(n, device=offsets.device)
    pb = position_bucket_ref(ids.view(n, 1) - ids.view(1, n), pos_weights.numel(), max_len)  # [n, n]
    tb = time_bucket_ref(ts.unsqueeze(2) - ts.unsqueeze(1), ts_weights.numel())             # [B, n, n]
    return pos_weights[pb].unsqueeze(0) + ts_weights[tb]


# ----------------------------------------------------------------------------------------------------------
# Cross-attention, pooled multi-head attention (PMA) and block-local attention (owner: kernels helper D;
# the spec of gemray.kernels.jagged_attention's cross / PMA / block kernels).
# ----------------------------------------------------------------------------------------------------------


def _attend_padded_ref(pq: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, valid: torch.Tensor,
                       activation: str, alpha: float, norm: float) -> torch.Tensor:
    """pq [B, H, m, Dqk], pk [B, H, n, Dqk], pv [B, H, n, Dv], valid [B, 1, m, n] bool -> [B, H, m, Dv].

    softmax over the valid keys (a row with none gives 0); pointwise activations give act(alpha*qk)/norm
    on valid pairs.
    """
    logits = torch.matmul(pq, pk.transpose(-1, -2)) * alpha
    if activation == "softmax":
        row_any = valid.any(-1, keepdim=True)
        attn = torch.softmax(logits.masked_fill(~(valid | ~row_any), float("-inf")), dim=-1)
        attn = attn * (valid & row_any)
    else:
        act = {"silu": F.silu, "gelu": F.gelu, "none": lambda x: x}[activation]
        attn = act(logits) / norm * valid
    return torch.matmul(attn, pv)


def _default_alpha(activation: str, alpha: float | None, d: int) -> float:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if alpha is not None:
        return float(alpha)
    return 1.0 / math.sqrt(d) if activation == "softmax" else 1.0


def _check_jagged(name: str, x: torch.Tensor, offsets: torch.Tensor) -> int:
    """Check a jagged tensor x [T, H, D] and its offsets [B+1] int64 (start at 0, never decrease, end at T);
    return the longest sequence's length. Raises ValueError naming the function, field and sequence."""
    if x.dim() != 3:
        raise ValueError(f"{name}: expected [T, H, D], got {tuple(x.shape)}")
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} offsets: expected 1-D int64 [B+1], got {offsets.dtype} {tuple(offsets.shape)}")
    if int(offsets[0]) != 0:
        raise ValueError(f"{name}: offsets[0] must be 0, got {int(offsets[0])}")
    if int(offsets[-1]) != x.shape[0]:
        raise ValueError(f"{name}: offsets[-1]={int(offsets[-1])} != T={x.shape[0]}")
    lengths = offsets[1:] - offsets[:-1]
    if lengths.numel() and int(lengths.min()) < 0:
        b = int(torch.argmin(lengths))
        raise ValueError(f"{name}: offsets must not decrease: sequence {b} has length {int(lengths[b])}")
    return int(lengths.max()) if lengths.numel() else 0


def jagged_cross_attention_ref(q: torch.Tensor, q_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int, *,
                               activation: str = "softmax", alpha: float | None = None) -> torch.Tensor:
    """Cross-attention of jagged queries against a different jagged key/value set (non-causal).

    q: [Tq, H, Dqk] with q_offsets [B+1] int64 (e.g. candidate items per user); k: [Tk, H, Dqk],
    v: [Tk, H, Dv] with kv_offsets [B+1] (e.g. the user history). Query row of sequence b attends to every
    key of sequence b. activation/alpha as ``jagged_attention_ref``; pointwise activations divide by
    N = max_kv_len. A sequence with no keys gives 0. Returns [Tq, H, Dv].
    Raises ValueError on bad shapes, batch-size mismatch or a sequence longer than its max length.
    """
    mq = _check_jagged("jagged_cross_attention_ref q", q, q_offsets)
    mk = _check_jagged("jagged_cross_attention_ref k", k, kv_offsets)
    if q_offsets.numel() != kv_offsets.numel() or v.shape[:2] != k.shape[:2] or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"jagged_cross_attention_ref: mismatched q {tuple(q.shape)} / k {tuple(k.shape)} / "
                         f"v {tuple(v.shape)} or batch sizes")
    if mq > max_q_len or mk > max_kv_len:
        raise ValueError(f"jagged_cross_attention_ref: lengths ({mq}, {mk}) exceed ({max_q_len}, {max_kv_len})")
    alpha = _default_alpha(activation, alpha, q.shape[2])
    B, (Tq, H, Dqk), Dv = q_offsets.numel() - 1, q.shape, v.shape[2]
    if Tq == 0 or mk == 0:
        return q.new_zeros((Tq, H, Dv)) + (q.sum() + k.sum() + v.sum()) * 0.0
    pq = _pad(q.reshape(Tq, H * Dqk), q_offsets, mq).view(B, mq, H, Dqk).transpose(1, 2)
    pk = _pad(k.reshape(-1, H * Dqk), kv_offsets, mk).view(B, mk, H, Dqk).transpose(1, 2)
    pv = _pad(v.reshape(-1, H * Dv), kv_offsets, mk).view(B, mk, H, Dv).transpose(1, 2)
    lk = (kv_offsets[1:] - kv_offsets[:-1]).view(B, 1, 1, 1)
    valid = (torch.arange(mk, device=q.device).view(1, 1, 1, mk) < lk).expand(B, 1, mq, mk)
    out = _attend_padded_ref(pq, pk, pv, valid, activation, alpha, float(max(max_kv_len, 1)))
    return _unpad(out.transpose(1, 2).reshape(B, mq, H * Dv), q_offsets).view(Tq, H, Dv)


def pma_ref(seeds: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor, max_kv_len: int,
            *, activation: str = "softmax", alpha: float | None = None) -> torch.Tensor:
    """Pooled multi-head attention (Set Transformer's PMA, Lee et al. 2019): S learned seed queries per
    head, shared by all sequences, attend to each jagged history.

    seeds: [S, H, Dqk]; k: [T, H, Dqk], v: [T, H, Dv]; kv_offsets [B+1] int64. activation/alpha as
    ``jagged_attention_ref`` (pointwise: divide by N = max_kv_len). An empty history gives 0.
    Returns [B, S, H, Dv]. Raises ValueError on bad shapes or a history longer than max_kv_len.
    """
    mk = _check_jagged("pma_ref k", k, kv_offsets)
    if seeds.dim() != 3 or seeds.shape[1:] != k.shape[1:] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"pma_ref: seeds {tuple(seeds.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} mismatch")
    if mk > max_kv_len:
        raise ValueError(f"pma_ref: a history of length {mk} > max_kv_len {max_kv_len}")
    alpha = _default_alpha(activation, alpha, seeds.shape[2])
    B, (S, H, Dqk), Dv = kv_offsets.numel() - 1, seeds.shape, v.shape[2]
    if B == 0 or mk == 0:
        return seeds.new_zeros((B, S, H, Dv)) + (seeds.sum() + k.sum() + v.sum()) * 0.0
    pq = seeds.transpose(0, 1).unsqueeze(0)  # [1, H, S, Dqk]
    pk = _pad(k.reshape(-1, H * Dqk), kv_offsets, mk).view(B, mk, H, Dqk).transpose(1, 2)
    pv = _pad(v.reshape(-1, H * Dv), kv_offsets, mk).view(B, mk, H, Dv).transpose(1, 2)
    lk = (kv_offsets[1:] - kv_offsets[:-1]).view(B, 1, 1, 1)
    valid = (torch.arange(mk, device=k.device).view(1, 1, 1, mk) < lk).expand(B, 1, S, mk)
    out = _attend_padded_ref(pq, pk, pv, valid, activation, alpha, float(max(max_kv_len, 1)))
    return out.transpose(1, 2)  # [B, S, H, Dv]


def jagged_block_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                               max_len: int, *, block_size: int = 64, window: int = 0,
                               activation: str = "softmax", causal: bool = True,
                               alpha: float | None = None) -> torch.Tensor:
    """Block-local jagged self-attention: query position i sees key j of its sequence only when
    ``i // block_size == j // block_size`` (or, when ``window`` > 0, only when ``|i - j| < window``),
    and j <= i if causal. q/k: [T, H, Dqk], v: [T, H, Dv], offsets [B+1] int64. activation/alpha as
    ``jagged_attention_ref`` (pointwise: divide by N = max_len). Returns [T, H, Dv].
    Raises ValueError on bad shapes, block_size <= 0 without a window, or a sequence longer than max_len.
    """
    n = _check_jagged("jagged_block_attention_ref q", q, offsets)
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"jagged_block_attention_ref: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if window <= 0 and block_size <= 0:
        raise ValueError(f"jagged_block_attention_ref: block_size must be > 0, got {block_size}")
    if n > max_len:
        raise ValueError(f"jagged_block_attention_ref: a sequence of length {n} > max_len {max_len}")
    alpha = _default_alpha(activation, alpha, q.shape[2])
    B, (T, H, Dqk), Dv = offsets.numel() - 1, q.shape, v.shape[2]
    if T == 0:
        return v * 0.0 + (q.sum() + k.sum()) * 0.0
    pq = _pad(q.reshape(T, H * Dqk), offsets, n).view(B, n, H, Dqk).transpose(1, 2)
    pk = _pad(k.reshape(T, H * Dqk), offsets, n).view(B, n, H, Dqk).transpose(1, 2)
    pv = _pad(v.reshape(T, H * Dv), offsets, n).view(B, n, H, Dv).transpose(1, 2)
    ids = torch.arange(n, device=q.device)
    i, j = ids.view(n, 1), ids.view(1, n)
    L = (offsets[1:] - offsets[:-1]).view(B, 1, 1, 1)
    local = ((i - j).abs() < window) if window > 0 else ((i // block_size) == (j // block_size))
    if causal:
        local = local & (j <= i)
    valid = local.view(1, 1, n, n) & (i.view(1, 1, n, 1) < L) & (j.view(1, 1, 1, n) < L)
    out = _attend_padded_ref(pq, pk, pv, valid, activation, alpha, float(max(max_len, 1)))
    return _unpad(out.transpose(1, 2).reshape(B, n, H * Dv), offsets).view(T, H, Dv)


# ----------------------------------------------------------------------------------------------------------
# Fused norm + FP8 quantize (kernels/norm_quant.py): input checks shared by both backends, and the spec
# ----------------------------------------------------------------------------------------------------------
# Quantization: per row, per block of ``block_size`` columns, scale = amax / 448, q = clamp(y * 448 / amax)
# cast to e4m3fn (round to nearest even), all-zero block -> scale 0, q 0 (DeepSeek-V3 1x128 tiles).
NORM_QUANT_FP8_DTYPE = torch.float8_e4m3fn
NORM_QUANT_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_NORM_QUANT_KINDS = ("layer", "rms")
_NORM_QUANT_BACKENDS = ("auto", "triton", "reference")
_NORM_QUANT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_norm_quant_inputs(x, weight, bias, kind, eps, block_size, backend=None):
    """Validate ``norm_quant`` arguments (see gemray.kernels.norm_quant.norm_quant); raises ValueError."""
    if backend is not None and backend not in _NORM_QUANT_BACKENDS:
        raise ValueError(f"norm_quant: backend must be one of {_NORM_QUANT_BACKENDS}, got {backend!r}")
    if kind not in _NORM_QUANT_KINDS:
        raise ValueError(f"norm_quant: kind must be one of {_NORM_QUANT_KINDS}, got {kind!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"norm_quant: x must be a 2-D tensor [N, D], got {shape}")
    if x.dtype not in _NORM_QUANT_DTYPES:
        raise ValueError(f"norm_quant: x.dtype must be one of {_NORM_QUANT_DTYPES}, got {x.dtype}")
    d = x.shape[1]
    if d == 0:
        raise ValueError("norm_quant: x has D == 0 features; nothing to normalize")
    if not isinstance(block_size, int) or block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"norm_quant: block_size must be a positive power of two, got {block_size!r}")
    if d % block_size:
        raise ValueError(
            f"norm_quant: D={d} is not a multiple of block_size={block_size}; pad the feature dim or "
            f"pick a block_size that divides it"
        )
    if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):
        raise ValueError(f"norm_quant: eps must be a positive finite float, got {eps!r}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != (d,):
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"norm_quant: {name} must have shape [D]=[{d}], got {shape}")
        if p.dtype not in _NORM_QUANT_DTYPES:
            raise ValueError(f"norm_quant: {name}.dtype must be one of {_NORM_QUANT_DTYPES}, got {p.dtype}")
        if p.device != x.device:
            raise ValueError(f"norm_quant: {name} is on {p.device} but x is on {x.device}")


def quantize_blocks_ref(y: torch.Tensor, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row-block FP8 e4m3 quantization in plain PyTorch (the unfused "separate quantize pass").

    y: [N, D] float32/float16/bfloat16, D a multiple of ``block_size``.
    Returns ``(y_fp8 [N, D] float8_e4m3fn, scales [N, D // block_size] float32)`` with
    ``scales = amax / 448`` and ``y_fp8 = clamp(y * (448 / amax), -448, 448)`` (0 where amax == 0).
    Raises ValueError if D is not a multiple of ``block_size``.
    """
    n, d = y.shape
    if d % block_size:
        raise ValueError(f"quantize_blocks_ref: D={d} is not a multiple of block_size={block_size}")
    yb = y.detach().float().view(n, d // block_size, block_size)
    amax = yb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, NORM_QUANT_FP8_MAX / amax, torch.zeros_like(amax))
    q = (yb * inv).clamp_(-NORM_QUANT_FP8_MAX, NORM_QUANT_FP8_MAX).to(NORM_QUANT_FP8_DTYPE)
    return q.view(n, d), (amax / NORM_QUANT_FP8_MAX).squeeze(-1)


def norm_quant_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    kind: str = "layer",
    eps: float = 1e-5,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference LayerNorm/RMSNorm + FP8 block quantization (differentiable in ``y`` through autograd).

    x: [N, D]; weight, bias: [D] or None. The norm is computed in float32 and ``y`` rounded to ``x.dtype``.
    kind="layer": ``y = (x - mean) / sqrt(var + eps) * weight + bias`` (biased variance);
    kind="rms":   ``y = x / sqrt(mean(x^2) + eps) * weight + bias``.
    Returns ``(y [N, D] x.dtype, y_fp8 [N, D] float8_e4m3fn, scales [N, D // block_size] float32)``.
    Raises ValueError on bad shapes/dtypes/kind/block_size (see ``norm_quant``).
    """
    check_norm_quant_inputs(x, weight, bias, kind, eps, block_size)
    d = x.shape[1]
    xf = x.float()
    wf = None if weight is None else weight.float()
    if kind == "layer":
        yf = F.layer_norm(xf, (d,), wf, None, eps)
    else:
        yf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        if wf is not None:
            yf = yf * wf
    if bias is not None:
        yf = yf + bias.float()
    y = yf.to(x.dtype)
    q, scales = quantize_blocks_ref(y, block_size)
    return y, q, scales


def jagged_contextual_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                    max_len: int, *, contextual_len: int, activation: str = "silu",
                                    alpha: float | None = None,
                                    num_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Causal jagged self-attention whose first ``contextual_len`` positions form a bidirectional prefix
    (contextual features: they see each other; later positions see them causally anyway). Otherwise as
    ``jagged_attention_ref`` (masks from ``valid_attn_mask_ref``, N = max_len, alpha default).

    q/k: [T, H, Dqk], v: [T, H, Dv], offsets [B+1] int64. Returns [T, H, Dv].
    Raises ValueError on bad shapes, contextual_len < 0 or a sequence longer than max_len.
    """
    n = _check_jagged("jagged_contextual_attention_ref q", q, offsets)
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"jagged_contextual_attention_ref: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if contextual_len < 0 or n > max_len:
        raise ValueError(f"jagged_contextual_attention_ref: contextual_len {contextual_len} < 0 or a "
                         f"sequence of length {n} > max_len {max_len}")
    alpha = _default_alpha(activation, alpha, q.shape[2])
    B, (T, H, Dqk), Dv = offsets.numel() - 1, q.shape, v.shape[2]
    if T == 0:
        return v * 0.0 + (q.sum() + k.sum()) * 0.0
    lengths = offsets[1:] - offsets[:-1]
    valid = valid_attn_mask_ref(lengths, n, causal=True, num_targets=num_targets)  # [B, n, n]
    ids = torch.arange(n, device=q.device)
    L = lengths.view(B, 1, 1)
    prefix = (ids.view(1, n, 1) < contextual_len) & (ids.view(1, 1, n) < contextual_len)
    prefix = prefix & (ids.view(1, n, 1) < L) & (ids.view(1, 1, n) < L)
    inside = (ids.view(1, n, 1) < L) & (ids.view(1, 1, n) < L)
    valid = ((valid & inside) | prefix).unsqueeze(1)
    pq = _pad(q.reshape(T, H * Dqk), offsets, n).view(B, n, H, Dqk).transpose(1, 2)
    pk = _pad(k.reshape(T, H * Dqk), offsets, n).view(B, n, H, Dqk).transpose(1, 2)
    pv = _pad(v.reshape(T, H * Dv), offsets, n).view(B, n, H, Dv).transpose(1, 2)
    out = _attend_padded_ref(pq, pk, pv, valid, activation, alpha, float(max(max_len, 1)))
    return _unpad(out.transpose(1, 2).reshape(B, n, H * Dv), offsets).view(T, H, Dv)


def sampled_softmax_lse_ref(h: torch.Tensor, pos: torch.Tensor, e_neg: torch.Tensor, neg_ids: torch.Tensor,
                            target_ids: torch.Tensor, row_offsets: torch.Tensor, max_rows: int,
                            temperature: float) -> torch.Tensor:
    """Sampled-softmax log-sum-exp per row over the negatives its sequence shares (the retrieval head's
    "uniform_shared"; kernel: ``gemray.kernels.sampled_softmax``).

    h: [M, E] float (user states, one row per position with a next item); pos: [M] float, <h_i, e_pos_i>;
    e_neg: [B, R, E] float (the negatives of each sequence); neg_ids: [B, R] int64; target_ids: [M] int64;
    row_offsets: [B+1] int64 (rows of sequence b are row_offsets[b]:row_offsets[b+1]); max_rows: host int >=
    every sequence's row count; temperature > 0.
    Row i of sequence b: ``logsumexp([pos_i, <h_i, e_neg[b, r]> for r] / temperature)`` with -inf where
    ``neg_ids[b, r] == target_ids[i]`` (a sampled negative equal to the positive). Returns lse [M] float32
    (float64 for float64 inputs), differentiable in h, pos and e_neg. Loop-free and sync-free: h is padded to
    [B, max_rows, E] (index_copy), multiplied by e_neg^T in one bmm and un-padded (index_select).
    """
    dt = torch.float64 if torch.float64 in (h.dtype, e_neg.dtype, pos.dtype) else torch.float32
    n = max(int(max_rows), 1)
    flat = _flat_index(row_offsets, n, total=h.shape[0])                                    # [M] padded row
    neg = _unpad(torch.bmm(_pad(h.to(dt), row_offsets, n, flat), e_neg.to(dt).transpose(1, 2)), row_offsets,
                 flat)                                                                      # [M, R]
    same = neg_ids[flat // n] == target_ids.view(-1, 1)
    logits = torch.cat([pos.to(dt).view(-1, 1), neg.masked_fill(same, float("-inf"))], dim=1) / temperature
    return torch.logsumexp(logits, dim=1)


def bias_silu_split_ref(x: torch.Tensor, bias: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The HSTU block's uvqk activation (kernel: ``gemray.kernels.bias_silu``): ``torch.split(silu(x + bias),
    sizes, 1)`` with the sum and the SiLU in float32 (float64 for float64 inputs) and the result rounded to x's
    dtype, so a bf16 x and a float32 bias give bf16 splits.

    x: [T, W] float (the uvqk projection without its bias), bias: [W] float, sizes: split widths summing to W.
    Returns one [T, sizes[i]] tensor (a view) per split; differentiable in x (x's dtype) and bias (bias's
    dtype; the column sums of the unrounded dx). Raises ValueError when sizes do not sum to W.
    """
    if x.dim() != 2 or bias.shape != (x.shape[1],) or sum(int(s) for s in sizes) != x.shape[1]:
        raise ValueError(f"bias_silu_split: sizes {list(sizes)} must sum to W, the width of x {tuple(x.shape)} and "
                         f"of bias {tuple(bias.shape)}")
    wide = torch.promote_types(x.dtype, torch.float32)
    y = F.silu(x.to(wide) + bias.to(wide)).to(x.dtype)
    return list(torch.split(y, [int(s) for s in sizes], 1))
