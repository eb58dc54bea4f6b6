"""A:F autoscaling: the pure policy and its YAML, trace recording and the offline
simulator (live signals are in `afd_ray.observability`)."""

from afd_ray.autoscale.policy import (
    AutoscalePolicy,
    Decision,
    MetricsSnapshot,
    ScaleState,
    decide,
    load_policy,
)

__all__ = ["AutoscalePolicy", "Decision", "MetricsSnapshot", "ScaleState", "decide", "load_policy"]
