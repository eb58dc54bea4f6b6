"""Recovery from lost FFN ranks (docs/failures.md): find a dead FFN rank within a bound,
take it out of the layout under a new epoch, and re-form the layout from the live
ranks and standby ranks (`ffn.standby_ranks`), or the replacements Serve starts.

Detection, whichever comes first:
- its process ended: the connection the coordinator holds to its store closed
  (`afd_ray.control.liveness`; milliseconds on one node);
- its Serve replica vanished (the process was killed or crashed; read every
  `WATCH_PERIOD_S` from Serve's replica states);
- it reported that its FFN loop stopped (an EP collective or a receive failed);
- it sent no report for `ffn.heartbeat_timeout_s` (a hung replica).

A rank removed while its process still lives (e.g. it was stopped, then continued)
is fenced: the coordinator answers its next report with `fenced`, and the rank stops
its loop and fails Serve's health check, so Serve replaces it; the replacement is
what the re-formed layout waits for. It never serves again, under any epoch; a
restarted coordinator keeps the fence: the rank rejoins with a layout older than the
rejoined one and is GONE there too (`Registry.rejoin_ffn`).

Recovery, under the layout lock (no resize interleaves):
1. the lost ranks are GONE and leave the layout at once, so no new attention rank is
   peered with them (`assign_attention` waits while the layout is empty);
2. once the live ranks of the old layout plus the `placement.takers` (STANDBY ranks
   first: loaded and listening, at once; else the replacements Serve starts for a
   killed replica) reach the FFN target, a plan of a new epoch forms the layout from
   them: a standby copies its shard from the experts it holds (it holds every one),
   a replacement loads its shard from the checkpoint, live ranks keep their EP ranks
   and load nothing, or, where they must move, only the experts they newly own (make
   before break); a rank lost meanwhile restarts this step; Serve's replacement of
   the lost replica then stands by in the standby's place (`Resizer.stands_by`);
3. attention ranks are rebalanced onto the new layout (re-peered under new epochs);
   with EP, the attention ranks of the surviving EP ranks are re-peered too, under
   new epochs with the same peer: a surviving rank whose EP group failed closed
   their pairs (`afd_ray.ffn.layout`), and their in-step retry waits for a newer
   epoch; an attention rank whose engine failed with its peer is replaced by Serve;
4. the lost ranks are retired: `/afd/status` lists them (GONE) only until the
   layout is whole again; `recoveries` keeps each loss.

A recovery that fails (e.g. no replacement registered within the bound, or each one
died too) is retried, from step 2 with the layout the loss broke, after
`min(RETRY_S, wait_s)`, until the layout is whole again: its event carries the error
of the latest attempt and the number of attempts meanwhile.

The FFN side holds no request state, so nothing but time is lost on the FFN side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass

from afd_ray.control.liveness import ProcessWatch
from afd_ray.control.membership import LoopState, MemberState, RecoveryEvent
from afd_ray.control.placement import rebalance_moves, reformed_layout, stray_moves, takers
from afd_ray.control.registry import Plan, Registry
from afd_ray.control.resize import FFN_DEPLOYMENT, WATCH_PERIOD_S, Resizer
from afd_ray.control.serve_api import replica_states

__all__ = ["EP_LOST_GRACE_S", "RETRY_S", "Recovery"]

logger = logging.getLogger("ray.serve")

RETRY_S = 5.0
"""Longest wait before a failed recovery is tried again, seconds (`wait_s` when shorter)."""
EP_LOST_GRACE_S = 1.0
"""How long ranks of the serving layout report its EP group lost, every rank of it
reporting, with none found dead, before the layout is re-formed anyway
(`Recovery.lost_group`), seconds: the other ranks of a layout told to a restarted
coordinator rejoin within their report period (0.2 s). A rank of the layout silent
that long is more likely the dead one that broke the group: its death is found first
(its replica vanished, or its heartbeat)."""


@dataclass(frozen=True)
class _Loss:
    """A loss the layout has not recovered from yet."""

    before: tuple[int, ...]
    """The layout it broke, in EP order (its live ranks keep their EP ranks)."""
    event: int
    """Its index in `Recovery.events`."""
    detected: float
    """When it was found, `time.monotonic()` seconds."""


class Recovery:
    """Finds dead FFN ranks and re-forms the layout without them.

    Args:
        registry: the members, epoch and layout.
        resizer: holds the FFN target and the layout lock, counts loaded bytes.
        app: the Serve application's name.
        heartbeat_timeout_s: an FFN rank silent this long is dead, seconds.
        wait_s: bound on one recovery attempt (replacements started, layout switched), seconds.
        clock: the monotonic clock that times reports, seconds.
        replicas: Serve's replica states of a deployment of an app, by replica id.
    """

    def __init__(
        self,
        registry: Registry,
        resizer: Resizer,
        app: str,
        heartbeat_timeout_s: float,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        replicas: Callable[[str, str], Awaitable[dict[str, str]]] = replica_states,
    ) -> None:
        self._clock = clock
        self._replicas = replicas
        self._registry = registry
        self._resizer = resizer
        self._app = app
        self._heartbeat_s = heartbeat_timeout_s
        self._wait_s = wait_s
        self._last_report: dict[int, float] = {}
        """Monotonic time of each FFN rank's latest report."""
        self._stopped: dict[int, str] = {}
        """FFN ranks that reported their loop stopped, and why."""
        self._ep_lost: dict[int, float] = {}
        """FFN ranks whose latest reports said their EP group is lost, since when (monotonic)."""
        self._process = ProcessWatch()
        """Sees an FFN rank's process end within milliseconds (`afd_ray.control.liveness`)."""
        self.events: list[RecoveryEvent] = []
        self._bytes = 0
        self._unrecovered: _Loss | None = None
        """The loss being recovered from, or whose recovery failed (retried from `_retry_at` on)."""
        self._retry_at = 0.0

    @property
    def recovering(self) -> bool:
        """Lost FFN ranks are not replaced yet: a recovery runs, or one failed and is retried."""
        return self._unrecovered is not None

    def heard(self, rank: int, loop: LoopState) -> None:
        """FFN rank `rank` reported what its FFN loop does (`LoopState.STOPPED`: it ended)."""
        self._last_report[rank] = self._clock()
        if loop is LoopState.STOPPED and self._registry.ffn[rank].state is not MemberState.GONE:
            self._stopped.setdefault(rank, "its FFN loop stopped")
        if loop is LoopState.EP_LOST:
            self._ep_lost.setdefault(rank, self._clock())
        else:
            self._ep_lost.pop(rank, None)

    def lost_group(self) -> list[int]:
        """Ranks of the serving layout that have reported its EP group lost for
        `EP_LOST_GRACE_S` or longer, while every rank of it reported within that time,
        no loss is being recovered from and no plan is pending: the layout must be
        re-formed although the coordinator found no rank of it dead (the dead one was
        unknown to a restarted coordinator, or the group failed with every rank alive)."""
        registry = self._registry
        now = self._clock()
        silent = any(now - self._last_report.get(r, now - EP_LOST_GRACE_S) >= EP_LOST_GRACE_S for r in registry.layout)
        if self._unrecovered is not None or registry.plan is not None or silent:
            return []
        return [
            r
            for r in registry.layout
            if registry.ffn[r].epoch == registry.layout_epoch and now - self._ep_lost.get(r, now) >= EP_LOST_GRACE_S
        ]

    def record_bytes(self, num_bytes: int) -> None:
        """A rank loaded `num_bytes` for a layout while recovering."""
        self._bytes += num_bytes

    def dead(self, states: dict[str, str] | None) -> dict[int, str]:
        """Live-looking FFN ranks that are dead now, and how each was found dead;
        `states`: Serve's replica states by replica id (None: unreadable)."""
        now = self._clock()
        dead = {}
        for rank, member in self._registry.ffn.items():
            if member.state is MemberState.GONE:
                continue
            if rank in self._stopped:
                dead[rank] = self._stopped[rank]
            elif rank in self._process.ended:
                dead[rank] = self._process.ended[rank]
            elif states is not None and member.replica and member.replica not in states:
                dead[rank] = f"its Serve replica {member.replica} vanished"
            elif rank in self._last_report and now - self._last_report[rank] > self._heartbeat_s:
                dead[rank] = f"no report for {now - self._last_report[rank]:.1f} s (ffn.heartbeat_timeout_s)"
        return dead

    async def _states(self) -> dict[str, str] | None:
        try:
            return await self._replicas(self._app, FFN_DEPLOYMENT)
        except Exception:
            logger.debug("replica states unavailable", exc_info=True)
            return None

    async def watch(self) -> None:
        """Forever: every `WATCH_PERIOD_S`, or at once when an FFN rank's process ended,
        find dead FFN ranks and recover from them, or retry a failed recovery once due."""
        while True:
            self._process.follow(self._registry.ffn)
            with suppress(TimeoutError):  # woken at once when a rank's process ends
                await asyncio.wait_for(self._process.changed.wait(), WATCH_PERIOD_S)
            self._process.changed.clear()
            dead = self.dead(await self._states())
            try:
                if dead or self.lost_group() or (self._unrecovered is not None and time.monotonic() >= self._retry_at):
                    await self._recover(dead)
                else:
                    await self._move_strays()
            except Exception:
                logger.exception("FFN recovery failed")

    async def _move_strays(self) -> None:
        """Move READY attention ranks whose FFN peer is outside the serving layout
        onto it (`placement.stray_moves`), unless the layout is changing, being
        recovered, or has lost its EP group (its ranks serve nothing until it is
        re-formed, and the recovery then re-peers every rank): after a coordinator
        restart an attention rank can rejoin peered with a rank that died meanwhile,
        or one the old coordinator had moved it off before the rank followed."""
        registry = self._registry
        busy = registry.plan is not None or self._resizer.layout_lock.locked() or self._unrecovered is not None
        if not registry.layout or busy or any(registry.ffn[r].loop is LoopState.EP_LOST for r in registry.layout):
            return
        moves = stray_moves(registry.attention, registry.layout)
        for rank, peer in moves:
            registry.repeer(rank, peer)
        if moves:
            await registry.notify()

    async def _until(self, condition: Callable[[], bool], deadline: float) -> dict[int, str]:
        """Until `condition()` holds (then `{}`) or an FFN rank is found dead (then the
        dead ranks), re-checking at least every `WATCH_PERIOD_S`.

        Raises:
            TimeoutError: neither before the monotonic `deadline`.
        """
        while True:
            dead = self.dead(await self._states())
            if dead or condition():
                return dead
            if time.monotonic() > deadline:
                raise TimeoutError(f"the FFN layout did not recover within {self._wait_s} s")
            try:
                await self._registry.wait(condition, WATCH_PERIOD_S)
            except TimeoutError:
                pass

    def _remove(self, dead: dict[int, str]) -> None:
        """Take the `dead` ranks out (GONE, out of the layout); those of the layout the
        loss being recovered from broke join its event's `lost` (the first found
        gives its cause when the loss began without a known dead rank)."""
        registry = self._registry
        for rank, cause in dead.items():
            logger.warning("FFN rank %d is dead: %s", rank, cause)
            registry.update_ffn(rank, state=MemberState.GONE, ep_rank=None)
            self._stopped.pop(rank, None)
            self._ep_lost.pop(rank, None)
        registry.layout = tuple(r for r in registry.layout if r not in dead)
        loss = self._unrecovered
        lost = sorted(r for r in dead if loss is not None and r in loss.before)
        if loss is not None and lost:
            event = self.events[loss.event]
            update: dict[str, object] = {"lost": sorted({*event.lost, *lost})}
            if not event.lost:
                update |= {"cause": dead[lost[0]], "since_report_s": self._since_report(lost[0])}
            self.events[loss.event] = event.model_copy(update=update)

    def _since_report(self, rank: int) -> float:
        return self._clock() - self._last_report.get(rank, self._clock())

    async def _recover(self, dead: dict[int, str]) -> None:
        """Take the `dead` ranks out and re-form the layout (again, for a loss not
        recovered from yet); with no loss pending, dead ranks outside the layout (not
        joined yet) are only retired."""
        registry = self._registry
        async with self._resizer.layout_lock:
            before = registry.formed_layout()
            lost = sorted(r for r in dead if r in before or (registry.plan and r in registry.plan.ranks))
            loss, group = self._unrecovered, self.lost_group()
            if loss is None and (lost or group):
                event = self._loss_event(before, lost, dead, group)
                loss = _Loss(before, len(self.events), time.monotonic())
                self.events.append(event)
                self._bytes = 0
            self._unrecovered = loss
            self._remove(dead)
            await registry.notify()
            if loss is None:  # a rank that had not joined a layout yet: Serve replaces it
                registry.retire_gone_ffn(self._resizer.targets[FFN_DEPLOYMENT])
                return
            event = self.events[loss.event]
            self.events[loss.event] = event.model_copy(update={"attempts": event.attempts + 1})
            try:
                plan = await asyncio.wait_for(self._reform(loss.before), self._wait_s)
                moves = rebalance_moves(registry.attention, plan.ranks)
                for rank, peer in moves:
                    registry.repeer(rank, peer)
                if len(loss.before) > 1:  # the surviving EP ranks dropped their attention pairs too
                    moved = {rank for rank, _ in moves}
                    for rank, member in sorted(registry.attention.items()):
                        if member.state is MemberState.READY and rank not in moved and member.ffn_peer in loss.before:
                            registry.repeer(rank, member.ffn_peer)
                await registry.notify()
                registry.retire_gone_ffn(self._resizer.targets[FFN_DEPLOYMENT])
                self._unrecovered = None
                update = {
                    "epoch": plan.epoch,
                    "whole_s": time.monotonic() - loss.detected,
                    "bytes_loaded": self._bytes,
                    "error": None,
                }
                logger.info(
                    "FFN layout recovered: EP ranks %s (epoch %d) %.1f s after losing %s",
                    plan.ranks,
                    plan.epoch,
                    update["whole_s"],
                    self.events[loss.event].lost,
                )
            except Exception as exc:
                registry.plan = None  # the plan this attempt published, if any: no rank prepares it any more
                self._retry_at = time.monotonic() + min(RETRY_S, self._wait_s)
                update = {"error": f"{type(exc).__name__}: {exc}"}
                logger.exception(
                    "FFN recovery of %s failed (attempt %d); it is retried",
                    self.events[loss.event].lost,
                    self.events[loss.event].attempts,
                )
            self.events[loss.event] = self.events[loss.event].model_copy(update=update)

    def _loss_event(
        self, before: tuple[int, ...], lost: list[int], dead: dict[int, str], group: list[int]
    ) -> RecoveryEvent:
        """The event of a new loss of the layout `before`: its `lost` ranks found dead,
        or, with none, ranks of `before` this coordinator does not know (they never
        rejoined it: dead) and the ranks whose EP group failed (`group`)."""
        if lost:
            first = lost[0]
            return RecoveryEvent(
                lost=lost, cause=dead[first], detected_s=time.time(), since_report_s=self._since_report(first)
            )
        unknown = [r for r in before if r not in self._registry.ffn]
        cause = f"FFN ranks {group} reported their EP group of epoch {self._registry.layout_epoch} lost" + (
            f"; FFN ranks {unknown} of it never rejoined this coordinator" if unknown else ""
        )
        return RecoveryEvent(lost=unknown, cause=cause, detected_s=time.time(), since_report_s=0.0)

    async def _reform(self, before: tuple[int, ...]) -> Plan:
        """Form the layout from the live ranks and the replacements, under a new epoch;
        a rank lost while this runs starts it over. The live ranks of the layout
        `before` the loss keep their EP ranks (`reformed_layout`). Returns the plan
        that serves.

        Raises:
            TimeoutError: not within `wait_s` seconds.
        """
        registry = self._registry
        target = self._resizer.targets[FFN_DEPLOYMENT]
        deadline = time.monotonic() + self._wait_s
        while True:
            dead = await self._until(
                lambda: len(registry.layout) + len(takers(registry.ffn, registry.layout)) >= target, deadline
            )
            if dead:
                self._remove(dead)
                continue
            ranks = reformed_layout(before, registry.layout, takers(registry.ffn, registry.layout), target)
            plan = Plan(registry.next_epoch(), ranks, None)
            registry.plan = plan
            logger.info("FFN recovery: layout of epoch %d from ranks %s", plan.epoch, ranks)
            await registry.notify()
            dead = await self._until(lambda: all(registry.ffn[r].reached(plan.epoch) for r in ranks), deadline)
            if dead:
                self._remove(dead)
                registry.plan = None
                continue
            registry.switch_layout(plan)
            await registry.notify()
            return plan
