"""Dead FFN ranks found by the coordinator's recovery (`afd_ray.control.recovery`),
without Ray: the real registry and recovery, on a clock the test advances."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from afd_ray.config import AFDConfig
from afd_ray.connector.header import FFNAddress
from afd_ray.control.membership import LoopState, MemberState
from afd_ray.control.placement import live_count
from afd_ray.control.recovery import Recovery
from afd_ray.control.registry import Registry
from afd_ray.control.resize import Resizer
from afd_ray.control.status import StatusView
from afd_ray.observability.signals import SignalAggregator

LOADING_SILENCE_S = 14.0
"""How long the SmolLM2 FFN rank of deployments/afd.yaml went without a report while
it loaded, on the 2-core machine at load average 11 (it was declared dead 14 s after
it registered, 10.6 s after its last report, under the old 10 s default)."""


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _recovery(cfg: AFDConfig, clock: _Clock) -> tuple[Registry, Recovery]:
    """A registry with one registered FFN rank (rank 0, the first layout) and the
    recovery the coordinator builds from `cfg`."""
    registry = Registry("gloo", cfg.connector.timeout_s, cfg.ffn.num_ranks)
    registry.add_ffn(FFNAddress("127.0.0.1", 1, 2), replica="ffn#0")
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale)
    recovery = Recovery(
        registry, resizer, "afd", cfg.ffn.heartbeat_timeout_s, cfg.autoscale.resize_timeout_s, clock=clock
    )
    return registry, recovery


def test_a_loading_ffn_rank_is_not_declared_dead_under_the_defaults() -> None:
    """With the default `ffn.heartbeat_timeout_s`, a rank silent as long as a loading
    rank was on the loaded CI machine is alive; silent past the timeout it is dead.
    Fails with the old 10 s default."""
    clock = _Clock()
    cfg = AFDConfig()
    _, recovery = _recovery(cfg, clock)
    states = {"ffn#0": "RUNNING"}
    recovery.heard(0, LoopState.SERVING)

    clock.now += LOADING_SILENCE_S
    assert recovery.dead(states) == {}

    recovery.heard(0, LoopState.SERVING)
    clock.now += cfg.ffn.heartbeat_timeout_s + 0.1
    (cause,) = recovery.dead(states).values()
    assert "ffn.heartbeat_timeout_s" in cause


def test_a_configured_heartbeat_timeout_is_the_bound() -> None:
    """The bound is the configured one, not a constant: 5 s declares the same silence dead."""
    clock = _Clock()
    _, recovery = _recovery(AFDConfig.model_validate({"ffn": {"heartbeat_timeout_s": 5}}), clock)
    recovery.heard(0, LoopState.SERVING)
    clock.now += 4.9
    assert recovery.dead(None) == {}
    clock.now += 0.2
    assert list(recovery.dead(None)) == [0]


class _Serve:
    """Serve's replica states of the FFN deployment, as the test sets them."""

    def __init__(self, **states: str) -> None:
        self.states = states

    async def __call__(self, app: str, deployment: str) -> dict[str, str]:
        return dict(self.states)


async def _until(condition: Callable[[], bool], within_s: float) -> None:
    """Poll `condition` until it holds (bounded: fails past `within_s` seconds)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _serve_plans(registry: Registry, alive: set[int]) -> None:
    """The FFN ranks in `alive`, as their reports tell the coordinator: each prepares
    the pending plan it is in and then serves its epoch."""
    while True:
        plan = registry.plan
        if plan is not None:
            for rank in alive.intersection(plan.ranks):
                registry.update_ffn(rank, epoch=plan.epoch)
            await registry.notify()
        await asyncio.sleep(0.02)


def test_a_failed_recovery_is_retried_until_the_layout_is_whole() -> None:
    """1F: the FFN rank dies and no replacement registers within the recovery bound:
    that attempt fails. A replacement registering later is formed into the layout by
    a retry, the event then has no error, and the pool no longer counts as recovering.
    Before, the failed recovery was not retried: the layout stayed empty for good
    (the replacement's `ep_assignment` timed out, Serve restarted it, and so on)."""
    wait_s = 1.0
    cfg = AFDConfig()
    registry = Registry("gloo", cfg.connector.timeout_s, 1)
    registry.add_ffn(FFNAddress("127.0.0.1", 1, 2), replica="ffn#0")
    registry.update_ffn(0, state=MemberState.READY, ep_rank=0, epoch=0)
    serve = _Serve(**{"ffn#0": "RUNNING"})
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale)
    recovery = Recovery(registry, resizer, "afd", cfg.ffn.heartbeat_timeout_s, wait_s, replicas=serve)
    alive: set[int] = set()

    async def run() -> None:
        tasks = [asyncio.create_task(recovery.watch()), asyncio.create_task(_serve_plans(registry, alive))]
        try:
            del serve.states["ffn#0"]  # SIGKILL: its replica vanished
            await _until(lambda: bool(recovery.events) and recovery.events[0].error is not None, 10 * wait_s)
            assert registry.layout == () and recovery.recovering, recovery.events
            replacement = registry.add_ffn(FFNAddress("127.0.0.1", 3, 4), replica="ffn#1")
            serve.states["ffn#1"] = "RUNNING"
            alive.add(replacement)
            await _until(lambda: registry.layout == (replacement,) and not recovery.recovering, 10 * wait_s)
        finally:
            for task in tasks:
                task.cancel()

    asyncio.run(run())
    (event,) = recovery.events
    assert event.lost == [0] and event.error is None and event.whole_s is not None, event
    assert event.attempts >= 2 and event.epoch == registry.layout_epoch > 0, event
    assert registry.plan is None and registry.ffn[1].state is MemberState.READY
    assert [m.rank for m in registry.listed_ffn()] == [1]  # the lost rank is retired once whole again


def test_gone_attention_ranks_leave_the_listing_once_the_pool_is_whole() -> None:
    """2A: attention rank 0's replica vanishes (SIGKILL): it is GONE and still listed
    (its FFN peer drops it), until Serve's replacement is READY; then `/afd/status`
    no longer lists it, and its record stays GONE (a late poll never rejoins it).
    Before, every GONE attention rank was listed for ever."""
    cfg = AFDConfig.model_validate({"attention": {"num_ranks": 2}})
    registry = Registry("gloo", cfg.connector.timeout_s, 1)
    registry.add_ffn(FFNAddress("127.0.0.1", 1, 2), replica="ffn#0")
    serve = _Serve(**{"a#0": "RUNNING", "a#1": "RUNNING"})
    for replica in ("a#0", "a#1"):
        registry.set_attention(registry.add_attention(replica).rank, MemberState.READY)
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale, replicas=serve)

    def listed() -> list[tuple[int, MemberState]]:
        return [(m.rank, m.state) for m in registry.listed_attention()]

    async def run() -> None:
        watch = asyncio.create_task(resizer.watch_replicas())
        try:
            del serve.states["a#0"]  # SIGKILL
            await _until(lambda: registry.attention[0].state is MemberState.GONE, 10)
            await asyncio.sleep(1.0)  # two more watch periods: not whole, so still listed
            assert listed() == [(0, MemberState.GONE), (1, MemberState.READY)]
            assert registry.ffn_directive(0, 0).dead_peers == [0]
            replacement = registry.add_attention("a#2").rank
            serve.states["a#2"] = "RUNNING"
            registry.set_attention(replacement, MemberState.READY)
            await _until(lambda: listed() == [(1, MemberState.READY), (2, MemberState.READY)], 10)
        finally:
            watch.cancel()

    asyncio.run(run())
    assert registry.attention[0].state is MemberState.GONE and registry.add_attention("a#3").rank == 3


def test_attention_ranks_whose_start_failed_are_gone_and_not_listed() -> None:
    """2A at most (`attention.max_ranks` 2), one READY: the second replica's engine
    fails at start on every Serve retry. A failed start the rank reports itself, and
    one whose replica vanished while STARTING (the report never reached the
    coordinator), are GONE and not listed, not counted in the pool size, and their
    FFN peer is told to drop them; `/afd/status` never lists more than 2 attention
    ranks. Before, nothing unregistered them: each retry left a STARTING rank listed
    and counted for ever (3 listed for `max_ranks` 2)."""
    cfg = AFDConfig.model_validate({"attention": {"num_ranks": 2, "max_ranks": 2}})
    registry = Registry("gloo", cfg.connector.timeout_s, 1)
    registry.add_ffn(FFNAddress("127.0.0.1", 1, 2), replica="ffn#0")
    serve = _Serve(**{"a#0": "RUNNING"})
    registry.set_attention(registry.add_attention("a#0").rank, MemberState.READY)
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale, replicas=serve)
    recovery = Recovery(registry, resizer, "afd", cfg.ffn.heartbeat_timeout_s, 10.0, replicas=serve)
    view = StatusView(registry, resizer, recovery, SignalAggregator())

    def listed() -> list[tuple[int, MemberState]]:
        return [(m.rank, m.state) for m in view.status({}, False, False, None).attention]

    async def run() -> None:
        watch = asyncio.create_task(resizer.watch_replicas())
        try:
            serve.states["a#1"] = "STARTING"
            reported = registry.add_attention("a#1").rank
            assert listed() == [(0, MemberState.READY), (reported, MemberState.STARTING)]
            assert registry.attention_failed(reported)  # `AttentionServer._failed_start`
            assert not registry.attention_failed(reported)  # a second report changes nothing
            assert listed() == [(0, MemberState.READY)]
            del serve.states["a#1"]

            serve.states["a#2"] = "STARTING"  # Serve's retry; its report is lost
            silent = registry.add_attention("a#2").rank
            assert listed() == [(0, MemberState.READY), (silent, MemberState.STARTING)]
            await asyncio.sleep(1.0)  # two watch periods: a starting replica is left alone
            assert registry.attention[silent].state is MemberState.STARTING
            del serve.states["a#2"]
            await _until(lambda: registry.attention[silent].state is MemberState.GONE, 10)
            assert listed() == [(0, MemberState.READY)]
        finally:
            watch.cancel()

    asyncio.run(run())
    assert registry.attention[1].state is registry.attention[2].state is MemberState.GONE
    assert registry.ffn_directive(0, 0).dead_peers == [1, 2]
    assert view.pool_load() is not None and view.pool_load().attention_ranks == 1
    assert live_count(registry.attention) == 1  # the pool size the metrics and resizes count
    assert registry.attention_directive(2).state is MemberState.GONE  # a late poll reads GONE, never rejoins
