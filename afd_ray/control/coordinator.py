"""The coordinator: the Serve-facing facade of the control plane.

A single-replica Serve deployment. Pool members call it at start-up, to report
counters, to poll for what they must do (re-peer, drain, prepare a new FFN layout)
and when they leave; nothing on the data path goes through it. It holds no logic of
its own; the parts are:

- `registry.Registry`: members, the epoch and the FFN layout;
- `placement`: pure peer assignment, rebalance and bound functions;
- `resize.Resizer`: resizes, FFN scale-in and Serve replica watching;
- `recovery.Recovery`: dead FFN ranks found and the layout re-formed without them;
- `autoscaler.Autoscaler`: the live policy loop;
- `observability.signals.SignalAggregator`: the autoscaling signals;
- `observability.steps.StepLog`: both pools' step records, for `trace`;
- `observability.publish.CoordinatorPublisher`: pool, resize and autoscaler metrics;
- `status.StatusView`: `/afd/status`, the pool load and the metrics snapshot.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from ray import serve

from afd_ray.autoscale.schema import AutoscalePolicy, MetricsSnapshot
from afd_ray.config import (
    AttentionPoolConfig,
    AutoscaleConfig,
    ConnectorConfig,
    FFNPoolConfig,
    ObservabilityConfig,
)
from afd_ray.connector.header import FFNAddress
from afd_ray.control.autoscaler import Autoscaler
from afd_ray.control.eplb import EPLBController
from afd_ray.control.membership import (
    AFDStatus,
    AttentionAssignment,
    AttentionDirective,
    AttentionMember,
    EPAssignment,
    FFNDirective,
    FFNMember,
    LoopState,
    MemberState,
    PoolLoad,
    ResizeEvent,
    ScaleRequest,
)
from afd_ray.control.recovery import Recovery
from afd_ray.control.registry import Registry
from afd_ray.control.resize import ATTENTION_DEPLOYMENT, FFN_DEPLOYMENT, Resizer
from afd_ray.control.status import StatusView
from afd_ray.eplb.records import EPLBEvent
from afd_ray.eplb.slots import Slots
from afd_ray.observability.publish import CoordinatorPublisher
from afd_ray.observability.signals import AttentionReport, SignalAggregator
from afd_ray.observability.stall import LoopWatch
from afd_ray.observability.stats import FFNStats
from afd_ray.observability.steps import AttentionStep, FFNStep, StepLog, TokenBreakdown
from afd_ray.platform import Platform, collective_backend

__all__ = ["ATTENTION_DEPLOYMENT", "FFN_DEPLOYMENT", "Coordinator"]

logger = logging.getLogger("ray.serve")
"""Serve's logger: resizes show in the coordinator replica's log and on the console."""


class Coordinator:
    """Hands out ranks and FFN peers, runs resizes, keeps what `/afd/status` shows.

    Peer assignment is balanced (`placement`): a new attention rank gets the FFN rank
    with the fewest attention peers (lowest rank on ties), so A attention ranks over F
    FFN ranks give each FFN rank floor(A/F) or ceil(A/F) peers; resizes restore that.

    Args:
        platform: picks the collective backend of pair and EP groups.
        connector: rendezvous and receive timeouts, the pair transport.
        attention, ffn: pool sizes at start and resize bounds.
        autoscale: drain and resize timeouts, whether the autoscaler runs.
        policy: the autoscaling policy (`autoscale.policy`, loaded by the app builder).
        observability: whether to export pool, resize and autoscaler metrics; step
            records kept per rank for `trace`.
    """

    def __init__(
        self,
        platform: Platform,
        connector: ConnectorConfig,
        attention: AttentionPoolConfig,
        ffn: FFNPoolConfig,
        autoscale: AutoscaleConfig,
        policy: AutoscalePolicy | None = None,
        observability: ObservabilityConfig = ObservabilityConfig(),
    ) -> None:
        app = serve.get_replica_context().app_name
        LoopWatch(asyncio.get_running_loop(), "coordinator")  # a blocked loop stalls every member: log where
        self._registry = Registry(collective_backend(platform), connector.timeout_s, ffn.num_ranks, connector.transport)
        self._resizer = Resizer(self._registry, app, attention, ffn, autoscale)
        self._recovery = Recovery(
            self._registry, self._resizer, app, ffn.heartbeat_timeout_s, autoscale.resize_timeout_s
        )
        self._signals = SignalAggregator()
        self._view = StatusView(self._registry, self._resizer, self._recovery, self._signals)
        self._steps = StepLog(observability.step_records)
        self._published = CoordinatorPublisher() if observability.metrics else None
        self._paused = False
        """A manual resize paused the autoscaler (until `resume_autoscaler`)."""
        self._joining: dict[str, float] = {}
        """Attention replicas waiting in `assign_attention`: Serve replica id ->
        monotonic time the wait began."""
        self._new_autoscaler = functools.partial(
            Autoscaler,
            interval_s=autoscale.interval_s,
            attention=attention,
            ffn=ffn,
            resizer=self._resizer,
            metrics=self.metrics,
            paused=lambda: self._paused,
            published=self._published,
        )
        self._autoscaler = self._new_autoscaler(policy) if autoscale.enabled and policy is not None else None
        self._tasks = [
            asyncio.create_task(self._resizer.follow_serve_targets()),
            asyncio.create_task(self._resizer.watch_replicas()),
            asyncio.create_task(self._recovery.watch()),
        ]
        if self._autoscaler is not None:
            self._tasks.append(asyncio.create_task(self._autoscaler.run()))
        self._eplb = EPLBController(
            ffn.eplb, self._registry, self._resizer, observability.metrics, lambda: self._recovery.dead(None)
        )
        self._tasks.append(asyncio.create_task(self._eplb.run()))
        if self._published is not None:
            self._tasks.append(asyncio.create_task(self._view.publish(self._published)))

    # --- FFN pool --------------------------------------------------------------

    async def register_ffn(self, address: FFNAddress, replica: str = "") -> int:
        """Add an FFN rank serving at `address` in Serve replica `replica` (STARTING, or
        STANDBY: `Resizer.stands_by`); returns its rank. The first `ffn.num_ranks` ranks
        form the first layout (epoch 0). After a restart of this coordinator, it first
        waits (bounded) for the running FFN ranks to rejoin (`Resizer.await_rejoins`)."""
        await self._resizer.await_rejoins(FFN_DEPLOYMENT, replica)
        rank = self._registry.add_ffn(address, replica, standby=self._resizer.stands_by())
        await self._registry.notify()
        return rank

    async def ep_assignment(self, rank: int, wait_s: float) -> EPAssignment:
        """FFN rank `rank`'s place in the layout that takes it in (`Registry.taking`), or
        for a STANDBY rank, what it holds while it stands by (`Registry.standby_assignment`).

        Raises:
            TimeoutError: the first layout was not complete, or no scale-out took this
                rank in, within `wait_s` seconds.
        """
        registry = self._registry
        await registry.wait(
            lambda: registry.taking(rank) is not None or registry.ffn[rank].state is MemberState.STANDBY, wait_s
        )
        taking = registry.taking(rank)
        return registry.standby_assignment(rank) if taking is None else self._eplb.assign(taking)

    async def report_ffn(
        self,
        rank: int,
        stats: FFNStats,
        expert_tokens: list[int],
        epoch: int,
        pause_s: float,
        steps: list[FFNStep] | None = None,
        loop: LoopState = LoopState.SERVING,
        expert_load: list[list[int]] | None = None,
    ) -> FFNDirective:
        """Replace the counters and expert load of FFN rank `rank`, which serves layout
        `epoch` and paused its steps at most `pause_s` seconds at a step boundary since
        its last report; feed its counters to the autoscaling signals and keep its new
        step records (`steps`) for `trace`. Each report is the rank's heartbeat;
        `loop` STOPPED (its FFN loop ended) makes it dead.

        Returns:
            `fenced` for a rank this coordinator removed (GONE): it must never serve
            again, and nothing it reports is recorded; else the layout this rank must
            prepare while a resize or recovery is pending, and its attention peers that
            vanished without LEAVE.
        """
        registry = self._registry
        if rank not in registry.ffn:  # this coordinator restarted
            return FFNDirective(rejoin=True)
        member = registry.ffn[rank]
        if member.state is MemberState.GONE:  # e.g. found dead while its process was stopped, now running again
            return FFNDirective(fenced=True)
        self._recovery.heard(rank, loop)
        if loop is LoopState.STOPPED:
            await registry.notify()
        update = vars(stats) | {"expert_tokens": expert_tokens, "epoch": epoch, "loop": loop}  # shallow: a StepSplit
        if member.state is MemberState.STARTING and rank in registry.layout and epoch == registry.layout_epoch:
            update["state"] = member.state.to(MemberState.READY)
            update["ep_rank"] = registry.layout.index(rank)
        registry.update_ffn(rank, **update)
        self._resizer.record_pause(pause_s)
        if pause_s > 0:
            logger.info("FFN rank %d paused %.4f s at a step boundary (epoch %d)", rank, pause_s, epoch)
        self._signals.report_ffn(rank, stats, time.time())
        self._eplb.report(rank, expert_load)  # [L][E] routed rows over its window
        self._steps.add_ffn(rank, steps or [])
        if epoch != member.epoch or "state" in update or loop is not member.loop:
            await registry.notify()
        return self._eplb.directive(registry.ffn_directive(rank, epoch))

    async def rejoin_ffn(
        self, member: FFNMember, layout: tuple[int, ...], preparing: int, placements: tuple[Slots, ...] | None = None
    ) -> None:
        """A running FFN rank re-registers after this coordinator restarted: `member`
        as it knows itself (address, replica, the epoch, EP rank and loop state it
        serves), the FFN ranks of that layout in EP order, and the newest layout epoch
        it was asked to prepare (`Registry.rejoin_ffn`); the expert placement of that
        layout (EPLB, None: contiguous; `EPLBController.rejoined`)."""
        self._registry.rejoin_ffn(member, tuple(layout), preparing)
        if layout and member.epoch is not None:
            self._eplb.rejoined(member.epoch, placements)
        self._recovery.heard(member.rank, member.loop or LoopState.SERVING)
        await self._registry.notify()

    async def rejoin_attention(self, member: AttentionMember) -> None:
        """A running attention rank re-registers after this coordinator restarted:
        `member` as it knows itself (its FFN peer and pairing epoch)."""
        self._registry.rejoin_attention(member)
        await self._registry.notify()

    async def ffn_loaded(self, rank: int, epoch: int, num_bytes: int) -> None:
        """FFN rank `rank` loaded `num_bytes` of weights for the layout of `epoch`."""
        self._resizer.record_bytes(num_bytes)
        self._recovery.record_bytes(num_bytes)
        logger.info("FFN rank %d loaded %.1f MB of weights for epoch %d", rank, num_bytes / 1e6, epoch)

    async def ffn_leaving(self, rank: int) -> None:
        """Scale-in of FFN rank `rank` (its replica is stopping); returns once it
        serves nothing (`Resizer.ffn_leaving`).

        Raises:
            TimeoutError: not done within `autoscale.resize_timeout_s`.
        """
        await self._resizer.ffn_leaving(rank)

    # --- attention pool --------------------------------------------------------

    async def assign_attention(self, wait_s: float, replica: str = "", node: str = "") -> AttentionAssignment:
        """A new attention rank id (STARTING) and its FFN peer, once the FFN layout
        serves; `replica` is its Serve replica id, `node` its Ray node id.

        Raises:
            TimeoutError: the FFN pool was not complete within `wait_s` seconds.
        """
        registry = self._registry
        self._joining[replica] = time.monotonic()
        try:
            await self._resizer.await_rejoins(ATTENTION_DEPLOYMENT, replica)
            await registry.wait(lambda: bool(registry.layout), wait_s)
        finally:
            del self._joining[replica]
        member = registry.add_attention(replica, node)
        await registry.notify()
        return registry.attention_assignment(member.rank)

    async def attention_ready(self, rank: int) -> None:
        """Attention rank `rank` started its engine and opened its pair channel. A rank
        this coordinator does not know (restarted before it rejoined) is ignored with
        a warning, here and in the three reports below (`Registry.attention_ready`)."""
        if self._registry.attention_ready(rank):
            await self._registry.notify()

    async def attention_poll(self, rank: int) -> AttentionDirective | None:
        """What attention rank `rank` must do now: its state (DRAINING once Serve
        stops its replica) and its current FFN peer; None: this coordinator restarted
        and does not know the rank, which must `rejoin_attention`."""
        return self._registry.attention_directive(rank)

    async def attention_peered(self, rank: int, epoch: int) -> None:
        """Attention rank `rank` re-peered: its pair channel of `epoch` is open."""
        if self._registry.attention_peered(rank, epoch):
            await self._registry.notify()

    async def attention_leaving(self, rank: int) -> None:
        """Attention rank `rank` is being removed (DRAINING)."""
        if self._registry.attention_leaving(rank):
            await self._registry.notify()

    async def attention_failed(self, rank: int) -> None:
        """Attention rank `rank` failed to start (its engine did not start) and exits:
        GONE, no longer listed (`Registry.attention_failed`)."""
        if self._registry.attention_failed(rank):
            await self._registry.notify()

    async def attention_gone(self, rank: int) -> None:
        """Attention rank `rank` closed its pair channel (LEAVE sent) and exits."""
        if self._registry.attention_gone(rank):
            await self._registry.notify()

    # --- resizes ---------------------------------------------------------------

    async def scale(self, request: ScaleRequest, reason: str = "manual") -> ResizeEvent:
        """Resize both pools to `request` and return once the new layout serves.

        A `manual` resize pauses the autoscaler until `resume_autoscaler`.

        Raises:
            ValueError: a size is out of its pool's bounds (names the field).
        """
        self._resizer.check(request)
        if reason == "manual":
            self._paused = True
        return await self._resizer.scale(request, reason)

    async def set_policy(self, policy: AutoscalePolicy) -> None:
        """Evaluate `policy` (already validated) from the next evaluation on; start the
        autoscaler if the deployment ran without one. A pause stays until resumed."""
        if self._autoscaler is not None:
            self._autoscaler.policy = policy
            logger.info("autoscaling policy replaced")
            return
        self._autoscaler = self._new_autoscaler(policy)
        self._tasks.append(asyncio.create_task(self._autoscaler.run()))
        logger.info("autoscaling policy set; autoscaler started")

    async def rebalance_experts(self, num_redundant_experts: int | None = None) -> EPLBEvent:
        """`POST /afd/eplb`: rebalance the expert placement now with `num_redundant_experts`
        redundant slots (None: `ffn.eplb`'s; `EPLBController.rebalance`, which raises
        ValueError outside `[0, ffn.eplb.num_redundant_experts]`)."""
        return await self._eplb.rebalance("manual", num_redundant_experts)

    async def resume_autoscaler(self) -> None:
        """Let the autoscaler change the pool sizes again after a manual resize."""
        self._paused = False
        logger.info("autoscaler resumed")

    # --- signals and status ----------------------------------------------------

    async def report_attention(
        self, rank: int, report: AttentionReport, steps: list[AttentionStep] | None = None
    ) -> None:
        """Add attention rank `rank`'s autoscaling signals since its previous report,
        and keep its new step records (`steps`) for `trace`."""
        self._signals.report_attention(rank, report, time.time())
        self._steps.add_attention(rank, steps or [])

    async def trace(self, request_id: str) -> list[TokenBreakdown]:
        """The engine steps of request `request_id` still held in the step records,
        each split across the pools (`afd_ray.observability.steps.breakdown`)."""
        return self._steps.breakdown(request_id)

    async def metrics(self) -> MetricsSnapshot:
        """The autoscaling signals of the current members (FFN standbys excluded) over
        the last `SignalAggregator.window_s` seconds."""
        return self._view.metrics()

    async def pool_load(self) -> PoolLoad | None:
        """What the ingress admits requests against: READY attention ranks, their KV
        usage and latencies, FFN rows per step, and whether a resize or recovery runs;
        None while no attention rank is known (just started, or restarted and the
        members have not rejoined yet: the ingress keeps its last load)."""
        return self._view.pool_load()

    async def status(self) -> AFDStatus:
        """Epoch, the attention ranks with their state and FFN peer (a GONE one until
        the pool has its READY ranks again), the attention replicas still waiting for
        the FFN layout, the FFN ranks with their state and counters (a GONE one until
        the layout is whole again), targets, resize and recovery events, autoscaling
        signals."""
        return self._view.status(self._joining, self._paused, self._autoscaler is not None, self._eplb.status())
