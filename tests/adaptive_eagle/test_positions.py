"""adaptive_eagle.positions: the shared context-position buckets (labels bounded, the open bucket last), verify
step positions as the engine and the replay count them, and the request's context position."""

from __future__ import annotations

import pytest

import trainer.positions
from adaptive_eagle import positions
from adaptive_eagle.positions import (DEFAULT_EDGES, bucket_labels, context_position, label_of, parse_edges,
                                      step_positions)


def test_labels_are_bounded_and_the_open_bucket_is_last():
    assert bucket_labels() == ("0-512", "512-1k", "1-2k", "2-4k", "4-8k", "8k+")
    assert len(bucket_labels(DEFAULT_EDGES)) == len(DEFAULT_EDGES)
    assert [label_of(p) for p in (0, 511, 512, 2047, 2048, 8191, 8192, 10**9)] == \
        ["0-512", "0-512", "512-1k", "1-2k", "2-4k", "4-8k", "8k+", "8k+"]
    assert {label_of(p) for p in range(0, 20_000, 97)} <= set(bucket_labels())
    with pytest.raises(ValueError, match="position must be >= 0"):
        label_of(-1)
    with pytest.raises(ValueError, match="buckets"):
        bucket_labels((0, 100, 100))


def test_step_positions_follow_the_committed_tokens():
    """A prompt of 10: the prefill samples token 10, the first step drafts 11; each step moves by accepted + 1."""
    assert step_positions(10, [2, 0, 3]) == [11, 14, 15]
    assert step_positions(1, []) == []
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        step_positions(0, [1])


def test_context_position_is_the_middle_of_the_generation():
    assert context_position(4000, 96) == 4048 and context_position(300, 0) == 300
    with pytest.raises(ValueError, match="generated_tokens"):
        context_position(10, -1)


def test_the_trainer_re_exports_the_same_objects():
    for name in ("DEFAULT_EDGES", "bucket_label", "bucket_of", "buckets_below", "check_edges", "parse_edges"):
        assert getattr(trainer.positions, name) is getattr(positions, name)
    assert parse_edges("0,512,1024") == (0, 512, 1024)
