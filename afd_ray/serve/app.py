"""The Serve application builder: `import_path` of `deployments/afd.yaml`."""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from afd_ray.attention.server import AttentionServer
from afd_ray.config import AFDConfig
from afd_ray.control.coordinator import Coordinator
from afd_ray.ffn.server import FFNServer
from afd_ray.platform import actor_resources, resource_key
from afd_ray.serve.ingress import Ingress

__all__ = ["build_app"]


def build_app(args: dict[str, object]) -> Application:
    """Validate the YAML `args` into an `AFDConfig` and bind the application.

    Each pool member (an `AttentionServer` or `FFNServer` replica) runs in its own
    placement group of one bundle, `{CPU|GPU|NPU: <pool>.bundle_resources}`, so a
    pool grows or shrinks one member at a time. An attention rank takes at most
    `attention.max_num_seqs` requests at a time; further requests wait in Serve's
    queue. The coordinator and the ingress hold no device (`num_cpus=0`).

    Raises:
        pydantic.ValidationError: `args` does not fit `AFDConfig`; the message names
            the offending field (e.g. `attention.num_ranks`).
    """
    cfg = AFDConfig.model_validate(args)
    key = resource_key(cfg.platform)
    coordinator = serve.deployment(Coordinator).options(
        name="coordinator",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        # FFN ranks report counters several times a second: keep them out of the log.
        logging_config={"enable_access_log": False},
    ).bind(cfg.platform, cfg.connector, cfg.ffn.num_ranks)
    ffn = serve.deployment(FFNServer).options(
        name="ffn",
        num_replicas=cfg.ffn.num_ranks,
        ray_actor_options=dict(actor_resources(cfg.platform, cfg.ffn.bundle_resources)),
        placement_group_bundles=[{key: cfg.ffn.bundle_resources}],
        placement_group_strategy="STRICT_PACK",
    ).bind(cfg.platform, cfg.model, cfg.ffn, cfg.connector, cfg.gate_placement, coordinator)
    attention = serve.deployment(AttentionServer).options(
        name="attention",
        num_replicas=cfg.attention.num_ranks,
        max_ongoing_requests=cfg.attention.max_num_seqs,
        ray_actor_options=dict(actor_resources(cfg.platform, cfg.attention.bundle_resources)),
        placement_group_bundles=[{key: cfg.attention.bundle_resources}],
        placement_group_strategy="STRICT_PACK",
    ).bind(cfg.model, cfg.attention, cfg.connector, cfg.gate_placement, coordinator)
    ingress = serve.deployment(Ingress).options(
        name="ingress",
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(attention, coordinator, ffn)
