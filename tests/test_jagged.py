"""JaggedBatch helpers: offsets/positions/padding round trips, incl. empty and length-1 sequences."""

import pytest
import torch

from gemray.jagged import (JaggedBatch, jagged_to_padded, lengths_to_offsets, padded_to_jagged, query_timestamps,
                           positions, segment_ids)


def test_offsets_positions_segments():
    lengths = torch.tensor([2, 0, 3, 1])
    off = lengths_to_offsets(lengths)
    assert off.tolist() == [0, 2, 2, 5, 6]
    assert segment_ids(off).tolist() == [0, 0, 2, 2, 2, 3]
    assert positions(off).tolist() == [0, 1, 0, 1, 2, 0]


def test_pad_round_trip():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 1, 5, 5])
    off = lengths_to_offsets(lengths)
    vals = torch.randn(int(off[-1]), 4, generator=g)
    padded = jagged_to_padded(vals, off, 5, padding_value=-1.0)
    assert padded.shape == (5, 5, 4)
    assert torch.equal(padded[1], torch.full((5, 4), -1.0))
    assert torch.equal(padded_to_jagged(padded, off), vals)
    with pytest.raises(ValueError, match="max_len"):
        jagged_to_padded(vals, off, 4)


def test_validate_names_field():
    off = torch.tensor([0, 2, 3])
    b = JaggedBatch(user_ids=torch.tensor([1, 2]), offsets=off, item_ids=torch.tensor([1, 2, 3]),
                    ratings=torch.tensor([8, 6, 10]), timestamps=torch.tensor([1, 2, 3]))
    assert b.validate().batch_size == 2 and b.num_tokens == 3 and b.max_len == 2
    with pytest.raises(ValueError, match="ratings"):
        b.with_(ratings=torch.tensor([1])).validate()
    with pytest.raises(ValueError, match="offsets"):
        b.with_(offsets=torch.tensor([0, 3, 2])).validate()


def test_query_timestamps_next_item_then_target():
    # sequences [10, 20, 30], [5], [], [7, 8]
    ts = torch.tensor([10, 20, 30, 5, 7, 8])
    offsets = torch.tensor([0, 3, 4, 4, 6])
    assert query_timestamps(ts, offsets).tolist() == [20, 30, 30, 5, 8, 8]
    last = torch.tensor([100, 200, 300, 400])
    assert query_timestamps(ts, offsets, last).tolist() == [20, 30, 100, 200, 8, 400]
    assert query_timestamps(ts[:0], torch.tensor([0, 0]), torch.tensor([9])).numel() == 0
    assert ts.tolist() == [10, 20, 30, 5, 7, 8]  # input untouched


def test_validate_target_timestamps_shape():
    b = JaggedBatch(user_ids=torch.arange(2), offsets=torch.tensor([0, 1, 2]), item_ids=torch.tensor([1, 2]),
                    ratings=torch.tensor([8, 8]), timestamps=torch.tensor([1, 2]), targets=torch.tensor([3, 4]),
                    target_timestamps=torch.tensor([5]))
    with pytest.raises(ValueError, match="target_timestamps"):
        b.validate()


def test_host_shape_and_sync_free_helpers_match_the_device_reads():
    """HostShape's ints equal what reading the offsets gives; JaggedBatch.to carries them (not as a tensor) and the
    batch's properties use them; next_item_index / positions / query_timestamps with host sizes (the sync-free forms)
    equal the mask / nonzero definitions, empty sequences (leading, inner, trailing) and B = 0 included."""
    from gemray.jagged import HostShape, next_item_index, next_item_offsets, positions, query_timestamps, segment_ids

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        B = int(torch.randint(0, 6, (1,), generator=g))
        lens = torch.randint(0, 5, (B,), generator=g)
        if trial % 7 == 0 and B:
            lens[0] = 0
        off = lengths_to_offsets(lens)
        T = int(off[-1])
        ts = torch.cumsum(torch.randint(0, 100, (T,), generator=g), 0)
        last = torch.randint(0, 10 ** 6, (B,), generator=g)
        hs = HostShape.of(off)
        assert (hs.num_tokens, hs.max_len, hs.num_next) == (T, int(lens.max()) if B else 0,
                                                           int((lens - 1).clamp(min=0).sum()))
        seg = segment_ids(off)
        pos = positions(off)
        want_idx = torch.nonzero(pos < (lens[seg] - 1)).view(-1)
        assert torch.equal(next_item_index(off), want_idx) and torch.equal(next_item_index(off, hs.num_next), want_idx)
        # the rows of next_item_index per sequence: sequence b's are next_item_offsets[b]:next_item_offsets[b + 1]
        row_off = next_item_offsets(off)
        assert row_off.numel() == B + 1 and int(row_off[-1]) == want_idx.numel()
        assert torch.equal(seg[want_idx], torch.repeat_interleave(torch.arange(B), row_off[1:] - row_off[:-1]))
        assert torch.equal(positions(off, T), pos) and torch.equal(segment_ids(off, T), seg)
        for lst in (None, last):
            want = ts.clone()
            if T > 1:
                want[:-1] = ts[1:]
            has = lens > 0
            ends = off[1:][has] - 1
            want[ends] = ts[ends] if lst is None else lst[has]
            assert torch.equal(query_timestamps(ts, off, lst), want)
    batch = JaggedBatch(user_ids=torch.arange(3), offsets=lengths_to_offsets(torch.tensor([2, 0, 5])),
                        item_ids=torch.arange(1, 8), ratings=torch.ones(7, dtype=torch.int64),
                        timestamps=torch.arange(7), candidate_offsets=torch.tensor([0, 1, 1, 4]),
                        candidate_ids=torch.arange(4), labels=torch.zeros(4, 2))
    moved = batch.to("meta")
    assert moved.host == HostShape(num_tokens=7, max_len=5, num_next=5, num_candidates=4, max_candidates=3)
    assert moved.offsets.is_meta and (moved.num_tokens, moved.max_len, moved.num_candidates) == (7, 5, 4)
    assert moved.host_shape() is moved.host and batch.to("cpu").host is None  # CPU batches compute it on demand
    with pytest.raises(ValueError, match="CPU tensor"):
        HostShape.of(moved.offsets)
