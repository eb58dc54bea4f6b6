"""The `afd_*` metrics: every name, kind, unit, description, label set and bucket list,
defined once here, and the `ray.util.metrics` objects that export them.

Ray exports an application metric `NAME` to Prometheus as `ray_NAME` (a counter as
`ray_NAME_total`, a histogram as `ray_NAME_bucket`, `_sum`, `_count`), with Ray's own
labels (`SessionName`, `NodeAddress`, `WorkerId`, ...) beside the ones listed here.
`Metric.series` gives those exported names; `afd_ray.observability.dashboards` builds
its panel queries from them, and docs/observability.md lists the table of `METRICS`.

vLLM's own engine metrics (`vllm:*`, exported as `ray_vllm_*`) come from vLLM's
`RayPrometheusStatLogger`, not from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from ray.util import metrics as ray_metrics

__all__ = ["METRICS", "Kind", "Metric", "MetricSet", "by_name"]


class Kind(str, Enum):
    """Prometheus metric type."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Metric:
    """One `afd_*` metric."""

    name: str
    """Name given to `ray.util.metrics` (Prometheus: `ray_` + name)."""
    kind: Kind
    unit: str
    """Unit of a sample (also the name's suffix where Prometheus conventions have one)."""
    description: str
    labels: tuple[str, ...]
    """Label keys, besides Ray's own."""
    buckets: tuple[float, ...] = ()
    """Histogram bucket upper bounds, in `unit` (histograms only)."""

    @property
    def series(self) -> str:
        """The Prometheus series name Ray exports: `ray_<name>`, `_total` for a
        counter; a histogram's `_bucket`/`_sum`/`_count` are appended to it."""
        return f"ray_{self.name}_total" if self.kind is Kind.COUNTER else f"ray_{self.name}"


_STEP_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Per-step times: 100 us (a GPU layer stack) to 2.5 s (a long CPU prefill)."""
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_RESIZE_S = (0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)

_RANK = ("pool", "rank", "epoch")

METRICS: tuple[Metric, ...] = (
    Metric(
        "afd_ffn_steps",
        Kind.COUNTER,
        "steps",
        "FFN forward steps served (one step runs every FFN layer for the attention peers in it).",
        _RANK,
    ),
    Metric(
        "afd_ffn_tokens",
        Kind.COUNTER,
        "tokens",
        "Token rows served by an FFN rank, summed over steps (not over layers).",
        _RANK,
    ),
    Metric(
        "afd_ffn_busy_seconds",
        Kind.COUNTER,
        "seconds",
        "Wall time an FFN rank spent inside steps (receive + compute + send); its rate is the busy fraction.",
        _RANK,
    ),
    Metric(
        "afd_ffn_tokens_per_step",
        Kind.HISTOGRAM,
        "tokens",
        "Token rows of one FFN step, over all its attention peers.",
        _RANK,
        _TOKENS,
    ),
    Metric(
        "afd_ffn_queue_seconds",
        Kind.HISTOGRAM,
        "seconds",
        "Batching window of one FFN step: from its first step header to the start of its compute.",
        _RANK,
        _STEP_S,
    ),
    Metric(
        "afd_ffn_compute_seconds",
        Kind.HISTOGRAM,
        "seconds",
        "FFN compute of one step, every layer, without EP collectives and without waiting for A2F tensors.",
        _RANK,
        _STEP_S,
    ),
    Metric(
        "afd_ffn_ep_collective_seconds",
        Kind.HISTOGRAM,
        "seconds",
        "EP collectives (all-gather of rows and routing, reduce-scatter of outputs) of one FFN step, every layer.",
        _RANK,
        _STEP_S,
    ),
    Metric(
        "afd_ffn_split_seconds",
        Kind.COUNTER,
        "seconds",
        "Timed FFN steps split on the FFN rank's device timeline (afd_ray.observability.timeline), by "
        "part: attention (waits for each later layer's rows: the attention rank's per-layer work and A2F), "
        "wire (F2A copies and signals), ffn (FFN compute, EP collectives included), idle (previous step's "
        "last F2A to the first layer's rows). Over the rate of afd_ffn_split_steps: seconds per step.",
        (*_RANK, "part"),
    ),
    Metric(
        "afd_ffn_split_steps",
        Kind.COUNTER,
        "steps",
        "FFN steps timed for afd_ffn_split_seconds: every step on CPU, one in "
        "timeline.CUDA_SAMPLE_EVERY on CUDA, none starting over timeline.IDLE_GAP_S after the previous one.",
        _RANK,
    ),
    Metric(
        "afd_a2f_bytes",
        Kind.COUNTER,
        "bytes",
        "Bytes an FFN rank received from its attention peers (hidden states, and top-k ids and "
        "weights with gate_on_attention).",
        _RANK,
    ),
    Metric(
        "afd_f2a_bytes",
        Kind.COUNTER,
        "bytes",
        "Bytes an FFN rank sent back to its attention peers (FFN outputs).",
        _RANK,
    ),
    Metric(
        "afd_expert_tokens",
        Kind.COUNTER,
        "tokens",
        "Rows routed to each expert by the tokens an FFN rank served, summed over MoE layers.",
        (*_RANK, "expert"),
    ),
    Metric(
        "afd_expert_imbalance",
        Kind.GAUGE,
        "ratio",
        "Expert load imbalance of an FFN rank's tokens since its previous report: max over experts / "
        "mean over experts of the rows routed (1 = balanced).",
        _RANK,
    ),
    Metric(
        "afd_eplb_balancedness",
        Kind.GAUGE,
        "ratio",
        "Balancedness of one MoE layer over the FFN pool's expert-load window (ffn.eplb.window_size steps): "
        "mean over max of the EP ranks' routed rows under the placement in use (1 = balanced; the coordinator).",
        ("layer",),
    ),
    Metric(
        "afd_connector_wait_seconds",
        Kind.HISTOGRAM,
        "seconds",
        "Time one attention step was blocked in the FFN exchange (A2F send to F2A receive), summed over layers.",
        _RANK,
        _STEP_S,
    ),
    Metric(
        "afd_pool_ranks",
        Kind.GAUGE,
        "ranks",
        "Live members (starting or ready) of a pool; pool ffn_standby: FFN ranks standing by outside the layout.",
        ("pool",),
    ),
    Metric(
        "afd_pool_target_ranks",
        Kind.GAUGE,
        "ranks",
        "Target size of a pool (the last resize asked for it); pool ffn_standby: ffn.standby_ranks.",
        ("pool",),
    ),
    Metric(
        "afd_epoch",
        Kind.GAUGE,
        "epoch",
        "Membership epoch of the application (bumped by every re-peering and FFN layout switch).",
        (),
    ),
    Metric(
        "afd_resizes",
        Kind.COUNTER,
        "resizes",
        "Resizes finished, by who asked (manual or autoscaler) and outcome (ok or error).",
        ("trigger", "outcome"),
    ),
    Metric(
        "afd_resize_seconds",
        Kind.HISTOGRAM,
        "seconds",
        "Duration of a resize, from the request to the new layout serving.",
        ("trigger",),
        _RESIZE_S,
    ),
    Metric(
        "afd_resize_pause_seconds",
        Kind.HISTOGRAM,
        "seconds",
        "Longest step-boundary pause of the FFN loop during a resize (0 when none paused).",
        ("trigger",),
        _RESIZE_S,
    ),
    Metric(
        "afd_autoscale_decisions",
        Kind.COUNTER,
        "decisions",
        "Autoscaler evaluations per pool, by action (out: grow, in: shrink, hold) and reason: the "
        "deciding signal, all_below, bounds, in_band or no_signals (Decision.attention_cause); the "
        "full reason text is in the coordinator's log and, for a resize, in /afd/status.",
        ("pool", "action", "reason"),
    ),
)

_BY_NAME = {metric.name: metric for metric in METRICS}


def by_name(name: str) -> Metric:
    """The metric named `name`.

    Raises:
        KeyError: no `afd_*` metric has that name.
    """
    return _BY_NAME[name]


_Instrument = ray_metrics.Counter | ray_metrics.Gauge | ray_metrics.Histogram


class MetricSet:
    """The `ray.util.metrics` instruments of `names` for one process, created once.

    Ray aggregates each (name, labels) series per worker process; a process creates
    the instruments it records (FFN ranks the FFN ones, the coordinator the pool
    ones). Must be created inside a Ray worker (a Serve replica).

    Raises:
        KeyError: a name is not in `METRICS`.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self._instruments: dict[str, _Instrument] = {}
        for name in names:
            metric = by_name(name)
            if metric.kind is Kind.COUNTER:
                instrument: _Instrument = ray_metrics.Counter(name, metric.description, metric.labels)
            elif metric.kind is Kind.GAUGE:
                instrument = ray_metrics.Gauge(name, metric.description, metric.labels)
            else:
                instrument = ray_metrics.Histogram(name, metric.description, list(metric.buckets), metric.labels)
            self._instruments[name] = instrument

    def inc(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        """Add `value` (> 0; 0 is skipped) to counter `name`."""
        if value > 0:
            self._instruments[name].inc(value, tags=dict(tags))

    def set(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        """Set gauge `name` to `value`."""
        self._instruments[name].set(value, tags=dict(tags))

    def observe(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        """Add one sample `value` to histogram `name`."""
        self._instruments[name].observe(value, tags=dict(tags))
