"""gemray.model.moe: token-choice top-k routing, capacity overflow, Switch's load-balancing loss by hand,
the experts against a per-token loop, and the MoE candidate tower inside GEM (config errors, meta build)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gemray.config import ModelConfig
from gemray.model.moe import MoEFFN, expert_capacity


def _moe(E=4, k=2, cf=0.0, D=3, Hd=5, O=2, seed=0):
    torch.manual_seed(seed)
    return MoEFFN(D, Hd, O, E, k, cf)


def _per_token_reference(m: MoEFFN, x: torch.Tensor, keep_mask: torch.Tensor | None = None) -> torch.Tensor:
    """y_t = sum_j g_tj FFN_{e_tj}(x_t), token by token, with explicit weights (no batching, no sorting)."""
    p = torch.softmax(x @ m.router.weight.t(), dim=-1)
    g, e = torch.topk(p, m.top_k, dim=-1)
    if m.top_k > 1:
        g = g / g.sum(-1, keepdim=True)
    out = torch.zeros(x.shape[0], m.out_dim)
    for t in range(x.shape[0]):
        for j in range(m.top_k):
            if keep_mask is not None and not keep_mask[j, t]:
                continue
            ex = int(e[t, j])
            h = F.silu(x[t] @ m.w1[ex] + m.b1[ex])
            out[t] += g[t, j] * (h @ m.w2[ex] + m.b2[ex])
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_matches_per_token_loop_and_gradients(k):
    m = _moe(E=4, k=k, cf=0.0)
    x = torch.randn(9, 3, requires_grad=True)
    y, aux = m(x)
    want = _per_token_reference(m, x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert float(aux["dropped"]) == 0.0 and int(aux["tokens_per_expert"].sum()) == 9 * k
    (g,) = torch.autograd.grad(y.square().sum(), x, retain_graph=True)
    (g_ref,) = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    # every expert weight is in the graph, also an expert that got no token (zero gradient, not None)
    grads = torch.autograd.grad(y.sum() + aux["aux_loss"], [m.router.weight, *m.expert_parameters()])
    assert all(gr is not None for gr in grads)


def test_load_balancing_loss_by_hand():
    """E=2, k=1, router weight fixed: p = softmax(x W_r^T) by hand; f = routed shares; aux = E sum f_e P_e."""
    m = _moe(E=2, k=1, cf=0.0, D=2)
    with torch.no_grad():
        m.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    x = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 3.0]])
    # logits = x; p0 = softmax([2, 0]), p1 = softmax([1, 0]), p2 = softmax([0, 3])
    s = lambda a, b: (math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b)))
    P = [s(2, 0), s(1, 0), s(0, 3)]
    f = [2 / 3, 1 / 3]                              # tokens 0, 1 -> expert 0; token 2 -> expert 1
    P_mean = [sum(p[e] for p in P) / 3 for e in range(2)]
    want = 2 * (f[0] * P_mean[0] + f[1] * P_mean[1])
    _, aux = m(x)
    assert abs(float(aux["aux_loss"].detach()) - want) < 1e-6
    assert aux["tokens_per_expert"].tolist() == [2, 1]
    # perfectly balanced uniform routing gives exactly 1
    with torch.no_grad():
        m.router.weight.zero_()
    _, aux = m(torch.randn(4, 2))
    assert abs(float(aux["aux_loss"].detach()) - 1.0) < 1e-6


def test_capacity_overflow_drops_second_choices_first_and_is_counted():
    """E=2, k=2, factor 0.5: capacity ceil(0.5 * 4 * 2 / 2) = 2 per expert. Every token picks both experts;
    the slot-major queue gives each expert its first-choice tokens before any second choice."""
    assert expert_capacity(4, 2, 2, 0.5) == 2 and expert_capacity(4, 2, 2, 0.0) == 8
    m = _moe(E=2, k=2, cf=0.5, D=2)
    with torch.no_grad():
        m.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    x = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.0, 0.0], [1.0, 0.0]])  # first choices: e0, e1, e0, e0
    y, aux = m(x)
    # expert 0 queue: first choices t0, t2, t3 (t3 over capacity), then t1's second choice (over)
    # expert 1 queue: first choice t1, then second choices t0 (kept), t2, t3 (over)
    keep = torch.tensor([[True, True, True, False], [True, False, False, False]])  # [slot, token]
    assert abs(float(aux["dropped"]) - 4 / 8) < 1e-7
    assert aux["tokens_per_expert"].tolist() == [2, 2]
    torch.testing.assert_close(y, _per_token_reference(m, x, keep), rtol=1e-5, atol=1e-6)
    assert torch.equal(y[3], torch.zeros(2))       # both of token 3's assignments dropped: no output
    m.eval()                                       # evaluation drops nothing
    y, aux = m(x)
    assert float(aux["dropped"]) == 0.0
    torch.testing.assert_close(y, _per_token_reference(m, x), rtol=1e-5, atol=1e-6)


def test_empty_input_and_errors():
    m = _moe()
    y, aux = m(torch.zeros(0, 3, requires_grad=True))
    assert y.shape == (0, 2) and float(aux["aux_loss"].detach()) == 0.0
    (y.sum() + aux["aux_loss"]).backward()
    assert m.router.weight.grad is not None and m.w1.grad is not None
    with pytest.raises(ValueError, match="expected x"):
        m(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="top_k"):
        MoEFFN(3, 4, 2, 2, 3)


def test_sliced_init_equals_full_init():
    """Expert parallelism keeps experts [start, start + E_l): the same values as one full build."""
    full = _moe(E=4, seed=3)
    torch.manual_seed(3)
    part = MoEFFN(3, 5, 2, 4, 2, 0.0)
    with torch.no_grad():
        for name in ("w1", "b1", "w2", "b2"):
            setattr(part, name, torch.nn.Parameter(getattr(part, name)[2:4].clone()))
    part.expert_start = 2
    torch.manual_seed(3)
    part.reset_parameters()
    for name in ("w1", "b1", "w2", "b2"):
        torch.testing.assert_close(getattr(part, name), getattr(full, name)[2:4], rtol=0, atol=0)
    torch.testing.assert_close(part.router.weight, full.router.weight, rtol=0, atol=0)


def test_config_errors_name_fields():
    base = dict(tasks=["ctr"], mlp_dims=[8, 4])
    ModelConfig(moe_experts=4, moe_top_k=2, **base).validate()
    for kw, msg in [(dict(moe_experts=-1), "model.moe_experts"), (dict(moe_experts=2, moe_top_k=3), "moe_top_k"),
                    (dict(moe_experts=2, mlp_dims=[8]), "at least two widths"),
                    (dict(moe_experts=2, tasks=["retrieval"]), "needs a ranking task"),
                    (dict(moe_capacity_factor=-1.0), "moe_capacity_factor")]:
        cfg = ModelConfig(**{**base, **kw})
        with pytest.raises(ValueError, match=msg):
            cfg.validate()


def test_gem_with_experts_trains_and_meta_build_matches():
    """The MoE tower in GEM: aux loss in the loss (weight), stats, every parameter reached; a meta build +
    init_weights equals the direct build (what parallelize relies on)."""
    from test_model_gem import _cfg, _gem_batch, _model

    cfg = _cfg(mlp_dims=[16, 8], moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0, moe_aux_weight=0.5)
    torch.manual_seed(0)
    model = _model(cfg)
    assert model.tower.moe is not None and model.tower.mlp[0] is model.tower.moe
    batch = _gem_batch([3, 5, 2], [4, 0, 3])
    model.seed_sampling(1)
    loss, stats = model(batch)
    assert {"moe_aux_loss", "moe_dropped"} <= set(stats)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    # the aux loss enters with its weight
    model.seed_sampling(1)
    cfg0 = _cfg(mlp_dims=[16, 8], moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0, moe_aux_weight=0.0)
    model.cfg = cfg0
    loss0, _ = model(batch)
    torch.testing.assert_close(float(loss.detach()) - float(loss0.detach()), 0.5 * float(stats["moe_aux_loss"]), rtol=1e-4,
                               atol=1e-6)
    torch.manual_seed(5)
    direct = _model(cfg)
    meta = _model(cfg, device="meta")
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.init_weights()
    sd = meta.state_dict()
    for k, v in direct.state_dict().items():
        if not k.startswith("embeddings."):
            assert torch.equal(sd[k], v), k


def test_expert_parallel_refuses_where_it_cannot_apply():
    from test_model_gem import _cfg, _model

    from gemray.config import load_config
    from gemray.parallel.expert import check_expert_parallel

    with pytest.raises(ValueError, match="has no mixture-of-experts layers"):
        check_expert_parallel(_model(_cfg(mlp_dims=[16, 8]), device="meta"), 2)
    with pytest.raises(ValueError, match="expert_parallel=2 does not divide model.moe_experts=3"):
        check_expert_parallel(_model(_cfg(mlp_dims=[16, 8], moe_experts=3, moe_top_k=1), device="meta"), 2)
    check_expert_parallel(_model(_cfg(mlp_dims=[16, 8], moe_experts=4), device="meta"), 2)
    with pytest.raises(ValueError, match="use parallel.dense='fsdp' or 'hsdp'"):
        load_config(None, ["parallel.expert_parallel=2"])  # dense DDP replicates: no shard ranks to borrow


def test_step_flops_count_the_router_and_k_experts():
    from test_model_flops import _tiny

    from gemray.model.flops import step_flops

    lengths = (torch.tensor([3, 2]), torch.tensor([2, 1]))
    cfg = _tiny(tasks=["ctr"], mlp_dims=[5, 4], moe_experts=3, moe_top_k=2)
    dense = _tiny(tasks=["ctr"], mlp_dims=[5, 4])
    f, f0 = step_flops(cfg, *lengths), step_flops(dense, *lengths)
    C, i = 3, dense.width * 3
    assert f0["mlp"] == 3 * 2 * C * (i * 5 + 5 * 4 + 4 * 1)
    assert f["mlp"] == 3 * 2 * C * (i * 3 + 2 * (i * 5 + 5 * 4) + 4 * 1)


def test_epoch_moe_stats_average_steps():
    from gemray.train.task_stats import MoEStats

    s = MoEStats()
    s.add({"loss_ctr": 1.0})  # a step without experts' stats adds nothing
    s.add({"moe_aux_loss": torch.tensor(1.2), "moe_dropped": torch.tensor(0.1)})
    s.add({"moe_aux_loss": 1.0, "moe_dropped": 0.3})
    out = s.reduce(torch.device("cpu"))
    assert out == pytest.approx({"train_moe_aux_loss": 1.1, "train_moe_dropped": 0.2})
    assert s.reduce(torch.device("cpu")) == {"train_moe_aux_loss": 0.0, "train_moe_dropped": 0.0}
