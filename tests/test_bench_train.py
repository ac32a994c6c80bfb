"""gemray bench train (CPU): the JSON's fields and their arithmetic, the profile classifier, the kernel warm-up's
regimes and its no-side-effect run (interpreted Triton), and the throughput fields of training."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from gemray.bench.train import (classify_kernel, idle_gaps, kernel_breakdown, stall_check, summarize)
from gemray.cli import main
from gemray.config import load_config
from gemray.kernels.config import DEFAULT
from gemray.train.throughput import mfu_or_none, peak_flops_for, scaling_fields
from gemray.train.warmup import reachable_regimes, warmup_lengths
from model_utils import cpu_trainer

CONFIG = "configs/ml-latest-small.toml"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from gemray.pipelines.synthetic import SyntheticSpec, prepare_synthetic

    out = tmp_path_factory.mktemp("bench") / "syn"
    spec = SyntheticSpec(users=120, items=200, seed=3, max_len=48, min_len=4, mean_len=16.0, candidates=6)
    prepare_synthetic(out, spec, num_files=2, progress=False, workers=1)
    return out


def _overrides(prepared, *extra):
    return ["--set", f"data.prepared_dir={prepared}", "data.max_seq_len=48", "data.batch_size=16",
            "ray.use_gpu=false", *extra]


def test_bench_train_smoke_json_fields_and_arithmetic(synthetic, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "train", "--config", CONFIG, *_overrides(synthetic), "--steps", "3", "--warmup", "1",
               "--profile", "--profile-steps", "1", "--host-profile", "2", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "step time" in printed and "local MFU" in printed and "profile (1 steps" in printed
    assert "host profile (2 steps" in printed
    r = json.loads(out.read_text())
    for key in ("step_s", "data_s", "tokens_per_s", "samples_per_s", "model_tflops_per_s", "local_mfu",
                "local_mfu_compute", "peak_memory", "data_stall_pct", "compile_stall", "loader", "warmup_compile",
                "scaling_ratio", "e2e_mfu", "profile", "steps", "torch_compile", "local_mfu_second_half",
                "allocator"):
        assert key in r, key
    assert r["allocator"] is None  # CPU: no caching allocator to count
    tc = r["torch_compile"]
    assert tc["enabled"] is False and tc["modules"] == [] and tc["during_measured"]["frames"] == 0
    assert r["measured_steps"] == 3 and len(r["steps"]) == 1 + 3
    meas = [s for s in r["steps"] if s["phase"] == "measured"]
    wall = sum(s["step_s"] + s["data_s"] for s in meas)
    flops = sum(s["flops"] for s in meas)
    assert flops > 0
    assert r["model_tflops_per_s"] == pytest.approx(flops / wall / 1e12, rel=1e-9)
    assert r["tokens_per_s"] == pytest.approx(sum(s["tokens"] for s in meas) / wall, rel=1e-9)
    assert r["data_stall_pct"] == pytest.approx(100 * sum(s["data_s"] for s in meas) / wall, rel=1e-9)
    assert r["step_s"]["max"] == pytest.approx(max(s["step_s"] for s in meas))
    assert r["local_mfu"] is None and r["peak_flops"] is None  # CPU: TFLOP/s only
    assert r["scaling_ratio"] == 1.0 and r["world_size"] == 1
    assert r["peak_memory"]["rss_bytes"] > 0 and r["loader"]["workers"] == 0
    assert r["warmup_compile"]["ran"] is False  # reference attention on CPU: nothing to compile
    p = r["profile"]
    assert p["per_step_s"]["gemm"] > 0 and p["per_step_s"]["embeddings_fwd"] > 0
    assert p["per_step_s"]["data_wait"] > 0 and p["steps"] == 1
    assert sum(p["per_step_s"].values()) <= 1.5 * p["step_wall_s"]  # operators' self time: no double counting
    hp = r["host_profile"]
    assert hp["steps"] == 2 and hp["host_s"] > 0
    own = {n: sec for n, sec, _ in hp["by_own"]}
    cum = {n: sec for n, sec, _ in hp["by_cumulative"]}
    assert any("train_step" in n for n in cum), list(cum)[:10]  # the step itself is on the cumulative list
    assert 0 < max(own.values()) <= hp["wall_s"] / 2 * 1.05  # own seconds per step fit inside a step
    assert all(s["host_s"] == s["step_s"] for s in r["steps"])  # CPU: operators run as called
    assert all(1 <= s["max_len"] <= 48 and "device_allocs" not in s for s in r["steps"])  # no allocator on CPU
    # the interpreter compiles nothing: no JIT cache misses, counted per step and in all
    assert r["jit_misses"] == {"count": 0, "steps": 0, "kernels": []}
    assert all(s["jit_misses"] == 0 and s["jit_kernels"] == [] for s in r["steps"])
    assert "kernel compiles 0 JIT cache misses in 0 of the measured steps" in printed


def test_summarize_mfu_is_flops_over_time_over_peak():
    recs = [{"data_s": 0.01, "step_s": 0.09, "flops": 5e12, "tokens": 1000, "samples": 8},
            {"data_s": 0.0, "step_s": 0.1, "flops": 3e12, "tokens": 600, "samples": 8},
            {"data_s": 0.02, "step_s": 0.28, "flops": 7e12, "tokens": 1400, "samples": 8}]
    s = summarize(recs, 989e12)
    wall = 0.5
    assert s["model_tflops_per_s"] == pytest.approx(15e12 / wall / 1e12)
    assert s["local_mfu"] == pytest.approx(15e12 / wall / 989e12)
    assert s["local_mfu_compute"] == pytest.approx(15e12 / 0.47 / 989e12)
    assert s["local_mfu_second_half"] == pytest.approx(10e12 / 0.38 / 989e12)  # the later 2 of 3 steps
    assert s["tokens_per_s"] == pytest.approx(3000 / wall) and s["samples_per_s"] == pytest.approx(24 / wall)
    assert s["data_stall_pct"] == pytest.approx(100 * 0.03 / wall)
    assert s["step_s"]["median"] == pytest.approx(0.1) and s["step_s"]["max"] == pytest.approx(0.28)
    assert s["compile_stall"]["flagged"] and s["compile_stall"]["max_over_median"] == pytest.approx(2.8)
    assert summarize(recs, None)["local_mfu"] is None


def test_summarize_with_a_measured_window_uses_it_as_the_wall():
    # CUDA: batches are read while the device works, so the window is shorter than data_s + step_s
    recs = [{"data_s": 0.02, "step_s": 0.1, "host_s": 0.06, "flops": 4e12, "tokens": 1000, "samples": 8},
            {"data_s": 0.02, "step_s": 0.1, "host_s": 0.08, "flops": 4e12, "tokens": 1000, "samples": 8}]
    s = summarize(recs, 989e12, wall_s=0.2)
    assert s["wall_s"] == 0.2 and s["tokens_per_s"] == pytest.approx(10_000)
    assert s["local_mfu"] == pytest.approx(8e12 / 0.2 / 989e12)
    assert s["data_stall_pct"] == pytest.approx(20.0) and s["host_s"]["median"] == pytest.approx(0.07)
    assert summarize(recs, 989e12)["wall_s"] == pytest.approx(0.24)  # no window: the parts' sum


def test_stall_check_flags_only_above_twice_the_median():
    assert not stall_check([1.0, 1.0, 2.0])["flagged"]
    assert stall_check([1.0, 1.0, 2.01])["flagged"]
    assert stall_check([])["max_over_median"] is None


@pytest.mark.parametrize("name,cat", [
    ("_gdpa_fwd", "attention"), ("_gdpa_bwd", "attention"), ("_gdpa_dq_ds", "attention"), ("_ws_fwd", "attention"),
    ("_bwd_delta", "attention"), ("_ws_dv_ds", "attention"), ("_ws_ds_gemm", "attention"),
    ("flash_fwd_kernel", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel<...>", "attention"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"), ("ampere_sgemm_128x64_nn", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_nn_align4>", "gemm"),
    ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("aten::bmm", "gemm"),
    ("split_embedding_codegen_forward_unweighted_kernel", "embeddings_fwd"),
    ("split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1", "embeddings_bwd"),
    ("bounds_check_indices_kernel", "embeddings_fwd"), ("fbgemm::jagged_to_padded_dense", "embeddings_fwd"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("ncclKernel_AllToAll_RING_LL_Sum_int8_t", "communication"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "other"),
    ("Memcpy HtoD (Pageable -> Device)", "other"), ("_norm_quant_fwd", "other"),
])
def test_classify_kernel(name, cat):
    assert classify_kernel(name) == cat


def test_kernel_breakdown_counts_only_the_exposed_part_of_communication():
    ks = [("sm90_xmma_gemm", 0.0, 1.0), ("_gdpa_fwd", 1.0, 1.5), ("ncclDevKernel_AllToAll", 0.8, 2.0),
          ("elementwise", 3.0, 3.2)]
    b = kernel_breakdown(ks)
    assert b["gemm"] == pytest.approx(1.0) and b["attention"] == pytest.approx(0.5)
    assert b["overlapped_communication"] == pytest.approx(0.7)  # 0.8..1.5 under compute
    assert b["exposed_communication"] == pytest.approx(0.5)     # 1.5..2.0
    assert b["other"] == pytest.approx(0.2) and b["gpu_busy"] == pytest.approx(2.2)


def test_idle_gaps_charge_each_gap_to_the_innermost_running_host_op_and_its_phase():
    # kernels: busy 0-1, 1.5-2 (gap 0.5), 2.05-3 (gap 0.05), 3-4 touching (no gap), 6-7 (gap 2)
    ks = [("a", 0.0, 1.0), ("b", 1.5, 2.0), ("c", 2.05, 3.0), ("d", 3.0, 4.0), ("e", 6.0, 7.0), ("f", 0.2, 0.4)]
    host = [("aten::copy_", 0.9, 1.6, 1), ("cudaStreamSynchronize", 1.0, 1.45, 1),   # nested: the sync is inner
            ("python_op", 1.9, 2.2, 1),
            ("autograd::engine", 4.0, 8.0, 2), ("CompiledFunctionBackward", 4.5, 5.5, 2),  # another thread
            ("aten::mm", 5.1, 5.3, 2)]
    phases = [("gemray.forward", 0.0, 2.5), ("gemray.backward", 4.0, 8.0)]
    r = idle_gaps(ks, host, phases, min_gap_s=0.01)
    assert r["gaps"] == 3 and r["idle_s"] == pytest.approx(0.5 + 0.05 + 2.0)
    by = {n: (s, k) for n, s, k in r["by_host_op"]}
    assert by["cudaStreamSynchronize"] == (pytest.approx(0.5), 1)   # midpoint 1.25: inside the sync
    assert by["python_op"] == (pytest.approx(0.05), 1)              # midpoint 2.025
    assert by["CompiledFunctionBackward"] == (pytest.approx(2.0), 1)  # midpoint 5.0: after aten::mm ended
    assert r["by_phase"] == {"gemray.backward": pytest.approx(2.0), "gemray.forward": pytest.approx(0.55)}
    assert [g[1] for g in r["largest"]] == pytest.approx([2.0, 0.5, 0.05])
    assert r["first_step_s"] == 0.0  # no boundary given
    # the first profiled step (it starts on an empty launch queue) ends at 3.0: its gaps (midpoints 1.25, 2.025)
    # apart from the later one (midpoint 5.0)
    assert idle_gaps(ks, host, phases, min_gap_s=0.01, first_step_end=3.0)["first_step_s"] == pytest.approx(0.55)
    # a gap shorter than min_gap_s is not counted; no host op at all
    r = idle_gaps([("a", 0.0, 1.0), ("b", 1.001, 2.0), ("c", 3.0, 4.0)], [], min_gap_s=0.01)
    assert r["gaps"] == 1 and r["by_host_op"] == [["(no host op)", pytest.approx(1.0), 1]]
    assert r["by_phase"] == {"(between phases)": pytest.approx(1.0)}
    assert idle_gaps([], [])["gaps"] == 0


def test_peak_table_and_scaling_fields():
    assert peak_flops_for("NVIDIA H200") == 989e12 and peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12 and peak_flops_for("cpu") is None
    assert mfu_or_none(1e12, 0.0, 989e12) is None and mfu_or_none(1e12, 1.0, None) is None
    assert scaling_fields(world_size=1, tokens_per_s=100.0, local_mfu=0.3) == {"scaling_ratio": 1.0, "e2e_mfu": 0.3}
    assert scaling_fields(world_size=4, tokens_per_s=360.0, local_mfu=0.25) == {"scaling_ratio": None,
                                                                               "e2e_mfu": None}
    f = scaling_fields(world_size=4, tokens_per_s=360.0, local_mfu=0.25,
                       reference={"tokens_per_s": 100.0, "local_mfu": 0.4})
    assert f["scaling_ratio"] == pytest.approx(0.9) and f["e2e_mfu"] == pytest.approx(0.36)
    with pytest.raises(ValueError, match="tokens_per_s"):
        scaling_fields(world_size=2, tokens_per_s=1.0, local_mfu=None, reference={"tokens_per_s": 0})


def test_throughput_metrics_over_epochs(tmp_path):
    from gemray.controller.results import load_scaling_reference, throughput_metrics

    hist = [{"tokens_per_s": 100.0, "model_tflops_per_s": 1.0, "mfu_flops": 0.0, "mfu_rank_s": 0.0,
             "peak_flops": 1e12},
            {"tokens_per_s": 300.0, "model_tflops_per_s": 3.0, "mfu_flops": 6e12, "mfu_rank_s": 2.0,
             "peak_flops": 1e12}]
    m = throughput_metrics(hist, 1)
    assert m["tokens_per_s"] == 200.0 and m["model_tflops_per_s"] == 2.0
    assert m["local_mfu"] == pytest.approx(3.0) and m["scaling_ratio"] == 1.0 and m["e2e_mfu"] == m["local_mfu"]
    cpu = throughput_metrics([{**h, "peak_flops": None} for h in hist], 2)
    assert cpu["local_mfu"] is None and cpu["scaling_ratio"] is None
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"tokens_per_s": 100.0, "local_mfu": 0.5}))
    m2 = throughput_metrics(hist, 2, load_scaling_reference(str(ref)))
    assert m2["scaling_ratio"] == pytest.approx(1.0) and m2["e2e_mfu"] == pytest.approx(0.5)
    assert load_scaling_reference("") is None
    with pytest.raises(FileNotFoundError, match="scaling_reference"):
        load_scaling_reference(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="tokens_per_s"):
        load_scaling_reference(str(tmp_path / "bad.json"))


def test_epoch_stats_carry_flops_and_the_mfu_window():
    import torch.distributed as dist

    from gemray.train.stats import EpochStats

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        st = EpochStats()
        st.add(1.0, 10, 100, 4, flops=5e12, seconds=None)  # warm-up step: FLOPs counted, not in the MFU window
        st.add(1.0, 10, 100, 4, flops=2e12, seconds=0.5)
        st.add(1.0, 10, 100, 4, flops=2e12, seconds=1.5)
        st.reduce(torch.device("cpu"), 1)
        r = st.result(1e12)
        assert r["mfu_flops"] == 4e12 and r["mfu_rank_s"] == 2.0
        assert r["local_mfu"] == pytest.approx(2.0)
        assert r["model_tflops_per_s"] == pytest.approx(9e12 / r["train_s"] / 1e12)
        assert st.result(None)["local_mfu"] is None
    finally:
        if made:
            dist.destroy_process_group()


def test_reachable_regimes_follow_the_mean_length_bounds():
    assert reachable_regimes(50) == ["short"]
    assert reachable_regimes(200) == ["short"]
    assert reachable_regimes(256) == ["short", "medium"]
    assert reachable_regimes(1024) == ["short", "medium", "long"]
    assert reachable_regimes(4096) == ["short", "medium", "long", "xlong"]
    kc = DEFAULT.replace(regime_mean_len=(8, 16, 32))
    assert reachable_regimes(20, kc) == ["short", "medium", "long"]
    with pytest.raises(ValueError):
        reachable_regimes(0)


@pytest.mark.parametrize("max_len", [48, 200, 1000, 4096])
@pytest.mark.parametrize("batch", [1, 3, 32])
def test_warmup_lengths_land_in_their_regime_with_both_alignments(max_len, batch):
    for reg in reachable_regimes(max_len):
        variants = warmup_lengths(reg, batch, max_len)
        assert 1 <= len(variants) <= 2
        for lens in variants:
            assert len(lens) == batch and all(1 <= n <= max_len for n in lens)
            assert DEFAULT.regime_of(sum(lens), batch) == reg
        assert sum(variants[0]) % 16 == 0 or batch * variants[0][0] < 16
        if len(variants) == 2:
            assert sum(variants[1]) % 16 != 0 and max(variants[1]) == max_len


def test_warmup_batches_stay_within_the_token_budget_and_their_regime():
    from gemray.kernels.config import REGIMES
    from gemray.train.warmup import warmup_lengths_within, warmup_token_budget

    budget = warmup_token_budget(129_000)  # a real gem-h200 batch of 128 histories
    assert budget == 161_250
    for reg in reachable_regimes(4096):
        full = warmup_lengths(reg, 128, 4096)
        got = warmup_lengths_within(reg, 128, 4096, budget)
        lo, hi = (1, *DEFAULT.regime_mean_len)[REGIMES.index(reg)], (*DEFAULT.regime_mean_len, 1 << 62)[REGIMES.index(reg)]
        for lens in got:
            assert lo <= sum(lens) / len(lens) < hi and max(lens) <= 4096
        if all(sum(lens) <= budget for lens in full):
            assert got == full  # within the budget: unchanged
        else:                   # e.g. xlong (mean >= 2048): 2x a real batch at 128 histories
            assert all(sum(lens) <= budget for lens in got) and len(got[0]) < 128
            assert [sum(lens) % 16 == 0 for lens in got] == [sum(lens) % 16 == 0 for lens in full]
    assert len(warmup_lengths_within("xlong", 128, 4096, budget)[0]) == 64  # 64 x 2048 = 131,072 tokens
    assert len(warmup_lengths_within("xlong", 128, 4096, 1)[0]) == 2  # never below two sequences


def test_warm_up_runs_interpreted_and_changes_no_weight(synthetic):
    """The warm-up on the Triton backend (the CPU interpreter): every reachable regime runs forward + backward,
    and no parameter, embedding row, .grad or fused-optimizer step count changes."""
    import torch.distributed as dist

    from gemray.bench.train import _init_process_group, first_batch
    from gemray.kernels.jagged_attention import interpreting
    from gemray.parallel import sparse_step_counts, sparse_step_modules
    from gemray.train.trainer import Trainer
    from gemray.train.warmup import warm_up_attention

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    cfg = load_config(CONFIG, [f"data.prepared_dir={synthetic}", "data.max_seq_len=32", "data.batch_size=4",
                               "data.sub_batch_size=4", "ray.use_gpu=false", "data.reader=arrow",
                               "model.attention_backend=triton"])
    device = torch.device("cpu")
    made = _init_process_group(device)
    try:
        tr = Trainer(cfg)
        tr.setup(context=(0, 1, device))
        tr.build()
        def local(v):  # a ShardedTensor's rows on this rank (world size 1: all of them)
            if hasattr(v, "local_shards"):
                return torch.cat([s.tensor.detach().flatten() for s in v.local_shards()])
            return v.detach().flatten()

        before = {k: local(v).clone() for k, v in tr.dmp.state_dict().items() if isinstance(v, torch.Tensor)}
        assert any("embeddings" in k for k in before)
        steps = sparse_step_counts(tr.dmp.module)
        assert steps and set(steps) == {0}  # the TBE kernels are found (TorchRec keeps them out of .modules())
        info = warm_up_attention(cfg, device, tr.dmp.module, first_batch(tr))
        # FBGEMM counts an optimizer step per TBE forward (its Adam bias correction reads it): the warm-up's 2
        # forwards left it at 2, so the Triton path's first Adam update was ~0.64x the reference path's
        assert sparse_step_counts(tr.dmp.module) == steps
        assert [int(m.iter_cpu[0]) for m in sparse_step_modules(tr.dmp.module)] == steps
        assert info["ran"] and [d["regime"] for d in info["regimes"]] == ["short", "short"]
        assert {d["tokens"] % 16 == 0 for d in info["regimes"]} == {True, False}
        after = tr.dmp.state_dict()
        assert all(torch.equal(before[k], local(after[k])) for k in before)
        assert all(p.grad is None for p in tr.dmp.parameters())
        # the check can fail: one real training step moves the embedding rows it looked up
        tr.restore(from_ray=False)
        tr.begin_epoch(0)
        tr.train_step(first_batch(tr))
        assert sparse_step_counts(tr.dmp.module) == [1] * len(steps)  # a training step counts (the check can fail)
        moved = tr.dmp.state_dict()
        assert any(not torch.equal(before[k], local(moved[k])) for k in before if "embeddings" in k)
        off = warm_up_attention(load_config(CONFIG, ["ray.use_gpu=false"]), device, tr.dmp.module, first_batch(tr))
        assert off["ran"] is False and "does not use the Triton kernels" in off["why"]
    finally:
        if made:
            dist.destroy_process_group()


def test_train_epoch_logs_tflops_and_reports_local_mfu_fields(synthetic, caplog):
    """Trainer.train_epoch outside Ray (world 1): every logged step carries TFLOP/s and MFU, the epoch's result
    counts the FLOPs of exactly its batches and leaves the warm-up steps out of the MFU window."""

    from gemray.train.throughput import batch_flops

    cfg = load_config(CONFIG, [f"data.prepared_dir={synthetic}", "data.max_seq_len=48", "data.batch_size=16",
                               "ray.use_gpu=false", "data.reader=arrow", "train.max_steps_per_epoch=4",
                               "train.log_every=1", "train.mfu_warmup_steps=1", "checkpoint.every_epochs=1"])
    with cpu_trainer(cfg) as tr:
        expected = [batch_flops(cfg.model, b) for (b, _), _ in zip(tr.train_stream.iter_epoch(0, 0), range(4))]
        # in-process the trainer leaves gemray's logging to the caller: its records reach caplog's root handler
        caplog.set_level(logging.INFO, logger="gemray")
        res = tr.train_epoch(0)
        lines = [r.getMessage() for r in caplog.records if "TFLOP/s" in r.getMessage()]
        assert len(lines) == 4 and all("MFU n/a" in m for m in lines)
        assert tr.stats.g["flops"] == pytest.approx(sum(expected))
        assert res["model_tflops_per_s"] == pytest.approx(sum(expected) / res["train_s"] / 1e12)
        assert res["mfu_flops"] == pytest.approx(sum(expected[1:]))  # the first step is the warm-up
        assert res["mfu_rank_s"] > 0 and res["local_mfu"] is None and res["peak_flops"] is None
        assert math.isfinite(res["train_loss"])


def test_train_epoch_with_the_sparse_dist_pipeline_trains_the_same(synthetic):
    """Trainer.train_epoch (world 1, outside Ray) with parallel.train_pipeline = "sparse_dist": every step after
    the first was prefetched by the one before, and the epoch's losses equal the plain run's. The model has a
    ranking task with a 4-expert MoE tower: its routing figures are in the epoch's result."""
    import torch.distributed as dist

    from gemray.bench.train import _init_process_group
    from gemray.train.trainer import Trainer

    device = torch.device("cpu")
    made = _init_process_group(device)
    try:
        out = {}
        for pipe in ("none", "sparse_dist"):
            cfg = load_config(CONFIG, [f"data.prepared_dir={synthetic}", "data.max_seq_len=48", "data.batch_size=16",
                                       "ray.use_gpu=false", "data.reader=arrow", "train.max_steps_per_epoch=3",
                                       "checkpoint.every_epochs=1", f"parallel.train_pipeline={pipe}",
                                       "model.tasks=retrieval,ctr", "model.mlp_dims=16,8", "model.moe_experts=4",
                                       "model.moe_capacity_factor=1.0"])
            tr = Trainer(cfg)
            tr.setup(context=(0, 1, device))
            tr.build()
            tr.restore(from_ray=False)
            losses = []
            tr.recorder.step = lambda *a, loss=None, **k: losses.append(loss)
            res = tr.train_epoch(0)
            out[pipe] = (losses, res["train_loss"], tr.pipeline)
        assert out["none"][2] is None and out["sparse_dist"][2].served_ahead == 2
        assert len(out["none"][0]) == 3
        assert out["sparse_dist"][0] == pytest.approx(out["none"][0], rel=1e-6)
        assert out["sparse_dist"][1] == pytest.approx(out["none"][1], rel=1e-6)
        assert res["train_moe_aux_loss"] > 0.0 and 0.0 <= res["train_moe_dropped"] < 1.0
    finally:
        if made:
            dist.destroy_process_group()


def test_device_kernels_keep_device_work_only():
    from types import SimpleNamespace as NS

    from gemray.bench.train import device_kernels

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, dev, a, b, **kw):
        return NS(name=name, device_type=dev, time_range=NS(start=a, end=b), **kw)

    events = [ev("aten::mm", cpu, 0, 10), ev("sm90_xmma_gemm", cuda, 2, 6), ev("ProfilerStep#3", cuda, 0, 50),
              ev("train_step", cuda, 0, 40, is_user_annotation=True), ev("_gdpa_fwd", cuda, 6, 9),
              ev("span", cuda, 0, 9, activity_type="gpu_user_annotation")]
    assert device_kernels(events) == [("sm90_xmma_gemm", 2e-6, 6e-6), ("_gdpa_fwd", 6e-6, 9e-6)]


def test_compile_report_splits_the_warm_up_from_the_measured_steps():
    from gemray.bench.train import compile_report, format_table

    def snap(frames, breaks, inner, bw):
        return {"frames": frames, "frames_total": frames, "graphs": frames, "graph_breaks": breaks,
                "seconds": {"_compile.compile_inner": inner, "compile_fx.<locals>.bw_compiler": bw,
                            "GraphLowering.run": inner / 2}}

    rep = compile_report(True, "inductor", ["encoder.blocks.0", "tower"], snap(0, 0, 0.0, 0.0),
                         snap(2, 0, 30.0, 12.0), snap(2, 0, 30.0, 12.0))
    u, d = rep["until_measured"], rep["during_measured"]
    assert (u["frames"], u["graph_breaks"], u["seconds"]) == (2, 0, 42.0)  # frames + lazily compiled backward
    assert u["seconds_by_phase"]["GraphLowering.run"] == 15.0
    assert (d["frames"], d["seconds"], d["seconds_by_phase"]) == (0, 0.0, {})
    again = compile_report(True, "inductor", [], snap(0, 0, 0.0, 0.0), snap(1, 0, 5.0, 1.0), snap(2, 1, 9.0, 1.0))
    assert (again["during_measured"]["frames"], again["during_measured"]["graph_breaks"],
            again["during_measured"]["seconds"]) == (1, 1, 4.0)
    res = {"config": "c", "device": "d", "attention_backend": "triton", "batch_size": 1, "max_seq_len": 1,
           "measured_steps": 1, "warmup_steps": 1, "step_s": {"median": 0.1, "p90": 0.1, "max": 0.1},
           "tokens_per_s": 1.0, "samples_per_s": 1.0, "model_tflops_per_s": 1.0, "local_mfu": None,
           "local_mfu_compute": None, "data_stall_pct": 0.0, "loader": {"cpu_cores": 1}, "peak_memory": {},
           "compile_stall": {"max_over_median": 1.0, "flagged": False, "factor": 2.0},
           "warmup_compile": {"ran": True, "seconds": 1.0, "regimes": []}, "torch_compile": again,
           "sync_debug": {"total": 3, "step_s": 0.2, "sites": [
               {"site": "gemray/jagged.py:10", "frame": "gemray/jagged.py:10", "count": 2, "message": "m"},
               {"site": "torchrec/x.py:5", "frame": "gemray/model/gem.py:7", "count": 1, "message": "m"}]}}
    table = format_table(res)
    assert "during them 1 frame(s), 4.0 s  RECOMPILED" in table
    assert "3 in one step" in table and "   2x gemray/jagged.py:10\n" in table + "\n"
    assert "1x torchrec/x.py:5  (from gemray/model/gem.py:7)" in table


def test_sync_debug_is_refused_off_cuda(tmp_path, capsys):
    rc = main(["bench", "train", "--config", CONFIG, *_overrides(tmp_path / "nowhere"), "--steps", "1",
               "--sync-debug"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--sync-debug needs a CUDA device" in err and "ray.use_gpu = false" in err
    from gemray.bench.train import run_bench

    cfg = load_config(CONFIG, _overrides(tmp_path / "nowhere")[1:])
    with pytest.raises(RuntimeError, match="--sync-debug needs a CUDA device"):
        run_bench(cfg, steps=1, warmup=0, sync_debug=True)


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--warmup", "-1"], ["--profile-steps", "0"],
                                   ["--host-profile", "-2"]])
def test_bad_step_counts_are_refused_before_any_data_is_made(tmp_path, capsys, flags):
    """`gemray bench train --steps 0`: one line and exit 2 before the synthetic data is generated (was: the data
    generated first, then the refusal)."""
    data = tmp_path / "never-made"
    rc = main(["bench", "train", "--config", CONFIG, "--set", f"data.prepared_dir={data}", "ray.use_gpu=false",
               *flags])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gemray: error: bench train: expected --steps >= 1, --warmup >= 0"), err
    assert not data.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_use_gpu_without_cuda_is_refused_in_one_line(tmp_path, capsys):
    """ray.use_gpu = true on a machine without CUDA: one error line and exit 2 before the data is prepared (was: a
    RuntimeError traceback from bench_device after the preparation)."""
    data = tmp_path / "never-made"
    rc = main(["bench", "train", "--config", CONFIG, "--set", f"data.prepared_dir={data}", "ray.use_gpu=true",
               "--steps", "1", "--warmup", "0"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("gemray: error: bench train: ray.use_gpu is true but no CUDA device is visible (--set "
                       "ray.use_gpu=false to bench on the CPU)"), err
    assert not data.exists()


def test_unwritable_json_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    """`gemray bench train --json PATH` that cannot be written (a file where a folder should be, a folder given, a
    read-only folder): exit 2 with one line naming --json and the path, before the data is prepared or a step is
    run (was: a bare errno after every step). Missing folders on the path are still made, as before."""
    import errno
    import tempfile

    import gemray.bench.train as bench
    import gemray.controller.run as run
    from gemray.cli import _writable_file

    monkeypatch.setattr(run, "ensure_prepared", lambda cfg: pytest.fail("the data must not be prepared"))
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("no step must run"))
    (tmp_path / "afile").write_text("")
    base = ["bench", "train", "--config", CONFIG, *_overrides(tmp_path / "nowhere"), "--steps", "1", "--json"]
    cases = [(tmp_path / "afile" / "sub" / "r.json", f"--json {tmp_path / 'afile' / 'sub' / 'r.json'}: "
              f"{tmp_path / 'afile'} is not a folder"),
             (tmp_path, f"--json {tmp_path} is a folder; give a file name in it")]
    for target, line in cases:
        assert main([*base, str(target)]) == 2, target
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"gemray: error: {line}"], err
    assert _writable_file(tmp_path / "new" / "sub" / "r.json", "--json", make_parents=True)
    assert not (tmp_path / "new").exists()  # the check makes no folder; the command does, once it writes

    def refuse(*a, **k):  # a read-only folder, for root too
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    assert main([*base, str(tmp_path / "new" / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gemray: error: --json {tmp_path / 'new' / 'r.json'} is not writable: Read-only file system"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written


def test_bad_kernel_tiles_are_refused_before_the_data_is_generated(tmp_path, monkeypatch, capsys):
    """`gemray bench train` with a model.kernel_tiles file naming an unknown regime (valid JSON: the config loads)
    generated gem-tiny's synthetic data first and was refused only when the model was built; it is refused at
    once, as `gemray train` does (preflight_kernel_tiles), and no data is written."""
    import gemray.controller.run as run

    tiles = tmp_path / "tiles.json"
    tiles.write_text('{"nosuchregime": {}}')
    data = tmp_path / "gem-tiny"
    monkeypatch.setattr(run, "ensure_prepared", lambda cfg: pytest.fail("the data must not be prepared"))
    rc = main(["bench", "train", "--config", "configs/gem-tiny.toml", "--steps", "1", "--warmup", "0", "--set",
               f"data.prepared_dir={data}", "ray.use_gpu=false", f"model.kernel_tiles={tiles}"])
    assert rc == 2 and not data.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['gemray: error: model.kernel_tiles: unknown regime "nosuchregime" (one of ["short", "medium", '
                   '"long", "xlong"])'], err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bench_train_compiled_with_sync_debug(synthetic, tmp_path, capsys):
    """On the GPU: train.compile (inductor) compiles before the measured steps (none during them, no stall flag),
    and --sync-debug lists the host syncs left in one step by site (printed and in the JSON)."""
    out = tmp_path / "r.json"
    overrides = _overrides(synthetic, "train.compile=true", "model.attention_backend=triton")
    overrides[overrides.index("ray.use_gpu=false")] = "ray.use_gpu=true"
    rc = main(["bench", "train", "--config", CONFIG, *overrides, "--steps", "6", "--warmup", "4", "--sync-debug",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    tc = r["torch_compile"]
    assert tc["enabled"] and tc["modules"] and tc["until_measured"]["frames"] >= 1
    assert tc["during_measured"]["frames"] == 0 and not r["compile_stall"]["flagged"]
    assert all({"device_allocs", "host_allocs", "host_alloc_ms"} <= s.keys() for s in r["steps"])
    sd = r["sync_debug"]
    assert "host syncs" in printed and sd["total"] == sum(s["count"] for s in sd["sites"])


def test_evaluate_counts_no_fused_optimizer_step(synthetic):
    """Trainer.evaluate's embedding lookups leave FBGEMM's per-TBE step count (the one its Adam bias correction
    reads) where training left it; the same evaluation pass run bare does move it, so the check can fail."""
    from gemray.parallel import sparse_step_counts
    from gemray.train.evaluation import evaluation_sums

    cfg = load_config(CONFIG, [f"data.prepared_dir={synthetic}", "data.max_seq_len=48", "data.batch_size=16",
                               "ray.use_gpu=false", "data.reader=arrow", "train.max_steps_per_epoch=2",
                               "data.eval_batch_size=32"])
    with cpu_trainer(cfg) as tr:
        tr.train_epoch(0)
        trained = sparse_step_counts(tr.dmp.module)
        assert trained and set(trained) == {2}
        metrics = tr.evaluate("valid")
        assert metrics["num_users"] > 32  # several batches were looked up
        assert sparse_step_counts(tr.dmp.module) == trained
        tr.dmp.eval()
        with torch.no_grad():
            evaluation_sums(tr.dmp.module, tr.evaluators, tr.streams["valid"].iter_epoch(0), tr.device)
        assert all(c > t for c, t in zip(sparse_step_counts(tr.dmp.module), trained))


def test_checkpoint_state_carries_the_sparse_step_count_and_restore_sets_it(synthetic, monkeypatch):
    """TorchRec's checkpoints hold the tables and the fused optimizer's moments but not FBGEMM's step count (its
    Adam bias correction): the trainer's checkpoint state carries it and a restore sets it on every TBE; a
    checkpoint without it (older) gives the restored global step."""
    import torch.distributed as dist

    import gemray.train.trainer as trainer_mod
    from gemray.bench.train import _init_process_group
    from gemray.parallel import sparse_step_counts
    from gemray.train.trainer import Trainer

    cfg = load_config(CONFIG, [f"data.prepared_dir={synthetic}", "data.max_seq_len=48", "data.batch_size=16",
                               "ray.use_gpu=false", "data.reader=arrow", "train.max_steps_per_epoch=3"])
    device = torch.device("cpu")
    made = _init_process_group(device)
    try:
        tr = Trainer(cfg)
        tr.setup(context=(0, 1, device))
        tr.build()
        tr.restore(from_ray=False)
        tr.train_epoch(0)
        saved = []
        monkeypatch.setattr(tr, "save", lambda reason, metrics, state, in_progress: saved.append(state))
        assert tr.maybe_checkpoint(tr.global_step, epoch_end=True, metrics={}) is not None
        assert saved[-1]["sparse_steps"] == 3 == saved[-1]["global_step"]
        fresh = Trainer(cfg)
        fresh.setup(context=(0, 1, device))
        fresh.build()
        assert set(sparse_step_counts(fresh.dmp.module)) == {0}
        state = {**saved[-1], "sparse_steps": 7}  # as loaded back: the count need not be the global step
        monkeypatch.setattr(trainer_mod, "restore_from_ray", lambda model, opt: dict(state))
        fresh.restore()
        assert fresh.global_step == 3 and set(sparse_step_counts(fresh.dmp.module)) == {7}
        state.pop("sparse_steps")
        fresh.restore()
        assert set(sparse_step_counts(fresh.dmp.module)) == {3}
    finally:
        if made:
            dist.destroy_process_group()


def test_a_loader_worker_trains_the_same_and_bench_reports_it(synthetic, tmp_path, capsys):
    """data.loader_workers = 1 (a DataLoader worker process makes the batches): one short CPU epoch gives the
    in-process run's losses and data position, and leaves no process behind; `gemray bench train` reports the
    worker count in its JSON and table."""
    import multiprocessing

    out = {}
    for workers in (0, 1):
        cfg = load_config(CONFIG, [f"data.prepared_dir={synthetic}", "data.max_seq_len=48", "data.batch_size=16",
                                   "ray.use_gpu=false", "data.reader=arrow", "train.max_steps_per_epoch=3",
                                   "checkpoint.every_epochs=1", f"data.loader_workers={workers}"])
        with cpu_trainer(cfg) as tr:
            assert tr.train_stream.workers == workers
            losses = []
            tr.recorder.step = lambda *a, loss=None, **k: losses.append(loss)
            res = tr.train_epoch(0)
            out[workers] = (losses, res["train_loss"], tr.consumed)
        assert not multiprocessing.active_children()
    assert len(out[0][0]) == 3 and out[1] == out[0]
    js = tmp_path / "r.json"
    rc = main(["bench", "train", "--config", CONFIG, *_overrides(synthetic, "data.loader_workers=1"), "--steps", "2",
               "--warmup", "0", "--json", str(js)])
    assert rc == 0
    assert "(loader 1 worker process, " in capsys.readouterr().out
    r = json.loads(js.read_text())
    assert r["loader"]["workers"] == 1 and r["loader"]["in_process"] is False and r["loader"]["pin_memory"] is False
    assert not multiprocessing.active_children()


def test_bench_train_says_which_settings_have_no_effect(tmp_path, caplog):
    """bench train logs the config's ineffective settings as `gemray train` does (before anything is built:
    here the sync-debug refusal off CUDA follows it)."""
    from gemray.bench.train import run_bench

    cfg = load_config(CONFIG, _overrides(tmp_path / "nowhere")[1:] + ["train.compile=false",
                                                                      "train.compile_mode=max-autotune-no-cudagraphs"])
    caplog.set_level(logging.WARNING, logger="gemray.config")
    with pytest.raises(RuntimeError, match="--sync-debug needs a CUDA device"):
        run_bench(cfg, steps=1, warmup=0, sync_debug=True)
    said = [r.getMessage() for r in caplog.records if r.name == "gemray.config"]
    assert len(said) == 1 and "train.compile_mode" in said[0] and "no effect" in said[0]


def test_kernel_launchers_sums_each_kernels_launches_by_operator():
    from gemray.bench.train import kernel_launchers

    launches = [("copy_kernel", "aten::copy_ [[8, 4]] <- aten::contiguous", 1e-3),
                ("copy_kernel", "aten::copy_ [[2, 2]] <- aten::to", 3e-3),
                ("copy_kernel", "aten::copy_ [[8, 4]] <- aten::contiguous", 2.5e-3),
                ("copy_kernel", "aten::copy_ [[1]] <- aten::clone", 0.5e-3),
                ("gemm", "aten::mm [[8, 4], [4, 4]]", 2e-3)]
    out = kernel_launchers(launches, top=2)
    # per kernel, the launchers by total seconds, largest first, cut at `top`
    assert out["copy_kernel"] == [["aten::copy_ [[8, 4]] <- aten::contiguous", 3.5e-3],
                                  ["aten::copy_ [[2, 2]] <- aten::to", 3e-3]]
    assert out["gemm"] == [["aten::mm [[8, 4], [4, 4]]", 2e-3]]
    assert kernel_launchers([]) == {}


def test_launcher_names_the_operator_its_shapes_and_callers():
    from types import SimpleNamespace as NS

    from gemray.bench.train import _launcher

    root = NS(name="ProfilerStep#3", cpu_parent=None, input_shapes=[])
    outer = NS(name="gemray.forward", cpu_parent=root, input_shapes=[])
    mid = NS(name="aten::contiguous", cpu_parent=outer, input_shapes=[[128, 1024]])
    op = NS(name="aten::copy_", cpu_parent=mid, input_shapes=[[128, 1024], [], [128, 1024]])
    assert _launcher(op) == "aten::copy_ [[128, 1024], [128, 1024]] <- aten::contiguous <- gemray.forward"
    assert _launcher(NS(name="aten::mm", cpu_parent=root, input_shapes=None)) == "aten::mm"


def test_steady_device_idle_counts_the_gaps_after_the_marker_only():
    from gemray.bench.train import MARKER_KERNEL, steady_device_idle

    kernels = [("k0", 0.0, 1.0), ("k1", 5.0, 6.0),          # the first step: a 4 s gap before the marker, ignored
               (MARKER_KERNEL, 6.0, 6.5),
               ("a", 6.5, 8.0), ("b", 7.0, 9.0),            # overlapping kernels count once: busy 6.5 -> 9.0
               ("c", 10.0, 12.5), ("d", 12.0, 12.5)]        # a 1 s gap, then busy 10.0 -> 12.5
    out = steady_device_idle(kernels, steps=2)
    assert out == {"steps": 2, "busy_s_per_step": 2.5, "idle_s_per_step": 0.5, "window_s": 6.0}
    # a kernel that started before the marker ended counts only from the marker's end
    out = steady_device_idle([(MARKER_KERNEL, 0.0, 1.0), ("x", 0.5, 2.0), ("y", 3.0, 4.0)], steps=1)
    assert out == {"steps": 1, "busy_s_per_step": 2.0, "idle_s_per_step": 1.0, "window_s": 3.0}
    assert steady_device_idle([("a", 0.0, 1.0)], steps=2) is None              # no marker
    assert steady_device_idle([(MARKER_KERNEL, 0.0, 1.0)], steps=2) is None    # nothing after it
    assert steady_device_idle(kernels, steps=0) is None


def test_bench_leaves_sigterm_to_the_process(synthetic, tmp_path):
    """The bench never polls the preemption vote, so its trainer installs no SIGTERM handler: `timeout ... gemray
    bench train` ends at the first SIGTERM (with the vote's handler it logged "emergency checkpoint at the next poll
    step" and ran on until a second one). A training Trainer still installs it."""
    import signal

    from gemray.bench.train import run_bench

    cfg = load_config(CONFIG, _overrides(synthetic)[1:] + ["train.compile=false"])
    sentinel = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, sentinel)
    try:
        run_bench(cfg, steps=1, warmup=0)
        assert signal.getsignal(signal.SIGTERM) is sentinel
        with cpu_trainer(cfg) as tr:
            assert tr.vote is not None and signal.getsignal(signal.SIGTERM) is not sentinel
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_jit_misses_counts_through_triton_hook_and_restores_it():
    """JitMisses installs a counting ``jit_cache_hook`` (the JIT calls it on each launch that misses its kernel
    cache), calls on a hook installed before it with the same arguments and returns its answer (a true answer
    skips the compile), and puts the earlier hook back on exit."""
    from triton import knobs

    from gemray.bench.train import JitMisses

    seen = []

    def earlier(*args, **kwargs):
        seen.append(kwargs["key"])
        return False

    class Fn:
        name = "_gdpa_fwd"

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = earlier
    try:
        with JitMisses() as jit:
            hook = knobs.runtime.jit_cache_hook
            assert hook is not earlier
            assert hook(key="k1", fn=Fn()) is False and hook(key="k2", fn=object()) is False
        assert knobs.runtime.jit_cache_hook is earlier
        assert jit.count == 2 and jit.names == ["_gdpa_fwd", "?"] and seen == ["k1", "k2"]
    finally:
        knobs.runtime.jit_cache_hook = old
    with JitMisses() as jit:  # no earlier hook: the JIT is told to compile (None)
        assert knobs.runtime.jit_cache_hook(key="k3", fn=Fn()) is None
    assert jit.count == 1 and knobs.runtime.jit_cache_hook is old


def test_allocator_counts_merge_the_pinned_host_allocators(monkeypatch):
    """On CUDA the per-step allocator window counts the device allocator's cudaMalloc calls and the pinned host
    allocator's cudaHostAlloc calls and microseconds (torch.cuda.host_memory_stats); a torch without the host stats
    counts 0 for them; off CUDA there is nothing to count."""
    from gemray.bench import train as bt

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "num_alloc_retries": 1, "num_device_alloc": 7, "num_device_free": 2, "active.all.current": 99})
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {
        "num_host_alloc": 3, "host_alloc_time.total": 4500, "num_host_free": 0}, raising=False)
    got = bt._allocator_counts(torch.device("cuda", 0))
    assert got == {"alloc_retries": 1, "device_allocs": 7, "device_frees": 2, "host_allocs": 3, "host_alloc_us": 4500}
    monkeypatch.delattr(torch.cuda, "host_memory_stats")
    got = bt._allocator_counts(torch.device("cuda", 0))
    assert got["device_allocs"] == 7 and got["host_allocs"] == 0 and got["host_alloc_us"] == 0
    assert bt._allocator_counts(torch.device("cpu")) is None


def _steps_from(tokens_flops, extra_ms=None, **fields):
    """Records whose step time is exactly 0.9 ms per 1k tokens + 1.5 ms per TFLOP + 4 ms, plus extra_ms[i]."""
    extra_ms = extra_ms or {}
    return [{"step_s": (0.9 * t / 1e3 + 1.5 * f / 1e12 + 4.0 + extra_ms.get(i, 0.0)) / 1e3, "tokens": t, "flops": f,
             **{k: v[i] for k, v in fields.items()}} for i, (t, f) in enumerate(tokens_flops)]


def test_slow_steps_finds_the_steps_over_their_work_even_the_largest_batches():
    """Steps that pay a fixed ~20 ms on top of their work are found among batches whose sizes spread the step
    times more than that (the largest batch among them: the most leverage on a squares fit), each with its
    suspects; the rest define the fit, recovered exactly; local MFU without them is theirs alone."""
    import random

    from gemray.bench.train import _slow_steps_line, slow_steps

    rnd = random.Random(3)
    tf = [(t, t * (300 + rnd.uniform(-60, 60)) * 1e6) for t in (rnd.randint(110_000, 150_000) for _ in range(30))]
    tf[7] = (160_000, 160_000 * 330e6)  # the largest batch, and slow
    slow_at = {2: 25.0, 7: 23.0, 13: 28.0, 14: 22.0, 28: 26.0}  # on steps of ~180 ms: the threshold ~18 ms
    allocs = [1 if i in (7, 13) else 0 for i in range(30)]
    recs = _steps_from(tf, slow_at, device_allocs=allocs, jit_misses=[0] * 30)
    r = slow_steps(recs, peak=989e12)
    assert [s["index"] for s in r["steps"]] == sorted(slow_at)
    for s in r["steps"]:
        assert s["excess_ms"] == pytest.approx(slow_at[s["index"]], abs=1e-6)
        assert s["device_allocs"] == allocs[s["index"]] and s["jit_misses"] == 0
    assert r["fit_ms"] == pytest.approx({"per_1k_tokens": 0.9, "per_tflop": 1.5, "fixed": 4.0}, abs=1e-6)
    assert r["excess_ms"] == pytest.approx(sum(slow_at.values()), abs=1e-5)
    rest = [x for i, x in enumerate(recs) if i not in slow_at]
    assert r["local_mfu_without"] == pytest.approx(sum(x["flops"] for x in rest) / sum(x["step_s"] for x in rest)
                                                   / 989e12)
    line = _slow_steps_line(r, 30)
    assert "5 of 30" in line and "2 with cudaMalloc" in line and "0 with JIT misses" in line
    assert "steps 2, 7, 13, 14, 28" in line


def test_slow_steps_lists_none_on_steady_steps_and_needs_ten():
    """Steps their work explains (within a 5% jitter of the median step) are not slow; under 10 records there is
    nothing to fit; a step 20% of the median over its work is slow at the default 10%, not at 30%."""
    from gemray.bench.train import slow_steps

    tf = [(100_000 + 5_000 * i, (100_000 + 5_000 * i) * 300e6) for i in range(12)]
    jitter = {i: (-1) ** i * 0.05 * 100 for i in range(12)}  # +-5 ms on ~100-150 ms steps
    r = slow_steps(_steps_from(tf, jitter))
    assert r["steps"] == [] and r["local_mfu_without"] is None
    assert slow_steps(_steps_from(tf[:9])) is None
    import statistics

    median_ms = statistics.median(x["step_s"] for x in _steps_from(tf)) * 1e3
    recs = _steps_from(tf, {4: 0.2 * median_ms})
    assert [s["index"] for s in slow_steps(recs)["steps"]] == [4]
    assert slow_steps(recs, excess=0.3)["steps"] == []
