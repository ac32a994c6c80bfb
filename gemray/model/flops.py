"""Exact model FLOPs of a GEM training step on its real jagged lengths, and MFU.

Shape key: B requests, L_b history length of request b, T = sum L_b, Lc_b its candidate count, C = sum Lc_b,
M = sum max(L_b - 1, 0) (positions with a next item), E = embedding_dim, d = ``cfg.width``, H heads,
A = attention_dim, V = linear_dim (per head), S = pma_seeds, R = num_negatives, K = ranking tasks,
n_l = ``cfg.num_blocks``.

Convention (NVIDIA recsys-examples ``examples/commons/utils/perf.py``, ``cal_hstu_flops_single_rank``, the
figure behind their 31.4% E2E MFU on H100): a GEMM of [M, K] x [K, N] is 2MNK FLOPs; attention counts only
the valid (query, key) pairs of each sequence, 2 (Dqk + Dv) FLOPs per pair and head (QK^T and PV; no padding,
no masked pairs); a training step (forward + backward) is 3x the forward GEMMs (dX and dW) and 3.5x the
forward attention (FlashAttention's backward: 5 GEMMs, QK^T recomputed); embedding lookups count 0.
Softmax / activation / norm arithmetic counts 0, except the HSTU layers' small elementwise terms that
NVIDIA counts (``elementwise``).

Components of ``step_flops`` (forward FLOPs, times the multiplier; all disjoint, ``total`` is their sum):

    hstu_gemm        n_l * [2 T d (2HV + 2HA)  (uvqk)  +  2 T (HV) d  (output)]                          x3
    hstu_attention   n_l * 2 H (A + V) * pairs, pairs = sum_b of the valid pairs of sequence b:          x3.5
                     causal L(L+1)/2; window w (i - w < j <= i): L(L+1)/2 if L <= w else
                     w(w+1)/2 + (L - w) w; block s: q s(s+1)/2 + r(r+1)/2 (L = q s + r)
    elementwise      n_l * [T H V (u gating; x2 with backward, as NVIDIA) + T d (residual add, fwd only)]
    input_projection 2 T W_tok d + 2 C W_cand d + 2 B W_ctx d, each only where a projection exists
                     (W = E for "sum", F E for "concat"; none when W == d)                              x3
    tower_gemm       2 C d HA (q) + 2 T d H(A+V) (k|v) + 2 C HV d (out) + 2 B SHV d (pool)               x3
    tower_attention  2 H (A + V) * [sum_b Lc_b L_b (cross: every candidate x every key)                  x3.5
                     + S sum_b L_b (PMA: every seed x every key)]
    mlp              2 C sum_i in_i out_i over the widths [3d (+d with context), *mlp_dims, K]          x3
                     (MoE, moe_experts = X: the first two layers count k times, + 2 C in X for the
                     router; nominal: assignments dropped over capacity are not subtracted)
    retrieval_head   "uniform" / "in_batch": 2 M (R + 1) E; "uniform_shared": 2 T R E + 2 M E           x3
                     (negative logits as GEMMs over what is computed, + the positive dot products; scored
                     in the item table's width E), + 2 T d E when d != E (``GEM.retrieval_proj``)
    embeddings       0

Derived keys: ``gemm`` (hstu_gemm + input_projection + tower_gemm + mlp + retrieval_head), ``attention``
(hstu + tower), ``candidate_tower`` (tower_gemm + tower_attention), ``hstu_only`` (hstu_gemm +
hstu_attention + elementwise: the scope NVIDIA's convention counts) and ``total``.

Mapping to NVIDIA's formula (``nvidia_hstu_flops`` reproduces it literally, to compare with their figures):
they count HSTU layers only (our ``hstu_only``), with A = V = D, and differ in three terms: (1) their output
projection is ``2 T H hidden`` (no per-head width: for 4 heads of 256 at width 1024 that is 1/256 of the
``2 T (H D) hidden`` the layer computes, about 20% of the layer's GEMMs); (2) their causal pairs are L^2 / 2
(we count the diagonal too: L(L+1)/2); (3) their residual add is ``T H hidden`` (we count ``T d``).

FlopCounterMode: ``gemray.ops`` registers formulas for its cross-attention / PMA custom ops with this
convention (forward 2 pairs H (Dqk + Dv), backward 2.5x), so ``torch.utils.flop_counter.FlopCounterMode``
over a forward + backward agrees with ``tower_attention`` exactly, and with the GEMM components exactly
(aten mm / addmm, 1 forward + 2 backward GEMMs each). The HSTU self-attention still runs as the reference's
padded batched matmuls on CPU: FlopCounterMode counts those as 3x (PyTorch's bmm backward, no recompute) over
the padded n x n squares, where ``hstu_attention`` counts 3.5x over the valid causal pairs
(tests/test_model_flops.py checks both relations).
"""

from __future__ import annotations

import torch

from gemray.config import ModelConfig
from gemray.ops import gdpa_flops

PEAK_BF16_DENSE = 989e12  # H100 / H200 SXM dense bf16 tensor-core peak, FLOP/s (NVIDIA datasheet)
GEMM_MULT = 3.0           # forward + backward of a GEMM: y = xW, dx = dy W^T, dW = x^T dy
ATTN_MULT = 3.5           # forward + backward of attention: 2 forward GEMMs + 5 backward (QK^T recomputed)
COMPONENTS = ("hstu_gemm", "hstu_attention", "elementwise", "input_projection", "tower_gemm", "tower_attention",
              "mlp", "retrieval_head", "embeddings")


def _lengths(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D int64 tensor [B], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    x = x.detach().to("cpu", torch.int64)
    if x.numel() and int(x.min()) < 0:
        raise ValueError(f"{name}: lengths must be >= 0")
    return x


def attention_pairs(lengths: torch.Tensor, *, causal: bool = True, window: int = 0, block: int = 0) -> int:
    """Valid (query, key) pairs of jagged self-attention, summed over the sequences.

    lengths: [B] int64 sequence lengths. causal: key j <= query i. window > 0: only |i - j| < window
    (``kernels.reference.jagged_block_attention_ref``); block > 0: only keys of the query's block
    (i // block == j // block). Returns a Python int. Raises ValueError for negative lengths, window < 0,
    block < 0 or both set.
    """
    L = _lengths(lengths, "attention_pairs lengths")
    if window < 0 or block < 0 or (window and block):
        raise ValueError(f"attention_pairs: window ({window}) and block ({block}) must be >= 0, at most one set")
    if window:
        w = int(window)
        tri = L * (L + 1) // 2
        c = torch.where(L <= w, tri, torch.full_like(L, w * (w + 1) // 2) + (L - w) * w)
        return int(c.sum()) if causal else int((2 * c - L).sum())
    if block:
        q, r = L // block, L % block
        if causal:
            return int((q * (block * (block + 1) // 2) + r * (r + 1) // 2).sum())
        return int((q * block * block + r * r).sum())
    return int((L * (L + 1) // 2).sum()) if causal else int((L * L).sum())


def _combined_width(cfg: ModelConfig, num_features: int) -> int:
    return cfg.embedding_dim * (num_features if cfg.combiner == "concat" else 1)


def step_flops(cfg: ModelConfig, lengths: torch.Tensor, candidate_lengths: torch.Tensor | None = None, *,
               backward: bool = True) -> dict[str, float]:
    """Model FLOPs of one step of the GEM model ``cfg`` on one rank's batch (module docstring).

    Args:
        cfg: ModelConfig (validated here).
        lengths: [B] int64 history lengths (``JaggedBatch.lengths``).
        candidate_lengths: [B] int64 candidates per request (``candidate_offsets`` differences); required
            when ``cfg.tasks`` has a ranking task, ignored otherwise.
        backward: True = a training step (forward + backward, multipliers 3 / 3.5); False = forward only
            (evaluation / serving).
    Returns:
        {component: FLOPs (float)} for ``COMPONENTS`` plus "gemm", "attention", "candidate_tower",
        "hstu_only" and "total".
    Raises:
        ValueError: bad lengths, or candidate_lengths missing / of another B with ranking tasks.
    """
    cfg.validate()
    L = _lengths(lengths, "step_flops lengths")
    B = L.numel()
    T = int(L.sum())
    M = int((L - 1).clamp(min=0).sum())
    d, E, H, A, V, nl = cfg.width, cfg.embedding_dim, cfg.num_heads, cfg.attention_dim, cfg.linear_dim, cfg.num_blocks
    gm = GEMM_MULT if backward else 1.0
    am = ATTN_MULT if backward else 1.0
    out = dict.fromkeys(COMPONENTS, 0.0)

    out["hstu_gemm"] = gm * nl * (2.0 * T * d * (2 * H * V + 2 * H * A) + 2.0 * T * (H * V) * d)
    pairs = attention_pairs(L, causal=True, window=cfg.attention_window, block=cfg.attention_block)
    out["hstu_attention"] = am * nl * float(gdpa_flops(pairs, H, A, V))
    out["elementwise"] = nl * ((2.0 if backward else 1.0) * T * H * V + 1.0 * T * d)

    n_tok = 1 + int(cfg.use_rating_feature) + int(cfg.use_time_feature) + len(cfg.token_features)
    w_tok = _combined_width(cfg, n_tok)
    proj = 2.0 * T * w_tok * d if w_tok != d else 0.0

    if cfg.ranking_tasks:
        if candidate_lengths is None:
            raise ValueError(f"step_flops: candidate_lengths [B] is required with ranking tasks {cfg.ranking_tasks}")
        Lc = _lengths(candidate_lengths, "step_flops candidate_lengths")
        if Lc.numel() != B:
            raise ValueError(f"step_flops: candidate_lengths has B={Lc.numel()}, lengths B={B}")
        C = int(Lc.sum())
        S = cfg.pma_seeds
        w_cand = _combined_width(cfg, 1 + len(cfg.candidate_features))
        proj += 2.0 * C * w_cand * d if w_cand != d else 0.0
        if cfg.context_features:
            w_ctx = _combined_width(cfg, len(cfg.context_features))
            proj += 2.0 * B * w_ctx * d if w_ctx != d else 0.0
        out["tower_gemm"] = gm * (2.0 * C * d * H * A + 2.0 * T * d * H * (A + V) + 2.0 * C * H * V * d
                                  + 2.0 * B * S * H * V * d)
        tower_pairs = int((Lc * L).sum()) + S * T
        out["tower_attention"] = am * float(gdpa_flops(tower_pairs, H, A, V))
        dims = [d * (4 if cfg.context_features else 3)] + [int(m) for m in cfg.mlp_dims] + [len(cfg.ranking_tasks)]
        if cfg.moe_experts:  # router + top-k experts per candidate (nominal: capacity drops not subtracted)
            per_c = dims[0] * cfg.moe_experts + cfg.moe_top_k * (dims[0] * dims[1] + dims[1] * dims[2])
            per_c += sum(i * o for i, o in zip(dims[2:-1], dims[3:]))
        else:
            per_c = sum(i * o for i, o in zip(dims[:-1], dims[1:]))
        out["mlp"] = gm * 2.0 * C * per_c
    out["input_projection"] = gm * proj

    if "retrieval" in cfg.tasks:
        R = cfg.num_negatives
        if cfg.negatives == "uniform_shared":
            head = 2.0 * T * R * E + 2.0 * M * E
        else:
            head = 2.0 * M * (R + 1) * E
        if d != E:  # GEM.retrieval_proj: the T states, d -> E, before scoring against the E-wide item table
            head += 2.0 * T * d * E
        out["retrieval_head"] = gm * head

    total = sum(out[c] for c in COMPONENTS)
    out["gemm"] = sum(out[c] for c in ("hstu_gemm", "input_projection", "tower_gemm", "mlp", "retrieval_head"))
    out["attention"] = out["hstu_attention"] + out["tower_attention"]
    out["candidate_tower"] = out["tower_gemm"] + out["tower_attention"]
    out["hstu_only"] = out["hstu_gemm"] + out["hstu_attention"] + out["elementwise"]
    out["total"] = total
    return out


def nvidia_hstu_flops(cfg: ModelConfig, lengths: torch.Tensor, *, backward: bool = True) -> float:
    """NVIDIA recsys-examples' ``cal_hstu_flops_single_rank`` for this model's HSTU layers (causal, no
    contextual or candidate tokens, residual on), written from its formula: per layer and sequence of length
    L, attention ``2 H L^2 D`` (x3.5), GEMMs ``2 L 4 H D hidden + 2 L H hidden`` (x3), elementwise
    ``L H D`` (x2) + ``L H hidden``; D = attention_dim, hidden = ``cfg.width``. For comparing with their
    published MFU; ``step_flops(...)["hstu_only"]`` is the exact count (module docstring: three differences).
    Raises ValueError when attention_dim != linear_dim (their formula has one per-head width).
    """
    if cfg.attention_dim != cfg.linear_dim:
        raise ValueError(f"nvidia_hstu_flops: their formula needs attention_dim == linear_dim, got "
                         f"{cfg.attention_dim} and {cfg.linear_dim}")
    L = _lengths(lengths, "nvidia_hstu_flops lengths").to(torch.float64)
    H, D, hid = cfg.num_heads, cfg.attention_dim, cfg.width
    attn = (4 * H * L * L * D - 2 * H * L * L * D) * (3.5 if backward else 1.0)
    gemm = (2 * L * 4 * H * D * hid + 2 * L * H * hid) * (3.0 if backward else 1.0)
    other = L * H * D * (2.0 if backward else 1.0) + L * H * hid
    return float((attn + gemm + other).sum()) * cfg.num_blocks


def mfu(flops: float, seconds: float, peak: float = PEAK_BF16_DENSE) -> float:
    """Model FLOPs utilisation, a fraction: ``flops / seconds / peak`` (peak in FLOP/s; default 989e12, the
    H100 / H200 dense bf16 peak; pass the local rank's FLOPs and step time for the local MFU).
    Raises ValueError for seconds <= 0, peak <= 0 or flops < 0."""
    if not seconds > 0 or not peak > 0 or flops < 0:
        raise ValueError(f"mfu: expected flops >= 0, seconds > 0 and peak > 0, got {flops}, {seconds}, {peak}")
    return float(flops) / float(seconds) / float(peak)
