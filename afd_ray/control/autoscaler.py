"""The live autoscaler: evaluates the pure policy (`autoscale.policy.decide`, the same
code the simulator runs) on the coordinator's signals and asks the resize
orchestration for its targets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from afd_ray.autoscale.policy import decide
from afd_ray.autoscale.schema import AutoscalePolicy, MetricsSnapshot, ScaleState
from afd_ray.config import AttentionPoolConfig, FFNPoolConfig
from afd_ray.control.membership import ScaleRequest
from afd_ray.control.placement import clamp
from afd_ray.control.resize import ATTENTION_DEPLOYMENT, FFN_DEPLOYMENT, Resizer
from afd_ray.observability.publish import CoordinatorPublisher

__all__ = ["Autoscaler"]


class Autoscaler:
    """Every `interval_s`, unless paused or a resize runs: decide, clamp the targets to
    the pools' bounds, resize if they differ from the current targets.

    Args:
        policy: the autoscaling policy.
        interval_s: seconds between two evaluations (`autoscale.interval_s`).
        attention, ffn: the pools' resize bounds.
        resizer: runs the resizes and holds the current targets.
        metrics: the current signals snapshot.
        paused: whether a manual resize paused it (until the coordinator resumes it).
        published: exports each decision (`afd_autoscale_decisions`), or None.
    """

    def __init__(
        self,
        policy: AutoscalePolicy,
        interval_s: float,
        attention: AttentionPoolConfig,
        ffn: FFNPoolConfig,
        resizer: Resizer,
        metrics: Callable[[], Awaitable[MetricsSnapshot]],
        paused: Callable[[], bool],
        published: CoordinatorPublisher | None = None,
    ) -> None:
        self.policy = policy
        """Evaluated from the next evaluation on; replaced by `POST /afd/autoscale/policy`."""
        self._interval_s = interval_s
        self._attention, self._ffn = attention, ffn
        self._resizer = resizer
        self._metrics = metrics
        self._paused = paused
        self._published = published

    async def run(self) -> None:
        """Forever: evaluate the policy and resize to its targets."""
        targets = self._resizer.targets
        state = ScaleState.initial(targets[ATTENTION_DEPLOYMENT], targets[FFN_DEPLOYMENT])
        while True:
            await asyncio.sleep(self._interval_s)
            if self._paused() or self._resizer.busy:
                continue
            state = state.follow(targets[ATTENTION_DEPLOYMENT], targets[FFN_DEPLOYMENT], time.time())
            decision = decide(await self._metrics(), state, self.policy)
            if self._published is not None:
                self._published.decision(
                    ATTENTION_DEPLOYMENT, state.attention.target, decision.attention_target, decision.attention_cause
                )
                self._published.decision(FFN_DEPLOYMENT, state.ffn.target, decision.ffn_target, decision.ffn_cause)
            state = decision.state
            target = ScaleRequest(
                attention=clamp(decision.attention_target, self._attention),
                ffn=clamp(decision.ffn_target, self._ffn),
            )
            if (target.attention, target.ffn) != (targets[ATTENTION_DEPLOYMENT], targets[FFN_DEPLOYMENT]):
                await self._resizer.scale(target, reason=decision.reason)
