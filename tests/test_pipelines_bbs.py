"""Base batch shuffling: permutation property, balance on real MovieLens lengths, the plan, imbalance."""

from __future__ import annotations


import numpy as np
import pytest
from paths import DATA

from gemray.pipelines import prepare_movielens
from gemray.pipelines.bbs import form_batches, imbalance, plan_epoch, simulate_imbalance



def test_hand_example():
    tokens = np.array([1, 9, 2, 8, 3, 7, 4, 6])
    batches = form_batches(tokens, batch_size=4, sub_batch_size=2)
    # sorted 9 8 7 6 4 3 2 1 -> sub-batches [9 8] [7 6] [4 3] [2 1]; heaviest with lightest
    assert [sorted(tokens[b].tolist()) for b in batches] == [[1, 2, 8, 9], [3, 4, 6, 7]]
    assert [int(tokens[b].sum()) for b in batches] == [20, 20]
    # consecutive batches of sorted input are as bad as it gets; BBS fixes them
    srt = np.array([9, 8, 7, 6, 4, 3, 2, 1])
    assert [int(srt[b].sum()) for b in form_batches(srt, 4, 2)] == [20, 20]


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 64, 100, 257])
@pytest.mark.parametrize("use_rng", [False, True])
def test_every_index_exactly_once(size, use_rng):
    rng = np.random.default_rng(size)
    tokens = rng.integers(1, 300, size=size)
    batches = form_batches(tokens, 32, 8, np.random.default_rng(1) if use_rng else None)
    assert len(batches) == -(-size // 32)
    allidx = np.concatenate(batches) if batches else np.empty(0, np.int64)
    assert sorted(allidx.tolist()) == list(range(size))
    sizes = [b.size for b in batches]
    assert all(s == 32 for s in sizes[:-1]) and (not sizes or sizes[-1] == (size % 32 or 32))
    assert all(b.dtype == np.int64 for b in batches)


def test_deterministic_without_rng_and_tie_break_with_rng():
    tokens = np.array([5] * 16)
    assert all(np.array_equal(a, b) for a, b in zip(form_batches(tokens, 8, 4), form_batches(tokens, 8, 4)))
    a = form_batches(tokens, 8, 4, np.random.default_rng(0))
    b = form_batches(tokens, 8, 4, np.random.default_rng(1))
    assert not all(np.array_equal(x, y) for x, y in zip(a, b))


def test_form_batches_errors():
    with pytest.raises(ValueError, match="multiple of sub_batch_size"):
        form_batches(np.arange(10), 10, 4)
    with pytest.raises(ValueError):
        form_batches(np.arange(10), 0, 4)
    with pytest.raises(ValueError, match="1-D"):
        form_batches(np.ones((2, 2)), 2, 1)


def test_balance_on_skewed_lengths():
    lengths = np.random.default_rng(0).lognormal(4.0, 0.8, size=4096).astype(np.int64) + 1
    spread = {}
    for bbs in (False, True):
        if bbs:
            batches = form_batches(lengths, 128, 16, np.random.default_rng(0))
        else:
            batches = [np.arange(k, k + 128) for k in range(0, 4096, 128)]
        totals = np.array([lengths[b].sum() for b in batches], dtype=float)
        spread[bbs] = totals.max() / totals.mean()
    print(f"\nmax/mean batch tokens in one 4096-sample window: random {spread[False]:.3f}, BBS {spread[True]:.3f}")
    assert spread[True] < 1.05 < spread[False]


def test_imbalance_values():
    assert imbalance(np.array([[1, 1], [1, 3]])) == pytest.approx((1.0 + 1.5) / 2)
    assert imbalance(np.array([[0, 0], [2, 2], [4, 0]])) == pytest.approx((1.0 + 2.0) / 2)  # idle step skipped
    assert imbalance(np.zeros((3, 2))) == 1.0
    with pytest.raises(ValueError, match="steps, world_size"):
        imbalance(np.ones(3))
    with pytest.raises(ValueError, match="negative"):
        imbalance(np.array([[1, -1]]))


def test_plan_epoch_covers_pads_and_is_seeded():
    lengths = np.random.default_rng(3).integers(1, 50, size=70)
    kw = dict(batch_size=16, bbs=True, sub_batch_size=4, window_batches=2, shuffle=True, seed=7)
    plan = plan_epoch(lengths, num_batches=7, epoch=0, rank=1, **kw)
    assert len(plan) == 7 and [b.size for b in plan[-3:]] == [6, 0, 0]  # 70 = 4*16 + 6, then 2 empty
    assert sorted(np.concatenate(plan).tolist()) == list(range(70))
    again = plan_epoch(lengths, num_batches=7, epoch=0, rank=1, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(plan, again))
    other = plan_epoch(lengths, num_batches=7, epoch=1, rank=1, **kw)
    assert not all(np.array_equal(a, b) for a, b in zip(plan, other))
    plain = plan_epoch(lengths, num_batches=5, epoch=0, rank=0, **{**kw, "bbs": False, "shuffle": False})
    assert [b.tolist() for b in plain] == [list(range(k, min(k + 16, 70))) for k in range(0, 70, 16)]
    with pytest.raises(ValueError, match="more than num_batches"):
        plan_epoch(lengths, num_batches=4, epoch=0, rank=0, **kw)
    assert [b.size for b in plan_epoch(np.empty(0), num_batches=2, epoch=0, rank=0, **kw)] == [0, 0]


@pytest.mark.parametrize("fmt", ["ml-100k", "ml-latest-small"])
def test_bbs_reduces_cross_rank_imbalance_on_real_lengths(fmt, tmp_path):
    out = tmp_path / fmt
    prepare_movielens(DATA / fmt, out, num_files=8)
    kw = dict(world_size=2, batch_size=32, max_seq_len=200, sub_batch_size=8)
    res = {bbs: [simulate_imbalance(out, bbs=bbs, seed=0, epoch=e, **kw) for e in range(3)] for bbs in (False, True)}
    mean = {bbs: float(np.mean([r["imbalance"] for r in rs])) for bbs, rs in res.items()}
    print(f"\n{fmt} train, world 2, batch 32, sub 8, 3 epochs: imbalance "
          f"without BBS {mean[False]:.4f}, with BBS {mean[True]:.4f}")
    assert res[True][0]["steps"] == res[False][0]["steps"] > 5
    assert res[True][0]["tokens_per_step_mean"] == pytest.approx(res[False][0]["tokens_per_step_mean"])
    assert 1.0 <= mean[True] < mean[False]
    # valid/test are never BBS'd: the bbs flag does not change them
    v = [simulate_imbalance(out, split="valid", bbs=b, **kw)["imbalance"] for b in (False, True)]
    assert v[0] == v[1]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_simulate_imbalance_replays_the_training_plan(world, tmp_path):
    """simulate_imbalance (``gemray bench bbs``) reports the plan training runs: the train stream's samples, the
    epoch's global order and plan_global_step step by step, the last, partial step included (it replayed the
    older per-rank plan_epoch, whose steps and figures training no longer had)."""
    from gemray.pipelines.bbs import global_epoch_order, plan_global_step
    from gemray.pipelines.stream import ElasticTrainStream, HistoryStream

    out = tmp_path / "prep"
    prepare_movielens(DATA / "ml-latest-small", out, num_files=4)  # 610 users
    kw = dict(batch_size=48, max_seq_len=50, sub_batch_size=8, bbs=True, seed=3, epoch=1)
    base = HistoryStream(out, "train", rank=0, world_size=1, batch_size=48, max_seq_len=50, sub_batch_size=8,
                         seed=3, reader="arrow")
    stream = ElasticTrainStream(base, rank=0, world_size=world)  # what every rank of the run plans from
    d = base._load()
    lengths = d["stop"] - d["start"]
    order = global_epoch_order(lengths.size, seed=3, epoch=1, shuffle=True)
    consumed, rows = 0, []
    while consumed < lengths.size:
        parts, consumed = plan_global_step(order, lengths, consumed=consumed, world_size=world, batch_size=48,
                                           bbs=True, sub_batch_size=8, seed=3, epoch=1)
        rows.append([int(lengths[p].sum()) for p in parts])
    tokens = np.array(rows)
    assert [int(b.num_tokens) for b, _ in stream.iter_epoch(1)] == tokens[:, 0].tolist()  # rank 0 trains these
    r = simulate_imbalance(out, world_size=world, **kw)
    assert r["steps"] == len(rows) == stream.num_steps()
    assert r["imbalance"] == pytest.approx(imbalance(tokens))
    assert r["last_step_imbalance"] == pytest.approx(imbalance(tokens[-1:])) and r["last_step_imbalance"] < 1.2
    assert r["tokens_per_step_mean"] == pytest.approx(tokens.mean())
