"""The Serve application builder: `import_path` of `deployments/afd.yaml`."""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from afd_ray.attention.server import AttentionServer
from afd_ray.config import AFDConfig
from afd_ray.platform import actor_resources, resource_key
from afd_ray.serve.ingress import Ingress

__all__ = ["build_app"]


def build_app(args: dict[str, object]) -> Application:
    """Validate the YAML `args` into an `AFDConfig` and bind the application.

    Each attention rank is one `AttentionServer` replica in its own placement group
    of one bundle, `{CPU|GPU|NPU: attention.bundle_resources}`. It takes at most
    `attention.max_num_seqs` requests at a time; further requests wait in Serve's
    queue, where the autoscaler sees them. The ingress holds no device (`num_cpus=0`).

    Raises:
        pydantic.ValidationError: `args` does not fit `AFDConfig`; the message names
            the offending field (e.g. `attention.num_ranks`).
    """
    cfg = AFDConfig.model_validate(args)
    attention = serve.deployment(AttentionServer).options(
        name="attention",
        num_replicas=cfg.attention.num_ranks,
        max_ongoing_requests=cfg.attention.max_num_seqs,
        ray_actor_options=dict(actor_resources(cfg.platform, cfg.attention.bundle_resources)),
        placement_group_bundles=[{resource_key(cfg.platform): cfg.attention.bundle_resources}],
        placement_group_strategy="STRICT_PACK",
    )
    ingress = serve.deployment(Ingress).options(
        name="ingress",
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(attention.bind(cfg.model, cfg.attention), None)
