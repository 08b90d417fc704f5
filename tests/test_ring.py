"""TokenRing: messages arrive intact, in order, and a stale or overwritten slot is never consumed."""

import numpy as np
import pytest

from mirror_mlx.drafts.host import BRANCHES as EARLY_EXIT
from mirror_mlx.drafts.host import WINDOWS as WINDOW
from mirror_mlx.drafts.ring import RingFull, RingOverwritten, TokenRing


@pytest.fixture
def ring():
    r = TokenRing(capacity=4, max_ints=16, max_floats=8)
    yield r
    r.close()


def test_round_trip_of_ids_and_logprobs(ring):
    seq = ring.put(EARLY_EXIT, step=7, ints=[5, 9, 2], floats=[-0.5, -1.25])
    msg = ring.get(seq)
    assert (msg.kind, msg.step, msg.ints.tolist(), msg.floats.tolist()) == (EARLY_EXIT, 7, [5, 9, 2], [-0.5, -1.25])


def test_wrap_around_keeps_order(ring):
    for i in range(1, 11):  # 10 messages through 4 slots
        seq = ring.put(WINDOW, step=i, ints=[i, i + 1])
        assert seq == i
        assert ring.get(seq).ints.tolist() == [i, i + 1]


def test_stale_slot_is_not_consumed(ring):
    ring.put(WINDOW, 1, ints=[1])
    ring.get(1)
    assert ring.get(2) is None  # not written yet: slot 2 still holds nothing newer
    ring.put(WINDOW, 2, ints=[2])
    ring.put(WINDOW, 3, ints=[3])
    ring.get(2), ring.get(3)
    assert ring.get(6) is None  # slot 6 % 4 == 2 holds message 2: stale, never returned as 6


def test_writer_refuses_to_overwrite_unread_messages(ring):
    for i in range(4):
        ring.put(WINDOW, i, ints=[i])
    with pytest.raises(RingFull):
        ring.put(WINDOW, 4, ints=[4])


def test_overwritten_slot_is_detected():
    ring = TokenRing(capacity=2, max_ints=4, max_floats=1)
    try:
        for i in range(2):
            ring.put(WINDOW, i, ints=[i])
        assert ring.get(2).ints.tolist() == [1]  # a reader that skipped ahead lets the writer reuse message 1's slot
        ring.put(WINDOW, 2, ints=[2])
        ring.put(WINDOW, 3, ints=[3])
        with pytest.raises(RingOverwritten):
            ring.get(1)
    finally:
        ring.close()


def test_second_handle_by_name_sees_the_same_slots(ring):
    other = TokenRing(capacity=4, max_ints=16, max_floats=8, name=ring.name, create=False, track=False)
    seq = ring.put(EARLY_EXIT, 3, ints=np.arange(10), floats=[0.25])
    assert other.get(seq).ints.tolist() == list(range(10))
    other.close(unlink=False)


def test_oversized_message_is_refused(ring):
    with pytest.raises(ValueError, match="exceeds"):
        ring.put(WINDOW, 0, ints=range(17))
