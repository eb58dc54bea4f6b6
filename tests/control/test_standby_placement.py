"""Standby FFN ranks (`ffn.standby_ranks`) in the coordinator's pure parts and its
recovery, without Ray: the real placement functions, registry, resizer and recovery,
with Serve's replica states and replica count as the test sets them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from afd_ray.config import AFDConfig
from afd_ray.connector.header import FFNAddress
from afd_ray.control import resize
from afd_ray.control.membership import FFNMember, LoopState, MemberState, ScaleRequest
from afd_ray.control.placement import serving_ffn, stands_by, takers
from afd_ray.control.recovery import Recovery
from afd_ray.control.registry import Registry
from afd_ray.control.resize import FFN_DEPLOYMENT, Resizer
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.models.tiny import build_tiny
from afd_ray.weights import resident_bytes


def _member(rank: int, state: MemberState, loop: LoopState | None = None) -> FFNMember:
    return FFNMember(rank=rank, address=FFNAddress("127.0.0.1", 10 + rank, 20 + rank), state=state, loop=loop)


def test_the_key_is_validated_and_named() -> None:
    assert AFDConfig().ffn.standby_ranks == 0
    with pytest.raises(ValidationError, match=r"ffn\.standby_ranks|standby_ranks"):
        AFDConfig.model_validate({"ffn": {"standby_ranks": -1}})
    with pytest.raises(ValidationError, match="standby_ranks"):
        AFDConfig.model_validate({"ffn": {"standby_ranks": "1"}})  # no coercion


def test_takers_are_loaded_standbys_then_joiners_then_loading_standbys() -> None:
    ffn = {
        0: _member(0, MemberState.READY, LoopState.SERVING),
        1: _member(1, MemberState.STANDBY),  # still loading: no report yet
        2: _member(2, MemberState.STARTING),
        3: _member(3, MemberState.STANDBY, LoopState.SERVING),
        4: _member(4, MemberState.GONE),
    }
    assert takers(ffn, (0,)) == (3, 2, 1)
    assert serving_ffn(ffn) == [0, 2]  # a standby is no serving capacity


def test_a_new_rank_stands_by_unless_a_loss_or_a_scale_out_needs_it() -> None:
    ready = {0: _member(0, MemberState.READY, LoopState.SERVING)}
    assert not stands_by(ready, (0,), (), 1, 0)  # no standby configured: as before
    assert stands_by(ready, (0,), (), 1, 1)  # the layout is whole
    assert not stands_by({}, (), (), 1, 1)  # the loss of the only rank, no standby: it joins
    standby = {1: _member(1, MemberState.STANDBY, LoopState.SERVING)}
    assert stands_by(standby, (), (), 1, 1)  # the standby takes the loss: the new one stands by
    assert not stands_by(ready | standby, (0,), (), 3, 1)  # scale-out to 3: the standby and this one join
    assert stands_by(ready | standby, (0,), (0, 1), 2, 1)  # scale-out to 2 planned with the standby


def test_registry_standby_state_and_assignment() -> None:
    registry = Registry("gloo", 60.0, 1)
    first = registry.add_ffn(FFNAddress("127.0.0.1", 1, 2), "ffn#0", standby=True)
    assert registry.ffn[first].state is MemberState.STARTING and registry.layout == (first,)  # the first layout
    spare = registry.add_ffn(FFNAddress("127.0.0.1", 3, 4), "ffn#1", standby=True)
    assert registry.ffn[spare].state is MemberState.STANDBY and spare not in registry.layout
    assignment = registry.standby_assignment(spare)
    assert assignment.standby and (assignment.ep_rank, assignment.ep_size, assignment.ranks) == (0, 1, ())
    assert (assignment.host, assignment.store_port) == ("127.0.0.1", 3)
    assert MemberState.STANDBY.to(MemberState.READY) is MemberState.READY
    with pytest.raises(ValueError, match="standby"):
        MemberState.READY.to(MemberState.STANDBY)


class _Serve:
    """Serve's replica states of the FFN deployment, as the test sets them."""

    def __init__(self, **states: str) -> None:
        self.states = states

    async def __call__(self, app: str, deployment: str) -> dict[str, str]:
        return dict(self.states)


async def _until(condition: Callable[[], bool], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _serve_plans(registry: Registry) -> None:
    """Every live FFN rank, as its reports tell the coordinator: it prepares a pending
    plan it is in or leaves by, and serves (or left at) its epoch."""
    while True:
        plan = registry.plan
        if plan is not None:
            for rank in (*plan.ranks, *([] if plan.leaving is None else [plan.leaving])):
                if registry.ffn[rank].state is not MemberState.GONE:
                    registry.update_ffn(rank, epoch=plan.epoch)
            await registry.notify()
        await asyncio.sleep(0.02)


def _standby_app(num_ranks: int) -> tuple[Registry, Resizer, Recovery, _Serve]:
    """`num_ranks` FFN ranks serving the first layout (EP order = rank order) and one
    loaded standby, registered as the coordinator registers them."""
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": num_ranks, "standby_ranks": 1}})
    registry = Registry("gloo", 60.0, num_ranks)
    serve = _Serve()
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale, replicas=serve)
    for rank in range(num_ranks + 1):
        registry.add_ffn(FFNAddress("127.0.0.1", 10 + rank, 20 + rank), f"ffn#{rank}", standby=resizer.stands_by())
        serve.states[f"ffn#{rank}"] = "RUNNING"
    for rank in range(num_ranks):
        registry.update_ffn(rank, state=MemberState.READY, ep_rank=rank, epoch=0, loop=LoopState.SERVING)
    registry.update_ffn(num_ranks, loop=LoopState.SERVING)  # loaded, reported
    recovery = Recovery(registry, resizer, "afd", cfg.ffn.heartbeat_timeout_s, 30.0, replicas=serve)
    return registry, resizer, recovery, serve


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_the_standby_takes_the_lost_ep_rank_at_once_and_the_replacement_stands_by(num_ranks: int) -> None:
    """F ranks + 1 standby: EP rank 0's replica vanishes (SIGKILL). The recovery takes
    the standby into the layout at EP rank 0 under a new epoch without any new rank
    registering (the survivors keep their EP ranks); Serve's replacement, registering
    afterwards, stands by. Before, the recovery waited for Serve's replacement."""
    registry, resizer, recovery, serve = _standby_app(num_ranks)
    spare = num_ranks
    assert registry.ffn[spare].state is MemberState.STANDBY and registry.layout == tuple(range(num_ranks))

    async def run() -> None:
        tasks = [asyncio.create_task(recovery.watch()), asyncio.create_task(_serve_plans(registry))]
        try:
            del serve.states["ffn#0"]
            await _until(lambda: not recovery.recovering and registry.layout[:1] == (spare,), 10)
        finally:
            for task in tasks:
                task.cancel()

    asyncio.run(run())
    assert registry.layout == (spare, *range(1, num_ranks)) and registry.ffn[spare].state is MemberState.READY
    (event,) = recovery.events
    assert event.lost == [0] and event.error is None and event.attempts == 1, event
    assert registry.ffn[0].state is MemberState.GONE and 0 in registry.retired
    assert resizer.stands_by()  # the layout is whole: Serve's replacement stands by
    replacement = registry.add_ffn(FFNAddress("127.0.0.1", 99, 98), "ffn#9", standby=resizer.stands_by())
    assert registry.ffn[replacement].state is MemberState.STANDBY


def test_a_lost_standby_is_only_retired() -> None:
    """The standby's replica vanishes: no loss of the layout, no recovery event; its
    record is GONE and no longer listed."""
    registry, _, recovery, serve = _standby_app(1)

    async def run() -> None:
        watch = asyncio.create_task(recovery.watch())
        try:
            del serve.states["ffn#1"]
            await _until(lambda: registry.ffn[1].state is MemberState.GONE, 10)
        finally:
            watch.cancel()

    asyncio.run(run())
    assert recovery.events == [] and registry.layout == (0,) and [m.rank for m in registry.listed_ffn()] == [0]


def test_scale_in_where_serve_stops_the_standby(monkeypatch: pytest.MonkeyPatch) -> None:
    """2F + 1 standby -> 1F. Serve picks the standby to stop: it leaves at once, so
    Serve is asked for one replica fewer, stops a layout rank (its scale-in hands its
    peers over), and is then asked for the standby again: target + 1 replicas."""
    registry, resizer, _, _ = _standby_app(2)
    asked: list[int] = []

    async def set_num_replicas(app: str, deployment: str, num_replicas: int) -> None:
        assert deployment == FFN_DEPLOYMENT
        asked.append(num_replicas)

    monkeypatch.setattr(resize, "set_num_replicas", set_num_replicas)

    async def run() -> None:
        plans = asyncio.create_task(_serve_plans(registry))
        scale = asyncio.create_task(resizer.scale(ScaleRequest(attention=1, ffn=1), "manual"))
        try:
            await _until(lambda: asked == [2, 2], 10)
            await resizer.ffn_leaving(2)  # Serve stopped the standby
            await _until(lambda: asked[-1] == 1, 10)
            await resizer.ffn_leaving(1)  # then a layout rank
            event = await asyncio.wait_for(scale, 10)
            assert event.error is None, event
        finally:
            plans.cancel()

    asyncio.run(run())
    assert registry.layout == (0,) and asked == [2, 2, 1, 2], asked
    assert registry.ffn[2].state is MemberState.GONE and registry.ffn[1].state is MemberState.GONE


def test_a_standby_holds_every_expert_and_takes_an_ep_rank_without_loading(tmp_path: Path) -> None:
    """What a standby costs and saves (tiny Qwen3-MoE, float32, CPU): its stack (EP rank
    0 of 1, `Registry.standby_assignment`) holds every routed expert, F times an EP-F
    rank's, and the rest as an EP rank does; taking EP rank 1 of 2 copies that shard
    from it and reads nothing from the checkpoint (`loaded_bytes` 0), giving the
    tensors an EP rank loading from the checkpoint gets."""
    checkpoint = build_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    cpu = torch.device("cpu")
    standby = load_ffn_stack(checkpoint, torch.float32, cpu, 0, 1)
    loaded = load_ffn_stack(checkpoint, torch.float32, cpu, 1, 2)
    taken = load_ffn_stack(checkpoint, torch.float32, cpu, 1, 2, reuse=standby)
    held, shard = resident_bytes(standby), resident_bytes(loaded)
    experts = [name for name in held if ".experts." in name]
    assert experts and all(held[name] == 2 * shard[name] for name in experts), (held, shard)
    assert all(held[name] == shard[name] for name in held if name not in experts), (held, shard)
    assert taken.loaded_bytes == 0 and loaded.loaded_bytes == sum(shard.values())
    for (name, mine), (_, reference) in zip(taken.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(mine, reference), name
    print(f"\nstandby stack {sum(held.values())} B, EP2 shard {sum(shard.values())} B (tiny Qwen3-MoE, float32)")
