"""What the coordinator shows: `/afd/status`, the ingress's pool load, the autoscaling
metrics snapshot, and the export of pool sizes and resize events as metrics.

`StatusView` reads the registry, the resizer and the recovery; it changes nothing.
"""

from __future__ import annotations

import asyncio
import time

from afd_ray.autoscale.schema import MetricsSnapshot
from afd_ray.control.membership import AFDStatus, MemberState, PoolLoad
from afd_ray.control.placement import live_count, live_ranks, serving_ffn
from afd_ray.control.recovery import Recovery
from afd_ray.control.registry import Registry
from afd_ray.control.resize import ATTENTION_DEPLOYMENT, FFN_DEPLOYMENT, FFN_STANDBY, Resizer
from afd_ray.eplb.records import EPLBStatus
from afd_ray.observability.publish import CoordinatorPublisher
from afd_ray.observability.signals import SignalAggregator

__all__ = ["StatusView"]

_PUBLISH_PERIOD_S = 0.5
"""How often pool sizes, the epoch and new resize events are exported as metrics."""


class StatusView:
    """Assembles what the coordinator answers from its parts (read only).

    Args:
        registry: the members, epoch and layout.
        resizer: the pools' targets and resize events.
        recovery: recovery events, and whether one runs.
        signals: the autoscaling signals the members report.
    """

    def __init__(self, registry: Registry, resizer: Resizer, recovery: Recovery, signals: SignalAggregator) -> None:
        self._registry, self._resizer, self._recovery, self._signals = registry, resizer, recovery, signals

    def metrics(self) -> MetricsSnapshot:
        """The autoscaling signals of the current members (FFN standbys excluded) over
        the last `SignalAggregator.window_s` seconds."""
        registry = self._registry
        return self._signals.snapshot(time.time(), live_ranks(registry.attention), serving_ffn(registry.ffn))

    def pool_load(self) -> PoolLoad | None:
        """READY attention ranks, their KV usage and latencies, FFN rows per step, and
        whether a resize or recovery runs; None while no attention rank is known."""
        registry = self._registry
        if not registry.attention:
            return None
        metrics = self.metrics()
        return PoolLoad(
            attention_ranks=sum(m.state is MemberState.READY for m in registry.attention.values()),
            kv_cache_usage=metrics.kv_cache_usage,
            ffn_tokens_per_step=metrics.tokens_per_ffn_step,
            ttft_p90_s=metrics.ttft_p90_s,
            tpot_p90_s=metrics.tpot_p90_s,
            resizing=self._resizer.busy,
            recovering=self._recovery.recovering,
        )

    def status(
        self,
        waiting: dict[str, float],
        autoscale_paused: bool,
        autoscale_enabled: bool,
        eplb: EPLBStatus | None,
    ) -> AFDStatus:
        """The body of `/afd/status` (`Coordinator.status`); `waiting`: Serve replica id
        -> monotonic time its wait for the FFN layout began."""
        registry, resizer = self._registry, self._resizer
        now = time.monotonic()
        return AFDStatus(
            epoch=registry.epoch,
            attention=registry.listed_attention(),
            attention_waiting={replica: now - since for replica, since in waiting.items()},
            ffn=registry.listed_ffn(),
            target_attention=resizer.targets[ATTENTION_DEPLOYMENT],
            target_ffn=resizer.targets[FFN_DEPLOYMENT],
            target_standby=resizer.standby_ranks,
            autoscale_paused=autoscale_paused,
            autoscale_enabled=autoscale_enabled,
            resizes=resizer.resizes,
            recoveries=self._recovery.events,
            metrics=self.metrics(),
            eplb=eplb,
        )

    async def publish(self, published: CoordinatorPublisher) -> None:
        """Forever, every `_PUBLISH_PERIOD_S`: export the pool sizes, targets and epoch,
        and each resize event finished since."""
        registry, resizer = self._registry, self._resizer
        exported = 0
        while True:
            await asyncio.sleep(_PUBLISH_PERIOD_S)
            live = {ATTENTION_DEPLOYMENT: live_count(registry.attention), FFN_DEPLOYMENT: live_count(registry.ffn)}
            live[FFN_STANDBY] = sum(m.state is MemberState.STANDBY for m in registry.ffn.values())
            published.pools(live, dict(resizer.targets) | {FFN_STANDBY: resizer.standby_ranks}, registry.epoch)
            for event in resizer.resizes[exported:]:
                trigger = "manual" if event.reason == "manual" else "autoscaler"
                published.resize(trigger, event.error is None, event.duration_s, event.pause_s)
            exported = len(resizer.resizes)
