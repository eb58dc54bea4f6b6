"""EPLB in the coordinator without Ray (`afd_ray.control.eplb`): the real registry and
resizer, FFN ranks played by the test through the coordinator's calls (their reports
and the plans they serve), and the `ffn.eplb` config."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection

import pytest
from pydantic import ValidationError

from afd_ray.config import AFDConfig
from afd_ray.connector.header import FFNAddress
from afd_ray.control.eplb import EPLBController
from afd_ray.control.membership import FFNDirective, FFNMember, MemberState
from afd_ray.control.registry import Plan, Registry
from afd_ray.control.resize import Resizer
from afd_ray.eplb.slots import layer_placements

SKEWED = [[[60, 50, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 30, 40]], [[40, 40, 0, 0, 0, 0, 0, 0], [0] * 6 + [20, 30]]]
"""Window loads `[L][E]` reported by FFN ranks 0 and 1: both route most rows to experts
0-1 in layer 0 and 6-7 in layer 1, each a block of one rank."""


def _controller(config: dict, dead: Callable[[], Collection[int]] = tuple) -> tuple[Registry, EPLBController]:
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": 2, "min_ranks": 2, "eplb": config}})
    registry = Registry("gloo", cfg.connector.timeout_s, 2)
    for rank in range(2):
        registry.add_ffn(FFNAddress("127.0.0.1", 1 + rank, 2), replica=f"ffn#{rank}")
    registry.switch_layout(Plan(0, registry.layout, None))
    for rank in registry.layout:
        registry.update_ffn(rank, epoch=0)
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale)
    return registry, EPLBController(cfg.ffn.eplb, registry, resizer, metrics=False, dead=dead)


async def _serve_plans(registry: Registry, eplb: EPLBController, seen: list[FFNDirective]) -> None:
    """Both FFN ranks: take the directive of their report, serve the plan's epoch."""
    while True:
        for rank in registry.layout:
            directive = eplb.directive(registry.ffn_directive(rank, registry.ffn[rank].epoch))
            if directive.plan is not None:
                seen.append(directive)
                registry.update_ffn(rank, epoch=directive.plan.epoch)
        await registry.notify()
        await asyncio.sleep(0.01)


def test_status_shows_the_pools_balancedness_per_layer() -> None:
    registry, eplb = _controller({})
    assert eplb.status() is None
    for rank, load in enumerate(SKEWED):
        eplb.report(rank, load)
    status = eplb.status()
    assert status is not None and not status.enabled and status.placements == []
    # layer 0: rank 0 computes 60+50+1+1+40+40 = 192 rows, rank 1 4: mean 98 over max 192
    assert status.balancedness == pytest.approx([98 / 192, 63 / 122])
    assert status.rank_rows == [192 + 4, 4 + 122] and status.window_rows == 322
    eplb.report(1, None)  # a dense model reports nothing: the latest window stays
    assert eplb.status() == status


@pytest.mark.parametrize("redundant", [0, 2])
def test_a_rebalance_switches_the_layout_to_the_balanced_placement(redundant: int) -> None:
    registry, eplb = _controller({"num_redundant_experts": redundant})
    for rank, load in enumerate(SKEWED):
        eplb.report(rank, load)
    seen: list[FFNDirective] = []

    async def run():
        ranks = asyncio.create_task(_serve_plans(registry, eplb, seen))
        try:
            return await asyncio.wait_for(eplb.rebalance("manual"), 10)
        finally:
            ranks.cancel()

    epoch_before = registry.layout_epoch
    event = asyncio.run(run())
    assert event.error is None and event.epoch == registry.layout_epoch > epoch_before
    assert event.layers_moved == 2
    assert event.balancedness_before < 0.52 and event.balancedness_after > 0.9
    status = eplb.status()
    assert status.balancedness == pytest.approx([event.balancedness_after] * 2, abs=0.05)
    assert status.num_redundant_experts == redundant and len(status.placements) == 2
    # every rank was told the new placement with its plan, and a rank joining later gets it too
    placements = {d.plan.assignment.placements for d in seen}
    assert len(placements) == 1 and layer_placements(placements.pop())[0].slots == tuple(
        tuple(rank) for rank in status.placements[0]
    )
    assert eplb.assign(registry.ep_assignment(0, registry.layout, registry.layout_epoch)).placements is not None
    # the same load again: nothing gains min_gain, nothing moves
    again = asyncio.run(eplb.rebalance("manual"))
    assert again.epoch is None and again.error is None and again.layers_moved == 0
    assert registry.layout_epoch == event.epoch


def test_a_rebalance_may_ask_for_fewer_redundant_experts_than_configured() -> None:
    """`POST /afd/eplb {"num_redundant_experts": R}`: R in [0, configured] places that
    many replicas this time (0 first, then the configured 2 from that placement); more
    than configured, or fewer than 0, is refused before anything starts."""
    registry, eplb = _controller({"num_redundant_experts": 2})
    for rank, load in enumerate(SKEWED):
        eplb.report(rank, load)
    for bad in (3, -1):
        with pytest.raises(ValueError, match=r"^num_redundant_experts: .* outside \[0, 2\]"):
            asyncio.run(eplb.rebalance("manual", bad))
    assert eplb.events == []

    shown = []

    async def run():
        ranks = asyncio.create_task(_serve_plans(registry, eplb, []))
        try:
            for redundant in (0, 2):
                event = await asyncio.wait_for(eplb.rebalance("manual", redundant), 10)
                assert event.error is None and event.epoch == registry.layout_epoch, event
                assert event.layers_moved == 2, event
                status = eplb.status()
                assert status.num_redundant_experts == redundant and all(
                    len(rank) == (8 + redundant) // 2 for slots in status.placements for rank in slots
                ), status.placements
                shown.append((event.balancedness_before, event.balancedness_after))
        finally:
            ranks.cancel()

    asyncio.run(run())
    # skewed blocks -> no replica -> 2 replicas: each step raises the balancedness
    (before, middle), (again, after) = shown
    assert before < 0.52 < middle < after and middle == pytest.approx(again), shown


def test_a_rebalance_without_load_or_during_a_resize_is_refused() -> None:
    registry, eplb = _controller({})
    assert "no expert load" in asyncio.run(eplb.rebalance("manual")).error
    for rank in range(2):  # MoE ranks that served no step yet report windows of zeros
        eplb.report(rank, [[0] * 8, [0] * 8])
    assert eplb.status() is None  # a fresh-user trial saw balancedness 1.0 and a 200 with epoch null
    assert "no expert load" in asyncio.run(eplb.rebalance("manual")).error
    for rank, load in enumerate(SKEWED):
        eplb.report(rank, load)
    registry.plan = Plan(registry.next_epoch(), registry.layout, None)  # a layout change pending
    event = asyncio.run(eplb.rebalance("manual"))
    assert "layout is changing" in event.error and event.epoch is None
    assert [e.error is not None for e in eplb.events] == [True, True, True]
    # a refusal reads no load: no balancedness (it said 1.0 before and after)
    assert all(e.balancedness_before is None is e.balancedness_after for e in eplb.events)


@pytest.mark.parametrize(
    ("ffn", "key"),
    [
        ({"eplb": {"window_size": 0}}, "window_size"),
        ({"eplb": {"balancedness_bound": 1.5}}, "balancedness_bound"),
        ({"eplb": {"step_interval": "10"}}, "step_interval"),
        ({"eplb": {"num_redundant_experts": 2}}, "ffn.eplb.num_redundant_experts"),  # min_ranks 1
        ({"eplb": {"window": 5}}, "window"),
    ],
)
def test_bad_eplb_config_names_the_key(ffn: dict, key: str) -> None:
    with pytest.raises(ValidationError, match=key):
        AFDConfig.model_validate({"ffn": ffn})
    assert AFDConfig.model_validate({"ffn": {"min_ranks": 2, "num_ranks": 2, "eplb": {"num_redundant_experts": 2}}})


def test_the_policy_rebalances_every_step_interval_under_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """`enabled`: once the serving layout's first rank has stepped `step_interval` more
    steps, a mean balancedness under the bound starts a rebalance (`policy`); over
    the bound (or disabled) nothing moves."""
    monkeypatch.setattr("afd_ray.control.eplb._PERIOD_S", 0.01)

    async def run(config: dict, steps: int, wait_s: float = 0.3) -> list:
        registry, eplb = _controller(config)
        for rank, load in enumerate(SKEWED):
            eplb.report(rank, load)
        seen: list[FFNDirective] = []
        tasks = [asyncio.create_task(_serve_plans(registry, eplb, seen)), asyncio.create_task(eplb.run())]
        try:
            await asyncio.sleep(0.1)
            assert eplb.events == []  # no step yet
            registry.update_ffn(registry.layout[0], steps=steps)
            deadline = asyncio.get_running_loop().time() + wait_s
            while not eplb.events and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
        finally:
            for task in tasks:
                task.cancel()
        return eplb.events

    (event,) = asyncio.run(run({"enabled": True, "step_interval": 10, "log_balancedness": True}, 10, wait_s=5))
    assert event.reason == "policy" and event.error is None and event.epoch is not None
    assert asyncio.run(run({"enabled": True, "step_interval": 10}, 9)) == []  # not yet due
    assert asyncio.run(run({"enabled": True, "step_interval": 10, "balancedness_bound": 0.5}, 10)) == []
    assert asyncio.run(run({"enabled": False, "step_interval": 10}, 10)) == []


def _plan(registry: Registry, ranks: tuple[int, ...]) -> Plan:
    """A resize or recovery publishes the plan of a new layout over `ranks`."""
    for rank in set(ranks) - set(registry.ffn):
        assert registry.add_ffn(FFNAddress("127.0.0.1", 1 + rank, 2), replica=f"ffn#{rank}") == rank
    registry.plan = Plan(registry.next_epoch(), ranks, None)
    return registry.plan


def test_a_resize_or_recovery_keeps_the_placement_policy() -> None:
    """A rebalanced pool resized to 3 ranks: the new layout's placement is the policy's
    for 3 ranks (`redundant_for`: 8 + 1 slots), the same for every rank of it and for a
    rank that joins later; a recovery at the serving size keeps the serving placement
    (balanced already: the replacement loads the lost rank's slots)."""
    registry, eplb = _controller({"num_redundant_experts": 2})
    for rank, load in enumerate(SKEWED):
        eplb.report(rank, load)

    async def rebalance():
        ranks = asyncio.create_task(_serve_plans(registry, eplb, []))
        try:
            return await asyncio.wait_for(eplb.rebalance("manual"), 10)
        finally:
            ranks.cancel()

    assert asyncio.run(rebalance()).epoch is not None
    serving = eplb.placed(registry.layout_epoch)
    plan = _plan(registry, (0, 1, 2))
    given = [eplb.assign(registry.ep_assignment(rank, plan.ranks, plan.epoch)).placements for rank in plan.ranks]
    assert given[0] is not None and given.count(given[0]) == 3
    assert all(len(slots) == 3 and {len(rank) for rank in slots} == {3} for slots in given[0])
    assert eplb.directive(registry.ffn_directive(0, registry.layout_epoch)).plan.assignment.placements == given[0]
    for rank in range(2):  # the load changes once the plan's placement is fixed: it stays
        eplb.report(rank, [[1] * 8, [1] * 8])
    assert eplb.assign(registry.ep_assignment(2, plan.ranks, plan.epoch)).placements == given[0]
    registry.plan = None
    for rank, load in enumerate(SKEWED):
        eplb.report(rank, load)
    recovery = _plan(registry, (0, 3))  # rank 1 lost, rank 3 replaces it at EP rank 1
    assert eplb.assign(registry.ep_assignment(3, recovery.ranks, recovery.epoch)).placements == serving


def test_without_eplb_in_use_a_new_layout_stays_contiguous() -> None:
    """`enabled` false and no rebalance yet: a resize keeps the contiguous blocks
    (the deployment never asked for EPLB); `enabled`: the policy places it."""
    for config, contiguous in (({}, True), ({"enabled": True}, False)):
        registry, eplb = _controller(config)
        for rank, load in enumerate(SKEWED):
            eplb.report(rank, load)
        plan = _plan(registry, (0, 1, 2, 3))
        placements = eplb.assign(registry.ep_assignment(3, plan.ranks, plan.epoch)).placements
        assert (placements is None) is contiguous, placements
    registry, eplb = _controller({"enabled": True})  # no load yet: contiguous
    plan = _plan(registry, (0, 1, 2, 3))
    assert eplb.assign(registry.ep_assignment(3, plan.ranks, plan.epoch)).placements is None


def test_a_rank_found_dead_ends_the_rebalance_at_once() -> None:
    """An FFN rank of the layout dies while the ranks prepare the rebalance's layout:
    the rebalance fails within about `WATCH_PERIOD_S` (not `resize_timeout_s`), the plan
    is dropped and the layout lock free, so the recovery runs at once."""
    dead: set[int] = set()
    registry, eplb = _controller({}, lambda: dead)
    for rank, load in enumerate(SKEWED):
        eplb.report(rank, load)

    async def run():
        rebalance = asyncio.create_task(eplb.rebalance("manual"))
        await registry.wait(lambda: registry.plan is not None, 5)
        registry.update_ffn(0, epoch=registry.plan.epoch)  # rank 0 prepared it; rank 1 dies first
        dead.add(1)
        return await asyncio.wait_for(rebalance, 5)

    event = asyncio.run(run())
    assert event.epoch is None and "FFN ranks [1] died" in event.error, event
    # found by a new-user trial: the failed switch said 12 layers moved, and its error began "RuntimeError: "
    assert event.layers_moved == 0 and event.balancedness_after == event.balancedness_before, event
    assert event.error.startswith("FFN ranks [1] died"), event
    assert registry.plan is None and registry.layout_epoch == 0
    assert eplb.status().placements == []  # the serving layout is unchanged


def test_a_restarted_coordinator_recovers_the_placement_from_the_rejoining_ranks() -> None:
    """The layout of epoch 4 serves a rebalanced placement when the coordinator
    restarts: the ranks rejoin with it (`Coordinator.rejoin_ffn`), so `/afd/status`
    shows it, not the contiguous blocks, and a recovery at that size keeps it. Before,
    the restarted coordinator showed the layout as contiguous until the next rebalance
    (the ranks kept serving theirs), and a recovery then planned against the blocks."""
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": 2, "min_ranks": 2, "eplb": {"num_redundant_experts": 2}}})
    registry = Registry("gloo", cfg.connector.timeout_s, 2)
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale)
    eplb = EPLBController(cfg.ffn.eplb, registry, resizer, metrics=False)
    serving = (((0, 1, 2, 3, 6), (0, 1, 4, 5, 7)), ((0, 1, 2, 6, 7), (2, 3, 4, 5, 6)))
    for rank in range(2):
        member = FFNMember(
            rank=rank, address=FFNAddress("127.0.0.1", 1 + rank, 2), replica=f"ffn#{rank}", state=MemberState.READY
        )
        registry.rejoin_ffn(member.model_copy(update={"epoch": 4, "ep_rank": rank}), (0, 1), 4)
        eplb.rejoined(4, [[list(r) for r in slots] for slots in serving])  # as Ray hands them over
        eplb.report(rank, SKEWED[rank])
    assert registry.layout == (0, 1) and registry.layout_epoch == 4
    status = eplb.status()
    assert status.placements == [[list(r) for r in slots] for slots in serving]
    assert status.num_redundant_experts == 2
    eplb.rejoined(4, None)  # a later rank cannot replace what the layout holds
    assert eplb.placed(4) == serving
    recovery = _plan(registry, (0, 2))  # rank 1 lost after the restart; rank 2 replaces it
    placed = eplb.assign(registry.ep_assignment(2, recovery.ranks, recovery.epoch)).placements
    assert placed is not None and placed[0] == serving[0], placed  # balanced: kept
