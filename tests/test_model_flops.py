"""gemray.model.flops: hand counts on a tiny config, valid-pair counts against the attention masks, NVIDIA's
convention, and torch.utils.flop_counter.FlopCounterMode over a tiny GEM stack's forward + backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gemray.config import ModelConfig
from gemray.jagged import lengths_to_offsets
from gemray.kernels.reference import length_groups, valid_attn_mask_ref
from gemray.model.flops import attention_pairs, mfu, nvidia_hstu_flops, step_flops
from gemray.model.hstu import HSTUEncoder
from gemray.model.inputs import InputLayer
from gemray.model.ranking import CandidateTower, MultiTaskHead

LENGTHS = torch.tensor([2, 0, 3])
CANDS = torch.tensor([1, 2, 0])


def _tiny(**kw):
    base = dict(embedding_dim=4, num_blocks=2, num_heads=1, attention_dim=2, linear_dim=3, dropout=0.0,
                tasks=["retrieval", "ctr"], pma_seeds=2, mlp_dims=[5], num_negatives=3)
    base.update(kw)
    return ModelConfig(**base)


def test_step_flops_by_hand():
    """T=5, B=3, C=3, M=3, d=E=4, H=1, A=2, V=3, 2 layers, S=2, R=3, MLP [12, 5, 1]."""
    f = step_flops(_tiny(), LENGTHS, CANDS)
    assert f["hstu_gemm"] == 3 * 2 * (2 * 5 * 4 * (6 + 4) + 2 * 5 * 3 * 4) == 3120
    assert f["hstu_attention"] == 3.5 * 2 * (2 * 9 * 1 * (2 + 3)) == 630  # causal pairs 3 + 0 + 6
    assert f["elementwise"] == 2 * (2 * 5 * 1 * 3 + 5 * 4) == 100
    assert f["input_projection"] == 0  # sum of E-wide embeddings, d = E: no projection
    assert f["tower_gemm"] == 3 * (2 * 3 * 4 * 2 + 2 * 5 * 4 * 5 + 2 * 3 * 3 * 4 + 2 * 3 * 2 * 3 * 4) == 1392
    assert f["tower_attention"] == 3.5 * 2 * (1 * 2 + 2 * 5) * 1 * 5 == 420  # cross 1x2, PMA 2 seeds x 5
    assert f["mlp"] == 3 * 2 * 3 * (12 * 5 + 5 * 1) == 1170
    assert f["retrieval_head"] == 3 * 2 * 3 * (3 + 1) * 4 == 288
    assert f["embeddings"] == 0
    assert f["total"] == 7120 and f["hstu_only"] == 3850
    assert f["candidate_tower"] == 1812 and f["attention"] == 1050
    assert f["gemm"] == 3120 + 1392 + 1170 + 288
    fwd = step_flops(_tiny(), LENGTHS, CANDS, backward=False)
    assert fwd["hstu_gemm"] == 1040 and fwd["hstu_attention"] == 180 and fwd["elementwise"] == 2 * (15 + 20)
    # concat of item, rating, time_gap, category (16 wide) projected to d = 4 on T = 5 tokens
    f = step_flops(_tiny(token_features=["category"], combiner="concat"), LENGTHS, CANDS)
    assert f["input_projection"] == 3 * 2 * 5 * 16 * 4
    f = step_flops(_tiny(tasks=["retrieval"], negatives="uniform_shared"), LENGTHS)
    assert f["retrieval_head"] == 3 * (2 * 5 * 3 * 4 + 2 * 3 * 4) and f["mlp"] == f["tower_gemm"] == 0
    # model_dim 6 != E = 4: the states are projected 6 -> 4 (GEM.retrieval_proj), then scored 4 wide
    f = step_flops(_tiny(tasks=["retrieval"], model_dim=6), LENGTHS)
    assert f["retrieval_head"] == 3 * (2 * 3 * (3 + 1) * 4 + 2 * 5 * 6 * 4)
    # window 2: pairs 3 + (3 + 2) = 8; block 2: 3 + (3 + 1) = 7 (the pair counts step_flops will use once the
    # HSTU blocks take model.attention_window / attention_block, which the config refuses until then)
    assert attention_pairs(LENGTHS, window=2) == 8 and attention_pairs(LENGTHS, block=2) == 7
    assert attention_pairs(LENGTHS) == 9
    with pytest.raises(ValueError, match="candidate_lengths"):
        step_flops(_tiny(), LENGTHS)


def _mask_pairs(lengths, causal, window, block):
    n = int(lengths.max()) if lengths.numel() else 0
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    local = torch.ones(n, n, dtype=torch.bool)
    if window:
        local = (i - j).abs() < window
    elif block:
        local = (i // block) == (j // block)
    if causal:
        local = local & (j <= i)
    inside = (i.view(1, n, 1) < lengths.view(-1, 1, 1)) & (j.view(1, 1, n) < lengths.view(-1, 1, 1))
    return int((local & inside).sum())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window,block", [(0, 0), (1, 0), (3, 0), (64, 0), (0, 1), (0, 4), (0, 64)])
def test_attention_pairs_count_the_masks(causal, window, block):
    g = torch.Generator().manual_seed(window * 7 + block)
    lengths = torch.cat([torch.tensor([0, 1, 40]), torch.randint(0, 30, (9,), generator=g)])
    assert attention_pairs(lengths, causal=causal, window=window, block=block) == \
        _mask_pairs(lengths, causal, window, block)
    if not window and not block and causal:
        valid = valid_attn_mask_ref(lengths, 40, causal=True)
        inside = (torch.arange(40).view(1, -1, 1) < lengths.view(-1, 1, 1))
        assert attention_pairs(lengths) == int((valid & inside).sum())


def test_nvidia_convention_and_its_three_differences():
    cfg = _tiny(attention_dim=2, linear_dim=2, tasks=["retrieval"])
    L = torch.tensor([2, 3])
    # per sequence of length L: attention 2 H L^2 D x3.5 = 14 L^2; GEMMs (64 L + 8 L) x3; other 4 L + 4 L
    assert nvidia_hstu_flops(cfg, L) == 2 * sum(14 * n * n + 216 * n + 8 * n for n in (2, 3)) == 2604
    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(embedding_dim=16, num_blocks=3, num_heads=4, attention_dim=8, linear_dim=8)
    L = torch.cat([torch.tensor([0, 1]), torch.randint(0, 50, (20,), generator=g)])
    T, H, D, d, nl = int(L.sum()), 4, 8, 16, 3
    ours, theirs = step_flops(cfg, L)["hstu_only"], nvidia_hstu_flops(cfg, L)
    out_proj = 3 * 2 * T * (H * D * d - H * d)                      # they drop the per-head width
    diagonal = 3.5 * 2 * H * 2 * D * float((L * (L + 1) / 2 - L * L / 2).sum())  # we count j == i
    residual = T * d - T * H * d                                    # they add T H hidden
    assert ours - theirs == pytest.approx(nl * (out_proj + diagonal + residual))
    with pytest.raises(ValueError, match="attention_dim == linear_dim"):
        nvidia_hstu_flops(_tiny(), L)


def test_mfu():
    assert mfu(989e12, 1.0) == 1.0
    assert mfu(4.945e14, 2.0, peak=989e12) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        mfu(1.0, 0.0)


def test_flop_counter_agrees_with_step_flops():
    """FlopCounterMode over a tiny GEM stack (concat inputs -> 2 HSTU blocks -> candidate tower -> CTR/CVR
    BCE), forward + backward, on a jagged batch with an empty history, a length-1 one and empty candidate lists.

    GEMMs (aten mm / addmm: 1 forward + 2 backward GEMMs each) agree exactly with the GEMM components; the
    tower's cross-attention / PMA custom ops carry this convention's formulas (gemray.ops), so they agree
    exactly too. The HSTU self-attention runs as the reference's padded batched matmuls, which the counter
    sees as 2 bmm forward + 4 backward (3x, no recompute) over the padded n x n squares of each length group,
    where step_flops counts 3.5x over the valid causal pairs: the two differ by exactly those two factors.
    """
    cfg = ModelConfig(embedding_dim=8, num_blocks=2, num_heads=2, attention_dim=4, linear_dim=3, dropout=0.0,
                      num_position_buckets=16, num_time_buckets=16, token_features=["category"],
                      candidate_features=["category"], context_features=["hour"], combiner="concat",
                      tasks=["ctr", "cvr"], pma_seeds=3, mlp_dims=[16], attention_backend="reference")
    lengths, cands = torch.tensor([5, 0, 1, 12, 3]), torch.tensor([2, 1, 0, 3, 0])
    off, coff = lengths_to_offsets(lengths), lengths_to_offsets(cands)
    B, T, C, E, max_len = 5, int(off[-1]), int(coff[-1]), 8, 12
    g = torch.Generator().manual_seed(0)

    def leaf(n):
        return torch.randn(n, E, generator=g).requires_grad_()

    emb = {"item_id": leaf(T), "rating": leaf(T), "time_gap": leaf(T), "category": leaf(T),
           "cand_item_id": leaf(C), "cand_category": leaf(C), "ctx_hour": leaf(B)}
    timestamps = torch.cumsum(torch.randint(0, 1000, (T,), generator=g), 0)
    labels = torch.stack([torch.tensor([1.0, 0, 1, 1, 0, 1]), torch.tensor([1.0, 0, 0, 1, 0, 0])], 1)
    torch.manual_seed(0)
    layer, enc = InputLayer(cfg), HSTUEncoder(cfg, max_len)
    tower, head = CandidateTower(cfg, max_len), MultiTaskHead.from_config(cfg)
    with FlopCounterMode(display=False) as fc:
        states = enc(layer.token_embeddings(emb), off, timestamps)
        logits = tower(states, off, layer.candidate_embeddings(emb), coff, layer.context_embeddings(emb))
        loss, _ = head(logits, labels)
        loss.backward()
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    assert set(counts) <= {"aten.mm", "aten.addmm", "aten.bmm", "gemray.cross_attention",
                           "gemray.cross_attention_backward", "gemray.pma", "gemray.pma_backward"}, counts
    f = step_flops(cfg, lengths, cands)
    assert f["input_projection"] > 0 and f["tower_attention"] > 0
    assert counts["aten.mm"] + counts["aten.addmm"] == \
        f["hstu_gemm"] + f["input_projection"] + f["tower_gemm"] + f["mlp"]
    tower_attn = sum(v for k, v in counts.items() if k.startswith("gemray."))
    assert tower_attn == f["tower_attention"]
    H, A, V = 2, 4, 3
    padded = sum(seqs.numel() * n * n for seqs, n in length_groups(lengths))
    assert counts["aten.bmm"] == 3 * cfg.num_blocks * 2 * H * (A + V) * padded
    valid = attention_pairs(lengths)
    assert f["hstu_attention"] == pytest.approx(counts["aten.bmm"] * (3.5 / 3) * (valid / padded))
