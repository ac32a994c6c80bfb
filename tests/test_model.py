"""GEM end to end on CPU: features KJT, embeddings, forward/backward, empty batches, overfitting, meta build."""

import math

import pytest
import torch

from gemray.jagged import JaggedBatch
from gemray.kernels.reference import time_bucket_ref
from gemray.model import GEM, feature_names, make_embedding_collection, sparse_features
from gemray.model.features import time_gap_buckets
from gemray.model.heads import next_item_index
from model_utils import random_batch, tiny_cfg


def test_sparse_features_content():
    cfg = tiny_cfg()
    b = JaggedBatch(user_ids=torch.tensor([5, 6, 7]), offsets=torch.tensor([0, 2, 2, 5]),
                    item_ids=torch.tensor([7, 3, 9, 9, 1]), ratings=torch.tensor([8, 10, 2, 4, 6]),
                    timestamps=torch.tensor([100, 102, 50, 50, 1050]))
    neg = torch.tensor([[11, 12], [13, 14], [15, 16]])
    kjt = sparse_features(b, neg_ids=neg, cfg=cfg)
    assert kjt.keys() == ["item_id", "neg_item_id", "rating", "time_gap"] == feature_names(cfg)
    d = kjt.to_dict()
    assert d["item_id"].values().tolist() == [7, 3, 9, 9, 1]
    assert d["item_id"].lengths().tolist() == [2, 0, 3]
    assert d["neg_item_id"].values().tolist() == [11, 12, 13, 14, 15, 16]
    assert d["neg_item_id"].lengths().tolist() == [2, 2, 2]
    assert d["rating"].values().tolist() == [8, 10, 2, 4, 6]
    # gaps: seq0: first -> 0, 2 s -> 1 + floor(ln 2 / 0.301) = 3; seq2: first 0, 0 s -> 1 + 0 = 1,
    # 1000 s -> 1 + floor(ln 1000 / 0.301) = 1 + 22 = 23
    assert d["time_gap"].values().tolist() == [0, 3, 0, 1, 23]
    assert int(math.log(1000) / 0.301) == 22
    # without negatives / features
    kjt2 = sparse_features(b, neg_ids=None, cfg=tiny_cfg(use_rating_feature=False, use_time_feature=False))
    assert kjt2.keys() == ["item_id", "neg_item_id"]
    assert kjt2.to_dict()["neg_item_id"].lengths().tolist() == [0, 0, 0]


def test_sparse_features_errors_and_empty():
    cfg = tiny_cfg()
    b = random_batch([2, 1])
    with pytest.raises(ValueError, match="ratings"):
        sparse_features(b.with_(ratings=torch.tensor([1, 11, 3])), neg_ids=None, cfg=cfg)
    with pytest.raises(ValueError, match="neg_ids"):
        sparse_features(b, neg_ids=torch.ones(3, 2, dtype=torch.int64), cfg=cfg)
    with pytest.raises(ValueError, match="timestamps"):
        time_gap_buckets(torch.tensor([5, 3]), torch.tensor([0, 2]), 32)
    kjt = sparse_features(random_batch([]), neg_ids=None, cfg=cfg)
    assert kjt.stride() == 1 and kjt.values().numel() == 0
    assert time_gap_buckets(torch.tensor([10 ** 12, 0]), torch.tensor([0, 1, 2]), 32).tolist() == [0, 0]
    assert int(time_bucket_ref(torch.tensor([10 ** 12]), 31)) == 30


def test_embedding_collection_tables_and_meta():
    cfg = tiny_cfg()
    ec = make_embedding_collection(cfg, 40, "cpu")
    w = ec.embeddings["item"].weight
    assert w.shape == (41, 16)
    assert 0.01 < float(w.detach().std()) < 0.03 and float(w.detach().abs().max()) <= 0.02 * math.sqrt(3) + 1e-6
    assert ec.embeddings["rating"].weight.shape == (11, 16)
    assert ec.embeddings["time_gap"].weight.shape == (32, 16)
    meta = make_embedding_collection(cfg, 40, "meta")
    assert meta.embeddings["item"].weight.device.type == "meta"
    with pytest.raises(ValueError, match="num_items"):
        make_embedding_collection(cfg, 0)


@pytest.mark.parametrize("negatives", ["uniform", "uniform_shared", "in_batch"])
def test_gem_forward_backward(negatives):
    torch.manual_seed(0)
    model = GEM(tiny_cfg(negatives=negatives), num_items=40, max_seq_len=12)
    batch = random_batch([3, 0, 1, 12, 5, 2])
    loss, stats = model(batch, generator=torch.Generator().manual_seed(0))
    # positions with a next item: 2 + 0 + 0 + 11 + 4 + 1 = 18
    assert float(stats["num_targets"]) == 18 == next_item_index(batch.offsets).numel()
    assert loss.dim() == 0 and torch.isfinite(loss)
    # chance level is ~ln(1 + 8) for 8 negatives at init (cosines ~ 0)
    assert abs(float(loss.detach()) - math.log(9)) < 1.5
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert model.embeddings.embeddings["item"].weight.grad.abs().sum() > 0
    assert model.encoder.blocks[0].rel_bias.ts_w.grad.abs().sum() > 0


@pytest.mark.parametrize("negatives", ["uniform", "uniform_shared", "in_batch"])
@pytest.mark.parametrize("lengths", [[], [1, 1, 0], [0]])
def test_gem_batches_without_targets_keep_graph(lengths, negatives):
    model = GEM(tiny_cfg(negatives=negatives), num_items=40, max_seq_len=12)
    loss, stats = model(random_batch(lengths))
    assert float(loss.detach()) == 0.0 and float(stats["num_targets"]) == 0
    assert loss.grad_fn is not None
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_negative_sampling_is_seeded():
    model = GEM(tiny_cfg(dropout=0.0), num_items=40, max_seq_len=12)
    batch = random_batch([4, 6])
    l1, _ = model(batch, generator=torch.Generator().manual_seed(3))
    l2, _ = model(batch, generator=torch.Generator().manual_seed(3))
    l3, _ = model(batch, generator=torch.Generator().manual_seed(4))
    assert float(l1.detach()) == float(l2.detach()) and float(l1.detach()) != float(l3.detach())
    model.seed_sampling(7)
    a, _ = model(batch)
    model.seed_sampling(7)
    b, _ = model(batch)
    assert float(a.detach()) == float(b.detach())


def test_user_and_item_embeddings():
    model = GEM(tiny_cfg(), num_items=40, max_seq_len=12).eval()
    batch = random_batch([3, 0, 1, 12], targets=True)
    with torch.no_grad():
        users = model.user_embeddings(batch)
        items = model.item_embeddings(torch.arange(1, 41))
    assert users.shape == (4, 16) and items.shape == (40, 16)
    assert torch.allclose(items.norm(dim=-1), torch.ones(40), atol=1e-5)
    assert torch.allclose(users.norm(dim=-1), torch.tensor([1.0, 0.0, 1.0, 1.0]), atol=1e-5)
    # the last state of sequence 0 depends only on sequence 0
    alone = model.user_embeddings(random_batch([3], targets=True).with_(
        item_ids=batch.item_ids[:3], ratings=batch.ratings[:3], timestamps=batch.timestamps[:3]))
    torch.testing.assert_close(alone[0], users[0], rtol=1e-5, atol=1e-6)
    raw = model.embeddings.embeddings["item"].weight[5]
    torch.testing.assert_close(items[4], raw / raw.norm())


@pytest.mark.parametrize("negatives", ["uniform", "uniform_shared", "in_batch"])
def test_overfits_tiny_problem(negatives):
    # 8 users whose histories follow item i -> i+1 (mod 20): the model must learn the successor rule.
    torch.manual_seed(0)
    cfg = tiny_cfg(negatives=negatives, num_negatives=16, embedding_dim=16)
    model = GEM(cfg, num_items=20, max_seq_len=10)
    lengths = [10, 7, 5, 10, 8, 3, 9, 6]
    starts = torch.arange(8) * 3
    items = torch.cat([(s + torch.arange(L)) % 20 + 1 for s, L in zip(starts, lengths)])
    batch = random_batch(lengths, num_items=20).with_(item_ids=items)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        loss, _ = model(batch, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0], losses[::10]
    # and it ranks each trained next item near the top: histories without their last item must
    # predict that last item (a target seen in training)
    model.eval()
    short = [L - 1 for L in lengths]
    keep = torch.cat([torch.arange(int(o), int(o) + L) for o, L in zip(batch.offsets[:-1], short)])
    trunc = random_batch(short, num_items=20).with_(item_ids=items[keep], ratings=batch.ratings[keep],
                                                     timestamps=batch.timestamps[keep])
    with torch.no_grad():
        scores = model.user_embeddings(trunc) @ model.item_embeddings(torch.arange(1, 21)).T
    succ = items[batch.offsets[1:] - 1]
    ranks = (scores > scores.gather(1, (succ - 1).view(-1, 1))).sum(1)
    assert float((ranks < 3).float().mean()) >= 0.75, ranks


def _params(model):
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("features", [True, False])
def test_meta_build_then_init_weights_equals_a_direct_build(features):
    """A model built on meta (nothing allocated, nothing drawn) and materialised with to_empty + init_weights
    gets exactly the parameters of a direct build with the same seed, and leaves the RNG where it does."""
    cfg = tiny_cfg(use_rating_feature=features, use_time_feature=features)
    torch.manual_seed(11)
    direct = GEM(cfg, num_items=40, device="cpu", max_seq_len=12)
    after_direct = torch.rand(3)
    state = torch.get_rng_state()
    meta = GEM(cfg, num_items=40, device="meta", max_seq_len=12)
    assert all(p.is_meta for p in meta.parameters())
    assert torch.equal(torch.get_rng_state(), state)  # a meta build draws nothing
    meta.to_empty(device="cpu")
    torch.manual_seed(11)
    meta.init_weights()
    assert torch.equal(torch.rand(3), after_direct)
    a, b = _params(direct), _params(meta)
    assert a.keys() == b.keys() and len(a) == len(list(direct.parameters()))
    assert not [n for n in a if not torch.equal(a[n], b[n])]
    # not trivially equal: another seed gives other values, and the tables are drawn as TorchRec does
    torch.manual_seed(12)
    meta.init_weights()
    assert not torch.equal(_params(meta)["encoder.pos_emb"], a["encoder.pos_emb"])
    item = b["embeddings.embeddings.item.weight"]
    assert float(item.abs().max()) <= 0.02 * math.sqrt(3) + 1e-7 and 0.01 < float(item.std()) < 0.03
    loss, _ = meta(random_batch([4, 3]))
    assert torch.isfinite(loss)


def test_init_weights_with_tables_left_on_meta_gives_the_direct_build_dense_part():
    """parallelize materialises only the dense part before TorchRec shards the tables: init_weights then skips
    the tables' draws without allocating them, so the encoder is the direct build's and the RNG ends where
    the direct build leaves it (TorchRec's shard initialisation draws next, as it did after a direct build)."""
    from gemray.parallel import materialize_dense

    cfg = tiny_cfg()
    torch.manual_seed(5)
    direct = GEM(cfg, num_items=40, device="cpu", max_seq_len=12)
    after = torch.get_rng_state()
    model = GEM(cfg, num_items=40, device="meta", max_seq_len=12)
    torch.manual_seed(5)
    materialize_dense(model, "cpu")
    assert torch.equal(torch.get_rng_state(), after)
    assert all(p.is_meta for p in model.embeddings.parameters())
    assert not any(p.is_meta for p in model.encoder.parameters())
    got, want = _params(model.encoder), _params(direct.encoder)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    blk = model.encoder.blocks[0]
    assert 0.01 < float(blk.uvqk_weight.detach().std()) < 0.03 and float(blk.uvqk_bias.detach().abs().sum()) == 0
    from gemray.model import init_embedding_tables

    with pytest.raises(ValueError, match="unsharded torchrec EmbeddingCollection"):
        init_embedding_tables(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("rows, dim", [(1, 4), (3, 5), (64, 16), (65, 16), (129, 3), (257, 8)])
def test_skipped_table_draws_are_the_construction_draws(rows, dim, monkeypatch):
    """Skipping a table's draws in chunks (a small chunk here, to cross chunk edges with every kind of
    remainder) leaves the CPU RNG exactly where building the table does."""
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from gemray.model import embeddings, skip_table_draws

    monkeypatch.setattr(embeddings, "SKIP_CHUNK", 64)
    cfg = EmbeddingConfig(name="t", num_embeddings=rows, embedding_dim=dim, feature_names=["f"],
                          weight_init_min=-0.03, weight_init_max=0.03)
    torch.manual_seed(9)
    EmbeddingCollection(tables=[cfg], device=torch.device("cpu"))
    built = torch.get_rng_state()
    torch.manual_seed(9)
    skip_table_draws(cfg, "cpu")
    assert torch.equal(torch.get_rng_state(), built)
    assert embeddings._chunk_sizes(rows * dim, 64) and sum(embeddings._chunk_sizes(rows * dim, 64)) == rows * dim


def test_bad_config_and_sequence_raise():
    with pytest.raises(ValueError, match="negatives"):
        GEM(tiny_cfg(negatives="random"), num_items=10)
    with pytest.raises(ValueError, match="attn_dropout"):
        GEM(tiny_cfg(attn_dropout=0.1), num_items=10)
    model = GEM(tiny_cfg(), num_items=40, max_seq_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(random_batch([5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_uniform_shared_loss_matches_loop(dtype):
    from gemray.model.heads import RetrievalHead

    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 3, 3, 4, 6])           # lengths 3, 0, 1, 2 -> next-item positions 0, 1, 4
    item_ids = torch.tensor([5, 6, 7, 8, 9, 5])
    states = torch.nn.functional.normalize(torch.randn(6, 4, generator=g, dtype=dtype), dim=-1)
    item_emb = torch.randn(6, 4, generator=g, dtype=dtype)
    neg_ids = torch.tensor([[6, 1], [2, 3], [4, 4], [5, 2]])   # seq 0 draws its own target 6; seq 3 draws 5
    neg_emb = torch.randn(8, 4, generator=g, dtype=dtype)
    head = RetrievalHead("uniform_shared", 2, temperature=0.5)
    loss, stats = head(states, offsets, item_ids, item_emb, neg_ids=neg_ids, neg_emb=neg_emb)
    e = torch.nn.functional.normalize(item_emb, dim=-1)
    en = torch.nn.functional.normalize(neg_emb, dim=-1).view(4, 2, 4)
    terms = []
    for t, b in [(0, 0), (1, 0), (4, 3)]:
        logits = [states[t] @ e[t + 1]]
        for r in range(2):
            if int(neg_ids[b, r]) != int(item_ids[t + 1]):
                logits.append(states[t] @ en[b, r])
        logits = torch.stack(logits) / 0.5
        terms.append(torch.logsumexp(logits, 0) - logits[0])
    # position 0 (target 6) drops negative 6; position 4 (target 5) drops negative 5
    torch.testing.assert_close(loss, torch.stack(terms).mean())
    assert float(stats["num_targets"]) == 3


def test_jagged_dense_bmm_matches_a_loop_forward_and_backward():
    from gemray.model.heads import _jagged_dense_bmm

    g = torch.Generator().manual_seed(3)
    lengths = [4, 0, 1, 7, 2]                          # empty, length 1 and the max (7) in one batch
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(sum(lengths), 5, generator=g, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(len(lengths), 5, 3, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as in training: the product stays float32
        out = _jagged_dense_bmm(x, offsets, y, max(lengths))
    assert out.dtype == torch.float32 and out.shape == (sum(lengths), 3)
    xr, yr = x.detach().float().requires_grad_(), y.detach().clone().requires_grad_()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ref = torch.stack([xr[t] @ yr[seg[t]] for t in range(sum(lengths))])
    torch.testing.assert_close(out, ref)
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad.float(), xr.grad, atol=2e-2, rtol=2e-2)  # x.grad rounds to bf16
    torch.testing.assert_close(y.grad, yr.grad)


@pytest.mark.parametrize("mode", ["next", "self"])
def test_time_bias_query_uses_target_time(mode):
    """HSTU's time bias is keyed by the time of the predicted item: at evaluation the user state at the last
    position must depend on the target's timestamp ("next") and must not with "self"."""
    torch.manual_seed(0)
    model = GEM(tiny_cfg(time_bias_query=mode, use_time_feature=False), num_items=40, max_seq_len=12).eval()
    with torch.no_grad():  # make the time bias matter: distinct weights per bucket
        for blk in model.encoder.blocks:
            blk.rel_bias.ts_w.copy_(torch.linspace(-3.0, 3.0, blk.rel_bias.ts_w.numel()))
    batch = random_batch([3, 5], targets=True)
    last = batch.timestamps[batch.offsets[1:] - 1]
    soon, late = last + 1, last + 10 ** 8
    with torch.no_grad():
        a = model.user_embeddings(batch.with_(target_timestamps=soon))
        b = model.user_embeddings(batch.with_(target_timestamps=late))
        c = model.user_embeddings(batch.with_(target_timestamps=soon))
    torch.testing.assert_close(a, c)
    if mode == "next":
        assert (a - b).abs().max() > 1e-3
    else:
        torch.testing.assert_close(a, b)


def test_time_bias_buckets_follow_query_times():
    from gemray import ops
    ts = torch.tensor([0, 10, 1000, 50])
    offsets = torch.tensor([0, 3, 4])
    tq = torch.tensor([10, 1000, 10 ** 6, 7])
    pb, tb_self = ops.relative_bias_buckets(ts, offsets, 3, 8, 64, 12)
    _, tb_next = ops.relative_bias_buckets(ts, offsets, 3, 8, 64, 12, tq)
    _, tb_same = ops.relative_bias_buckets(ts, offsets, 3, 8, 64, 12, ts)
    assert torch.equal(tb_self, tb_same)
    assert int(tb_next[0, 2, 0]) == int(time_bucket_ref(torch.tensor(10 ** 6 - 0), 64))
    assert int(tb_next[0, 1, 0]) == int(time_bucket_ref(torch.tensor(1000), 64))
    assert int(tb_next[1, 0, 0]) == int(time_bucket_ref(torch.tensor(7 - 50), 64))
    assert int(tb_self[0, 2, 0]) == int(time_bucket_ref(torch.tensor(1000), 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Philox offsets per launch)")
def test_tables_left_on_meta_replay_cuda_draws_as_a_direct_gpu_build():
    """On CUDA, a model built on meta and initialised with its (small) tables left for TorchRec gets the dense
    weights of a direct GPU build: the tables' draws are replayed one launch each, so Philox's offset ends
    where the direct build's construction leaves it."""
    from gemray.parallel import materialize_dense

    cfg = tiny_cfg()
    torch.manual_seed(5)
    direct = GEM(cfg, num_items=40, device="cuda", max_seq_len=12)
    after = torch.cuda.get_rng_state()
    model = GEM(cfg, num_items=40, device="meta", max_seq_len=12)
    torch.manual_seed(5)
    materialize_dense(model, "cuda")
    assert torch.equal(torch.cuda.get_rng_state(), after)
    got, want = _params(model.encoder), _params(direct.encoder)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
