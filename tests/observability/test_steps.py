"""Step records and their join: a step's interval splits into parts that add up to it,
each taken from the side that measured it."""

from __future__ import annotations

import pytest

from afd_ray.observability.steps import AttentionStep, FFNStep, PeerStep, StepLog, StepRing, breakdown


def _attention(step_id: int, start_s: float, exchange_s: float, requests: tuple[str, ...]) -> AttentionStep:
    return AttentionStep(
        rank=1, epoch=3, step_id=step_id, start_s=start_s, num_tokens=2, exchange_s=exchange_s, requests=requests
    )


def test_ring_keeps_the_last_records_and_hands_out_new_ones_once() -> None:
    ring: StepRing[int] = StepRing(3)
    for i in range(5):
        ring.append(i)
    assert ring.records() == [2, 3, 4]
    assert ring.take_new() == [2, 3, 4]  # 5 new, only 3 held
    ring.append(5)
    assert ring.take_new() == [5]
    assert ring.take_new() == []


def test_breakdown_joins_by_rank_step_and_epoch() -> None:
    attention = [
        _attention(7, 100.0, 0.030, ("cmpl-a-0-1234abcd", "cmpl-b-0-5678abcd")),
        _attention(8, 100.050, 0.020, ("cmpl-b-0-5678abcd",)),
        _attention(9, 100.090, 0.0, ("cmpl-b-0-5678abcd",)),
    ]
    ffn = [
        FFNStep(
            epoch=0,
            start_s=0.0,
            peers=(
                PeerStep(rank=1, epoch=3, step_id=7, num_tokens=2, queue_s=0.004),
                PeerStep(rank=2, epoch=5, step_id=7, num_tokens=1, queue_s=0.0),
            ),
            compute_s=0.012,
            ep_s=0.003,
            f2a_s=0.001,
            total_s=0.02,
        ),
        # the same step id of another epoch (an older pairing) must not be joined
        FFNStep(
            epoch=0,
            start_s=0.0,
            peers=(PeerStep(rank=1, epoch=2, step_id=8, num_tokens=2, queue_s=1.0),),
            compute_s=1.0,
            ep_s=1.0,
            f2a_s=1.0,
            total_s=3.0,
        ),
    ]
    assert breakdown("cmpl-a", attention, ffn) == []  # its successor step 8 did not serve it
    attention[1] = _attention(8, 100.050, 0.020, ("cmpl-a-0-1234abcd", "cmpl-b-0-5678abcd"))
    (first,) = breakdown("cmpl-a", attention, ffn)
    assert first.step_id == 7 and first.ffn_tokens == 3
    assert first.total_s == pytest.approx(0.050)
    assert first.attention_s == pytest.approx(0.020)
    assert (first.ffn_queue_s, first.ffn_compute_s, first.ep_collective_s, first.f2a_s) == (0.004, 0.012, 0.003, 0.001)
    assert first.wire_s == pytest.approx(0.030 - 0.020)
    parts = first.attention_s + first.wire_s + first.ffn_queue_s + first.ffn_compute_s + first.ep_collective_s
    assert parts + first.f2a_s == pytest.approx(first.total_s)

    assert breakdown("cmpl-b", attention, ffn)[0].step_id == 7  # step 8's successor did not serve it
    attention.append(_attention(10, 100.2, 0.0, ("cmpl-b-0-5678abcd",)))
    steps = breakdown("cmpl-b", attention, ffn)
    assert [s.step_id for s in steps] == [7, 8, 9]  # step 10 has no successor yet: no interval
    assert steps[1].ffn_tokens is None and steps[1].wire_s == pytest.approx(0.020)  # no FFN record of epoch 3
    assert breakdown("cmpl-", attention, ffn) == []  # a prefix of an id is not the id


def test_step_log_is_bounded_per_rank() -> None:
    log = StepLog(capacity=2)
    log.add_attention(1, [_attention(i, float(i), 0.0, ("r-0-x",)) for i in range(5)])
    assert [s.step_id for s in log.breakdown("r")] == [3]  # steps 3 and 4 held; 4 has no successor
