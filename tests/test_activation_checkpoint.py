"""Activation checkpointing: the planner (pure, hand-checked costs, three levels per module), the probe and its op
census, the checkpointed model's exactness at levels full and selective (eager and compiled), what each level
keeps and recomputes, and the trainer's modes "selective" and "auto"."""

import copy
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gemray.model.hstu import HSTUEncoder
from gemray.parallel.activation_checkpoint import (ActivationCheckpointer, ModuleCost, _OpCensus, _Probe,
                                                   apply_checkpointing,
                                                   candidate_modules, peak_report, plan_checkpointing, plan_report,
                                                   format_bytes, predicted_peak, resolve_budget, saves_output,
                                                   scale_to_tokens)
from model_utils import cpu_trainer, tiny_cfg

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


def _blocks(n=4, tower=False):
    # a block: saves 100, input 10; selective keeps 40 more (gain 50 at cost 2: 0.04 per MiB), full gain 90 at
    # cost 10 (0.111 per MiB); selective -> full: 40 more for 8 (0.2 per MiB). The tower: selective keeps 80 more
    # (gain 10 at cost 5: 0.5 per MiB), full gain 90 at cost 9 (0.1 per MiB): straight to full is cheaper per byte
    costs = [ModuleCost(f"b{i}", 100 * MiB, 10 * MiB, 10.0, 40 * MiB, 2.0) for i in range(n)]
    if tower:
        costs.append(ModuleCost("tower", 100 * MiB, 10 * MiB, 9.0, 80 * MiB, 5.0))
    return costs


def _total_cost(costs, plan):
    return sum(c.cost(plan.level(c.name)) for c in costs)


def test_peak_model_of_mixed_levels_hand_checked():
    c, P0 = _blocks(), 1000 * MiB
    b0 = c[0]
    assert (b0.gain("selective"), b0.gain("full"), b0.live("selective"), b0.live("full")) == \
        (50 * MiB, 90 * MiB, 60 * MiB, 100 * MiB)
    assert predicted_peak(c, {"b0": "selective"}, P0) == (1000 - 50 + 60) * MiB
    assert predicted_peak(c, {"b0": "selective", "b1": "full"}, P0) == (1000 - 50 - 90 + 100) * MiB
    assert predicted_peak(c, {"b0": "none"}, P0) == P0 == predicted_peak(c, {}, P0)
    assert predicted_peak(c, ("b0", "b1"), P0) == predicted_peak(c, {"b0": "full", "b1": "full"}, P0)
    with pytest.raises(ValueError, match="levels"):
        predicted_peak(c, {"b0": "half"}, P0)
    with pytest.raises(ValueError, match="not offered"):
        ModuleCost("x", 10, 1, 1.0).kept("selective")


def test_planner_takes_selective_on_every_block_when_that_fits():
    c, P0 = _blocks(), 1000 * MiB
    p = plan_checkpointing(c, 870 * MiB, P0)  # 4 x selective: 1000 - 200 + 60 = 860
    assert p.levels == (("b0", "selective"), ("b1", "selective"), ("b2", "selective"), ("b3", "selective"))
    assert p.predicted_peak == 860 * MiB and p.fits and p.recompute == ("b0", "b1", "b2", "b3")
    assert "selective 4 [b0, b1, b2, b3]" in p.describe() and "full" not in p.describe().split(";")[0]
    # the whole-block planner (no selective offered) needs 3 blocks at full for the same budget: 30 vs 8
    whole = [ModuleCost(x.name, x.saved_bytes, x.input_bytes, x.recompute_cost) for x in c]
    q = plan_checkpointing(whole, 870 * MiB, P0)
    assert q.levels == (("b0", "full"), ("b1", "full"), ("b2", "full")) and q.predicted_peak == 830 * MiB
    assert _total_cost(c, p) == 8.0 < _total_cost(whole, q) == 30.0


def test_planner_upgrades_blocks_to_full_when_selective_is_not_enough():
    c, P0 = _blocks(), 1000 * MiB
    p = plan_checkpointing(c, 800 * MiB, P0)  # 860 with all selective; then b0, b1, b2 to full: 1000 - 320 + 100
    assert dict(p.levels) == {"b0": "full", "b1": "full", "b2": "full", "b3": "selective"}
    assert p.predicted_peak == 780 * MiB and p.fits and _total_cost(c, p) == 32.0
    # with the tower: after the blocks' selective steps its straight-to-full step (0.1 per MiB) comes before any
    # block's selective -> full (0.2): 1000 - 290 + 100 = 810, then b0 to full: 770
    c, P0 = _blocks(tower=True), 1000 * MiB
    p = plan_checkpointing(c, 800 * MiB, P0)
    assert p.levels == (("b0", "full"), ("b1", "selective"), ("b2", "selective"), ("b3", "selective"),
                        ("tower", "full"))
    assert p.predicted_peak == 770 * MiB and p.fits


def test_planner_recomputes_everything_fully_when_the_budget_is_out_of_reach():
    c, P0 = _blocks(tower=True), 1000 * MiB
    p = plan_checkpointing(c, 100 * MiB, P0)
    assert {lvl for _, lvl in p.levels} == {"full"} and set(p.recompute) == {c.name for c in c}
    assert p.predicted_peak == (1000 - 5 * 90 + 100) * MiB and not p.fits and "NOT met" in p.describe()
    assert plan_checkpointing(c, P0, P0).levels == ()  # fits already: nothing
    with pytest.raises(ValueError, match="negative"):
        plan_checkpointing([ModuleCost("x", 10, 1, 1.0, -1, 0.0)], 1, 10)


def test_scaling_to_the_design_batch_hand_checked():
    """scale_to_tokens: the candidates' saved / input / selective bytes and the other activations scale by the
    factor, the rest of the peak (here 500 MiB: parameters, optimizer state) stays; the recompute costs do not
    change; factor 1 changes nothing."""
    c, P0, other = _blocks(), 1000 * MiB, 100 * MiB  # activations: 100 + 4 x 100 = 500 MiB of the 1000
    s, peak = scale_to_tokens(c, other, P0, 1.25)
    assert peak == (500 + 1.25 * 500) * MiB == 1125 * MiB
    assert [(x.name, x.saved_bytes, x.input_bytes, x.selective_bytes) for x in s] == \
        [(f"b{i}", 125 * MiB, 12.5 * MiB, 50 * MiB) for i in range(4)]
    assert [(x.recompute_cost, x.selective_cost) for x in s] == [(10.0, 2.0)] * 4
    # the peak model on the scaled parts: 1125 - (125 - 12.5 - 50) + (125 - 50)
    assert predicted_peak(s, {"b0": "selective"}, peak) == (1125 - 62.5 + 75) * MiB
    assert predicted_peak(s, {"b0": "full", "b1": "full"}, peak) == (1125 - 2 * 112.5 + 125) * MiB
    assert scale_to_tokens(c, other, P0, 1.0) == (c, P0)
    whole = [ModuleCost("x", 8, 2, 1.0)]  # selective not offered stays not offered
    assert scale_to_tokens(whole, 0, 100, 2.0) == ([ModuleCost("x", 16, 4, 1.0)], 108)
    with pytest.raises(ValueError, match="factor"):
        scale_to_tokens(c, other, P0, 0)


def test_planning_for_more_tokens_recomputes_more():
    """At the probe batch's size all four blocks at selective fit 900 MiB (860); for 1.25x its tokens they would
    peak at 1125 - 4 x 62.5 + 75 = 950 MiB, so two blocks go on to full: 1125 - 2 x 112.5 - 2 x 62.5 + 125 =
    900. A fractional budget is a fraction of the scaled no-checkpointing peak."""
    c, P0, other = _blocks(), 1000 * MiB, 100 * MiB
    p1 = plan_checkpointing(c, 900 * MiB, P0)
    assert dict(p1.levels) == {f"b{i}": "selective" for i in range(4)} and p1.predicted_peak == 860 * MiB
    s, peak = scale_to_tokens(c, other, P0, 1.25)
    p = plan_checkpointing(s, 900 * MiB, peak)
    assert dict(p.levels) == {"b0": "full", "b1": "full", "b2": "selective", "b3": "selective"}
    assert p.predicted_peak == 900 * MiB and p.fits and p.no_checkpoint_peak == 1125 * MiB
    assert _total_cost(s, p) > _total_cost(c, p1)
    assert resolve_budget(0.8, peak) == 900 * MiB


def test_plan_and_peak_reports():
    """The plan's log line says the tokens it is for (INFO); an unreachable budget is a WARNING naming the budget
    and the lowest predicted peak. The next step's measured peak is INFO within the budget and a WARNING, naming
    budget, measured peak and tokens, above it."""
    import logging

    c, P0 = _blocks(), 1000 * MiB
    ok = plan_checkpointing(c, 900 * MiB, P0)
    level, msg = plan_report(ok, 1000, 1.25)
    assert level == logging.INFO and msg.startswith("activation checkpointing: auto, recompute 4 module(s)")
    assert msg.endswith("planned for 1250 tokens (1.25x the probe batch's 1000)")
    assert plan_report(ok, None, 1.25)[1].endswith("planned for 1.25x the probe batch's tokens")
    bad = plan_checkpointing(c, 100 * MiB, P0)  # every block full: 1000 - 360 + 100 = 740 MiB
    level, msg = plan_report(bad, 1000, 1.25)
    assert level == logging.WARNING and "NOT met" in msg
    assert "budget 100.00 MiB is unreachable: the lowest predicted peak" in msg and msg.endswith("740.00 MiB")
    level, msg = peak_report(900 * MiB, ok, 1100, 1250)
    assert level == logging.INFO
    assert msg == "activation checkpointing: measured peak 900.00 MiB at 1100 tokens (predicted 860.00 MiB for " \
                  "1250 tokens)"
    level, msg = peak_report(900 * MiB + 1, ok, 1300, 1250)
    assert level == logging.WARNING
    assert "measured peak 900.00 MiB at 1300 tokens exceeds the budget 900.00 MiB" in msg
    assert peak_report(900 * MiB + 1, ok, None, None)[1].endswith("(predicted 860.00 MiB)")


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


LENGTHS = [9, 0, 21, 1]  # an empty and a length-1 sequence among them


def _jagged(lengths=LENGTHS, d=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + list(lengths)).cumsum(0)
    T = int(offsets[-1])
    ts = torch.cumsum(torch.randint(0, 10 ** 5, (T,), generator=g), 0)
    return torch.randn(T, d, generator=g), offsets, ts


def _grads(enc, tok, offsets, ts):
    """(loss, {name: grad} of the parameters and of the input tokens); dropout seeded."""
    enc.zero_grad(set_to_none=True)
    tok = tok.clone().requires_grad_()
    torch.manual_seed(123)
    out = enc(tok, offsets, ts)
    loss = (out * torch.linspace(-1, 1, out.shape[1])).sum()
    loss.backward()
    return float(loss.detach()), {"tokens": tok.grad, **{n: p.grad.clone() for n, p in enc.named_parameters()}}


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_checkpointed_levels_give_identical_loss_and_grads(backend):
    """Blocks at full and at selective (one of each, then changed) give the loss and gradients of the plain
    encoder bit for bit, dropout included (its RNG replayed), on the reference attention and on the Triton kernels
    (the interpreter here: the path that saves gemray::gdpa_fwd); state-dict keys do not change."""
    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=8, linear_dim=8, num_blocks=3, dropout=0.2,
                   attention_backend=backend)
    enc = HSTUEncoder(cfg, 32)
    tok, off, ts = _jagged()
    ref_loss, ref_grads = _grads(enc, tok, off, ts)
    keys = set(enc.state_dict())
    mods = candidate_modules(enc)
    assert list(mods) == ["blocks.0", "blocks.1", "blocks.2"]
    for levels in ({"blocks.0": "selective", "blocks.1": "full", "blocks.2": "selective"},
                   {"blocks.0": "none", "blocks.1": "selective"}):
        apply_checkpointing(mods, levels)
        assert [getattr(m, "_gemray_checkpointed", "none") for m in mods.values()] == \
            [levels.get(n, "selective") for n in mods]
        loss, grads = _grads(enc, tok, off, ts)
        assert loss == ref_loss and set(enc.state_dict()) == keys
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    for _ in range(2):  # back to none, twice: the original forwards again
        apply_checkpointing(mods, {n: "none" for n in mods})
    assert not any(hasattr(m, "_gemray_checkpointed") for m in mods.values())
    assert _grads(enc, tok, off, ts)[0] == ref_loss
    enc.eval()
    with torch.no_grad():  # evaluation runs the plain forward
        torch.testing.assert_close(enc(tok, off, ts), HSTUEncoder.forward(enc, tok, off, ts), rtol=0, atol=0)


def test_selective_fp8_blocks_under_bf16_autocast_give_identical_loss_and_grads():
    """FP8 blocks (gemray.model.fp8: the norm-fused quantization into the FP8 GEMMs, emulated on the CPU, inside
    an autograd.Function) under bf16 autocast, as train.precision = "fp8" runs them: at selective the loss and
    gradients are the plain blocks' bit for bit (the GEMM outputs come back from the cache, the quantization and
    casts are recomputed)."""
    from gemray.model.fp8 import convert_to_fp8

    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=8, linear_dim=16, num_blocks=2, dropout=0.1,
                   attention_backend="reference")
    enc = HSTUEncoder(cfg, 32)
    assert convert_to_fp8(enc, "e4m3", min_dim=16)["converted"] == ["blocks.0", "blocks.1"]
    tok, off, ts = _jagged()

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _grads(enc, tok, off, ts)

    ref_loss, ref_grads = run()
    apply_checkpointing(candidate_modules(enc), {"blocks.0": "selective", "blocks.1": "selective"})
    loss, grads = run()
    assert loss == ref_loss
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


class _LiveStorages(TorchDispatchMode):
    """Weak references to the storage of every new op output (view ops' outputs share an older storage: not
    new) while active; :meth:`live_bytes` sums those still alive (what the forward left for the backward, however
    held: autograd's saved tensors, a checkpoint's cache)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and not func.is_view:
                st = t.untyped_storage()
                old = self.refs.get(st.data_ptr())
                if old is None or old[0]() is None:
                    self.refs[st.data_ptr()] = (weakref.ref(st), st.nbytes())
        return out

    def live_bytes(self, *exclude: torch.Tensor) -> int:
        gc.collect()
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        return sum(n for p, (r, n) in self.refs.items() if r() is not None and p not in skip)


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_selective_keeps_less_than_none_more_than_full_and_recomputes_no_gemm(backend):
    """One block's forward, at each level: the bytes still alive for the backward order none > selective > full
    (= only the input, which the caller holds anyway); selective's are exactly the outputs of the ops the census
    classified as kept (the probe's selective_bytes), none's the probe's saved bytes less the input's (and less
    the reference attention's per-batch layout cache's, warmed by the probe's forward: they predate the measured
    ones). In the backward, full recomputes the uvqk GEMMs (and, on the Triton kernels, the attention's forward
    op), selective neither -- it recomputes the pointwise ops (LayerNorm, SiLU) instead."""
    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=8, linear_dim=8, num_blocks=1,
                   attention_backend=backend)
    block = HSTUEncoder(cfg, 32).blocks[0]
    tok, off, ts = _jagged()
    x = tok.requires_grad_()
    with _Probe({"b": block}, list(block.parameters())) as probe:
        block(x, off, ts)
    cost = probe.costs()[0]
    assert cost.input_bytes == x.numel() * 4 + off.numel() * 8 + ts.numel() * 8
    assert 0 < cost.selective_cost < cost.recompute_cost and 0 < cost.selective_bytes < cost.saved_bytes
    kept, bwd = {}, {}
    for level in ("none", "selective", "full"):
        apply_checkpointing({"b": block}, {"b": level})
        live = _LiveStorages()
        with live:
            out = block(x, off, ts)
        kept[level] = live.live_bytes(out)
        count = _OpCount()
        with count:
            out.backward(torch.ones_like(out))
        bwd[level] = count.counts
        del out
    assert kept["none"] > kept["selective"] > kept["full"] == 0, kept
    assert kept["selective"] == cost.selective_bytes
    # the probe's saved bytes also count the saved storages that predate the forward (x, the layout cache's)
    assert 0.95 * (cost.saved_bytes - x.numel() * 4) <= kept["none"] <= cost.saved_bytes - x.numel() * 4
    gemms = {lvl: c.get("aten::mm", 0) + c.get("aten::addmm", 0) for lvl, c in bwd.items()}
    # full re-runs the projection's two GEMMs (u's, v / q / k's: gemray.ops.uvqk_projection); not the output GEMM:
    # torch's early stop ends the recompute once the last tensor the backward needs (the output GEMM's input) is back
    assert gemms["selective"] == gemms["none"] and gemms["full"] == gemms["none"] + 2, gemms
    assert bwd["none"].get("aten::native_layer_norm", 0) == bwd["none"].get("aten::silu", 0) == 0
    assert bwd["selective"]["aten::native_layer_norm"] == bwd["full"]["aten::native_layer_norm"] == 2
    assert bwd["selective"]["aten::silu"] >= 1  # the uvqk SiLU (and the reference attention's)
    if backend == "triton":
        assert [bwd[lvl].get("gemray::gdpa_fwd", 0) for lvl in ("none", "selective", "full")] == [0, 0, 1]
        assert all(bwd[lvl]["gemray::gdpa_bwd"] == 1 for lvl in bwd)
    assert saves_output(torch.ops.aten.addmm.default) and not saves_output(torch.ops.aten.bmm.default)


def _recording_aot_eager(backward_graphs: list):
    """aot_eager (its min-cut partitioner, which honours selective checkpointing's tags) that keeps the backward
    graphs it is given."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def bw(gm, example_inputs):
        backward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward), bw_compiler=bw,
                        partition_fn=min_cut_rematerialization_partition)


def _graph_ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_levels_under_compile_keep_the_gemms_and_the_attention():
    """Compiled blocks (train.compile's in-place ``Module.compile``, the Triton kernels in the interpreter), the
    level applied after their first compiled step, as "auto" does: the checkpoint runs inside the compiled region
    (dynamo recompiles for the new forward, no graph break) and gives eager's values and gradients. In the compiled
    backward, selective re-runs no GEMM and no attention forward (only the four gradient GEMMs); full re-runs the
    uvqk GEMM and gemray::gdpa_fwd."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from gemray.parallel.compile import compile_dense_modules

    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=8, linear_dim=8, num_blocks=1,
                   attention_backend="triton")
    base = HSTUEncoder(cfg, 32)
    for level in ("selective", "full"):
        enc, graphs = copy.deepcopy(base), []
        torch._dynamo.reset()
        counters.clear()
        assert compile_dense_modules(enc, backend=_recording_aot_eager(graphs)) == ["input_scale", "output_norm",
                                                                                    "blocks.0"]
        for step, lengths in enumerate(([5, 0, 12, 1], LENGTHS, [3, 7, 1])):
            if step == 1:
                apply_checkpointing(candidate_modules(enc), {"blocks.0": level})
                graphs.clear()
            tok, off, ts = _jagged(lengths, seed=step)
            loss, grads = _grads(enc, tok, off, ts)
            ref_loss, ref_grads = _grads(base, tok, off, ts)
            assert loss == pytest.approx(ref_loss, rel=1e-6)
            for n, g in grads.items():
                torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        # the block's graphs compiled after the level was applied (the attention in each; not the input scale's or
        # the output norm's)
        block_graphs = [ops for ops in map(_graph_ops, graphs) if any("gdpa" in o for o in ops)]
        assert block_graphs
        for ops in block_graphs:
            gemms = sum(o.startswith(("aten.mm", "aten.addmm")) for o in ops)
            recomputed_attention = sum("gdpa_fwd" in o for o in ops)
            # backward: two GEMMs per projection (u, v / q / k, output); full also re-runs u's and v / q / k's
            assert (gemms, recomputed_attention) == ((6, 0) if level == "selective" else (8, 1)), (level, ops)


def _probe_and_plan(ac, enc, tok, off, ts, tokens=31):
    """Warm-up and probe steps of ``ac`` on the CPU; (the probe step's loss, the plan)."""
    ac.setup(enc)
    with ac.step(enc, torch.device("cpu"), tokens=tokens):  # warm-up step: nothing measured, nothing planned
        _loss_and_grads(enc, tok, off, ts)
    assert ac.after_step() is None and ac.plan is None
    enc.zero_grad()
    with ac.step(enc, torch.device("cpu"), tokens=tokens):
        probe_loss = _loss_and_grads(enc, tok, off, ts)[0]
    return probe_loss, ac.after_step()


def test_auto_checkpointer_probes_plans_and_applies(caplog):
    import logging

    enc, tok, off, ts = _encoder_and_batch()
    ref_loss = _loss_and_grads(copy.deepcopy(enc), tok, off, ts)[0]
    ac = ActivationCheckpointer("auto", 0.6)
    with caplog.at_level(logging.INFO, logger="gemray.parallel.activation_checkpoint"):
        probe_loss, plan = _probe_and_plan(ac, enc, tok, off, ts)
    assert probe_loss == ref_loss  # the census's extra forwards forked the RNG: the step's dropout is unchanged
    assert plan is not None and plan.recompute and plan.fits
    assert plan.budget == int(0.6 * plan.no_checkpoint_peak)
    # planned for 1.25x the probe batch's 31 tokens: on the CPU the modelled peak is all activations, so the
    # design batch's is 1.25x the probe's (the plan of a checkpointer without headroom: the probe's own)
    assert (ac.probe_tokens, ac.design_tokens) == (31, 38)
    assert "planned for 38 tokens (1.25x the probe batch's 31)" in caplog.text
    assert "probe: 31 tokens, peak " in caplog.text
    same = ActivationCheckpointer("auto", 0.6, headroom=1.0)
    plan1 = _probe_and_plan(same, _encoder_and_batch()[0], tok, off, ts)[1]
    assert plan.no_checkpoint_peak == pytest.approx(1.25 * plan1.no_checkpoint_peak, abs=8)
    assert plan.budget == pytest.approx(1.25 * plan1.budget, abs=8)
    assert ac.probe_peak == plan1.no_checkpoint_peak == same.probe_peak
    probe_saved = plan.no_checkpoint_peak  # CPU: modelled = saved bytes of the blocks + the rest
    assert probe_saved > 0
    mods = candidate_modules(enc)
    assert {n: getattr(m, "_gemray_checkpointed", "none") for n, m in mods.items()} == \
        {n: plan.level(n) for n in mods}
    enc.zero_grad()
    with ac.step(enc, torch.device("cpu")):
        assert _loss_and_grads(enc, tok, off, ts)[0] == ref_loss
    assert ac.after_step() is None
    # full / selective: every block; none with a budget of 0 in auto mode
    for mode in ("full", "selective"):
        enc2 = _encoder_and_batch()[0]
        ActivationCheckpointer(mode).setup(enc2)
        assert all(getattr(m, "_gemray_checkpointed", None) == mode for m in candidate_modules(enc2).values())
    enc3 = _encoder_and_batch()[0]
    ac3 = ActivationCheckpointer("auto", 0)
    ac3.setup(enc3)
    with ac3.step(enc3, torch.device("cpu")):
        pass
    assert ac3.after_step() is None and not any(hasattr(m, "_gemray_checkpointed")
                                                for m in candidate_modules(enc3).values())
    with pytest.raises(ValueError):
        ActivationCheckpointer("sometimes")
    with pytest.raises(ValueError, match="headroom"):
        ActivationCheckpointer("auto", 0.5, headroom=0)


def test_auto_checkpointer_warns_of_an_unreachable_budget(caplog):
    """A budget of 1 KiB cannot be met: every block is recomputed fully and the plan is logged as a WARNING that
    says the budget is unreachable and names the lowest predicted peak."""
    import logging

    enc, tok, off, ts = _encoder_and_batch()
    ac = ActivationCheckpointer("auto", 1024)
    with caplog.at_level(logging.INFO, logger="gemray.parallel.activation_checkpoint"):
        plan = _probe_and_plan(ac, enc, tok, off, ts, tokens=31)[1]
    assert not plan.fits and {lvl for _, lvl in plan.levels} == {"full"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    msg = warnings[0].getMessage()
    assert "budget 1.00 KiB is unreachable: the lowest predicted peak" in msg and "planned for 38 tokens" in msg
    assert msg.endswith(format_bytes(plan.predicted_peak))


def test_census_counts_each_kept_output_even_when_an_address_is_reused():
    # SAC keeps every saved op's output until the backward, so two GEMM outputs are two storages even when the
    # first is freed before the second is made (a heap that reuses its address must not merge them); repeated
    # a few times so that the allocator gets every chance to hand the freed block back
    x, w = torch.randn(64, 48), torch.randn(48, 40)
    nbytes = 64 * 40 * 4
    for _ in range(5):
        census = _OpCensus(None)
        with torch.no_grad(), census:
            a = torch.mm(x, w)
            del a
            b = torch.mm(x, w)
            c = b.view(-1)  # a view of a counted output adds nothing
            del c
        assert census.saved_bytes == 2 * nbytes


def test_probe_measures_block_bytes():
    enc, tok, off, ts = _encoder_and_batch()
    with _Probe(candidate_modules(enc), list(enc.parameters())) as p:
        enc(tok, off, ts)
    costs = p.costs()
    assert [c.name for c in costs] == ["blocks.0", "blocks.1", "blocks.2"]
    # every block saves at least its [T, D] fp32 input, the LayerNorm output and the uvqk activations
    T, D = 31, 32
    assert all(c.saved_bytes >= 3 * T * D * 4 and c.input_bytes >= T * D * 4 for c in costs)
    assert len({c.saved_bytes for c in costs}) == 1  # identical blocks save identical bytes
    # the census: on the reference attention selective keeps the two GEMMs' outputs, uvqk [T, 2HV + 2HA] and the
    # output projection's [T, D]; recomputing the rest costs less than the whole forward
    W = 2 * 2 * 8 + 2 * 2 * 8
    assert all(c.selective_bytes == T * (W + D) * 4 for c in costs)
    assert all(0 < c.selective_cost < c.recompute_cost for c in costs)


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
    for mode in ("none", "full", "selective", "auto"):
        ok.train.activation_checkpointing = mode
        ok.validate()


TRAIN_CONFIG = "configs/gem-tiny.toml"
TRAIN_DATA = ["data.num_files=1", "data.max_seq_len=32", "data.batch_size=8", "data.sub_batch_size=8",
              'data.synthetic=["users=64", "items=200", "seed=5", "max_len=32", "min_len=4", "mean_len=12", '
              '"features=category=8,author=32", "devices=3", "candidates=6"]']


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """gem-tiny's generator at a smaller size (its token / candidate / context features), prepared once."""
    from gemray.config import load_config
    from gemray.pipelines.synthetic import ensure_synthetic

    out = tmp_path_factory.mktemp("ac") / "syn"
    ensure_synthetic(load_config(TRAIN_CONFIG, [f"data.prepared_dir={out}", *TRAIN_DATA]).data)
    return out


def _train(synthetic, steps: int, *sets: str):
    """(the losses of ``steps`` Trainer.train_step calls on the first batch, the trainer) of gem-tiny (2 HSTU
    blocks, the candidate tower) on the CPU with ``sets`` applied; the batch's token count is left in the
    trainer's ``_test_tokens``."""
    from gemray.bench.train import first_batch
    from gemray.config import load_config

    cfg = load_config(TRAIN_CONFIG, [f"data.prepared_dir={synthetic}", *TRAIN_DATA, "ray.use_gpu=false",
                                     "model.num_blocks=2", "model.dropout=0.1", *sets])
    with cpu_trainer(cfg) as tr:
        tr.begin_epoch(0)
        batch = first_batch(tr)
        tr._test_tokens = batch.num_tokens
        return [float(tr.train_step(batch)) for _ in range(steps)], tr


def test_trainer_selective_mode_trains_exactly_as_without_checkpointing(synthetic):
    """train.activation_checkpointing = "selective": every HSTU block and the tower at level selective, and three
    training steps (dropout on) give the losses of the same run without checkpointing, bit for bit."""
    plain, _ = _train(synthetic, 3, "train.activation_checkpointing=none", "model.attention_backend=reference")
    sel, tr = _train(synthetic, 3, "train.activation_checkpointing=selective", "model.attention_backend=reference")
    mods = candidate_modules(tr.dmp)
    assert len(mods) == 3 and all(m._gemray_checkpointed == "selective" for m in mods.values())
    assert sel == plain


def test_trainer_auto_mode_plans_selective_under_a_budget(synthetic, caplog):
    """train.activation_checkpointing = "auto" with a budget a little under the no-checkpointing peak, on the Triton
    kernels (the interpreter): the probe (step 2) finds selective some ten times cheaper per byte than full (the
    attention forward is saved, only pointwise ops are recomputed), the plan puts modules at selective and none at
    full, the modules run at the plan's levels, and training goes on."""
    import logging

    with caplog.at_level(logging.INFO, logger="gemray.parallel.activation_checkpoint"):
        losses, tr = _train(synthetic, 3, "train.activation_checkpointing=auto", "train.activation_memory_budget=0.97",
                            "model.attention_backend=triton")
    plan = tr.checkpointer.plan
    assert plan is not None and plan.fits and plan.budget == int(0.97 * plan.no_checkpoint_peak)
    levels = dict(plan.levels)
    assert set(levels.values()) == {"selective"}, plan.describe()
    assert {n: getattr(m, "_gemray_checkpointed", "none") for n, m in candidate_modules(tr.dmp).items()} == \
        {n: plan.level(n) for n in candidate_modules(tr.dmp)}
    assert f"auto, recompute {len(levels)} module(s): selective {len(levels)} [" in caplog.text
    # the trainer passes the batch's tokens: the plan is for 1.25x them
    T = tr._test_tokens
    assert tr.checkpointer.probe_tokens == T and f"planned for {int(1.25 * T)} tokens (1.25x the probe batch's {T})" \
        in caplog.text
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


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
    assert ac.probe_peak < plan.no_checkpoint_peak  # the plan's is the design batch's: 1.25x the tokens
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    measured = torch.cuda.max_memory_allocated(dev)
    assert measured < ac.probe_peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (measured peaks)")
@pytest.mark.parametrize("compiled", [False, True])
def test_selective_peak_lies_between_none_and_full_on_cuda(compiled):
    """On the GPU (Triton kernels, bf16 autocast as train.precision = "bf16"; eager and under inductor), the
    measured peak of a training step of 4 blocks orders none > selective > full, and selective's gradients are the
    plain blocks' (eager: bit for bit; compiled: within bf16 rounding of the compiled plain blocks')."""
    import torch._dynamo

    from gemray.parallel.compile import compile_dense_modules

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=256, num_heads=4, attention_dim=64, linear_dim=64, num_blocks=4,
                   attention_backend="triton")
    base = HSTUEncoder(cfg, 512, device=dev)
    offsets = torch.tensor([0, 300, 812, 812, 813, 1200], device=dev)  # an empty and a length-1 sequence
    ts = torch.arange(1200, device=dev) * 60
    tok = torch.randn(1200, 256, device=dev)
    peaks, grads = {}, {}
    for level in ("none", "selective", "full"):
        torch._dynamo.reset()
        enc = copy.deepcopy(base)
        apply_checkpointing(candidate_modules(enc), {n: level for n in candidate_modules(enc)})
        if compiled:
            compile_dense_modules(enc, backend="inductor")

        def step():
            enc.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = enc(tok, offsets, ts, max_len=512)
            out.float().square().sum().backward()

        for _ in range(2):  # kernel / graph compiles
            step()
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        peaks[level] = torch.cuda.max_memory_allocated(dev) - start
        grads[level] = [p.grad.float() for p in enc.parameters()]
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    for a, b in zip(grads["selective"], grads["none"]):
        if compiled:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
        else:
            assert torch.equal(a, b)


def _counting_backend():
    """A dynamo backend running the traced graph as is, counting compiles (graphs made) and calls of them."""
    stats = {"compiles": 0, "calls": 0}

    def backend(gm, example_inputs):
        stats["compiles"] += 1

        def run(*args):
            stats["calls"] += 1
            return gm.forward(*args)

        return run

    return backend, stats


@pytest.mark.parametrize("attention, autocast", [("triton", False), ("reference", True)])
def test_compiled_candidate_is_timed_compiled_without_recompiling_or_side_effects(monkeypatch, attention, autocast):
    """Of two blocks, the one compiled in place (``Module.compile``, a counting backend) gets its recompute
    seconds from its compiled forward -- run after the step through ``_compiled_call_impl`` (the compiled graph is
    called twice, no new compile: the inputs, their requires_grad and the autocast state as in the step) -- full:
    those seconds, selective: those less the census's seconds of the saved ops; the eager block keeps the census's.
    The timing writes no ``.grad`` (parameters or the step's input), leaves the RNG state as it was, and refuses to
    run while the probe is active. With bf16 autocast (the reference attention: its graph breaks are counted as
    calls too) the step's autocast is restored for the timing, else dynamo would recompile."""
    import torch._dynamo

    from gemray.parallel import activation_checkpoint as ac_mod

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=8, linear_dim=8, num_blocks=2, dropout=0.2,
                   attention_backend=attention)
    enc = HSTUEncoder(cfg, 32)
    backend, stats = _counting_backend()
    enc.blocks[0].compile(backend=backend)
    mods = candidate_modules(enc)
    tok, off, ts = _jagged()
    tok.requires_grad_()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = enc(tok, off, ts)
        out.float().sum().backward()

    step()  # the warm-up step compiles
    assert stats["compiles"] > 0
    assert ac_mod.compiled_in_place(mods["blocks.0"]) and not ac_mod.compiled_in_place(mods["blocks.1"])
    with _Probe(mods, list(enc.parameters())) as probe:
        step()  # (the reference attention's layout cache, filled by the census, may compile one more graph)
        with pytest.raises(RuntimeError, match="still active"):
            probe.time_compiled()
    grads = {n: p.grad.clone() for n, p in enc.named_parameters()}
    tok_grad, rng, calls, compiled = tok.grad.clone(), torch.get_rng_state(), stats["calls"], stats["compiles"]
    timed = []
    real = ac_mod._time_compiled_forward

    def spy(mod, *a, **k):
        timed.append((mod, real(mod, *a, **k)))
        return timed[-1][1]

    monkeypatch.setattr(ac_mod, "_time_compiled_forward", spy)
    seconds = probe.time_compiled()
    assert [m for m, _ in timed] == [mods["blocks.0"]] and seconds == {"blocks.0": timed[0][1]}
    assert seconds["blocks.0"] > 0
    assert stats["compiles"] == compiled, "the timing recompiled"
    per_call = 1 if attention == "triton" else None  # the Triton block is one graph; the reference has breaks
    assert stats["calls"] - calls == 2 * per_call if per_call else stats["calls"] - calls >= 2
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(tok.grad, tok_grad)
    assert all(torch.equal(p.grad, grads[n]) for n, p in enc.named_parameters())
    assert (probe.timing("blocks.0"), probe.timing("blocks.1")) == (_Probe.COMPILED, _Probe.CENSUS)
    c0, c1 = probe.costs()
    assert c0.recompute_cost == seconds["blocks.0"] != probe.full_s["blocks.0"]
    assert c0.selective_cost == max(seconds["blocks.0"] - probe.saved_ops_s["blocks.0"], 0.0)
    assert (c1.recompute_cost, c1.selective_cost) == (probe.full_s["blocks.1"], probe.selective_s["blocks.1"])
    assert probe.time_compiled() == seconds and len(timed) == 1  # the held inputs were dropped: nothing to time


def test_auto_checkpointer_logs_which_timing_each_candidate_used(caplog):
    """The probe's per-module lines say where the recompute seconds came from: the compiled forward for blocks
    compiled in place (here blocks.0, backend "eager"), the eager op census for the others."""
    import logging

    import torch._dynamo

    torch._dynamo.reset()
    enc, tok, off, ts = _encoder_and_batch()
    enc.blocks[0].compile(backend="eager")
    with caplog.at_level(logging.INFO, logger="gemray.parallel.activation_checkpoint"):
        plan = _probe_and_plan(ActivationCheckpointer("auto", 0.6), enc, tok, off, ts)[1]
    assert plan is not None and plan.fits
    lines = {r.getMessage().split(" saves ")[0].rsplit(" ", 1)[-1]: r.getMessage() for r in caplog.records
             if r.getMessage().startswith("activation checkpointing probe: blocks.")}
    assert sorted(lines) == ["blocks.0", "blocks.1", "blocks.2"]
    assert lines["blocks.0"].endswith("(timed: compiled forward)")
    assert lines["blocks.1"].endswith("(timed: eager op census)") and lines["blocks.2"].endswith("census)")
