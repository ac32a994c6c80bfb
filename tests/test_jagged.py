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
