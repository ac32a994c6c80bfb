"""train.compile (gemray.parallel.compile): the HSTU blocks, the retrieval head and the candidate tower compiled one by
one, with dynamic shapes, on a tiny three-task GEM (retrieval + CTR + CVR, side features, context, candidates) on the
Triton attention path (the interpreter here, TRITON_INTERPRET=1; backend aot_eager: no C++ codegen on the 2-core box,
inductor on the GPU). Steps of different lengths (T, B and C change every step, an empty history included) give the
eager model's loss and gradients within float tolerance, no graph break anywhere in the compiled modules, and a
bounded number of compiled graphs (one per module kind, not one per batch). The retrieval head (with the states'
projection traced into it) likewise for each negatives mode and kernel, its host ints going symbolic. The
activation-checkpointing "torch" mode and train.compile share the one compile path; the config refuses an unknown
backend.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model_utils import tiny_cfg  # noqa: E402

from gemray.jagged import JaggedBatch, lengths_to_offsets  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
NUM_ITEMS = 30
# (history lengths, candidates per request) of the steps: T, B and C all change; an empty history; a 1-token one
STEPS = [([3, 5], [2, 3]), ([7, 0, 4], [1, 2, 2]), ([1, 6, 2, 9], [3, 0, 1, 2]), ([4, 4], [1, 1])]


def _cfg(**kw):
    return tiny_cfg(attention_backend="triton", tasks=["retrieval", "ctr", "cvr"], token_features=["category"],
                    candidate_features=["category"], context_features=["hour"], negatives="uniform_shared",
                    model_dim=16, **kw)


def _batch(lengths, cands, seed):
    g = torch.Generator().manual_seed(100 + seed)
    off, coff = lengths_to_offsets(torch.tensor(lengths)), lengths_to_offsets(torch.tensor(cands))
    T, B, C = int(off[-1]), len(lengths), int(coff[-1])
    click = (torch.rand(C, generator=g) < 0.5).float()
    return JaggedBatch(
        user_ids=torch.arange(B), offsets=off, item_ids=torch.randint(1, NUM_ITEMS + 1, (T,), generator=g),
        ratings=torch.randint(1, 11, (T,), generator=g),
        timestamps=torch.cumsum(torch.randint(0, 10 ** 5, (T,), generator=g), 0),
        features={"category": torch.randint(1, 6, (T,), generator=g)},
        context={"hour": torch.randint(1, 25, (B,), generator=g)}, candidate_offsets=coff,
        candidate_ids=torch.randint(1, NUM_ITEMS + 1, (C,), generator=g),
        labels=torch.stack([click, click * (torch.rand(C, generator=g) < 0.5).float()], 1)).validate()


def _gem(cfg):
    from gemray.model.gem import GEM

    item_cat = torch.randint(1, 6, (NUM_ITEMS + 1,), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    return GEM(cfg, NUM_ITEMS, max_seq_len=16, cardinalities={"category": 5, "hour": 24},
               item_features={"category": item_cat})


def _counting_aot_eager(graphs: list):
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


def _assert_step_matches(eager, comp, batch, stat_keys) -> None:
    """One step of the compiled model ``comp`` gives the eager model's loss, the stats ``stat_keys`` and every
    parameter's gradient (None where eager's is None), within float tolerance."""
    le, st_e = eager(batch)
    lc, st_c = comp(batch)
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    for k in stat_keys:
        torch.testing.assert_close(st_c[k], st_e[k], rtol=1e-5, atol=1e-6)
    ge = torch.autograd.grad(le, [p for p in eager.parameters() if p.requires_grad], allow_unused=True)
    gc = torch.autograd.grad(lc, [p for p in comp.parameters() if p.requires_grad], allow_unused=True)
    for (n, _), a, b in zip([(n, p) for n, p in comp.named_parameters() if p.requires_grad], gc, ge):
        if a is None or b is None:
            assert a is None and b is None, n
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.skipif(not INTERPRET, reason="CPU test: the Triton interpreter (TRITON_INTERPRET=1)")
def test_compiled_gem_matches_eager_with_bounded_graphs_and_no_breaks():
    import torch._dynamo
    from torch._dynamo.utils import counters

    from gemray.parallel.compile import compile_dense_modules, is_compiled

    cfg = _cfg()
    eager, comp = _gem(cfg), _gem(cfg)
    graphs: list = []
    torch._dynamo.reset()
    counters.clear()
    names = compile_dense_modules(comp, backend=_counting_aot_eager(graphs))
    assert names == ["encoder.input_scale", "encoder.output_norm", "encoder.blocks.0", "encoder.blocks.1", "head",
                     "tower"]
    assert all(is_compiled(m) for m in (*comp.encoder.blocks, comp.encoder.input_scale, comp.encoder.output_norm,
                                        comp.head, comp.tower)) and not is_compiled(comp.encoder)
    assert compile_dense_modules(comp, backend="aot_eager") == []  # idempotent: nothing compiled twice
    for i, (lengths, cands) in enumerate(STEPS):
        batch = _batch(lengths, cands, i)
        eager.seed_sampling(i)
        comp.seed_sampling(i)
        _assert_step_matches(eager, comp, batch, ("loss_ctr", "loss_cvr", "count_ctr", "count_cvr", "num_targets"))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # per module kind (the blocks share theirs: same code, parameters inlined; input scale, output norm, retrieval
    # head and tower one each) a static graph for the first batch and a dynamic one from the second
    # (train.compile_dynamic = "auto"), at most one more each for a size dynamo specialises (0 / 1): not one per
    # batch -- 4 steps of new T, B and C would be 20 (measured: 11, the head's 2 of them)
    assert 10 <= len(graphs) <= 15, [g.code[:200] for g in graphs]
    assert counters["frames"]["total"] == counters["frames"]["ok"] <= len(graphs), dict(counters["frames"])


def test_torch_checkpointing_mode_and_train_compile_share_one_compile():
    import torch._functorch.config as fconfig

    from gemray.parallel.activation_checkpoint import ActivationCheckpointer
    from gemray.parallel.compile import compile_dense_modules

    model = _gem(_cfg())
    old = fconfig.activation_memory_budget
    try:
        ActivationCheckpointer("torch", 0.5, compile_backend="aot_eager").setup(model)
        assert all(b._compiled_call_impl is not None for b in model.encoder.blocks)
        assert model.tower._compiled_call_impl is None
        impls = [b._compiled_call_impl for b in model.encoder.blocks]
        # the blocks are not compiled again
        assert compile_dense_modules(model, backend="aot_eager") == ["head", "tower"]
        assert [b._compiled_call_impl for b in model.encoder.blocks] == impls
        with pytest.raises(ValueError, match="compile_backend"):
            compile_dense_modules(_gem(_cfg()), backend="tensorrt")
        with pytest.raises(ValueError, match="compile_dynamic"):
            compile_dense_modules(_gem(_cfg()), backend="aot_eager", dynamic="sometimes")
        with pytest.raises(ValueError, match="compile_mode"):
            compile_dense_modules(_gem(_cfg()), backend="aot_eager", mode="reduce-overhead")
    finally:
        fconfig.activation_memory_budget = old


def test_trainer_compiles_per_config_and_logs_the_choice(caplog):
    import logging

    from gemray.config import JobConfig
    from gemray.train.trainer import Trainer

    enc = ["encoder.input_scale", "encoder.output_norm", "encoder.blocks.0", "encoder.blocks.1"]
    for on, tower, want in ((False, True, []), (True, False, enc + ["head"]), (True, True, enc + ["head", "tower"])):
        cfg = JobConfig()
        cfg.train.compile, cfg.train.compile_tower, cfg.train.compile_backend = on, tower, "aot_eager"
        cfg.validate()
        trainer = Trainer.__new__(Trainer)
        trainer.cfg, trainer.dmp = cfg, _gem(_cfg())
        with caplog.at_level(logging.INFO, logger="gemray"):
            assert trainer.compile_dense() == want
        assert "torch.compile" in caplog.text
    # the reference attention (the CPU's "auto"): compiled it graph-breaks and recompiles -- said in a WARNING
    for attn, warned in (("reference", True), ("triton", False)):
        cfg = JobConfig()
        cfg.train.compile, cfg.train.compile_backend, cfg.model.attention_backend = True, "aot_eager", attn
        trainer = Trainer.__new__(Trainer)
        trainer.cfg, trainer.dmp = cfg, _gem(_cfg())
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gemray"):
            trainer.compile_dense()
        hits = [r for r in caplog.records if r.levelno == logging.WARNING and "reference attention" in r.getMessage()]
        assert bool(hits) is warned, caplog.text
    cfg.train.compile_backend = "tvm"
    with pytest.raises(ValueError, match="train.compile_backend"):
        cfg.validate()


def test_compile_options_are_parsed_checked_and_passed_to_inductor(monkeypatch):
    """train.compile_options: "name=value" strings typed, unknown inductor names refused at validation; the
    compile passes them as torch.compile's options merged over compile_mode's (torch takes one or the other), and
    another backend gets neither (with the ineffective-settings warning)."""
    import torch._inductor

    from gemray.config import JobConfig, compile_options
    from gemray.parallel.compile import compile_dense_modules

    assert compile_options([]) == {}
    assert compile_options(["cpp_wrapper=true", "triton.enable_pdl = False", "max_autotune_gemm_backends=ATEN",
                            "coordinate_descent_search_radius=2"]) == {
        "cpp_wrapper": True, "triton.enable_pdl": False, "max_autotune_gemm_backends": "ATEN",
        "coordinate_descent_search_radius": 2}
    assert compile_options(["cpp_wrapper=1", "triton.enable_pdl=0"]) == {"cpp_wrapper": True, "triton.enable_pdl": False}
    for bad, why in ((["cpp_wrapper"], "name=value"), (["no_such_knob=1"], "has no option 'no_such_knob'"),
                     (["triton.nope=1"], "has no option 'triton.nope'"), (["cpp_wrapper=1", "cpp_wrapper=0"], "twice"),
                     (["cpp_wrapper=maybe"], "cpp_wrapper takes true or false"),
                     (["compile_threads=two"], "compile_threads takes an integer"),
                     (["triton=1"], "has no option 'triton'")):
        cfg = JobConfig()
        cfg.train.compile_options = bad
        with pytest.raises(ValueError, match=f"train.compile_options.*{why}"):
            cfg.validate()

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    model = _gem(_cfg())
    compile_dense_modules(model, mode="max-autotune-no-cudagraphs", options={"cpp_wrapper": True})
    want = {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), "cpp_wrapper": True}
    assert seen and all(kw == {"backend": "inductor", "dynamic": None, "options": want} for kw in seen)
    assert "mode" not in seen[0] and want["max_autotune"] is True
    seen.clear()
    compile_dense_modules(_gem(_cfg()), backend="aot_eager", mode="max-autotune-no-cudagraphs",
                          options={"cpp_wrapper": True})
    assert seen and all(kw == {"backend": "aot_eager", "dynamic": None} for kw in seen)
    # activation_checkpointing = "torch" compiles the blocks first (the trainer's order): with the same options
    import torch._functorch.config as fconfig

    from gemray.config import TrainConfig
    from gemray.parallel.activation_checkpoint import ActivationCheckpointer

    seen.clear()
    tc = TrainConfig(activation_checkpointing="torch", activation_memory_budget=0.5,
                     compile_mode="max-autotune-no-cudagraphs", compile_options=["cpp_wrapper=true"])
    old = fconfig.activation_memory_budget
    try:
        ActivationCheckpointer.from_config(tc).setup(_gem(_cfg()))
    finally:
        fconfig.activation_memory_budget = old
    assert len(seen) == 4 and all(kw["options"] == want for kw in seen)  # 2 HSTU blocks, input scale, norm

    cfg = JobConfig()
    cfg.train.compile, cfg.train.compile_backend = True, "aot_eager"
    cfg.train.compile_options = ["cpp_wrapper=true"]
    cfg.validate()
    assert "train.compile_options" in cfg.ineffective_settings_warning()
    cfg.train.compile_backend = "inductor"
    assert cfg.ineffective_settings_warning() is None
    cfg.train.compile = False
    assert "train.compile_options" in cfg.ineffective_settings_warning()
    cfg.train.activation_checkpointing, cfg.train.activation_memory_budget = "torch", 0.5
    assert cfg.ineffective_settings_warning() is None  # the blocks are compiled with them


def test_compile_options_are_parsed_once_per_process(monkeypatch):
    """train.compile_options is parsed once for the validation, the config rebuilt in a worker, the activation
    checkpointer and the trainer's compile (was: once for each), and every caller gets its own dict."""
    import gemray.config as config
    from gemray.parallel.activation_checkpoint import ActivationCheckpointer

    parsed = []
    real = config._option_value
    monkeypatch.setattr(config, "_option_value", lambda name, *a: parsed.append(name) or real(name, *a))
    config._parsed_compile_options.cache_clear()
    cfg = config.JobConfig()
    cfg.train.compile_options = ["cpp_wrapper=true", "triton.enable_pdl=false"]
    cfg.validate()
    worker = config.from_dict(cfg.to_dict())  # what train_loop_per_worker does
    ActivationCheckpointer.from_config(worker.train)
    first = config.compile_options(worker.train.compile_options)
    assert parsed == ["cpp_wrapper", "triton.enable_pdl"]
    first["cpp_wrapper"] = False  # a caller's change stays its own
    assert config.compile_options(worker.train.compile_options) == {"cpp_wrapper": True, "triton.enable_pdl": False}
    cfg.train.compile_options = ["cpp_wrapper=maybe"]
    for _ in range(2):  # an error is raised every time, never cached as a result
        with pytest.raises(ValueError, match="train.compile_options: cpp_wrapper takes true or false"):
            cfg.validate()


def test_deferred_losses_are_read_together_checked_and_counted_in_order():
    """The CUDA path of Trainer.train_step keeps each loss on the device; flush_losses reads the pending ones at
    once, adds them to the epoch statistics in step order with their step events, and stops at the first NaN
    naming its global step (here on CPU tensors: the same code)."""
    from gemray.train.stats import EpochStats
    from gemray.train.trainer import Trainer

    events = []

    class Recorder:
        def step(self, global_step, epoch, consumed, loss=None, lr=None):
            events.append((global_step, loss, lr))

    t = Trainer.__new__(Trainer)
    t.device, t.stats, t.recorder = torch.device("cpu"), EpochStats(), Recorder()
    t._pending = [(torch.tensor(2.0), 4.0, 10, 2, 1e6, 0.1, 7, 0, 2, 5e-4),
                  (torch.tensor(1.0), 2.0, 6, 2, 1e6, 0.1, 8, 0, 4, 1e-3)]
    assert t.flush_losses() == 1.0 and t._pending == [] and t.flush_losses() is None
    assert events == [(8, 2.0, 5e-4), (9, 1.0, 1e-3)]
    assert t.stats.loss_sum == 2.0 * 4 + 1.0 * 2 and t.stats.tokens == [10, 6]
    t._pending = [(torch.tensor(3.0), 1.0, 1, 1, 0.0, None, 9, 0, 5, 1e-3),
                  (torch.tensor(float("nan")), 1.0, 1, 1, 0.0, None, 10, 0, 6, 1e-3)]
    with pytest.raises(FloatingPointError, match="training loss is nan.*global step 11 is the first"):
        t.flush_losses()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (compiled Triton)")
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_training_step_of_gemray_code_makes_no_host_sync(compiled):
    """A three-task GEM step on CUDA (Triton attention, bf16 autocast, a pinned batch moved by JaggedBatch.to with
    non_blocking: host shape attached), eager and with train.compile (inductor): under torch.cuda.set_sync_debug_mode("warn") no
    synchronisation is raised from gemray's own code (model, ops, kernels, jagged). Syncs inside other libraries
    (plain TorchRec EmbeddingCollection here, not the sharded one training uses) are printed, not failed."""
    import traceback
    import warnings

    from gemray.train.precision import autocast

    model = _gem(_cfg()).cuda()
    if compiled:
        from gemray.parallel.compile import compile_dense_modules

        compile_dense_modules(model, backend="inductor")
    dev = torch.device("cuda")

    def step(i):  # the batch pinned and copied without blocking, as the training loop moves its batches
        batch = _batch(*STEPS[i % len(STEPS)], i).pin_memory().to(dev, non_blocking=True)
        model.seed_sampling(i)
        with autocast("bf16", dev):
            loss, _ = model(batch)
        loss.backward()

    for i in range(len(STEPS)):  # compiles (and copies the item features once)
        step(i)
    torch.cuda.synchronize()
    ours, others = [], []

    def record(message, category, filename, lineno, file=None, line=None):
        # the site is the Python frame that called into torch: ours when that frame is gemray's own code
        own = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()[:-1]
               if "/gemray/" in f.filename or "/kernels/" in f.filename]
        mine = "/gemray/" in str(filename) or "/kernels/" in str(filename)
        (ours if mine else others).append((f"{filename}:{lineno}", own[-1:], str(message)[:120]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print("syncs outside gemray:", others)
    assert not ours, ours


# -- the retrieval head (and the states' projection it applies) compiled -----------------------------------------
# lengths of the steps: T, B and M = sum(max(L - 1, 0)) (the head's host ints max_len / num_next) change; empty and
# 1-token histories; a batch where no position has a next item (M = 0: the head's zero-loss branch)
HEAD_STEPS = [[3, 0, 5, 1], [7, 1, 4], [1, 6, 2, 9, 0], [4, 4], [1, 0], [2, 3, 8, 1, 1]]


def _retrieval_cfg(negatives="uniform_shared", kernel="triton"):
    """Retrieval only, model_dim 24 != embedding_dim 16: GEM has a retrieval_proj (traced into the compiled head)."""
    return tiny_cfg(attention_backend="triton", tasks=["retrieval"], negatives=negatives, retrieval_kernel=kernel,
                    model_dim=24)


def _retrieval_batch(lengths, seed):
    g = torch.Generator().manual_seed(200 + seed)
    off = lengths_to_offsets(torch.tensor(lengths))
    T = int(off[-1])
    return JaggedBatch(user_ids=torch.arange(len(lengths)), offsets=off,
                       item_ids=torch.randint(1, NUM_ITEMS + 1, (T,), generator=g),
                       ratings=torch.randint(1, 11, (T,), generator=g),
                       timestamps=torch.cumsum(torch.randint(0, 10 ** 5, (T,), generator=g), 0)).validate()


def _head_graph(gm) -> bool:
    """Whether a compiled graph is the retrieval head's (its item-embedding input; no other module takes one)."""
    return any(n.op == "placeholder" and "item_emb" in n.name for n in gm.graph.nodes)


def test_compile_targets_include_the_retrieval_head_and_keep_the_state_dict_keys():
    from gemray.model.gem import GEM
    from gemray.parallel.compile import compile_dense_modules, compile_targets, is_compiled

    torch.manual_seed(0)
    model = GEM(_retrieval_cfg(), NUM_ITEMS, max_seq_len=16)
    keys = list(model.state_dict().keys())
    assert "retrieval_proj.weight" in keys and "retrieval_proj.bias" in keys
    targets = compile_targets(model)
    assert "head" in targets and targets["head"] is model.head
    assert "head" not in compile_targets(model, head=False)
    # activation_checkpointing "torch" compiles the encoder's modules only; train.compile then adds the head
    assert "head" not in compile_dense_modules(model, backend="aot_eager", tower=False, head=False)
    assert compile_dense_modules(model, backend="aot_eager") == ["head"] and is_compiled(model.head)
    assert list(model.state_dict().keys()) == keys  # Module.compile() in place: no "_orig_mod." keys
    # the three-task model: the head before the tower
    assert list(compile_targets(_gem(_cfg()))) == ["encoder.input_scale", "encoder.output_norm", "encoder.blocks.0",
                                                    "encoder.blocks.1", "head", "tower"]


@pytest.mark.skipif(not INTERPRET, reason="CPU test: the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("negatives,kernel", [("uniform_shared", "triton"), ("uniform_shared", "reference"),
                                              ("uniform", "reference"), ("in_batch", "reference")])
def test_compiled_retrieval_head_matches_eager_with_bounded_recompiles(negatives, kernel):
    """The compiled GEM (head + retrieval_proj traced into it) gives the eager loss, stats and gradients over steps of
    different lengths, without a graph break (but "in_batch"'s eager draw), and the head compiles a bounded number
    of graphs: the changing host ints max_len / num_next do not recompile per batch."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from gemray.model.gem import GEM
    from gemray.parallel.compile import compile_dense_modules

    cfg = _retrieval_cfg(negatives, kernel)
    torch.manual_seed(0)
    eager = GEM(cfg, NUM_ITEMS, max_seq_len=16)
    torch.manual_seed(0)
    comp = GEM(cfg, NUM_ITEMS, max_seq_len=16)
    graphs: list = []
    torch._dynamo.reset()
    counters.clear()
    assert "head" in compile_dense_modules(comp, backend=_counting_aot_eager(graphs))
    for i, lengths in enumerate(HEAD_STEPS):
        batch = _retrieval_batch(lengths, i)
        eager.seed_sampling(i)
        comp.seed_sampling(i)
        _assert_step_matches(eager, comp, batch, ("num_targets", "pos_logit"))
    head = [g for g in graphs if _head_graph(g)]
    breaks = sum(counters["graph_break"].values())
    print(f"{negatives}/{kernel}: {len(head)} head graphs of {len(graphs)}, {breaks} graph breaks")
    assert head, "the head was not compiled"
    inputs = [{n.name for n in g.graph.nodes if n.op == "placeholder"} for g in head]
    assert all("l_proj_parameters_weight_" in i for i in inputs), inputs  # retrieval_proj traced into the head
    assert any("l_num_next_" in i for i in inputs), inputs  # the host int went symbolic (not one graph per value)
    if negatives == "uniform_shared" and kernel == "triton":  # the kernel's custom op, one node of the graph
        assert any("gemray.sampled_softmax_lse" in str(n.target) for g in head for n in g.graph.nodes)
    # measured 3 over the 6 steps: a static graph for the first step, one with symbolic sizes and host ints
    # (max_len, num_next) from the second, one for the M == 0 branch (the step [1, 0]) -- not one per step
    # ("in_batch": its eager draw splits the head; the graphs counted here are the parts before it)
    assert len(head) <= 3, [sorted(i) for i in inputs]
    if negatives != "in_batch":
        assert breaks == 0, "\n\n".join(k[:300] + f" x{v}" for k, v in counters["graph_break"].items())
