"""The attention server's answer to a worker whose FFN peer died mid-pass waits for
the coordinator's next assignment at most the worker's own bound
(`connector.peer_lost_wait_s`); before, it polled with no bound, so a rank whose
worker had given up kept polling until some later epoch came."""

from __future__ import annotations

import asyncio
import time

from afd_ray.attention.member import next_assignment
from afd_ray.control.membership import AttentionAssignment, AttentionDirective, MemberState


def _assignment(epoch: int, wait_s: float = 0.3) -> AttentionAssignment:
    return AttentionAssignment(
        peer=0,
        ffn_rank=epoch,
        host="127.0.0.1",
        store_port=1,
        control_port=2,
        epoch=epoch,
        transport="shm",
        timeout_s=1.0,
        peer_lost_wait_s=wait_s,
    )


def _polls(*answers: AttentionDirective | None | Exception):
    """A coordinator whose successive polls answer `answers` (the last one repeats)."""
    calls = []

    async def poll() -> AttentionDirective | None:
        answer = answers[min(len(calls), len(answers) - 1)]
        calls.append(time.monotonic())
        if isinstance(answer, Exception):
            raise answer
        return answer

    return poll, calls


def test_gives_up_after_the_workers_bound():
    held = _assignment(3, wait_s=0.3)
    poll, calls = _polls(AttentionDirective(state=MemberState.READY, assignment=held))
    started = time.monotonic()
    assert asyncio.run(next_assignment(poll, held, 0.05)) is None
    assert 0.25 <= time.monotonic() - started < 0.5
    assert len(calls) >= 5


def test_returns_the_first_newer_epoch_past_a_restarting_coordinator():
    held, new = _assignment(3), _assignment(4)
    poll, calls = _polls(
        RuntimeError("coordinator restarting"),
        None,  # restarted, does not know the rank yet
        AttentionDirective(state=MemberState.READY, assignment=None),
        AttentionDirective(state=MemberState.READY, assignment=held),
        AttentionDirective(state=MemberState.READY, assignment=new),
    )
    assert asyncio.run(next_assignment(poll, held, 0.01)) == new
    assert len(calls) == 5
