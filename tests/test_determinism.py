"""Run-to-run reproducibility of training (``train.deterministic``, ``gemray.train.trainer.apply_determinism``).

The same seed must give the same run: identical per-step losses and weights, with a validation pass between
epochs (evaluation leaves the model, the optimizers, the fused-optimizer step counts and the RNG as it found
them, so the steps after it are as reproducible as the ones before). Before ``train.deterministic`` two CPU
runs with several threads drifted apart in the first epoch (the position embedding's index backward adds in
thread order); on CUDA FBGEMM's TBE backward and the reference path's bias-bucket backward add with atomics.
GPU (@pytest.mark.gpu): the bias-bucket backward on CUDA is bit-reproducible.
"""

from __future__ import annotations

import pytest
import torch

from gemray.config import load_config
from model_utils import cpu_trainer
from paths import DATA

CONFIG = "configs/ml-latest-small.toml"


@pytest.fixture
def torch_state():
    """Leave the process's determinism flags and thread count as this test found them."""
    import torch.utils.deterministic as tud

    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             tud.fill_uninitialized_memory, torch.get_num_threads())
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    tud.fill_uninitialized_memory = saved[2]
    torch.set_num_threads(saved[3])


@pytest.fixture(scope="module")
def mls(tmp_path_factory):
    from gemray.pipelines.movielens import prepare_movielens

    src = DATA / "ml-latest-small"
    if not (src / "ratings.csv").is_file():
        pytest.skip(f"needs {src}")
    out = tmp_path_factory.mktemp("determ") / "mls"
    prepare_movielens(src, out)
    return out


def _train(prepared, *extra) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    """Two epochs of 6 steps in this process (world 1, gloo, CPU), validation after each: (per-step losses, every
    tensor of the model's and the optimizer's state at the end, the validation metrics)."""
    cfg = load_config(CONFIG, [f"data.prepared_dir={prepared}", "ray.use_gpu=false", "data.reader=arrow",
                               "train.epochs=2", "train.eval_every=1", "train.max_steps_per_epoch=6", *extra])
    with cpu_trainer(cfg) as tr:
        losses: list[float] = []
        tr.recorder.step = lambda *a, loss=None, **k: losses.append(loss)
        valid = []
        for epoch in range(cfg.train.epochs):
            tr.train_epoch(epoch)
            valid.append(tr.evaluate("valid"))
        state: dict[str, torch.Tensor] = {}

        def add(name, v):
            if isinstance(v, dict):
                for k, x in v.items():
                    add(f"{name}.{k}", x)
            elif hasattr(v, "local_shards"):  # a TorchRec ShardedTensor: this rank's rows
                state[name] = torch.cat([s.tensor.detach().reshape(-1) for s in v.local_shards()]).clone()
            elif isinstance(v, torch.Tensor):
                state[name] = v.detach().clone()

        add("model", tr.dmp.state_dict())
        add("optim", tr.optimizer.state_dict()["state"])
        return losses, state, valid


def test_training_is_bit_reproducible_across_validation(mls, torch_state):
    """Two identical runs with 4 CPU threads and validation after each epoch: every step's loss, every weight and
    optimizer moment, and the validation metrics are bit-identical (before train.deterministic the position
    embedding's multi-threaded index backward made the runs differ within the first epoch)."""
    torch.set_num_threads(4)
    a_loss, a_state, a_valid = _train(mls)
    b_loss, b_state, b_valid = _train(mls)
    assert len(a_loss) == 12 and a_loss == b_loss
    assert torch.are_deterministic_algorithms_enabled()  # Trainer.setup applied the default train.deterministic
    assert a_valid == b_valid
    assert a_state.keys() == b_state.keys() and len(a_state) > 10
    differing = [k for k in a_state if not torch.equal(a_state[k], b_state[k])]
    assert differing == []


def test_apply_determinism_sets_and_clears_the_flags(torch_state):
    import torch.utils.deterministic as tud

    from gemray.train.trainer import apply_determinism

    apply_determinism(True, torch.device("cpu"))
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert tud.fill_uninitialized_memory is False
    apply_determinism(False, torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()
    assert load_config(CONFIG).train.deterministic is True


def test_bucket_gather_gradient_equals_plain_indexing():
    """The CPU bincount backward and the index backward used on CUDA give the same gradient."""
    from gemray.ops import bucket_gather

    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 37, (5, 64, 64), generator=g)
    up = torch.randn(5, 64, 64, generator=g, dtype=torch.float64)
    (bucket_gather(w, idx) * up).sum().backward()
    ours = w.grad.clone()
    w.grad = None
    (w[idx] * up).sum().backward()
    torch.testing.assert_close(ours, w.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bucket_gather_backward_is_bit_reproducible():
    """The reference path's relative-bias buckets on CUDA: 5 backward passes over 2M indices into 128 buckets give
    the same d weights bit for bit (CUDA's weighted bincount, used before, adds with float atomics)."""
    from gemray.ops import bucket_gather

    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, 128, (32, 256, 256), device="cuda", generator=g)
    up = torch.randn(32, 256, 256, device="cuda", generator=g)
    grads = []
    for _ in range(5):
        w = torch.zeros(128, device="cuda", requires_grad=True)
        (bucket_gather(w, idx) * up).sum().backward()
        grads.append(w.grad)
    assert all(torch.equal(grads[0], x) for x in grads[1:])
