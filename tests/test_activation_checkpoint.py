"""Activation checkpointing planner (pure, hand-checked costs), the probe, and the checkpointed model's exactness."""

import pytest
import torch

from gemray.model.hstu import HSTUEncoder
from gemray.parallel.activation_checkpoint import (ActivationCheckpointer, ModuleCost, apply_checkpointing,
                                                   candidate_modules, plan_checkpointing, predicted_peak,
                                                   resolve_budget)
from model_utils import tiny_cfg

MiB = 2 ** 20


def _costs():
    # gain = saved - input; cost per byte gained: a 1/90, b 4/90, c 1/45 = 2/90, d never (saves no more than input)
    return [ModuleCost("a", 100 * MiB, 10 * MiB, 1.0), ModuleCost("b", 100 * MiB, 10 * MiB, 4.0),
            ModuleCost("c", 50 * MiB, 5 * MiB, 1.0), ModuleCost("d", 10 * MiB, 10 * MiB, 0.1)]


def test_peak_model_hand_checked():
    c = _costs()
    P0 = 1000 * MiB
    assert predicted_peak(c, (), P0) == P0
    assert predicted_peak(c, ("a",), P0) == (1000 - 90 + 100) * MiB
    assert predicted_peak(c, ("a", "c"), P0) == (1000 - 90 - 45 + 100) * MiB


def test_planner_cheapest_recompute_per_byte_first_until_budget():
    c, P0 = _costs(), 1000 * MiB
    assert plan_checkpointing(c, P0, P0).recompute == ()  # already fits
    p = plan_checkpointing(c, 1000 * MiB - 1, P0)          # a alone raises the peak (+10 MiB): goes on to c
    assert p.recompute == ("a", "c") and p.predicted_peak == 965 * MiB and p.fits
    p = plan_checkpointing(c, 900 * MiB, P0)               # a, c (965) then b: 1000-225+100 = 875
    assert p.recompute == ("a", "c", "b") and p.predicted_peak == 875 * MiB and p.fits
    p = plan_checkpointing(c, 500 * MiB, P0)               # cannot be met: every module with a gain, d never
    assert p.recompute == ("a", "c", "b") and not p.fits and "NOT met" in p.describe()
    with pytest.raises(ValueError):
        plan_checkpointing(c + [c[0]], 1, P0)


def test_resolve_budget():
    assert resolve_budget(0.5, 1000) == 500 and resolve_budget(1, 1000) == 1000
    assert resolve_budget(4096, 1000) == 4096 and resolve_budget(0, 1000) == 1000
    with pytest.raises(ValueError):
        resolve_budget(-1, 10)


def _encoder_and_batch(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=8, linear_dim=8, num_blocks=3, dropout=0.2)
    enc = HSTUEncoder(cfg, 32)
    offsets = torch.tensor([0, 9, 30, 31])
    ts = torch.arange(31) * 1000
    tok = torch.randn(31, 32)
    return enc, tok, offsets, ts


def _loss_and_grads(enc, tok, offsets, ts):
    torch.manual_seed(123)  # dropout
    out = enc(tok, offsets, ts)
    loss = (out * torch.linspace(-1, 1, 32)).sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in enc.named_parameters()}


def test_checkpointed_model_gives_identical_loss_and_grads():
    enc, tok, off, ts = _encoder_and_batch()
    ref_loss, ref_grads = _loss_and_grads(enc, tok, off, ts)
    keys = set(enc.state_dict())
    enc.zero_grad()
    mods = candidate_modules(enc)
    assert list(mods) == ["blocks.0", "blocks.1", "blocks.2"]
    apply_checkpointing(mods, ["blocks.0", "blocks.2"])
    loss, grads = _loss_and_grads(enc, tok, off, ts)
    assert loss == ref_loss and set(enc.state_dict()) == keys  # dropout replayed; state-dict keys unchanged
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=0)


def test_auto_checkpointer_probes_plans_and_applies():
    enc, tok, off, ts = _encoder_and_batch()
    ac = ActivationCheckpointer("auto", 0.6)
    ac.setup(enc)
    with ac.step(enc, torch.device("cpu")):  # warm-up step: nothing measured, nothing planned
        _loss_and_grads(enc, tok, off, ts)
    assert ac.after_step() is None and ac.plan is None
    enc.zero_grad()
    with ac.step(enc, torch.device("cpu")):
        _loss_and_grads(enc, tok, off, ts)
    plan = ac.after_step()
    assert plan is not None and plan.recompute and plan.fits
    assert plan.budget == int(0.6 * plan.no_checkpoint_peak)
    probe_saved = plan.no_checkpoint_peak  # CPU: modelled = saved bytes of the blocks + the rest
    assert probe_saved > 0
    assert all(getattr(candidate_modules(enc)[n], "_gemray_checkpointed", False) for n in plan.recompute)
    enc.zero_grad()
    with ac.step(enc, torch.device("cpu")):
        _loss_and_grads(enc, tok, off, ts)
    assert ac.after_step() is None
    # full: every block; none with a budget of 0 in auto mode
    enc2 = _encoder_and_batch()[0]
    ActivationCheckpointer("full").setup(enc2)
    assert all(getattr(m, "_gemray_checkpointed", False) for m in candidate_modules(enc2).values())
    enc3 = _encoder_and_batch()[0]
    ac3 = ActivationCheckpointer("auto", 0)
    ac3.setup(enc3)
    with ac3.step(enc3, torch.device("cpu")):
        pass
    assert ac3.after_step() is None and not any(hasattr(m, "_gemray_checkpointed")
                                                for m in candidate_modules(enc3).values())
    with pytest.raises(ValueError):
        ActivationCheckpointer("sometimes")


def test_probe_measures_block_bytes():
    enc, tok, off, ts = _encoder_and_batch()
    from gemray.parallel.activation_checkpoint import _Probe

    with _Probe(candidate_modules(enc), list(enc.parameters())) as p:
        enc(tok, off, ts)
    costs = p.costs()
    assert [c.name for c in costs] == ["blocks.0", "blocks.1", "blocks.2"]
    # every block saves at least its [T, D] fp32 input, the LayerNorm output and the uvqk activations
    T, D = 31, 32
    assert all(c.saved_bytes >= 3 * T * D * 4 and c.input_bytes >= T * D * 4 for c in costs)
    assert len({c.saved_bytes for c in costs}) == 1  # identical blocks save identical bytes


def test_torch_mode_sets_the_budget_and_compiles_blocks():
    import torch._functorch.config as fconfig

    enc = _encoder_and_batch()[0]
    old = fconfig.activation_memory_budget
    try:
        ActivationCheckpointer("torch", 0.5).setup(enc)
        assert fconfig.activation_memory_budget == 0.5
        assert all(m._compiled_call_impl is not None for m in candidate_modules(enc).values())
    finally:
        fconfig.activation_memory_budget = old


@pytest.mark.parametrize("sets, msg", [
    (dict(precision="fp16"), "precision"), (dict(fp8_grad="e3m4"), "fp8_grad"),
    (dict(fp8_recipe="block"), "fp8_recipe"),
    (dict(fp8_attention_inputs=True), "not implemented"), (dict(activation_checkpointing="some"), "activation_chec"),
    (dict(activation_memory_budget=-1.0), "activation_memory_budget"),
    (dict(activation_memory_budget=1.5), "activation_memory_budget"),
    (dict(activation_checkpointing="torch", activation_memory_budget=4e9), "fraction"),
])
def test_config_fields_refuse_bad_values(sets, msg):
    from gemray.config import JobConfig

    cfg = JobConfig()
    for k, v in sets.items():
        setattr(cfg.train, k, v)
    with pytest.raises(ValueError, match=msg):
        cfg.validate()
    ok = JobConfig()
    ok.train.precision, ok.train.activation_memory_budget = "fp8", 40e9
    ok.validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (measured peaks)")
def test_auto_plan_lowers_the_measured_peak_on_cuda():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=256, num_heads=4, attention_dim=64, linear_dim=64, num_blocks=4)
    enc = HSTUEncoder(cfg, 512, device=dev)
    offsets = torch.tensor([0, 300, 812, 1200], device=dev)
    ts = torch.arange(1200, device=dev) * 60
    tok = torch.randn(1200, 256, device=dev)

    def step():
        out = enc(tok, offsets, ts)
        out.float().square().sum().backward()
        enc.zero_grad(set_to_none=True)

    ac = ActivationCheckpointer("auto", 0.6)
    ac.setup(enc)
    for _ in range(2):  # warm-up, probe (no checkpointing)
        with ac.step(enc, dev):
            step()
        plan = ac.after_step()
    assert plan is not None and plan.recompute
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    measured = torch.cuda.max_memory_allocated(dev)
    assert measured < plan.no_checkpoint_peak
