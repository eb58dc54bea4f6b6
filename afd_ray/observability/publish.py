"""What each process of the application exports as `afd_*` metrics (`metrics.METRICS`).

One publisher per process, called from its periodic report loop (never from the data
path): the FFN server's, the attention server's and the coordinator's. Counters are
increased by the deltas of the cumulative counters since the previous call, and
histograms get one sample per step record taken since then.
"""

from __future__ import annotations

from collections.abc import Sequence

from afd_ray.observability.metrics import MetricSet
from afd_ray.observability.stats import FFNStats
from afd_ray.observability.steps import AttentionStep, FFNStep

__all__ = ["AttentionPublisher", "CoordinatorPublisher", "FFNPublisher"]


class FFNPublisher:
    """The FFN pool's metrics of FFN rank `rank` (create in its replica)."""

    def __init__(self, rank: int) -> None:
        self._rank = str(rank)
        self._metrics = MetricSet(
            (
                "afd_ffn_steps",
                "afd_ffn_tokens",
                "afd_ffn_busy_seconds",
                "afd_ffn_tokens_per_step",
                "afd_ffn_queue_seconds",
                "afd_ffn_compute_seconds",
                "afd_ffn_ep_collective_seconds",
                "afd_ffn_split_seconds",
                "afd_ffn_split_steps",
                "afd_a2f_bytes",
                "afd_f2a_bytes",
                "afd_expert_tokens",
                "afd_expert_imbalance",
            )
        )
        self._stats = FFNStats()
        self._expert_tokens: list[int] = []

    def publish(self, stats: FFNStats, expert_tokens: Sequence[int], epoch: int, steps: Sequence[FFNStep]) -> None:
        """Export the counters' growth since the previous call and one histogram sample
        per step in `steps`.

        Args:
            stats: the rank's cumulative counters.
            expert_tokens: cumulative rows routed to each expert `[E]`.
            epoch: the layout epoch the rank serves.
            steps: the step records taken since the previous call.
        """
        m, old = self._metrics, self._stats
        tags = {"pool": "ffn", "rank": self._rank, "epoch": str(epoch)}
        m.inc("afd_ffn_steps", stats.steps - old.steps, tags)
        m.inc("afd_ffn_tokens", stats.tokens - old.tokens, tags)
        m.inc("afd_ffn_busy_seconds", stats.busy_s - old.busy_s, tags)
        m.inc("afd_a2f_bytes", stats.a2f_bytes - old.a2f_bytes, tags)
        m.inc("afd_f2a_bytes", stats.f2a_bytes - old.f2a_bytes, tags)
        split = stats.split - old.split
        m.inc("afd_ffn_split_steps", split.steps, tags)
        parts = {"attention": split.attention_s, "wire": split.wire_s, "ffn": split.ffn_s, "idle": split.idle_s}
        for part, seconds in parts.items():
            m.inc("afd_ffn_split_seconds", seconds, tags | {"part": part})
        self._stats = stats
        for step in steps:
            step_tags = tags | {"epoch": str(step.epoch)}
            m.observe("afd_ffn_tokens_per_step", sum(peer.num_tokens for peer in step.peers), step_tags)
            m.observe("afd_ffn_queue_seconds", max((peer.queue_s for peer in step.peers), default=0.0), step_tags)
            m.observe("afd_ffn_compute_seconds", step.compute_s, step_tags)
            m.observe("afd_ffn_ep_collective_seconds", step.ep_s, step_tags)
        previous = self._expert_tokens or [0] * len(expert_tokens)
        load = [now - before for now, before in zip(expert_tokens, previous, strict=True)]
        self._expert_tokens = list(expert_tokens)
        for expert, rows in enumerate(load):
            m.inc("afd_expert_tokens", rows, tags | {"expert": str(expert)})
        if sum(load) > 0:
            m.set("afd_expert_imbalance", max(load) / (sum(load) / len(load)), tags)


class AttentionPublisher:
    """The attention pool's metrics of attention rank `rank` (create in its replica)."""

    def __init__(self, rank: int) -> None:
        self._rank = str(rank)
        self._metrics = MetricSet(("afd_connector_wait_seconds",))

    def publish(self, steps: Sequence[AttentionStep]) -> None:
        """One connector-wait sample per step record in `steps` (none for a graph
        replay, whose wait the host does not see)."""
        for step in steps:
            if step.replayed:
                continue
            tags = {"pool": "attention", "rank": self._rank, "epoch": str(step.epoch)}
            self._metrics.observe("afd_connector_wait_seconds", step.exchange_s, tags)


class CoordinatorPublisher:
    """Pool sizes, epoch, resizes and autoscaler decisions (create in the coordinator)."""

    def __init__(self) -> None:
        self._metrics = MetricSet(
            (
                "afd_pool_ranks",
                "afd_pool_target_ranks",
                "afd_epoch",
                "afd_resizes",
                "afd_resize_seconds",
                "afd_resize_pause_seconds",
                "afd_autoscale_decisions",
            )
        )

    def pools(self, live: dict[str, int], targets: dict[str, int], epoch: int) -> None:
        """Set the pool gauges: live members and target per pool (`attention`, `ffn`)."""
        for pool, ranks in live.items():
            self._metrics.set("afd_pool_ranks", ranks, {"pool": pool})
            self._metrics.set("afd_pool_target_ranks", targets[pool], {"pool": pool})
        self._metrics.set("afd_epoch", epoch, {})

    def resize(self, trigger: str, ok: bool, duration_s: float, pause_s: float) -> None:
        """Count one finished resize (`trigger`: `manual` or `autoscaler`)."""
        self._metrics.inc("afd_resizes", 1, {"trigger": trigger, "outcome": "ok" if ok else "error"})
        self._metrics.observe("afd_resize_seconds", duration_s, {"trigger": trigger})
        self._metrics.observe("afd_resize_pause_seconds", pause_s, {"trigger": trigger})

    def decision(self, pool: str, current: int, target: int, cause: str) -> None:
        """Count one autoscaler decision of `pool` from `current` to `target` ranks;
        `cause` is `Decision.attention_cause` / `ffn_cause` (a bounded label)."""
        action = "out" if target > current else "in" if target < current else "hold"
        self._metrics.inc("afd_autoscale_decisions", 1, {"pool": pool, "action": action, "reason": cause})
