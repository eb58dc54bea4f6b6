"""The coordinator's registry: pool members, the epoch counter and the FFN layout.

Epochs. One counter, bumped by every membership change that members act on: moving
an attention rank to another FFN peer (its pair channel is opened under the new
epoch; the FFN drops any later header of the old pairing) and switching the FFN
layout (the EP group of the new epoch replaces the old one at one step boundary).

Every change goes through a method here and wakes `wait`ers; the registry decides
nothing (placement does) and starts nothing (the resize orchestration does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from afd_ray.connector.header import FFNAddress
from afd_ray.connector.transports import TransportChoice, select_transport
from afd_ray.control.membership import (
    AttentionAssignment,
    AttentionDirective,
    AttentionMember,
    EPAssignment,
    FFNDirective,
    FFNMember,
    LayoutPlan,
    LoopState,
    MemberState,
)
from afd_ray.control.placement import least_loaded, peer_load
from afd_ray.platform import Backend

__all__ = ["Plan", "Registry"]

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Plan:
    """A pending FFN layout: `ranks` in EP order from `epoch` on; `leaving` drops out."""

    epoch: int
    ranks: tuple[int, ...]
    leaving: int | None


class Registry:
    """Members of both pools, the epoch, the serving FFN layout and a pending plan.

    Args:
        backend: collective backend of pair and EP groups (gloo | nccl | hccl).
        timeout_s: rendezvous and receive bound handed to members, seconds.
        first_layout_size: FFN ranks that form the first layout (epoch 0).
        transport: `ConnectorConfig.transport`, resolved per pair from the nodes of
            its two members (`select_transport`).
    """

    def __init__(
        self, backend: Backend, timeout_s: float, first_layout_size: int, transport: TransportChoice = "auto"
    ) -> None:
        self.backend = backend
        self.transport = transport
        self.timeout_s = timeout_s
        self._first_layout_size = first_layout_size
        self.epoch = 0
        self.layout: tuple[int, ...] = ()
        """FFN ranks in EP order serving since `layout_epoch`."""
        self.layout_epoch = 0
        self.plan: Plan | None = None
        self.ffn: dict[int, FFNMember] = {}
        self.attention: dict[int, AttentionMember] = {}
        self._next_attention = 0
        self._next_ffn = 0
        """Above every FFN rank id this registry heard of: its members, the layouts and
        FFN peers that members rejoined with (a new rank never reuses an id)."""
        self._formed_as: tuple[int, ...] = ()
        """`formed_layout`."""
        self.vanished: set[int] = set()
        """Attention ranks whose replica vanished without leaving (their FFN peer drops them)."""
        self.retired: set[int] = set()
        """GONE FFN ranks whose loss is behind: the layout was whole again after they
        went (`retire_gone_ffn`). `/afd/status` no longer lists them (`recoveries` and
        `resizes` keep the history); their records stay, so that a late report of one
        is still fenced and its rank id is never reused."""
        self.retired_attention: set[int] = set()
        """GONE attention ranks (left, or their replica vanished) once the attention
        pool had its target READY ranks again (`retire_gone_attention`): not listed any
        more; their records stay, so that a late poll of one still reads GONE (it never
        rejoins) and its id is never reused."""
        self._told: dict[int, tuple[int, ...]] = {}
        """The layout (EP order) of each epoch as the ranks that rejoined told it."""
        self._formed = False
        """A first layout formed, or members rejoined (a restarted coordinator):
        registering ranks no longer form the first layout."""
        self._changed = asyncio.Condition()

    # --- changes -----------------------------------------------------------------

    def next_epoch(self) -> int:
        """Bump and return the epoch."""
        self.epoch += 1
        return self.epoch

    def add_ffn(self, address: FFNAddress, replica: str = "", standby: bool = False) -> int:
        """A new FFN rank serving at `address` in Serve replica `replica`: STANDBY with
        `standby` once the first layout formed (`placement.stands_by`), else STARTING;
        the first `first_layout_size` ranks form the first layout."""
        rank = self._next_ffn
        self._next_ffn += 1
        state = MemberState.STANDBY if standby and self._formed else MemberState.STARTING
        self.ffn[rank] = FFNMember(rank=rank, address=address, replica=replica, state=state)
        if not self._formed and len(self.ffn) == self._first_layout_size:
            self.layout, self._formed = tuple(sorted(self.ffn)), True
            self._formed_as = self.layout
        return rank

    def rejoin_ffn(self, member: FFNMember, layout: tuple[int, ...], preparing: int) -> None:
        """A running FFN rank re-registers after a coordinator restart with its record
        (`epoch`, `ep_rank` and `loop` of the layout it serves), the FFN ranks of that
        layout in EP order (`layout`, () when it serves none) and the newest layout
        epoch it was asked to prepare (`preparing`; the epoch counter continues past
        it, so no new plan reuses an epoch the rank already prepares).

        Once every rank of the newest rejoined layout rejoined, they are the layout
        again. A layout whose rejoined ranks report their EP group lost
        (`LoopState.EP_LOST`) is one whose other ranks died (or whose group failed):
        its rejoined ranks are the layout at once, and the recovery re-forms it from
        them and the layout as formed (`formed_layout`), as after any FFN loss.

        The fence survives the restart: a rank that serves a layout older than the one
        rejoined, and is not in it, was removed from the layout (found dead) by the
        coordinator before its restart, so it is GONE here (fenced at its next
        report), whether it rejoins before or after that layout is complete."""
        self.ffn[member.rank] = member
        self.epoch = max(self.epoch, preparing)
        if member.epoch is not None:
            self.epoch = max(self.epoch, member.epoch)
        self._formed = True
        self._next_ffn = max(self._next_ffn, member.rank + 1, *(r + 1 for r in layout))
        if member.ep_rank is not None and member.epoch is not None:
            self._told[member.epoch] = layout
        serving = [
            m
            for m in self.ffn.values()
            if m.ep_rank is not None and m.epoch is not None and m.state is not MemberState.GONE
        ]
        newest = max((m.epoch for m in serving), default=0)
        told = self._told.get(newest, ())
        joined = tuple(r for r in told if any(m.rank == r and m.epoch == newest for m in serving))
        lost_group = any(self.ffn[r].loop is LoopState.EP_LOST for r in joined)
        if self.plan is None and joined and (joined == told or lost_group) and newest >= self.layout_epoch:
            self.layout, self.layout_epoch, self._formed_as = joined, newest, told
            logger.info("FFN layout of epoch %d rejoined: EP ranks %s of %s", newest, joined, told)
        for stale in (m for m in serving if m.epoch < self.layout_epoch and m.rank not in self.layout):
            self.update_ffn(stale.rank, state=MemberState.GONE, ep_rank=None)
            logger.warning(
                "FFN rank %d rejoined with the layout of epoch %d, older than the layout of epoch %d "
                "without it: it was removed, it stays fenced",
                stale.rank,
                stale.epoch,
                self.layout_epoch,
            )

    def rejoin_attention(self, member: AttentionMember) -> None:
        """A running attention rank re-registers after a coordinator restart."""
        self.attention[member.rank] = member
        self.epoch = max(self.epoch, member.epoch)
        self._formed = True
        self._next_attention = max(self._next_attention, member.rank + 1)
        self._next_ffn = max(self._next_ffn, member.ffn_peer + 1)
        logger.info("attention rank %d rejoined (FFN peer %d, epoch %d)", member.rank, member.ffn_peer, member.epoch)

    def update_ffn(self, rank: int, **update: object) -> None:
        self.ffn[rank] = self.ffn[rank].model_copy(update=update)

    def add_attention(self, replica: str, node: str = "") -> AttentionMember:
        """A new attention rank (STARTING) of Serve replica `replica` on Ray node
        `node`, peered with the least loaded FFN rank of the layout, under the
        current epoch. Requires a layout."""
        member = AttentionMember(
            rank=self._next_attention,
            ffn_peer=least_loaded(peer_load(self.attention, self.layout)),
            epoch=self.epoch,
            replica=replica,
            node=node,
        )
        self._next_attention += 1
        self.attention[member.rank] = member
        return member

    def set_attention(self, rank: int, state: MemberState, **update: object) -> None:
        """Move attention rank `rank` to `state` (forward only, `MemberState.to`)."""
        member = self.attention[rank]
        self.attention[rank] = member.model_copy(update={"state": member.state.to(state), **update})
        logger.info("attention rank %d: %s -> %s", rank, member.state.value, state.value)

    # --- what attention ranks report (`Coordinator.attention_*`) ----------------------
    # Each returns whether the registry changed (the caller then wakes `wait`ers). A
    # rank this registry does not know (a restarted coordinator before that rank
    # rejoined) is ignored with a warning, not re-registered: these reports carry
    # only the rank id, while a record needs its FFN peer, epoch, replica and node,
    # which the rank sends itself through `rejoin_attention` once its next poll
    # (`attention_directive`) returns None. A leaving rank that is unknown here has
    # no pairing to drain or retire; its FFN peer drops it on LEAVE.

    def attention_ready(self, rank: int) -> bool:
        """Attention rank `rank` opened its pair channel: READY, peered under its
        assignment's epoch. False (nothing changed): the rank is unknown."""
        member = self._reporting(rank, "ready")
        if member is None:
            return False
        self.set_attention(rank, MemberState.READY, peered_epoch=member.epoch)
        return True

    def attention_peered(self, rank: int, epoch: int) -> bool:
        """Attention rank `rank` opened its pair channel of `epoch`. False: unknown."""
        member = self._reporting(rank, f"peered under epoch {epoch}")
        if member is None:
            return False
        self.attention[rank] = member.model_copy(update={"peered_epoch": epoch})
        return True

    def attention_leaving(self, rank: int) -> bool:
        """Attention rank `rank` is being removed: DRAINING. False: unknown, or it
        already drains or is GONE (e.g. found dead before its replica stopped)."""
        member = self._reporting(rank, "leaving")
        if member is None or member.state in (MemberState.DRAINING, MemberState.GONE):
            return False
        self.set_attention(rank, MemberState.DRAINING)
        return True

    def attention_gone(self, rank: int) -> bool:
        """Attention rank `rank` closed its pair channel and exits: GONE. False:
        unknown, or GONE already (a second report, or found dead first)."""
        member = self._reporting(rank, "gone")
        if member is None or member.state is MemberState.GONE:
            return False
        self.set_attention(rank, MemberState.GONE)
        return True

    def attention_failed(self, rank: int) -> bool:
        """Attention rank `rank` failed to start (or its replica vanished while STARTING):
        GONE and retired at once, as it never served; `vanished`, so its FFN peer drops
        the pair if the worker opened one. False: unknown, or not STARTING."""
        member = self._reporting(rank, "a failed start")
        if member is None or member.state is not MemberState.STARTING:
            return False
        self.set_attention(rank, MemberState.GONE)
        self.vanished.add(rank)
        self.retired_attention.add(rank)
        return True

    def _reporting(self, rank: int, report: str) -> AttentionMember | None:
        """The record of attention rank `rank`, or None with a warning when this
        registry does not know it."""
        member = self.attention.get(rank)
        if member is None:
            logger.warning(
                "attention rank %d reported %s but is not registered here (the coordinator restarted "
                "before it rejoined): ignored, it rejoins at its next poll",
                rank,
                report,
            )
        return member

    def repeer(self, rank: int, ffn_peer: int) -> None:
        """Move attention rank `rank` to FFN peer `ffn_peer` under a new epoch."""
        member = self.attention[rank]
        self.attention[rank] = member.model_copy(update={"ffn_peer": ffn_peer, "epoch": self.next_epoch()})
        logger.info("attention rank %d: FFN peer %d -> %d (epoch %d)", rank, member.ffn_peer, ffn_peer, self.epoch)

    def retire_gone_ffn(self, target: int) -> None:
        """Retire every GONE FFN rank once the layout is whole again: `target` ranks
        serve it and no plan is pending (else nothing changes)."""
        if self.plan is None and len(self.layout) >= target:
            self.retired.update(r for r, m in self.ffn.items() if m.state is MemberState.GONE)

    def retire_gone_attention(self, target: int) -> None:
        """Retire every GONE attention rank once `target` attention ranks are READY
        (else nothing changes)."""
        if sum(m.state is MemberState.READY for m in self.attention.values()) >= target:
            self.retired_attention.update(r for r, m in self.attention.items() if m.state is MemberState.GONE)

    def listed_attention(self) -> list[AttentionMember]:
        """The attention members `/afd/status` lists, by rank: all but the retired
        ones (a GONE rank stays listed until the pool has its READY ranks again)."""
        return [m for r, m in sorted(self.attention.items()) if r not in self.retired_attention]

    def listed_ffn(self) -> list[FFNMember]:
        """The FFN members `/afd/status` lists, by rank: all but the retired ones (a
        GONE rank stays listed while the layout it left is not whole again)."""
        return [m for r, m in sorted(self.ffn.items()) if r not in self.retired]

    def formed_layout(self) -> tuple[int, ...]:
        """The serving layout in EP order as it was formed (the first layout, a switch,
        or what the ranks that rejoined a restarted coordinator told): `layout` plus
        the ranks since found dead, or that never rejoined (dead too)."""
        return self._formed_as

    def switch_layout(self, plan: Plan) -> None:
        """`plan` serves: its ranks become the layout, READY, with their EP ranks."""
        self.layout, self.layout_epoch, self.plan, self._formed_as = plan.ranks, plan.epoch, None, plan.ranks
        for r in plan.ranks:
            member = self.ffn[r]
            self.update_ffn(r, state=member.state.to(MemberState.READY), ep_rank=plan.ranks.index(r))
        logger.info("FFN layout of epoch %d serves: EP ranks %s", plan.epoch, plan.ranks)

    # --- what members get ----------------------------------------------------------

    def ep_assignment(self, rank: int, ranks: tuple[int, ...], epoch: int) -> EPAssignment:
        """FFN rank `rank`'s place in the layout `ranks` of `epoch`; the first rank's
        store hosts the EP rendezvous."""
        host = self.ffn[ranks[0]].address
        return EPAssignment(
            ep_rank=ranks.index(rank),
            ep_size=len(ranks),
            host=host.host,
            store_port=host.store_port,
            epoch=epoch,
            backend=self.backend,
            timeout_s=self.timeout_s,
            ranks=ranks,
        )

    def taking(self, rank: int) -> EPAssignment | None:
        """FFN rank `rank`'s place in the layout that takes it in: the serving layout,
        else the pending plan; None: neither does."""
        if rank in self.layout:
            return self.ep_assignment(rank, self.layout, self.layout_epoch)
        if self.plan is not None and rank in self.plan.ranks:
            return self.ep_assignment(rank, self.plan.ranks, self.plan.epoch)
        return None

    def standby_assignment(self, rank: int) -> EPAssignment:
        """What STANDBY FFN rank `rank` loads and serves while it stands by: every expert
        (EP rank 0 of 1), no layout (`ranks` empty), under the current layout epoch,
        with its own store (it joins no EP group until a plan takes it in)."""
        address = self.ffn[rank].address
        return EPAssignment(
            ep_rank=0,
            ep_size=1,
            host=address.host,
            store_port=address.store_port,
            epoch=self.layout_epoch,
            backend=self.backend,
            timeout_s=self.timeout_s,
            standby=True,
        )

    def attention_assignment(self, rank: int) -> AttentionAssignment:
        """Attention rank `rank`'s current FFN peer, pairing epoch and the pair's
        transport (`auto`: a same-node one when both run on one Ray node)."""
        member = self.attention[rank]
        address = self.ffn[member.ffn_peer].address
        same_node = bool(member.node) and member.node == address.node
        transport = select_transport(self.transport, self.backend, same_node)
        return AttentionAssignment.to_ffn(
            address, member.rank, member.ffn_peer, member.epoch, transport, self.timeout_s
        )

    def attention_directive(self, rank: int) -> AttentionDirective | None:
        """What attention rank `rank` must do now (`Coordinator.attention_poll`); None:
        this registry does not know the rank (the coordinator restarted), which must
        rejoin. Its assignment is None while its FFN peer is unknown here (a restarted
        coordinator before that rank rejoined, or a rank that died before the restart):
        the rank keeps the pairing it holds until it is moved (`stray_moves`)."""
        member = self.attention.get(rank)
        if member is None:
            return None
        assignment = self.attention_assignment(rank) if member.ffn_peer in self.ffn else None
        return AttentionDirective(state=member.state, assignment=assignment)

    def ffn_directive(self, rank: int, epoch: int) -> FFNDirective:
        """The answer to FFN rank `rank` serving `epoch`: the pending plan it must
        prepare (if it is in it or leaves by it) and its vanished attention peers."""
        dead = [r for r in sorted(self.vanished) if self.attention[r].ffn_peer == rank]
        plan = self.plan
        if plan is None or epoch >= plan.epoch or (rank not in plan.ranks and rank != plan.leaving):
            return FFNDirective(dead_peers=dead)
        assignment = self.ep_assignment(rank, plan.ranks, plan.epoch) if rank in plan.ranks else None
        return FFNDirective(plan=LayoutPlan(epoch=plan.epoch, assignment=assignment), dead_peers=dead)

    # --- waiting for changes -------------------------------------------------------

    async def notify(self) -> None:
        """Wake every `wait` to re-check its condition."""
        async with self._changed:
            self._changed.notify_all()

    async def wait(self, condition: Callable[[], bool], wait_s: float) -> None:
        """Until `condition()` holds (re-checked on every `notify`).

        Raises:
            TimeoutError: it did not within `wait_s` seconds.
        """
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(condition), wait_s)
