"""A coordinator restarted by Serve while its members keep serving (docs/failures.md), in
the middle of an FFN recovery among others, without Ray: the real registry and
recovery, fed the records the members re-register with (`rejoin_ffn`,
`rejoin_attention`) and the reports they send, on Serve replica states the test sets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from afd_ray.config import AFDConfig
from afd_ray.connector.header import FFNAddress
from afd_ray.control.membership import AttentionMember, FFNMember, LoopState, MemberState
from afd_ray.control.recovery import Recovery
from afd_ray.control.registry import Registry
from afd_ray.control.resize import Resizer

READY, GONE = MemberState.READY, MemberState.GONE
SERVING, EP_LOST = LoopState.SERVING, LoopState.EP_LOST
ADDRESS = FFNAddress("127.0.0.1", 1, 2)
WITHIN_S = 20.0
"""Bound on every wait of these tests (they take about a second each)."""


@asynccontextmanager
async def _tasks(*coroutines: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Runs `coroutines` as tasks for the body of the `async with`, cancelled on the way out."""
    tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()


def _ffn(rank: int, epoch: int, layout: tuple[int, ...], loop: LoopState = SERVING) -> FFNMember:
    """FFN rank `rank` as it rejoins: serving the layout `layout` of `epoch`."""
    return FFNMember(
        rank=rank,
        address=ADDRESS,
        replica=f"ffn#{rank}",
        state=READY,
        epoch=epoch,
        ep_rank=layout.index(rank),
        loop=loop,
    )


def _attention(rank: int, ffn_peer: int, epoch: int) -> AttentionMember:
    return AttentionMember(
        rank=rank, ffn_peer=ffn_peer, state=READY, epoch=epoch, replica=f"a#{rank}", peered_epoch=epoch
    )


def test_an_attention_rank_naming_an_unknown_ffn_peer_gets_no_assignment() -> None:
    """EP2 layout (0, 1) of epoch 3: FFN rank 1 died while the old coordinator
    recovered from it; attention rank 0, still peered with it, rejoins the restarted
    coordinator, which never heard of rank 1. Its poll is answered (its state, no
    assignment: it keeps the pairing it holds) instead of raising; an attention rank
    the registry does not know gets None (rejoin). Before, `attention_poll` raised
    KeyError: 1 at every poll of that rank."""
    registry = Registry("gloo", 5.0, 2)
    registry.rejoin_attention(_attention(0, ffn_peer=1, epoch=3))
    directive = registry.attention_directive(0)
    assert directive is not None and directive.state is READY and directive.assignment is None
    assert registry.attention_directive(7) is None
    registry.rejoin_ffn(_ffn(1, 3, (0, 1)), (0, 1), 3)
    directive = registry.attention_directive(0)
    assert directive is not None and directive.assignment is not None and directive.assignment.ffn_rank == 1


def test_a_restarted_coordinator_never_reuses_an_ffn_rank_id() -> None:
    """FFN rank 1 of the EP2 layout (0, 1) died before the restart. A new FFN rank
    (Serve's replacement) must not get id 1 while attention rank 0 still names 1 as
    its peer, nor any id of a layout a rejoined rank told. Before, new ids were
    max(known FFN ranks) + 1, so the replacement got 1: attention rank 0's peer
    became the replacement, under its old pairing epoch."""
    registry = Registry("gloo", 5.0, 2)
    registry.rejoin_attention(_attention(0, ffn_peer=1, epoch=3))
    registry.rejoin_ffn(_ffn(0, 3, (0, 1), EP_LOST), (0, 1), 3)
    assert registry.add_ffn(ADDRESS, "ffn#2") == 2
    restarted = Registry("gloo", 5.0, 2)
    restarted.rejoin_ffn(_ffn(0, 5, (0, 4)), (0, 4), 5)  # rank 4 has not rejoined yet
    assert restarted.add_ffn(ADDRESS, "ffn#5") == 5


class _Serve:
    """Serve's replica states of the FFN deployment, as the test sets them."""

    def __init__(self, *replicas: str) -> None:
        self.states = dict.fromkeys(replicas, "RUNNING")

    async def __call__(self, app: str, deployment: str) -> dict[str, str]:
        return dict(self.states)


async def _until(condition: Callable[[], bool], within_s: float = WITHIN_S) -> None:
    """Poll `condition` until it holds (bounded: fails past `within_s` seconds)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _report(registry: Registry, recovery: Recovery, alive: dict[int, LoopState]) -> None:
    """The FFN ranks in `alive`, as their reports (every 0.02 s here) tell the
    coordinator: each prepares the pending plan it is in (or leaves by) and switches to
    it at once (as a rank whose EP group is lost does), then serves it."""
    while True:
        plan = registry.plan
        for rank in list(alive):
            if plan is not None and (rank in plan.ranks or rank == plan.leaving):
                registry.update_ffn(rank, epoch=plan.epoch)
                alive[rank] = SERVING
            registry.update_ffn(rank, loop=alive[rank])
            recovery.heard(rank, alive[rank])
        await registry.notify()
        await asyncio.sleep(0.02)


def _coordinator(serve: _Serve, num_ffn: int) -> tuple[Registry, Recovery]:
    """A restarted coordinator's registry and recovery (FFN target `num_ffn`)."""
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": num_ffn}, "attention": {"num_ranks": 2}})
    registry = Registry("gloo", cfg.connector.timeout_s, num_ffn)
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale, replicas=serve)
    recovery = Recovery(registry, resizer, "afd", cfg.ffn.heartbeat_timeout_s, 10.0, replicas=serve)
    return registry, recovery


def test_a_restart_in_the_middle_of_a_recovery_reforms_the_layout() -> None:
    """EP2 layout (0, 1) of epoch 3; FFN rank 1 was SIGKILLed, and the coordinator
    restarted before its recovery switched the layout. FFN rank 0 (its EP group lost)
    and both attention ranks (rank 0 still peered with the dead rank 1) rejoin. The
    restarted coordinator takes rank 0 as the layout, records the loss of rank 1, and
    re-forms the layout with Serve's replacement (a new id) under a newer epoch: rank 0
    keeps EP rank 0, attention rank 0 moves to the replacement, attention rank 1 is
    re-peered with rank 0 under a new epoch (its pair was closed with the EP group).
    Before, the layout stayed empty for good (only one of its two EP ranks rejoined),
    and the replacement waited for a layout that never formed."""
    serve = _Serve("ffn#0")
    registry, recovery = _coordinator(serve, 2)
    alive = {0: EP_LOST}

    async def run() -> None:
        async with _tasks(recovery.watch(), _report(registry, recovery, alive)):
            registry.rejoin_attention(_attention(0, ffn_peer=1, epoch=3))
            registry.rejoin_attention(_attention(1, ffn_peer=0, epoch=2))
            registry.rejoin_ffn(_ffn(0, 3, (0, 1), EP_LOST), (0, 1), 3)
            recovery.heard(0, EP_LOST)
            assert registry.layout == (0,) and registry.epoch == 3
            await _until(lambda: recovery.recovering)
            replacement = registry.add_ffn(ADDRESS, "ffn#2")
            serve.states["ffn#2"] = "RUNNING"
            alive[replacement] = SERVING
            await _until(lambda: not recovery.recovering)

    asyncio.run(run())
    assert registry.layout == (0, 2) and registry.layout_epoch > 3 and registry.plan is None
    assert [(m.rank, m.ep_rank, m.state) for m in registry.listed_ffn()] == [(0, 0, READY), (2, 1, READY)]
    assert [(m.ffn_peer, m.epoch > 3) for m in registry.attention.values()] == [(2, True), (0, True)]
    (event,) = recovery.events
    assert event.lost == [1] and event.error is None and event.epoch == registry.layout_epoch, event
    assert "EP group of epoch 3 lost" in event.cause and "[1] of it never rejoined" in event.cause, event


def test_a_layout_whose_every_rank_lost_its_ep_group_is_reformed() -> None:
    """EP2 layout (0, 1) of epoch 3: both FFN ranks live but report their EP group
    lost (e.g. it failed as the old coordinator died); both rejoin the restarted
    coordinator, and no rank is dead, so no death starts a recovery. The layout is
    re-formed from the same ranks under a newer epoch (same EP ranks, no replacement
    needed) and the attention ranks are re-peered with their peers under new epochs.
    Before, the layout was taken as serving and never re-formed: both ranks served
    nothing until `connector.peer_lost_wait_s` ended their loops."""
    serve = _Serve("ffn#0", "ffn#1")
    registry, recovery = _coordinator(serve, 2)
    alive = {0: EP_LOST, 1: EP_LOST}

    async def run() -> None:
        async with _tasks(recovery.watch(), _report(registry, recovery, alive)):
            registry.rejoin_attention(_attention(0, ffn_peer=0, epoch=3))
            registry.rejoin_attention(_attention(1, ffn_peer=1, epoch=3))
            for rank in (0, 1):
                registry.rejoin_ffn(_ffn(rank, 3, (0, 1), EP_LOST), (0, 1), 3)
            assert registry.layout == (0, 1)
            await _until(lambda: registry.layout_epoch > 3 and not recovery.recovering)

    asyncio.run(run())
    assert registry.layout == (0, 1) and registry.plan is None
    assert [(m.ffn_peer, m.epoch > 3) for m in registry.attention.values()] == [(0, True), (1, True)]
    (event,) = recovery.events
    assert event.lost == [] and event.error is None and "EP group of epoch 3 lost" in event.cause, event


def test_a_stray_attention_rank_is_moved_onto_the_layout() -> None:
    """1F: FFN rank 0 died and the old coordinator's recovery switched to its
    replacement, rank 1, and re-peered attention rank 0 with it; the coordinator
    restarted before attention rank 0 followed, so it rejoins peered with the dead
    rank 0. Once the layout (1,) rejoined, the restarted coordinator moves it onto
    rank 1 under a newer epoch. Before, nothing moved it: its requests waited for a
    new peer until `connector.peer_lost_wait_s`, then failed."""
    serve = _Serve("ffn#1")
    registry, recovery = _coordinator(serve, 1)

    async def run() -> None:
        watch = asyncio.create_task(recovery.watch())
        try:
            registry.rejoin_attention(_attention(0, ffn_peer=0, epoch=4))
            registry.rejoin_ffn(_ffn(1, 5, (1,)), (1,), 5)
            await _until(lambda: registry.attention[0].ffn_peer == 1)
        finally:
            watch.cancel()

    asyncio.run(run())
    assert registry.attention[0].epoch > 5 and registry.layout == (1,) and not recovery.events


def test_a_lost_ep_group_with_a_silent_rank_waits_for_its_death() -> None:
    """EP2 layout (0, 1), no restart: rank 1 was SIGKILLed, rank 0 reports its EP
    group lost. While rank 1 is silent, its death (replica vanished, or heartbeat) is
    what starts the recovery, not the lost group: a plan with the dead rank in it
    would make rank 0 wait in an EP rendezvous for it. Once every rank reports the
    group lost for `EP_LOST_GRACE_S`, the layout is re-formed anyway."""
    from afd_ray.control.recovery import EP_LOST_GRACE_S

    now = [1000.0]
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": 2}})
    registry = Registry("gloo", 5.0, 2)
    for replica in ("ffn#0", "ffn#1"):
        registry.update_ffn(registry.add_ffn(ADDRESS, replica), state=READY, epoch=0)  # what its reports say
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale)
    recovery = Recovery(registry, resizer, "afd", 30.0, 10.0, clock=lambda: now[0])
    recovery.heard(1, SERVING)
    recovery.heard(0, EP_LOST)
    for _ in range(4):
        now[0] += EP_LOST_GRACE_S / 2
        recovery.heard(0, EP_LOST)
    assert recovery.lost_group() == []  # rank 1 silent for 2 x the grace
    recovery.heard(1, EP_LOST)
    assert recovery.lost_group() == [0]  # rank 1's report is new, its loss not yet the grace old
    now[0] += EP_LOST_GRACE_S
    recovery.heard(0, EP_LOST)
    recovery.heard(1, EP_LOST)
    assert recovery.lost_group() == [0, 1]


def test_no_stray_is_moved_onto_a_layout_whose_ep_group_is_lost() -> None:
    """The restart of `test_a_restart_in_the_middle_of_a_recovery_reforms_the_layout`,
    before the lost group's grace passed: attention rank 0, peered with the dead FFN
    rank 1, is not moved onto rank 0, which serves nothing until the layout is
    re-formed (its join there would wait for a loop that reads no header)."""
    serve = _Serve("ffn#0")
    registry, recovery = _coordinator(serve, 2)

    async def run() -> None:
        registry.rejoin_attention(_attention(0, ffn_peer=1, epoch=3))
        registry.rejoin_ffn(_ffn(0, 3, (0, 1), EP_LOST), (0, 1), 3)
        await recovery._move_strays()

    asyncio.run(run())
    assert registry.attention[0].ffn_peer == 1 and registry.attention[0].epoch == 3


def test_a_registration_waits_for_the_running_ranks_to_rejoin() -> None:
    """Serve's handle holds the calls made while the coordinator was down: a new FFN
    replica's registration can reach the restarted coordinator before the running
    FFN rank 0 has rejoined. It waits (bounded) until rank 0 rejoined, and gets id 1.
    Before, it got id 0 at once: rank 0's reports were then taken for the newcomer's,
    and its rejoin overwrote the newcomer's record."""
    from afd_ray.control.resize import FFN_DEPLOYMENT

    serve = _Serve("ffn#0")
    serve.states["ffn#9"] = "STARTING"  # the newcomer, in its constructor
    cfg = AFDConfig()
    registry = Registry("gloo", cfg.connector.timeout_s, 1)
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale, replicas=serve)

    async def register() -> int:
        await resizer.await_rejoins(FFN_DEPLOYMENT, "ffn#9")
        return registry.add_ffn(ADDRESS, "ffn#9")

    async def run() -> int:
        newcomer = asyncio.create_task(register())
        await asyncio.sleep(0.3)
        assert not newcomer.done()
        registry.rejoin_ffn(_ffn(0, 2, (0,)), (0,), 2)
        await registry.notify()
        return await asyncio.wait_for(newcomer, WITHIN_S)

    assert asyncio.run(run()) == 1
    assert registry.ffn[0].replica == "ffn#0" and registry.ffn[1].replica == "ffn#9"


def test_a_rank_leaving_before_it_rejoined_is_waited_for() -> None:
    """EP2 layout (0, 1) of epoch 3; the coordinator restarted, and Serve scales the
    FFN pool in: rank 1's replica stops before rank 1's first report rejoined it.
    Its `ffn_leaving` waits (bounded) until rank 1 rejoined, then hands its experts and
    peers over as a scale-in does: the layout is (0,) under a newer epoch and rank 1 is
    GONE. Before, `ffn_leaving` raised KeyError: 1 and rank 1 left without handing
    anything over (rank 0's EP group failed)."""
    serve = _Serve("ffn#0", "ffn#1")
    registry, recovery = _coordinator(serve, 1)
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": 1}})
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale, replicas=serve)
    alive = {0: SERVING}

    async def run() -> None:
        reports = asyncio.create_task(_report(registry, recovery, alive))
        try:
            registry.rejoin_ffn(_ffn(0, 3, (0, 1)), (0, 1), 3)
            leaving = asyncio.create_task(resizer.ffn_leaving(1))
            await asyncio.sleep(0.3)
            assert not leaving.done()
            registry.rejoin_ffn(_ffn(1, 3, (0, 1)), (0, 1), 3)
            alive[1] = SERVING
            await registry.notify()
            await asyncio.wait_for(leaving, WITHIN_S)
        finally:
            reports.cancel()

    asyncio.run(run())
    assert registry.layout == (0,) and registry.layout_epoch > 3 and registry.ffn[1].state is GONE


def test_the_last_ffn_rank_replaced_by_serve_is_recovered() -> None:
    """1A:1F, layout (0,) of epoch 1. Serve stops FFN rank 0's replica because it
    failed its health checks (it was SIGSTOPped past `ffn.heartbeat_timeout_s` while
    the coordinator restarted, then continued and rejoined), not because the pool
    shrinks: the FFN target stays 1. Its destructor calls `ffn_leaving(0)`, which must
    not take the rank out by itself (there is no rank to hand anything to); once the
    replica is gone the recovery finds it dead, re-forms the layout with Serve's
    replacement and re-peers attention rank 0. Before, `ffn_leaving` marked rank 0
    GONE while the layout stayed (0,): nothing found it dead, every replacement waited
    in `ep_assignment` for a layout that never formed, and the service answered 503
    for good (fresh-user walkthrough, 2026-12-03)."""
    serve = _Serve("ffn#0")
    registry, recovery = _coordinator(serve, 1)
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": 1}})
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale, replicas=serve)
    alive = {0: SERVING}

    async def run() -> int:
        async with _tasks(recovery.watch(), _report(registry, recovery, alive)):
            registry.rejoin_ffn(_ffn(0, 1, (0,)), (0,), 1)
            registry.rejoin_attention(_attention(0, ffn_peer=0, epoch=1))
            await asyncio.wait_for(resizer.ffn_leaving(0), WITHIN_S)
            del alive[0]
            serve.states = {"ffn#9": "RUNNING"}  # the stopped replica is gone, its replacement runs
            replacement = registry.add_ffn(ADDRESS, "ffn#9")
            alive[replacement] = SERVING
            await _until(lambda: registry.layout == (replacement,) and not recovery.recovering)
            return replacement

    replacement = asyncio.run(run())
    assert registry.plan is None and registry.ffn[0].state is GONE and registry.ffn[replacement].state is READY
    assert registry.attention[0].ffn_peer == replacement
    (event,) = recovery.events
    assert event.lost == [0] and event.error is None, event
