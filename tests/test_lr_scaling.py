"""Width-scaled dense learning rates (muP's Adam rule) and the linear warm-up: the pure rules, the fan-ins the
model declares, the optimizer's param groups and what one Adam step does with them, and the trainer applying the
warm-up from the global step (so a resumed run continues it)."""

from __future__ import annotations

import pytest
import torch

from gemray.config import load_config
from gemray.model import GEM
from gemray.model.lr_scaling import lr_scales, parameter_fan_ins, warmup_factor
from model_utils import cpu_trainer, tiny_cfg

CONFIG = "configs/gem-tiny.toml"
DATA = ["data.num_files=1", "data.max_seq_len=32", "data.batch_size=8", "data.sub_batch_size=8",
        'data.synthetic=["users=64", "items=200", "seed=5", "max_len=32", "min_len=4", "mean_len=12", '
        '"features=category=8,author=32", "devices=3", "candidates=6"]']


def test_lr_scales_and_warmup_factor_follow_their_rules():
    fan = {"a": 64, "b": 128, "c": 1024, "d": 16}
    assert lr_scales(fan, 0) == {n: 1.0 for n in fan}
    assert lr_scales(fan, 128) == {"a": 1.0, "b": 1.0, "c": 0.125, "d": 1.0}
    assert lr_scales(fan, 32) == {"a": 0.5, "b": 0.25, "c": 1 / 32, "d": 1.0}
    with pytest.raises(ValueError, match="base_fan_in"):
        lr_scales(fan, -1)
    with pytest.raises(ValueError, match="fan-in"):
        lr_scales({"x": 0}, 8)
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0 == warmup_factor(7, 1)
    with pytest.raises(ValueError, match="warmup"):
        warmup_factor(-1, 4)
    with pytest.raises(ValueError, match="warmup"):
        warmup_factor(0, -2)


def test_parameter_fan_ins_are_the_weights_input_widths():
    """Each weight matrix's fan-in is the width its outputs sum over, whatever the parameter's layout (HSTU's
    uvqk_weight is [D, W], nn.Linear's [out, in], the MoE experts' [E, in, out]); biases, position tables and
    the PMA seeds are not weight matrices."""
    cfg = tiny_cfg(tasks=["retrieval", "ctr", "cvr"], model_dim=64, num_heads=2, attention_dim=8, linear_dim=12,
                   mlp_dims=[32, 16], pma_seeds=2, moe_experts=4, moe_top_k=2)
    model = GEM(cfg, 100, device="meta", max_seq_len=32)
    fan = parameter_fan_ins(model)
    assert fan["encoder.blocks.0.uvqk_weight"] == 64 and fan["encoder.blocks.1.uvqk_weight"] == 64
    assert fan["encoder.blocks.0.o_weight"] == 2 * 12  # H x V
    assert fan["inputs.tokens.proj.weight"] == 16 and fan["retrieval_proj.weight"] == 64
    names = dict(model.named_parameters())
    for n, k in fan.items():
        assert n in names, n
        if n.endswith("w1") or n.endswith("w2"):
            assert k == names[n].shape[1], n
    assert any(n.endswith(".w1") for n in fan) and any(n.endswith(".w2") for n in fan)
    assert not [n for n in fan if n.endswith("bias") or "pos_emb" in n or n.endswith("seeds")
                or "embeddings." in n]
    # every Linear weight is there with its in_features
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            assert fan[f"{mod_name}.weight"] == mod.in_features


def _cfg(synthetic, *sets):
    return load_config(CONFIG, [f"data.prepared_dir={synthetic}", *DATA, "ray.use_gpu=false",
                                "train.max_steps_per_epoch=3", "train.weight_decay=0.0", *sets])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """gem-tiny's generator at a smaller size (its token / candidate features), prepared once."""
    from gemray.pipelines.synthetic import ensure_synthetic

    out = tmp_path_factory.mktemp("lr") / "syn"
    ensure_synthetic(load_config(CONFIG, [f"data.prepared_dir={out}", *DATA]).data)
    return out


def test_scaled_groups_move_each_weight_by_its_own_rate_and_the_warmup_follows_the_global_step(synthetic):
    """With lr_base_fan_in the dense AdamW has one group per multiplier; Adam's first step moves every weight
    with a gradient by ~lr x its multiplier (|m / sqrt(v)| = 1 at step 1), so the wide weights move 1/8 as far as
    the base-width ones. The warm-up sets the dense rates from the global step before each step: after resuming
    at step 2 the rate is what an uninterrupted run has there."""
    from gemray.bench.train import first_batch
    from gemray.parallel import dense_lr_scales

    with cpu_trainer(_cfg(synthetic, "train.lr=1e-3", "train.lr_base_fan_in=16", "train.lr_warmup_steps=4",
                          "model.model_dim=128")) as tr:
        fan = parameter_fan_ins(tr.dmp)
        scales = dense_lr_scales(tr.optimizer)
        assert sorted(set(scales), reverse=True) == scales and scales[0] == 1.0 and 16 / 128 in scales
        dense = [g for name, opt in tr.optimizer.optimizers if name == "dense" for g in opt.param_groups]
        params = dict(tr.dmp.named_parameters())
        for g, sc in zip(dense, scales):
            for p in g["params"]:
                name = next(n for n, q in params.items() if q is p)
                assert sc == (min(1.0, 16 / fan[name]) if name in fan else 1.0), name
        before = {n: p.detach().clone() for n, p in params.items()}
        seen = []
        orig_step = tr.optimizer.step

        def step(*a, **k):
            seen.append([g["lr"] for g in dense])
            return orig_step(*a, **k)

        tr.optimizer.step = step
        tr.begin_epoch(0)
        tr.train_step(first_batch(tr))
        assert seen[-1] == pytest.approx([1e-3 * 0.25 * sc for sc in scales])  # warm-up step 0: 1/4
        for n, k in fan.items():
            if n not in params or params[n].grad is None and torch.equal(params[n], before[n]):
                continue
            delta = (params[n].detach() - before[n]).abs()
            moved = delta[delta > 0]
            assert moved.numel(), n
            want = 1e-3 * 0.25 * min(1.0, 16 / k)
            assert moved.median().item() == pytest.approx(want, rel=0.05), n
        tr.global_step = 2  # as restored from a checkpoint taken after step 2
        tr.train_step(first_batch(tr))
        assert seen[-1] == pytest.approx([1e-3 * 0.75 * sc for sc in scales])
        tr.train_step(first_batch(tr))
        tr.train_step(first_batch(tr))
        assert seen[-1] == pytest.approx([1e-3 * sc for sc in scales])  # past the warm-up: the full rates


def test_the_warming_up_lr_is_logged_recorded_and_reaches_tensorboard(synthetic, tmp_path, caplog):
    """The base dense rate (train.lr x the warm-up factor, before the lr_base_fan_in multipliers) is visible: in
    rank 0's progress line of every logged step (``lr 2.50e-04``), in each ``step`` event of events.jsonl and so
    in TensorBoard's ``step/lr`` -- rising linearly over lr_warmup_steps, then flat (was: in none of them)."""
    import json
    import logging
    import re

    from gemray.controller.tensorboard import scalars

    events = tmp_path / "events.jsonl"
    cfg = _cfg(synthetic, "train.lr=1e-3", "train.lr_base_fan_in=16", "train.lr_warmup_steps=4",
               "train.max_steps_per_epoch=5", "train.log_every=1", "checkpoint.every_epochs=1",
               f"train.events_path={events}")
    want = [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]  # global steps 1..5: (step + 1) / 4 of lr, then lr
    with cpu_trainer(cfg) as tr:
        # in-process the trainer leaves gemray's logging to the caller: its records reach caplog's root handler
        caplog.set_level(logging.INFO, logger="gemray")
        tr.train_epoch(0)
        assert tr.global_step == 5
    lines = [r.getMessage() for r in caplog.records if re.match(r"epoch 1 step \d+/5 ", r.getMessage())]
    logged = [float(re.search(r" loss \S+, lr (\S+), ", m).group(1)) for m in lines]
    assert logged == want, lines
    assert "lr 2.50e-04, " in lines[0] and "lr 1.00e-03, " in lines[-1]
    recorded = [json.loads(x) for x in events.read_text().splitlines()]
    steps = [e for e in recorded if e["kind"] == "step"]
    assert [(e["detail"]["global_step"], e["detail"]["lr"]) for e in steps] == [
        (s, pytest.approx(v)) for s, v in zip(range(1, 6), want)]
    tb = [(s, v) for tag, v, s in scalars({}, recorded) if tag == "step/lr"]
    assert tb == [(s, pytest.approx(v)) for s, v in zip(range(1, 6), want)]


def test_without_scaling_the_dense_optimizer_has_one_group_at_train_lr(synthetic):
    from gemray.parallel import dense_lr_scales, set_dense_lr

    with cpu_trainer(_cfg(synthetic, "train.lr=3e-4")) as tr:
        assert dense_lr_scales(tr.optimizer) == [1.0]
        dense = [g for name, opt in tr.optimizer.optimizers if name == "dense" for g in opt.param_groups]
        assert [g["lr"] for g in dense] == [3e-4]
        with pytest.raises(ValueError, match="2 scales"):
            set_dense_lr(tr.optimizer, 1e-3, [1.0, 0.5])


@pytest.mark.parametrize("key", ["lr_base_fan_in", "lr_warmup_steps"])
def test_negative_lr_settings_are_refused(key):
    with pytest.raises(ValueError, match=f"train.{key}: expected >= 0"):
        load_config(CONFIG, [f"train.{key}=-1"]).validate()
