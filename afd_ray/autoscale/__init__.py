"""A:F autoscaling: the pure policy, live signal collection, trace recording and the
offline simulator."""

from afd_ray.autoscale.policy import (
    AutoscalePolicy,
    Decision,
    MetricsSnapshot,
    ScaleState,
    decide,
    load_policy,
)

__all__ = ["AutoscalePolicy", "Decision", "MetricsSnapshot", "ScaleState", "decide", "load_policy"]
