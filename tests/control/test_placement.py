"""The coordinator's pure placement functions and its registry, without Ray: peer
assignment, rebalance onto a new FFN layout, bounds, and the FFN directive."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from afd_ray.config import AttentionPoolConfig, FFNPoolConfig
from afd_ray.connector.header import FFNAddress
from afd_ray.control.membership import AttentionMember, FFNMember, LoopState, MemberState
from afd_ray.control.placement import (
    check_sizes,
    clamp,
    joining,
    least_loaded,
    live_count,
    peer_load,
    rebalance_moves,
    reformed_layout,
)
from afd_ray.control.registry import Plan, Registry

READY, STARTING, DRAINING, GONE = MemberState.READY, MemberState.STARTING, MemberState.DRAINING, MemberState.GONE


def _members(*peers: tuple[int, MemberState]) -> dict[int, AttentionMember]:
    return {r: AttentionMember(rank=r, ffn_peer=p, state=s) for r, (p, s) in enumerate(peers)}


def _apply(attention: dict[int, AttentionMember], moves: list[tuple[int, int]]) -> dict[int, AttentionMember]:
    out = dict(attention)
    for rank, peer in moves:
        out[rank] = out[rank].model_copy(update={"ffn_peer": peer})
    return out


def test_least_loaded_breaks_ties_by_lowest_rank() -> None:
    assert least_loaded({0: 1, 1: 0, 2: 0}) == 1
    assert least_loaded({3: 2, 1: 2}) == 1
    with pytest.raises(ValueError):
        least_loaded({})


def test_peer_load_ignores_gone_and_outside_ranks() -> None:
    attention = _members((0, READY), (0, GONE), (1, STARTING), (5, READY), (1, DRAINING))
    assert peer_load(attention, (0, 1)) == {0: 1, 1: 2}


def test_new_ranks_spread_floor_ceil() -> None:
    for num_ffn, num_attention in itertools.product(range(1, 5), range(0, 11)):
        registry = Registry("gloo", 1.0, num_ffn)
        for _ in range(num_ffn):
            registry.add_ffn(FFNAddress("127.0.0.1", 1, 2))
        for _ in range(num_attention):
            registry.add_attention("replica")
        load = peer_load(registry.attention, registry.layout)
        assert max(load.values()) - min(load.values()) <= 1
        assert sum(load.values()) == num_attention


def test_rebalance_moves_strays_off_a_leaving_rank() -> None:
    attention = _members((0, READY), (1, READY), (1, READY), (0, READY))
    moves = rebalance_moves(attention, (0,))  # FFN rank 1 leaves
    assert moves == [(1, 0), (2, 0)]
    assert set(peer_load(_apply(attention, moves), (0,)).values()) == {4}


def test_rebalance_moves_onto_a_new_rank() -> None:
    attention = _members((0, READY), (0, READY), (0, READY), (0, READY))
    moves = rebalance_moves(attention, (0, 1))  # FFN rank 1 joins
    assert moves == [(0, 1), (1, 1)]
    assert rebalance_moves(_apply(attention, moves), (0, 1)) == []


def test_rebalance_never_moves_starting_or_draining_ranks() -> None:
    # The busiest FFN rank has no READY peer: the coordinator's loop raised
    # StopIteration here (inside a resize: RuntimeError) before the split.
    attention = _members((0, STARTING), (0, DRAINING), (0, STARTING))
    assert rebalance_moves(attention, (0, 1)) == []
    assert rebalance_moves(_members((0, STARTING), (0, STARTING), (0, STARTING), (1, READY)), (0, 1, 2)) == []
    # a STARTING rank stranded on a leaving FFN rank is not moved either (it is not READY)
    assert rebalance_moves(_members((1, STARTING), (0, READY)), (0,)) == []


def test_rebalance_always_balances_ready_ranks() -> None:
    rng = random.Random(0)
    for _ in range(300):
        old = rng.randint(1, 4)
        new = tuple(sorted(rng.sample(range(6), rng.randint(1, 4))))
        attention = _members(
            *[(rng.randrange(old), rng.choice([READY, READY, GONE])) for _ in range(rng.randint(0, 9))]
        )
        after = _apply(attention, rebalance_moves(attention, new))
        load = peer_load(after, new)
        assert max(load.values()) - min(load.values()) <= 1, (attention, new)
        assert all(m.ffn_peer in new for m in after.values() if m.state is READY)
        assert all(after[r] == attention[r] for r in attention if attention[r].state is GONE)


def test_a_reformed_layout_keeps_the_survivors_ep_ranks() -> None:
    """After losing EP rank 0 of (0, 1), the survivor 1 stays EP rank 1 (it reloads
    nothing) and the replacement 2 takes the lost slot (it used to become EP rank 1
    and rank 1 moved to EP rank 0, reloading every expert of both)."""
    assert reformed_layout((0, 1), (1,), (2,), 2) == (2, 1)
    assert reformed_layout((0, 1), (0,), (2,), 2) == (0, 2)
    assert reformed_layout((0, 1, 2), (0, 2), (5, 6), 3) == (0, 5, 2)
    assert reformed_layout((0,), (), (1,), 1) == (1,)  # 1A:1F: the replacement alone
    assert reformed_layout((0, 1), (1,), (2, 3), 3) == (2, 1, 3)  # grown to the target
    assert reformed_layout((0, 1, 2), (2,), (4,), 3) == (4, 2)  # too few ranks: a smaller layout


def test_a_reformed_layout_under_a_smaller_target_keeps_every_live_rank_it_can() -> None:
    """The FFN target shrank (a scale-in) when a rank of the old layout was lost: the
    survivors past the new target fill the lost slots, EP ranks 0..n-1. Before, a
    survivor whose EP rank was not below the target was dropped: the survivor of EP2
    after losing EP rank 0 with target 1 gave an empty layout (which the recovery
    then switched to), and losing EP rank 0 of three with target 2 left one rank."""
    assert reformed_layout((0, 1), (1,), (), 1) == (1,)
    assert reformed_layout((0, 1, 2), (1, 2), (), 2) == (2, 1)
    assert reformed_layout((0, 1, 2), (1, 2), (5,), 2) == (2, 1)  # a live rank before a replacement
    assert reformed_layout((0, 1, 2), (0, 2), (), 2) == (0, 2)  # rank 1 lost: 2 moves to EP rank 1


def test_joining_and_live_count() -> None:
    address = FFNAddress("h", 1, 2)
    ffn = {
        0: FFNMember(rank=0, address=address, state=READY),
        1: FFNMember(rank=1, address=address),
        2: FFNMember(rank=2, address=address, state=GONE),
        3: FFNMember(rank=3, address=address),
    }
    assert joining(ffn, (0,)) == (1, 3)
    assert joining(ffn, (0, 3)) == (1,)
    assert live_count(ffn) == 3


def test_bounds_name_the_field() -> None:
    attention = AttentionPoolConfig(num_ranks=1, min_ranks=1, max_ranks=3)
    ffn = FFNPoolConfig(num_ranks=2, min_ranks=2)
    check_sizes(3, 2, attention, ffn)
    with pytest.raises(ValueError, match=r"attention: 4 is outside \[1, 3\]"):
        check_sizes(4, 2, attention, ffn)
    with pytest.raises(ValueError, match=r"ffn: 1 is outside \[2, 2\]"):
        check_sizes(1, 1, attention, ffn)
    assert (clamp(0, attention), clamp(9, attention), clamp(2, attention)) == (1, 3, 2)


def test_registry_directive_and_layout_switch() -> None:
    registry = Registry("gloo", 5.0, 1)
    assert registry.add_ffn(FFNAddress("h0", 10, 11)) == 0
    assert registry.layout == (0,)
    registry.add_ffn(FFNAddress("h1", 20, 21))
    assert registry.ffn[1].epoch is None and not registry.ffn[1].reached(0)  # no report yet
    member = registry.add_attention("r0")
    assert member.peered_epoch is None and not member.peered
    registry.set_attention(member.rank, READY, peered_epoch=0)
    assert registry.attention[member.rank].peered
    assert registry.ffn_directive(0, 0).plan is None
    plan = Plan(registry.next_epoch(), (0, 1), None)
    registry.plan = plan
    directive = registry.ffn_directive(1, 0)  # rank 1 reports an epoch older than the plan's
    assert directive.plan is not None and directive.plan.epoch == 1
    assignment = directive.plan.assignment
    assert (assignment.ep_rank, assignment.ep_size, assignment.host, assignment.store_port) == (1, 2, "h0", 10)
    assert registry.ffn_directive(1, 1).plan is None  # already serves the plan's epoch
    registry.switch_layout(plan)
    assert (registry.layout, registry.layout_epoch, registry.plan) == ((0, 1), 1, None)
    assert [registry.ffn[r].state for r in (0, 1)] == [READY, READY]
    registry.repeer(member.rank, 1)
    assert registry.attention_assignment(member.rank).store_port == 20 and registry.epoch == 2
    assert not registry.attention[member.rank].peered  # until it reports the pairing of epoch 2 open
    registry.vanished.add(member.rank)
    assert registry.ffn_directive(1, 1).dead_peers == [member.rank]


def test_a_gone_ffn_rank_is_listed_until_the_layout_is_whole_again() -> None:
    """A lost FFN rank stays listed (GONE) while its layout is short of the target or
    a new layout is pending; once the layout is whole it is retired: no longer listed,
    its record kept (still GONE, so a late report is fenced) and its id not reused.
    On the old registry every GONE rank was listed for ever."""
    registry = Registry("gloo", 5.0, 1)
    address = FFNAddress("h", 1, 2)
    registry.add_ffn(address)
    registry.update_ffn(0, state=GONE, ep_rank=None)  # found dead: out of the layout
    registry.layout = ()
    registry.retire_gone_ffn(target=1)
    assert [m.rank for m in registry.listed_ffn()] == [0]  # the layout is not whole
    assert registry.add_ffn(address) == 1  # the replacement
    registry.plan = Plan(registry.next_epoch(), (1,), None)
    registry.retire_gone_ffn(target=1)
    assert [m.rank for m in registry.listed_ffn()] == [0, 1]  # its layout is still pending
    registry.switch_layout(registry.plan)
    registry.retire_gone_ffn(target=1)
    assert [(m.rank, m.state) for m in registry.listed_ffn()] == [(1, READY)]
    assert registry.ffn[0].state is GONE and registry.add_ffn(address) == 2


def test_registry_wait_wakes_on_notify_and_times_out() -> None:
    async def run() -> None:
        registry = Registry("gloo", 5.0, 1)
        waiter = asyncio.create_task(registry.wait(lambda: bool(registry.layout), 5))
        await asyncio.sleep(0)
        registry.add_ffn(FFNAddress("h", 1, 2))
        await registry.notify()
        await asyncio.wait_for(waiter, 1)
        with pytest.raises(TimeoutError):
            await registry.wait(lambda: False, 0.05)

    asyncio.run(run())


def test_registry_rebuilds_the_layout_from_rejoining_members() -> None:
    """A restarted coordinator: members rejoin with their own records; the layout of
    the newest epoch is whole once all its EP ranks rejoined, new ranks go after them."""
    registry = Registry("gloo", 5.0, 2)
    address = FFNAddress("h", 1, 2)
    registry.rejoin_ffn(FFNMember(rank=3, address=address, state=READY, epoch=4, ep_rank=1), (2, 3), 4)
    assert registry.layout == ()
    registry.rejoin_ffn(FFNMember(rank=1, address=address, state=GONE, epoch=2), (), 2)
    registry.rejoin_ffn(FFNMember(rank=2, address=address, state=READY, epoch=4, ep_rank=0), (2, 3), 4)
    assert (registry.layout, registry.layout_epoch, registry.epoch) == ((2, 3), 4, 4)
    registry.rejoin_attention(AttentionMember(rank=5, ffn_peer=3, state=READY, epoch=6, peered_epoch=6))
    assert registry.epoch == 6 and registry.add_attention("r").rank == 6
    assert registry.add_ffn(address) == 4
    assert registry.layout == (2, 3)  # a registering rank never re-forms a first layout


def test_a_restarted_coordinator_keeps_a_fence() -> None:
    """EP2 layout of epoch 4 = FFN ranks 0 and 2: rank 1 (EP rank 1 of the layout of
    epoch 3) was found dead while its process was stopped, and rank 2 replaced it.
    The coordinator restarts before rank 1 runs again and learns it was fenced. When
    rank 1 rejoins with its old record, after or before the layout of epoch 4 is
    complete, it is GONE (its next report is answered `fenced`), not READY: on the
    old registry it rejoined as a live rank and `/afd/status` showed two EP ranks 1."""
    address = FFNAddress("h", 1, 2)
    fenced = FFNMember(rank=1, address=address, state=READY, epoch=3, ep_rank=1)
    layout = [
        FFNMember(rank=0, address=address, state=READY, epoch=4, ep_rank=0),
        FFNMember(rank=2, address=address, state=READY, epoch=4, ep_rank=1),
    ]
    for order in ([*layout, fenced], [fenced, *layout], [layout[0], fenced, layout[1]]):
        registry = Registry("gloo", 5.0, 2)
        for member in order:
            registry.rejoin_ffn(member, (0, 1) if member.epoch == 3 else (0, 2), member.epoch)
        assert (registry.layout, registry.layout_epoch) == ((0, 2), 4), order
        assert registry.ffn[1].state is GONE and registry.ffn[1].ep_rank is None, order
        assert [(m.rank, m.ep_rank) for m in registry.listed_ffn() if m.state is READY] == [(0, 0), (2, 1)]


def test_recovery_finds_dead_ranks() -> None:
    from afd_ray.config import AutoscaleConfig
    from afd_ray.control.recovery import Recovery
    from afd_ray.control.resize import Resizer

    async def run() -> None:
        registry = Registry("gloo", 5.0, 2)
        for replica in ("a", "b"):
            registry.add_ffn(FFNAddress("h", 1, 2), replica)
        resizer = Resizer(registry, "app", AttentionPoolConfig(), FFNPoolConfig(num_ranks=2), AutoscaleConfig())
        recovery = Recovery(registry, resizer, "app", heartbeat_timeout_s=0.05, wait_s=1)
        assert recovery.dead({"a": "RUNNING", "b": "RUNNING"}) == {}
        assert "replica b vanished" in recovery.dead({"a": "RUNNING"})[1]
        recovery.heard(0, LoopState.STOPPED)
        assert recovery.dead(None) == {0: "its FFN loop stopped"}
        recovery.heard(1, LoopState.SERVING)
        await asyncio.sleep(0.1)
        assert "no report for" in recovery.dead(None)[1]

    asyncio.run(run())


def test_attention_reports_of_an_unknown_rank_are_ignored_until_it_rejoins(caplog: pytest.LogCaptureFixture) -> None:
    """After a coordinator restart, an attention rank that has not rejoined yet may
    still report ready / peered / leaving / gone: each is ignored with a warning (the
    old registry raised KeyError), nothing is registered, and the rank's next poll
    reads None, so it rejoins with its full record; then its reports apply again."""
    registry = Registry("gloo", 5.0, 1)
    registry.add_ffn(FFNAddress("h0", 10, 11))
    before = dict(registry.attention), registry.epoch
    with caplog.at_level("WARNING", logger="ray.serve"):
        assert not registry.attention_ready(3)
        assert not registry.attention_peered(3, 2)
        assert not registry.attention_leaving(3)
        assert not registry.attention_gone(3)
    warned = [r.getMessage() for r in caplog.records if "attention rank 3 reported" in r.getMessage()]
    assert len(warned) == 4 and all("not registered here" in m for m in warned), warned
    assert (dict(registry.attention), registry.epoch) == before
    assert registry.attention_directive(3) is None  # the rank's poll: rejoin
    registry.rejoin_attention(AttentionMember(rank=3, ffn_peer=0, state=READY, epoch=2, peered_epoch=1))
    assert registry.attention_peered(3, 2) and registry.attention[3].peered_epoch == 2
    assert registry.attention_leaving(3) and registry.attention[3].state is DRAINING
    assert not registry.attention_leaving(3)  # already draining: nothing changes
    assert registry.attention_gone(3) and registry.attention[3].state is GONE


def test_reports_of_a_gone_attention_rank_change_nothing() -> None:
    """A rank already GONE (found dead, or its second report) may still report leaving
    or gone from its replica's shutdown: both are no-ops (they raised ValueError,
    GONE -> DRAINING / GONE -> GONE, and the error skipped the rest of the shutdown)."""
    registry = Registry("gloo", 5.0, 1)
    registry.add_ffn(FFNAddress("h0", 10, 11))
    member = registry.add_attention("r0")
    assert registry.attention_gone(member.rank)
    epoch = registry.epoch
    assert not registry.attention_leaving(member.rank)
    assert not registry.attention_gone(member.rank)
    assert (registry.attention[member.rank].state, registry.epoch) == (GONE, epoch)


def test_attention_ready_marks_a_known_rank_peered_under_its_epoch() -> None:
    registry = Registry("gloo", 5.0, 1)
    registry.add_ffn(FFNAddress("h0", 10, 11))
    registry.next_epoch()
    member = registry.add_attention("r0")
    assert registry.attention_ready(member.rank)
    assert (registry.attention[member.rank].state, registry.attention[member.rank].peered_epoch) == (READY, 1)
