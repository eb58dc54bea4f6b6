"""An attention rank whose engine fails at start tells the coordinator it is gone
(`Member.abandon`, called by `AttentionServer` before its constructor raises), within
a bound even when the coordinator does not answer. Before, nothing unregistered it:
every Serve retry of the replica left one more STARTING rank listed in `/afd/status`
and counted in the pool size. Without Ray: the real `Member` and `Registry`, with the
coordinator's handle standing in (`handle.attention_failed.remote(rank)`)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from afd_ray.attention import member as member_module
from afd_ray.attention.member import Member
from afd_ray.connector.header import FFNAddress
from afd_ray.control.membership import MemberState
from afd_ray.control.registry import Registry

HUNG_WAIT_S = 0.3
"""`_ABANDON_WAIT_S` in the test of a coordinator that never answers."""


class _Coordinator:
    """The coordinator handle as `Member.abandon` calls it, over a real registry;
    `answers` False: a hung coordinator (the call never returns)."""

    def __init__(self, registry: Registry, answers: bool) -> None:
        self.registry, self._answers = registry, answers
        self.attention_failed = SimpleNamespace(remote=self._attention_failed)

    async def _attention_failed(self, rank: int) -> None:
        if not self._answers:
            await asyncio.Event().wait()
        self.registry.attention_failed(rank)


def _registry() -> Registry:
    """One FFN rank: the first layout."""
    registry = Registry("gloo", 10.0, 1)
    registry.add_ffn(FFNAddress("127.0.0.1", 1, 2), replica="ffn#0")
    return registry


async def _abandon(coordinator: _Coordinator) -> tuple[int, float, zmq.asyncio.Socket]:
    """Register one attention rank as `Member.join` does, then abandon it: its rank,
    the seconds `abandon` took, and its rescue endpoint."""
    registry = coordinator.registry
    assignment = registry.attention_assignment(registry.add_attention("attention#0").rank)
    rescue = zmq.asyncio.Context.instance().socket(zmq.REP)
    rescue.setsockopt(zmq.LINGER, 0)
    rescue.bind_to_random_port("tcp://127.0.0.1")
    member = Member(coordinator, rescue, assignment, "attention#0", "node", 1.0)  # type: ignore[arg-type]
    started = time.monotonic()
    await member.abandon()
    return member.rank, time.monotonic() - started, rescue


def test_a_failed_start_is_gone_and_not_listed() -> None:
    registry = _registry()
    rank, _, rescue = asyncio.run(_abandon(_Coordinator(registry, answers=True)))
    assert registry.attention[rank].state is MemberState.GONE
    assert registry.listed_attention() == []
    assert registry.ffn_directive(0, 0).dead_peers == [rank]
    assert rescue.closed


def test_a_hung_coordinator_delays_a_failed_start_at_most_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank stays STARTING here: the coordinator's replica watch retires it once
    Serve removed the replica (tests/control/test_recovery.py)."""
    monkeypatch.setattr(member_module, "_ABANDON_WAIT_S", HUNG_WAIT_S)
    registry = _registry()
    rank, took_s, rescue = asyncio.run(_abandon(_Coordinator(registry, answers=False)))
    assert HUNG_WAIT_S <= took_s < HUNG_WAIT_S + 1.0
    assert registry.attention[rank].state is MemberState.STARTING
    assert rescue.closed
