"""The coordinator: ranks, FFN peers, the epoch, resizes and the status of both pools.

A single-replica Serve deployment. Pool members call it at start-up, to report
counters, to poll for what they must do (re-peer, drain, prepare a new FFN layout)
and when they leave; nothing on the data path goes through it.

Epochs. One counter, bumped by every membership change that members act on: moving
an attention rank to another FFN peer (its pair channel is opened under the new
epoch; the FFN drops any later header of the old pairing) and switching the FFN
layout (the EP group of the new epoch replaces the old one at one step boundary).

Resizes (`scale`), one at a time, each returning once the new layout serves:
- attention +n: Serve starts replicas; each registers (STARTING), gets the least
  loaded FFN peer, starts its engine, reports READY; its peer admits it at a step
  boundary. Nobody else pauses.
- attention -n: Serve picks replicas and drains them (no new requests, running ones
  finish up to `autoscale.drain_timeout_s`, then end with an explicit error); the
  replica's destructor closes its pair channel (LEAVE) and reports GONE.
- FFN +n (make before break): Serve starts replicas; each registers and waits for a
  `LayoutPlan`; every FFN rank of the new layout loads its new expert shard and opens
  the new EP group while the old layout serves; all switch at one agreed step
  boundary; then attention ranks are rebalanced onto the new ranks.
- FFN -n: Serve picks a replica and calls its destructor, which calls `ffn_leaving`:
  its attention peers move to the remaining ranks, the remaining ranks load the
  experts it owned and switch to an EP group without it, then it is GONE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ray import serve

from afd_ray.autoscale.policy import (
    AutoscalePolicy,
    MetricsSnapshot,
    ScaleState,
    decide,
)
from afd_ray.config import (
    AttentionPoolConfig,
    AutoscaleConfig,
    ConnectorConfig,
    FFNPoolConfig,
    Platform,
)
from afd_ray.connector.channel import FFNAddress
from afd_ray.control.membership import (
    AFDStatus,
    AttentionAssignment,
    AttentionDirective,
    AttentionMember,
    EPAssignment,
    FFNDirective,
    FFNMember,
    LayoutPlan,
    MemberState,
    ResizeEvent,
    ScaleRequest,
)
from afd_ray.control.serve_api import replica_states, set_num_replicas
from afd_ray.observability.signals import AttentionReport, SignalAggregator
from afd_ray.observability.stats import FFNStats
from afd_ray.platform import collective_backend

__all__ = ["ATTENTION_DEPLOYMENT", "FFN_DEPLOYMENT", "Coordinator"]

logger = logging.getLogger("ray.serve")
"""Serve's logger: resizes show in the coordinator replica's log and on the console."""

ATTENTION_DEPLOYMENT = "attention"
FFN_DEPLOYMENT = "ffn"
_SETTLE_S = 0.5
"""How long a resize waits, once the new layout serves, for the FFN ranks' reports of
the step-boundary pauses it caused (they report every 0.2 s), seconds."""
_WATCH_PERIOD_S = 0.5
"""How often the coordinator reads Serve's replica states (draining, dead ranks)."""


@dataclass(frozen=True)
class _Plan:
    """A pending FFN layout: `ranks` in EP order from `epoch` on; `leaving` drops out."""

    epoch: int
    ranks: tuple[int, ...]
    leaving: int | None


class Coordinator:
    """Hands out ranks and FFN peers, runs resizes, keeps what `/afd/status` shows.

    Peer assignment is balanced: a new attention rank gets the FFN rank with the
    fewest attention peers (lowest rank on ties), so A attention ranks over F FFN
    ranks give each FFN rank floor(A/F) or ceil(A/F) peers; resizes restore that.

    Args:
        platform: picks the collective backend of pair and EP groups.
        connector: rendezvous and receive timeouts.
        attention, ffn: pool sizes at start and resize bounds.
        autoscale: drain and resize timeouts, whether the autoscaler runs.
        policy: the autoscaling policy (`autoscale.policy`, loaded by the app builder).
    """

    def __init__(
        self,
        platform: Platform,
        connector: ConnectorConfig,
        attention: AttentionPoolConfig,
        ffn: FFNPoolConfig,
        autoscale: AutoscaleConfig,
        policy: AutoscalePolicy | None = None,
    ) -> None:
        self._app = serve.get_replica_context().app_name
        self._pools = {ATTENTION_DEPLOYMENT: attention, FFN_DEPLOYMENT: ffn}
        self._autoscale = autoscale
        self._policy = policy if autoscale.enabled else None
        self._backend = collective_backend(platform)
        self._timeout_s = connector.timeout_s
        self._epoch = 0
        self._layout: tuple[int, ...] = ()
        """FFN ranks in EP order serving since `_layout_epoch`."""
        self._layout_epoch = 0
        self._plan: _Plan | None = None
        self._ffn: dict[int, FFNMember] = {}
        self._attention: dict[int, AttentionMember] = {}
        self._next_attention = 0
        self._vanished: set[int] = set()
        """Attention ranks whose replica vanished without leaving (their FFN peer drops them)."""
        self._changed = asyncio.Condition()
        self._resize_lock = asyncio.Lock()
        self._layout_lock = asyncio.Lock()
        self._targets = {ATTENTION_DEPLOYMENT: attention.num_ranks, FFN_DEPLOYMENT: ffn.num_ranks}
        self._paused = False
        self._resizes: list[ResizeEvent] = []
        self._resize_pause_s = 0.0
        self._resize_bytes = 0
        self._signals = SignalAggregator()
        self._tasks = [asyncio.create_task(self._watch_replicas())]
        if self._policy is not None:
            self._tasks.append(asyncio.create_task(self._autoscaler()))

    # --- FFN pool --------------------------------------------------------------

    async def register_ffn(self, address: FFNAddress) -> int:
        """Add an FFN rank serving at `address` (STARTING); returns its rank. The first
        `ffn.num_ranks` ranks form the first layout (epoch 0)."""
        rank = len(self._ffn)
        self._ffn[rank] = FFNMember(rank=rank, address=address)
        if not self._layout and len(self._ffn) == self._targets[FFN_DEPLOYMENT]:
            self._layout = tuple(sorted(self._ffn))
        await self._notify()
        return rank

    async def ep_assignment(self, rank: int, wait_s: float) -> EPAssignment:
        """FFN rank `rank`'s place in the layout it starts in: the first layout, or the
        new layout of the scale-out that started it.

        Raises:
            TimeoutError: the first layout was not complete, or no scale-out took this
                rank in, within `wait_s` seconds.
        """
        await self._wait(lambda: rank in self._layout or (self._plan is not None and rank in self._plan.ranks),
                         wait_s)  # fmt: skip
        if rank in self._layout:
            return self._assignment(rank, self._layout, self._layout_epoch)
        assert self._plan is not None
        return self._assignment(rank, self._plan.ranks, self._plan.epoch)

    def _assignment(self, rank: int, ranks: tuple[int, ...], epoch: int) -> EPAssignment:
        host = self._ffn[ranks[0]].address
        return EPAssignment(
            ep_rank=ranks.index(rank), ep_size=len(ranks), host=host.host, store_port=host.store_port,
            epoch=epoch, backend=self._backend, timeout_s=self._timeout_s,
        )

    async def report_ffn(
        self, rank: int, stats: FFNStats, expert_tokens: list[int], epoch: int, pause_s: float
    ) -> FFNDirective:
        """Replace the counters and expert load of FFN rank `rank`, which serves layout
        `epoch` and paused its steps at most `pause_s` seconds at a step boundary since
        its last report; feed its counters to the autoscaling signals.

        Returns:
            The layout this rank must prepare while a resize is pending, and its
            attention peers that vanished without LEAVE.
        """
        member = self._ffn[rank]
        update = asdict(stats) | {"expert_tokens": expert_tokens, "epoch": epoch}
        if member.state is MemberState.STARTING and rank in self._layout and epoch == self._layout_epoch:
            update["state"] = member.state.to(MemberState.READY)
            update["ep_rank"] = self._layout.index(rank)
        self._ffn[rank] = member.model_copy(update=update)
        self._resize_pause_s = max(self._resize_pause_s, pause_s)
        if pause_s > 0:
            logger.info("FFN rank %d paused %.4f s at a step boundary (epoch %d)", rank, pause_s, epoch)
        self._signals.report_ffn(rank, stats, time.time())
        if epoch != member.epoch or "state" in update:
            await self._notify()
        dead = [r for r in sorted(self._vanished) if self._attention[r].ffn_peer == rank]
        plan = self._plan
        if plan is None or epoch >= plan.epoch or (rank not in plan.ranks and rank != plan.leaving):
            return FFNDirective(dead_peers=dead)
        assignment = self._assignment(rank, plan.ranks, plan.epoch) if rank in plan.ranks else None
        return FFNDirective(plan=LayoutPlan(epoch=plan.epoch, assignment=assignment), dead_peers=dead)

    async def ffn_loaded(self, rank: int, epoch: int, num_bytes: int) -> None:
        """FFN rank `rank` loaded `num_bytes` of weights for the layout of `epoch`."""
        self._resize_bytes += num_bytes
        logger.info("FFN rank %d loaded %.1f MB of weights for epoch %d", rank, num_bytes / 1e6, epoch)

    async def ffn_leaving(self, rank: int) -> None:
        """Scale-in of FFN rank `rank` (its replica is stopping): move its attention
        peers to the remaining ranks, switch the layout without it, mark it GONE.
        Returns once it serves nothing; the replica may then exit.

        Raises:
            TimeoutError: not done within `autoscale.resize_timeout_s`.
        """
        async with self._layout_lock:
            member = self._ffn[rank]
            self._ffn[rank] = member.model_copy(update={"state": member.state.to(MemberState.DRAINING)})
            remaining = tuple(r for r in self._layout if r != rank)
            if rank in self._layout and remaining:
                logger.info("FFN rank %d leaving: layout %s -> %s", rank, self._layout, remaining)
                await self._rebalance(remaining)
                await self._switch_layout(remaining, leaving=rank)
            self._ffn[rank] = self._ffn[rank].model_copy(
                update={"state": MemberState.GONE, "ep_rank": None}
            )
            await self._notify()

    async def _switch_layout(self, ranks: tuple[int, ...], leaving: int | None) -> None:
        """Make before break: publish the plan, wait until every rank of the old and
        the new layout serves its epoch (they switch together at one step boundary)."""
        self._epoch += 1
        plan = _Plan(self._epoch, ranks, leaving)
        self._plan = plan
        await self._notify()
        involved = set(ranks) | set(self._layout)
        await self._wait(
            lambda: all(self._ffn[r].epoch >= plan.epoch for r in involved), self._autoscale.resize_timeout_s
        )
        self._layout, self._layout_epoch, self._plan = ranks, plan.epoch, None
        for r in ranks:
            member = self._ffn[r]
            self._ffn[r] = member.model_copy(
                update={"state": member.state.to(MemberState.READY), "ep_rank": ranks.index(r)}
            )
        logger.info("FFN layout of epoch %d serves: EP ranks %s", plan.epoch, ranks)
        await self._notify()

    # --- attention pool --------------------------------------------------------

    async def assign_attention(self, wait_s: float, replica: str = "") -> AttentionAssignment:
        """A new attention rank id (STARTING) and its FFN peer, once the FFN layout
        serves; `replica` is its Serve replica id.

        Raises:
            TimeoutError: the FFN pool was not complete within `wait_s` seconds.
        """
        await self._wait(lambda: bool(self._layout), wait_s)
        load = self._load(self._layout)
        ffn_rank = min(load, key=lambda rank: (load[rank], rank))
        peer = self._next_attention
        self._next_attention += 1
        self._attention[peer] = AttentionMember(rank=peer, ffn_peer=ffn_rank, epoch=self._epoch, replica=replica)
        await self._notify()
        return self._attention_assignment(self._attention[peer])

    def _load(self, ranks: tuple[int, ...]) -> dict[int, int]:
        """Live attention peers of each FFN rank in `ranks`."""
        load = {rank: 0 for rank in ranks}
        for member in self._attention.values():
            if member.state is not MemberState.GONE and member.ffn_peer in load:
                load[member.ffn_peer] += 1
        return load

    def _attention_assignment(self, member: AttentionMember) -> AttentionAssignment:
        address = self._ffn[member.ffn_peer].address
        return AttentionAssignment(
            peer=member.rank, ffn_rank=member.ffn_peer, host=address.host, store_port=address.store_port,
            control_port=address.control_port, epoch=member.epoch, backend=self._backend,
            timeout_s=self._timeout_s,
        )

    async def attention_ready(self, rank: int) -> None:
        """Attention rank `rank` started its engine and opened its pair channel."""
        await self._set_attention(rank, MemberState.READY, peered_epoch=self._attention[rank].epoch)

    async def attention_poll(self, rank: int) -> AttentionDirective:
        """What attention rank `rank` must do now: its state (DRAINING once Serve
        stops its replica) and its current FFN peer."""
        member = self._attention[rank]
        return AttentionDirective(state=member.state, assignment=self._attention_assignment(member))

    async def attention_peered(self, rank: int, epoch: int) -> None:
        """Attention rank `rank` re-peered: its pair channel of `epoch` is open."""
        member = self._attention[rank]
        self._attention[rank] = member.model_copy(update={"peered_epoch": epoch})
        await self._notify()

    async def attention_leaving(self, rank: int) -> None:
        """Attention rank `rank` is being removed (DRAINING)."""
        if self._attention[rank].state is not MemberState.DRAINING:
            await self._set_attention(rank, MemberState.DRAINING)

    async def attention_gone(self, rank: int) -> None:
        """Attention rank `rank` closed its pair channel (LEAVE sent) and exits."""
        await self._set_attention(rank, MemberState.GONE)

    async def _set_attention(self, rank: int, state: MemberState, **update: object) -> None:
        member = self._attention[rank]
        self._attention[rank] = member.model_copy(update={"state": member.state.to(state), **update})
        logger.info("attention rank %d: %s -> %s", rank, member.state.value, state.value)
        await self._notify()

    async def _rebalance(self, ranks: tuple[int, ...]) -> None:
        """Move READY attention ranks so that each FFN rank of `ranks` has floor(A/F)
        or ceil(A/F) peers and none is on an FFN rank outside `ranks`; each move is a
        new epoch. Returns once every moved rank re-peered."""
        moved: list[int] = []
        while True:
            load = self._load(ranks)
            stray = [m for m in self._attention.values()
                     if m.state is MemberState.READY and m.ffn_peer not in ranks]  # fmt: skip
            busiest = max(load, key=lambda r: (load[r], -r))
            idlest = min(load, key=lambda r: (load[r], r))
            if stray:
                member = stray[0]
            elif load[busiest] - load[idlest] > 1:
                member = next(m for m in self._attention.values()
                              if m.state is MemberState.READY and m.ffn_peer == busiest)  # fmt: skip
            else:
                break
            self._epoch += 1
            self._attention[member.rank] = member.model_copy(update={"ffn_peer": idlest, "epoch": self._epoch})
            logger.info("attention rank %d: FFN peer %d -> %d (epoch %d)", member.rank, member.ffn_peer, idlest,
                        self._epoch)  # fmt: skip
            moved.append(member.rank)
        await self._notify()
        await self._wait(
            lambda: all(self._attention[r].peered_epoch >= self._attention[r].epoch
                        or self._attention[r].state is MemberState.GONE for r in moved),
            self._autoscale.resize_timeout_s,
        )  # fmt: skip

    async def _watch_replicas(self) -> None:
        """Mark attention ranks DRAINING when Serve stops their replica, GONE when the
        replica vanished without leaving (it died or was killed)."""
        while True:
            await asyncio.sleep(_WATCH_PERIOD_S)
            try:
                states = await replica_states(self._app, ATTENTION_DEPLOYMENT)
            except Exception:
                logger.debug("replica states unavailable", exc_info=True)
                continue
            for member in list(self._attention.values()):
                state = states.get(member.replica)
                if member.state is MemberState.READY and state == "STOPPING":
                    await self._set_attention(member.rank, MemberState.DRAINING)
                elif member.state in (MemberState.READY, MemberState.DRAINING) and state is None:
                    logger.warning("attention rank %d: replica %s vanished", member.rank, member.replica)
                    self._vanished.add(member.rank)
                    await self._set_attention(member.rank, MemberState.GONE)

    # --- resizes ---------------------------------------------------------------

    def _check(self, request: ScaleRequest) -> None:
        """Raises ValueError naming the field when a pool size is out of bounds."""
        for name, value in ((ATTENTION_DEPLOYMENT, request.attention), (FFN_DEPLOYMENT, request.ffn)):
            pool = self._pools[name]
            if not pool.min_ranks <= value <= pool.upper:
                raise ValueError(f"{name}: {value} is outside [{pool.min_ranks}, {pool.upper}] "
                                 f"({name}.min_ranks, {name}.max_ranks)")  # fmt: skip

    async def scale(self, request: ScaleRequest, reason: str = "manual") -> ResizeEvent:
        """Resize both pools to `request` and return once the new layout serves.

        A `manual` resize pauses the autoscaler until `resume_autoscaler`.

        Raises:
            ValueError: a size is out of its pool's bounds (names the field).
        """
        self._check(request)
        if reason == "manual":
            self._paused = True
        # An accepted resize runs to its end and is recorded even when the caller goes
        # away (a client leaving POST /afd/scale cancels this call): stopping halfway
        # would leave a layout nobody asked for.
        resize = asyncio.create_task(self._scale(request, reason))
        self._tasks.append(resize)
        resize.add_done_callback(self._tasks.remove)
        return await asyncio.shield(resize)

    async def _scale(self, request: ScaleRequest, reason: str) -> ResizeEvent:
        async with self._resize_lock:
            before = (self._live(ATTENTION_DEPLOYMENT), len(self._layout))
            started = time.time()
            self._resize_pause_s, self._resize_bytes = 0.0, 0
            logger.info("resize %dA:%dF -> %dA:%dF (%s)", *before, request.attention, request.ffn, reason)
            error = None
            try:
                await asyncio.wait_for(self._resize(request), self._autoscale.resize_timeout_s)
                await asyncio.sleep(_SETTLE_S)  # the FFN ranks' reports of the last boundary pauses
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                logger.exception("resize failed")
            event = ResizeEvent(
                reason=reason, from_attention=before[0], from_ffn=before[1], to_attention=request.attention,
                to_ffn=request.ffn, epoch=self._epoch, started_s=started, duration_s=time.time() - started,
                pause_s=self._resize_pause_s, bytes_loaded=self._resize_bytes, error=error,
            )
            self._resizes.append(event)
            logger.info("resize done: %s", event.model_dump_json())
            return event

    def _live(self, pool: str) -> int:
        members = self._attention if pool == ATTENTION_DEPLOYMENT else self._ffn
        return sum(m.state in (MemberState.STARTING, MemberState.READY) for m in members.values())

    async def _resize(self, request: ScaleRequest) -> None:
        wait_s = self._autoscale.resize_timeout_s
        if request.attention != self._targets[ATTENTION_DEPLOYMENT]:
            self._targets[ATTENTION_DEPLOYMENT] = request.attention
            await set_num_replicas(self._app, ATTENTION_DEPLOYMENT, request.attention)
            await self._wait(
                lambda: sum(m.state is MemberState.READY for m in self._attention.values()) == request.attention
                and all(m.state in (MemberState.READY, MemberState.GONE) for m in self._attention.values()),
                wait_s,
            )
            async with self._layout_lock:
                await self._rebalance(self._layout)
            await self._serve_routes(ATTENTION_DEPLOYMENT, request.attention, wait_s)
        if request.ffn != self._targets[FFN_DEPLOYMENT]:
            grow = request.ffn > len(self._layout)
            self._targets[FFN_DEPLOYMENT] = request.ffn
            await set_num_replicas(self._app, FFN_DEPLOYMENT, request.ffn)
            if grow:
                await self._wait(lambda: len(self._layout) + len(self._joining()) >= request.ffn, wait_s)
                async with self._layout_lock:
                    ranks = self._layout + self._joining()
                    await self._switch_layout(ranks, leaving=None)
                    await self._rebalance(ranks)
            else:
                await self._wait(lambda: len(self._layout) == request.ffn and self._plan is None, wait_s)

    async def _serve_routes(self, deployment: str, num_replicas: int, wait_s: float) -> None:
        """Until Serve runs exactly `num_replicas` replicas of `deployment` (new ones
        RUNNING, so routed to; stopped ones gone).

        Raises:
            TimeoutError: not within `wait_s` seconds.
        """
        deadline = time.monotonic() + wait_s
        while list((await replica_states(self._app, deployment)).values()) != ["RUNNING"] * num_replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Serve did not run {num_replicas} {deployment} replicas within {wait_s} s")
            await asyncio.sleep(_WATCH_PERIOD_S / 2)

    def _joining(self) -> tuple[int, ...]:
        """FFN ranks registered (STARTING) and not yet in a layout."""
        return tuple(r for r, m in sorted(self._ffn.items()) if m.state is MemberState.STARTING and r not in self._layout)

    def _clamp(self, pool: str, target: int) -> int:
        """`target` within the deployment's `min_ranks`..`max_ranks` of `pool`."""
        bounds = self._pools[pool]
        return min(max(target, bounds.min_ranks), bounds.upper)

    async def resume_autoscaler(self) -> None:
        """Let the autoscaler change the pool sizes again after a manual resize."""
        self._paused = False
        logger.info("autoscaler resumed")

    async def _autoscaler(self) -> None:
        """Evaluate the policy every `autoscale.interval_s` and resize to its targets
        unless a manual resize paused it."""
        assert self._policy is not None
        state = ScaleState.initial(self._targets[ATTENTION_DEPLOYMENT], self._targets[FFN_DEPLOYMENT])
        while True:
            await asyncio.sleep(self._autoscale.interval_s)
            if self._paused or self._resize_lock.locked():
                continue
            state = state.follow(self._targets[ATTENTION_DEPLOYMENT], self._targets[FFN_DEPLOYMENT], time.time())
            decision = decide(await self.metrics(), state, self._policy)
            state = decision.state
            target = ScaleRequest(
                attention=self._clamp(ATTENTION_DEPLOYMENT, decision.attention_target),
                ffn=self._clamp(FFN_DEPLOYMENT, decision.ffn_target),
            )
            if (target.attention, target.ffn) != (self._targets[ATTENTION_DEPLOYMENT], self._targets[FFN_DEPLOYMENT]):
                await self.scale(target, reason=decision.reason)

    # --- signals and status ----------------------------------------------------

    async def report_attention(self, rank: int, report: AttentionReport) -> None:
        """Add attention rank `rank`'s autoscaling signals since its previous report."""
        self._signals.report_attention(rank, report, time.time())

    async def metrics(self) -> MetricsSnapshot:
        """The autoscaling signals of the current members over the last
        `SignalAggregator.window_s` seconds."""
        return self._signals.snapshot(time.time(), self._live_ranks(self._attention), self._live_ranks(self._ffn))

    @staticmethod
    def _live_ranks(members: dict[int, AttentionMember] | dict[int, FFNMember]) -> list[int]:
        return [rank for rank, member in members.items() if member.state is not MemberState.GONE]

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, condition: Callable[[], bool], wait_s: float) -> None:
        """Until `condition()` holds (re-checked on every membership change).

        Raises:
            TimeoutError: it did not within `wait_s` seconds.
        """
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(condition), wait_s)

    async def status(self) -> AFDStatus:
        """Epoch, every attention rank with its state and FFN peer, every FFN rank
        with its state and counters, targets, resize events, autoscaling signals."""
        return AFDStatus(
            epoch=self._epoch,
            attention=[self._attention[r] for r in sorted(self._attention)],
            ffn=[self._ffn[r] for r in sorted(self._ffn)],
            target_attention=self._targets[ATTENTION_DEPLOYMENT],
            target_ffn=self._targets[FFN_DEPLOYMENT],
            autoscale_paused=self._paused,
            autoscale_enabled=self._policy is not None,
            resizes=self._resizes,
            metrics=await self.metrics(),
        )
