"""Resize orchestration: changes the pool sizes through Serve and walks the members
through each change, one resize at a time, each returning once the new layout serves.

- attention +n: Serve starts replicas; each registers (STARTING), gets the least
  loaded FFN peer, starts its engine, reports READY; its peer admits it at a step
  boundary. Nobody else pauses.
- attention -n: Serve picks replicas and drains them (no new requests, running ones
  finish up to `autoscale.drain_timeout_s`, then end with an explicit error); the
  replica's destructor closes its pair channel (LEAVE) and reports GONE.
- FFN +n (make before break): standby ranks (`ffn.standby_ranks`) join first, then
  the replicas Serve starts (each registers and waits for a `LayoutPlan`); every FFN
  rank of the new layout loads its new expert shard (a standby copies it from every
  expert it holds) and opens the new EP group while the old layout serves; all
  switch at one agreed step boundary; then attention ranks are rebalanced onto the
  new ranks. Serve runs the FFN target plus the standbys: new replicas stand by.
- FFN -n: Serve picks a replica and calls its destructor, which calls `ffn_leaving`:
  its attention peers move to the remaining ranks, the remaining ranks load the
  experts it owned and switch to an EP group without it, then it is GONE. A replica
  Serve stops while the FFN target does not shrink (it failed its health checks) hands
  nothing over: the recovery finds it dead once it is gone.

It also watches Serve's replica states: a stopping attention replica is DRAINING, a
vanished one GONE (its FFN peer drops its pair), also one that vanished while STARTING
(its start failed; not listed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from contextlib import suppress

from afd_ray.config import AttentionPoolConfig, AutoscaleConfig, FFNPoolConfig
from afd_ray.control.membership import MemberState, ResizeEvent, ScaleRequest
from afd_ray.control.placement import check_sizes, live_count, rebalance_moves, stands_by, takers
from afd_ray.control.registry import Plan, Registry
from afd_ray.control.serve_api import replica_states, set_num_replicas, target_replicas

__all__ = ["ATTENTION_DEPLOYMENT", "FFN_DEPLOYMENT", "FFN_STANDBY", "Resizer"]

logger = logging.getLogger("ray.serve")  # resizes show in the coordinator replica's log and on the console

ATTENTION_DEPLOYMENT = "attention"
FFN_DEPLOYMENT = "ffn"
FFN_STANDBY = "ffn_standby"
"""The `pool` label of the FFN standby ranks (`ffn.standby_ranks`) in the pool gauges."""
_SETTLE_S = 0.5
"""How long a resize waits, once the new layout serves, for the FFN ranks' reports of
the step-boundary pauses it caused (they report every 0.2 s), seconds."""
WATCH_PERIOD_S = 0.5
"""How often the coordinator reads Serve's replica states (draining, dead ranks)."""
REJOIN_WAIT_S = 5.0
"""Longest wait of a registering member for the running members of its pool to rejoin
a restarted coordinator (they do within one report or poll, 0.2-0.5 s), seconds."""


class Resizer:
    """Runs resizes and FFN scale-ins against `registry` and Serve.

    Args:
        registry: the members, epoch and layout it changes.
        app: the Serve application's name.
        attention, ffn: pool sizes at start and resize bounds.
        autoscale: drain and resize timeouts.
        replicas: Serve's replica states of a deployment of an app, by replica id.
    """

    def __init__(
        self,
        registry: Registry,
        app: str,
        attention: AttentionPoolConfig,
        ffn: FFNPoolConfig,
        autoscale: AutoscaleConfig,
        replicas: Callable[[str, str], Awaitable[dict[str, str]]] = replica_states,
    ) -> None:
        self._registry = registry
        self._replicas = replicas
        self._app = app
        self._attention_pool, self._ffn_pool = attention, ffn
        self._timeout_s = autoscale.resize_timeout_s
        self.targets = {ATTENTION_DEPLOYMENT: attention.num_ranks, FFN_DEPLOYMENT: ffn.num_ranks}
        self.resizes: list[ResizeEvent] = []
        self._pause_s = 0.0
        self._bytes = 0
        self._resize_lock = asyncio.Lock()
        self.layout_lock = asyncio.Lock()
        """Held by whatever changes the FFN layout (a resize, a scale-in, a recovery)."""
        self._tasks: set[asyncio.Task[ResizeEvent]] = set()

    @property
    def standby_ranks(self) -> int:
        """FFN ranks kept standing by outside the layout (`ffn.standby_ranks`): Serve runs
        the FFN target plus this many FFN replicas."""
        return self._ffn_pool.standby_ranks

    def stands_by(self) -> bool:
        """Whether an FFN rank registering now stands by (`placement.stands_by`): no loss
        or scale-out needs it to reach the FFN target."""
        registry = self._registry
        planned = registry.plan.ranks if registry.plan is not None else ()
        return stands_by(registry.ffn, registry.layout, planned, self.targets[FFN_DEPLOYMENT], self.standby_ranks)

    @property
    def busy(self) -> bool:
        """A resize is running."""
        return self._resize_lock.locked()

    def record_pause(self, pause_s: float) -> None:
        """An FFN rank paused its steps `pause_s` seconds at a step boundary."""
        self._pause_s = max(self._pause_s, pause_s)

    def record_bytes(self, num_bytes: int) -> None:
        """An FFN rank loaded `num_bytes` of weights for a new layout."""
        self._bytes += num_bytes

    def check(self, request: ScaleRequest) -> None:
        """Raises ValueError naming the field when a size of `request` is outside its
        pool's `min_ranks`..`max_ranks`."""
        check_sizes(request.attention, request.ffn, self._attention_pool, self._ffn_pool)

    async def scale(self, request: ScaleRequest, reason: str) -> ResizeEvent:
        """Resize both pools to `request` (within bounds: `check`) and return once the
        new layout serves.

        An accepted resize runs to its end and is recorded even when the caller goes
        away (a client leaving POST /afd/scale cancels this call): stopping halfway
        would leave a layout nobody asked for.
        """
        resize = asyncio.create_task(self._scale(request, reason))
        self._tasks.add(resize)
        resize.add_done_callback(self._tasks.discard)
        return await asyncio.shield(resize)

    async def _scale(self, request: ScaleRequest, reason: str) -> ResizeEvent:
        registry = self._registry
        async with self._resize_lock:
            before = (live_count(registry.attention), len(registry.layout))
            started = time.time()
            self._pause_s, self._bytes = 0.0, 0
            logger.info("resize %dA:%dF -> %dA:%dF (%s)", *before, request.attention, request.ffn, reason)
            error = None
            try:
                await asyncio.wait_for(self._resize(request), self._timeout_s)
                await asyncio.sleep(_SETTLE_S)  # the FFN ranks' reports of the last boundary pauses
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                logger.exception("resize failed")
            event = ResizeEvent(
                reason=reason,
                from_attention=before[0],
                from_ffn=before[1],
                to_attention=request.attention,
                to_ffn=request.ffn,
                epoch=registry.epoch,
                started_s=started,
                duration_s=time.time() - started,
                pause_s=self._pause_s,
                bytes_loaded=self._bytes,
                error=error,
            )
            self.resizes.append(event)
            logger.info("resize done: %s", event.model_dump_json())
            return event

    async def _resize(self, request: ScaleRequest) -> None:
        registry, wait_s = self._registry, self._timeout_s
        if request.attention != self.targets[ATTENTION_DEPLOYMENT]:
            self.targets[ATTENTION_DEPLOYMENT] = request.attention
            await set_num_replicas(self._app, ATTENTION_DEPLOYMENT, request.attention)
            await registry.wait(
                lambda: (
                    sum(m.state is MemberState.READY for m in registry.attention.values()) == request.attention
                    and all(m.state in (MemberState.READY, MemberState.GONE) for m in registry.attention.values())
                ),
                wait_s,
            )
            async with self.layout_lock:
                await self._rebalance(registry.layout)
            await self._serve_routes(ATTENTION_DEPLOYMENT, request.attention, wait_s)
        if request.ffn != self.targets[FFN_DEPLOYMENT]:
            grow = request.ffn > len(registry.layout)
            self.targets[FFN_DEPLOYMENT] = request.ffn
            await set_num_replicas(self._app, FFN_DEPLOYMENT, request.ffn + self.standby_ranks)
            if grow:  # standbys first (`takers`): Serve's new replicas then stand by in their place
                await registry.wait(
                    lambda: len(registry.layout) + len(takers(registry.ffn, registry.layout)) >= request.ffn, wait_s
                )
                async with self.layout_lock:
                    ranks = (registry.layout + takers(registry.ffn, registry.layout))[: request.ffn]
                    await self._switch_layout(ranks, leaving=None)
                    await self._rebalance(ranks)
            else:
                await self._shrink_ffn(request.ffn, wait_s)

    async def _shrink_ffn(self, target: int, wait_s: float) -> None:
        """Until `target` FFN ranks serve the layout. Serve picks the replicas it stops:
        a standby it stops leaves at once (it holds no peer), so Serve is asked for one
        replica fewer per standby gone until layout ranks left, then for the standbys
        again (new replicas stand by).

        Raises:
            TimeoutError: not within `wait_s` seconds.
        """
        registry = self._registry

        def standing() -> int:
            return sum(m.state is MemberState.STANDBY for m in registry.ffn.values())

        def shrunk() -> bool:
            return len(registry.layout) == target and registry.plan is None

        deadline = time.monotonic() + wait_s
        while not shrunk():
            standbys = standing()
            await set_num_replicas(self._app, FFN_DEPLOYMENT, target + standbys)
            await registry.wait(lambda: shrunk() or standing() < standbys, max(deadline - time.monotonic(), 0.0))
        if standing() < self.standby_ranks:
            await set_num_replicas(self._app, FFN_DEPLOYMENT, target + self.standby_ranks)

    async def ffn_leaving(self, rank: int) -> None:
        """Scale-in of FFN rank `rank` (its replica is stopping): move its attention
        peers to the remaining ranks, switch the layout without it, mark it GONE.
        Returns once it serves nothing; the replica may then exit.

        A rank this coordinator does not know (it restarted, and the rank has not
        rejoined yet) is waited for, at most `REJOIN_WAIT_S`; one that does not rejoin
        hands nothing over (the other ranks' EP group then fails and the layout is
        re-formed without it, `Recovery.lost_group`). A rank of the layout whose replica
        stops while the layout is no larger than the FFN target (not a scale-in: Serve
        replaces a replica that failed its health checks) is left in the layout: the
        recovery finds it dead once its replica is gone and takes the replacement in.

        Raises:
            TimeoutError: not done within `autoscale.resize_timeout_s`.
        """
        registry = self._registry
        try:
            await registry.wait(lambda: rank in registry.ffn, REJOIN_WAIT_S)
        except TimeoutError:
            logger.warning("FFN rank %d is leaving but never rejoined this coordinator: nothing handed over", rank)
            return
        if registry.ffn[rank].state is MemberState.GONE:  # found dead: recovery took it out
            return
        if rank in registry.layout and len(registry.layout) <= self.targets[FFN_DEPLOYMENT]:
            # Not a scale-in (that lowers the target first): Serve replaces this replica
            # (it failed its health checks). Its layout keeps it, so once the replica is
            # gone the recovery finds it dead and takes the replacement in.
            logger.warning("FFN rank %d: its replica stops without a scale-in; the recovery replaces it", rank)
            return
        async with self.layout_lock:
            if registry.ffn[rank].state is MemberState.GONE:
                return
            registry.update_ffn(rank, state=registry.ffn[rank].state.to(MemberState.DRAINING))
            remaining = tuple(r for r in registry.layout if r != rank)
            if rank in registry.layout and remaining:
                logger.info("FFN rank %d leaving: layout %s -> %s", rank, registry.layout, remaining)
                await self._rebalance(remaining)
                await self._switch_layout(remaining, leaving=rank)
            registry.update_ffn(rank, state=MemberState.GONE, ep_rank=None)
            registry.retire_gone_ffn(self.targets[FFN_DEPLOYMENT])
            await registry.notify()

    async def relayout(
        self, on_epoch: Callable[[int], None], dead: Callable[[], Collection[int]]
    ) -> tuple[int, float, int]:
        """A new layout epoch over the same FFN ranks (EPLB's new expert placement), make
        before break as an FFN resize; `on_epoch(epoch)` runs just before the plan of
        `epoch` is published. Returns the epoch, the longest pause and bytes loaded.
        Raises:
            RuntimeError: a resize or recovery is under way, or a rank is in `dead()`.
            TimeoutError: not done within `autoscale.resize_timeout_s`.
        """
        registry = self._registry
        if self.busy or self.layout_lock.locked() or registry.plan is not None:
            raise RuntimeError("the FFN layout is changing (a resize or recovery): retry once it serves")
        async with self.layout_lock:
            self._pause_s, self._bytes = 0.0, 0
            on_epoch(registry.epoch + 1)  # _switch_layout takes that epoch before it awaits anything
            await asyncio.wait_for(self._switch_layout(registry.layout, leaving=None, dead=dead), self._timeout_s)
            await asyncio.sleep(_SETTLE_S)  # the FFN ranks' reports of the switch's pauses
            return registry.layout_epoch, self._pause_s, self._bytes

    async def _switch_layout(
        self, ranks: tuple[int, ...], leaving: int | None, dead: Callable[[], Collection[int]] = tuple
    ) -> None:
        """Make before break: publish the plan, wait until every rank of the old and
        the new layout serves its epoch (they switch together at one step boundary).

        A rank of either layout in `dead()` first (read every `WATCH_PERIOD_S`) drops
        the plan and raises RuntimeError: the recovery then runs at once."""
        registry = self._registry
        plan = Plan(registry.next_epoch(), ranks, leaving)
        registry.plan = plan
        await registry.notify()
        involved = set(ranks) | set(registry.layout)
        reached = lambda: all(registry.ffn[r].reached(plan.epoch) for r in involved)  # noqa: E731
        while not reached():
            if lost := sorted(involved & set(dead())):
                registry.plan = None
                await registry.notify()
                raise RuntimeError(f"FFN ranks {lost} died before the layout of epoch {plan.epoch} served")
            with suppress(TimeoutError):
                await registry.wait(reached, WATCH_PERIOD_S)
        registry.switch_layout(plan)
        await registry.notify()

    async def _rebalance(self, ranks: tuple[int, ...]) -> None:
        """Apply `placement.rebalance_moves` onto `ranks`, each move a new epoch.
        Returns once every moved rank re-peered (or is GONE)."""
        registry = self._registry
        moved = []
        for rank, ffn_peer in rebalance_moves(registry.attention, ranks):
            registry.repeer(rank, ffn_peer)
            moved.append(rank)
        await registry.notify()
        await registry.wait(
            lambda: all(registry.attention[r].peered or registry.attention[r].state is MemberState.GONE for r in moved),
            self._timeout_s,
        )

    async def _serve_routes(self, deployment: str, num_replicas: int, wait_s: float) -> None:
        """Until Serve runs exactly `num_replicas` replicas of `deployment` (new ones
        RUNNING, so routed to; stopped ones gone).

        Raises:
            TimeoutError: not within `wait_s` seconds.
        """
        deadline = time.monotonic() + wait_s
        while list((await self._replicas(self._app, deployment)).values()) != ["RUNNING"] * num_replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Serve did not run {num_replicas} {deployment} replicas within {wait_s} s")
            await asyncio.sleep(WATCH_PERIOD_S / 2)

    async def await_rejoins(self, deployment: str, replica: str) -> None:
        """Until every replica of `deployment` that Serve runs, other than `replica`,
        is a member here, at most `REJOIN_WAIT_S`: a restarted coordinator must not
        hand a new member the rank id of a running one that has not rejoined yet (its
        reports would then be taken for the newcomer's). Without a restart every
        running replica is a member already, and this returns at once."""
        registry = self._registry
        try:
            states = await self._replicas(self._app, deployment)
        except Exception:  # the application is still being deployed: nothing runs yet
            logger.debug("replica states unavailable", exc_info=True)
            return
        running = {r for r, state in states.items() if state == "RUNNING" and r != replica}
        members = registry.attention if deployment == ATTENTION_DEPLOYMENT else registry.ffn
        try:
            await registry.wait(lambda: running <= {m.replica for m in members.values()}, REJOIN_WAIT_S)
        except TimeoutError:
            logger.warning(
                "%s replicas %s did not rejoin within %.0f s; %s registers anyway",
                deployment,
                sorted(running - {m.replica for m in members.values()}),
                REJOIN_WAIT_S,
                replica,
            )

    async def follow_serve_targets(self) -> None:
        """Take the pools' targets from Serve's replica counts once (a restarted
        coordinator continues from the sizes the last resize set, not the config's)."""
        for deployment in (ATTENTION_DEPLOYMENT, FFN_DEPLOYMENT):
            try:
                standby = self.standby_ranks if deployment == FFN_DEPLOYMENT else 0
                self.targets[deployment] = await target_replicas(self._app, deployment) - standby
            except Exception:  # the application is still being deployed: the config's sizes hold
                logger.debug("Serve target of %s unavailable", deployment, exc_info=True)

    async def watch_replicas(self) -> None:
        """Forever: mark attention ranks DRAINING when Serve stops their replica, GONE
        when the replica vanished without leaving (it died or was killed); retire the
        GONE ones once the pool has its target READY ranks again, and at once a
        STARTING one whose replica vanished (its start failed: `Registry.attention_failed`)."""
        registry = self._registry
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            try:
                states = await self._replicas(self._app, ATTENTION_DEPLOYMENT)
            except Exception:
                logger.debug("replica states unavailable", exc_info=True)
                continue
            for member in list(registry.attention.values()):
                state = states.get(member.replica)
                if member.state is MemberState.READY and state == "STOPPING":
                    registry.set_attention(member.rank, MemberState.DRAINING)
                    await registry.notify()
                elif member.state in (MemberState.READY, MemberState.DRAINING) and state is None:
                    logger.warning("attention rank %d: replica %s vanished", member.rank, member.replica)
                    registry.vanished.add(member.rank)
                    registry.set_attention(member.rank, MemberState.GONE)
                    await registry.notify()
                elif member.state is MemberState.STARTING and state is None:
                    logger.warning("attention rank %d: replica %s vanished while starting", member.rank, member.replica)
                    registry.attention_failed(member.rank)
                    await registry.notify()
            registry.retire_gone_attention(self.targets[ATTENTION_DEPLOYMENT])
