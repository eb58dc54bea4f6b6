"""A:F autoscaling: the schema (`schema`), the pure policy (`policy.decide`), its YAML
loader (`loader`), trace recording and the offline simulator (live signals are in
`afd_ray.observability`, the live loop in `afd_ray.control.autoscaler`)."""

from afd_ray.autoscale.loader import load_policy
from afd_ray.autoscale.policy import decide
from afd_ray.autoscale.schema import AutoscalePolicy, Decision, MetricsSnapshot, ScaleState

__all__ = ["AutoscalePolicy", "Decision", "MetricsSnapshot", "ScaleState", "decide", "load_policy"]
