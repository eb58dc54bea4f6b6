"""EPLB in the coordinator without Ray (`afd_ray.control.eplb`): the real registry and
resizer, FFN ranks played by the test through the coordinator's calls (their reports
and the plans they serve), and the `ffn.eplb` config."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from afd_ray.config import AFDConfig
from afd_ray.connector.header import FFNAddress
from afd_ray.control.eplb import EPLBController
from afd_ray.control.membership import FFNDirective
from afd_ray.control.registry import Plan, Registry
from afd_ray.control.resize import Resizer
from afd_ray.eplb.slots import layer_placements

SKEWED = [[[60, 50, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 30, 40]], [[40, 40, 0, 0, 0, 0, 0, 0], [0] * 6 + [20, 30]]]
"""Window loads `[L][E]` reported by FFN ranks 0 and 1: both route most rows to experts
0-1 in layer 0 and 6-7 in layer 1, each a block of one rank."""


def _controller(config: dict) -> tuple[Registry, EPLBController]:
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": 2, "min_ranks": 2, "eplb": config}})
    registry = Registry("gloo", cfg.connector.timeout_s, 2)
    for rank in range(2):
        registry.add_ffn(FFNAddress("127.0.0.1", 1 + rank, 2), replica=f"ffn#{rank}")
    registry.switch_layout(Plan(0, registry.layout, None))
    for rank in registry.layout:
        registry.update_ffn(rank, epoch=0)
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale)
    return registry, EPLBController(cfg.ffn.eplb, registry, resizer, metrics=False)


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
