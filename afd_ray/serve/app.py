"""The Serve application builder: `import_path` of `deployments/afd.yaml`."""

from __future__ import annotations

import ray
from ray import serve
from ray.serve import Application

from afd_ray.attention.server import AttentionServer
from afd_ray.autoscale.loader import load_policy
from afd_ray.autoscale.schema import AutoscalePolicy
from afd_ray.config import AFDConfig, IngressPlacement, PoolPlacement
from afd_ray.serve.check import ClusterResources, eplb_model_errors, fp8_device_errors
from afd_ray.control.coordinator import (
    ATTENTION_DEPLOYMENT,
    FFN_DEPLOYMENT,
    Coordinator,
)
from afd_ray.ffn.server import FFNServer
from afd_ray.models.embedded import check_gate_placement
from afd_ray.platform import Platform, actor_resources, resource_key
from afd_ray.serve.access import AccessKeys
from afd_ray.serve.ingress import Ingress

__all__ = ["build_app"]

_COORDINATOR_CALLS = 10_000
"""Concurrent calls the coordinator replica accepts."""
_HEALTH_CHECK_PERIOD_S = 2.0
"""Serve's health check period of pool members: an attention rank whose engine failed
(its FFN peer was lost mid-step) is replaced after 3 failed checks, about 6 s."""
_FFN_HEALTH_CHECK_PERIOD_S = 0.5
"""Serve's health check period of FFN ranks: Serve learns that a killed FFN replica's
actor died only from its next health check, and starts the replacement then (the
coordinator saw the death at once, `afd_ray.control.liveness`). At 2 s this took
0.6-2.2 s of a no-standby recovery's pause (docs/failures.md); a check costs the
rank one trivial call."""
HEAD_NODE_RESOURCE = "node:__internal_head__"
"""The Ray resource only the head node has, amount 1 (Ray 2.60
`ray._common.constants.HEAD_NODE_RESOURCE_NAME`; Serve's controller claims 0.001 of it
to run there)."""
_HEAD_NODE_SHARE = 0.001
"""What one ingress replica claims of `HEAD_NODE_RESOURCE`: up to 1000 replicas fit."""
_TEARDOWN_S = 60.0
"""Time a stopping attention replica has, after its drain timeout, to end its
remaining requests, close its pair channel and stop its engine, seconds."""


def build_app(args: dict[str, object]) -> Application:
    """Validate the YAML `args` into an `AFDConfig` and bind the application.

    Each pool member (an `AttentionServer` or `FFNServer` replica) runs in its own
    placement group of one bundle, `{CPU|GPU|NPU: <pool>.bundle_resources}` plus the
    pool's `placement.resources` (and its `placement.node_labels` as the bundle's
    label selector), so a pool grows or shrinks one member at a time, on the nodes
    its placement allows. An attention rank takes at most
    `attention.max_num_seqs` requests at a time; further requests wait in Serve's
    queue. The coordinator and the ingress hold no device (`num_cpus=0`); the ingress
    replicas run on the node `ingress.placement` names (default: the head node).

    Resizing: deploy with `external_scaler_enabled: true` (`serve.run(...,
    external_scaler_enabled=True)`); the coordinator then sets the pools' replica
    counts. A stopping attention replica gets `autoscale.drain_timeout_s` plus
    `_TEARDOWN_S` from Serve before it is killed, a stopping FFN replica
    `autoscale.resize_timeout_s` (its destructor runs the FFN scale-in).

    Raises:
        pydantic.ValidationError: `args` does not fit `AFDConfig`; the message names
            the offending field (e.g. `attention.num_ranks`).
        ValueError: `autoscale.policy` names a file that does not load (the message
            names the field in that file), `ingress.api_key_env` /
            `ingress.admin_key_env` names an unset environment variable, or
            `gate_placement: gate_on_attention` comes with a dense model
            (`check_gate_placement`), or `ffn.eplb` on with a dense model
            (`eplb_model_errors`), or FP8 (`model.quantization: fp8` or an FP8
            checkpoint) with a Ray cluster that has GPUs without FP8 kernels
            (`fp8_device_errors`).

    `serve run FILE.yaml` does not exit when this raises: Ray 2.60 builds the app in a
    task of its controller, marks it DEPLOY_FAILED after retries, and `serve run`
    sleeps on whatever the app's state; run `afd-ray check FILE.yaml` first
    (`afd_ray.serve.check`, the same checks, every error with its key path).
    """
    cfg = AFDConfig.model_validate(args)
    check_gate_placement(cfg.model, cfg.gate_placement)
    eplb_errors = eplb_model_errors(cfg, prefix="")
    if eplb_errors:
        raise ValueError("; ".join(map(str, eplb_errors)))
    if cfg.model.fp8 and ray.is_initialized():
        fp8_errors = fp8_device_errors(cfg, ClusterResources.of_running_cluster(), prefix="")
        if fp8_errors:
            raise ValueError("; ".join(map(str, fp8_errors)))
    access = AccessKeys.from_env(cfg.ingress)
    policy = _load_policy(cfg.autoscale.policy) if cfg.autoscale.policy else None
    coordinator = (
        serve.deployment(Coordinator)
        .options(
            name="coordinator",
            num_replicas=1,
            # Resizes, draining members and joiners wait inside calls: never queue the
            # members' polls and reports behind them.
            max_ongoing_requests=_COORDINATOR_CALLS,
            ray_actor_options={"num_cpus": 0},
            # FFN ranks report counters several times a second: keep them out of the log.
            logging_config={"enable_access_log": False},
        )
        .bind(cfg.platform, cfg.connector, cfg.attention, cfg.ffn, cfg.autoscale, policy, cfg.observability)
    )
    ffn = (
        serve.deployment(FFNServer)
        .options(
            name=FFN_DEPLOYMENT,
            num_replicas=cfg.ffn.num_ranks + cfg.ffn.standby_ranks,  # the layout's ranks and the standbys
            graceful_shutdown_timeout_s=cfg.autoscale.resize_timeout_s,
            **_member_placement(cfg.platform, cfg.ffn.bundle_resources, cfg.ffn.placement),
            health_check_period_s=_FFN_HEALTH_CHECK_PERIOD_S,
        )
        .bind(
            cfg.platform,
            cfg.model,
            cfg.ffn,
            cfg.connector,
            cfg.gate_placement,
            coordinator,
            cfg.observability,
            attention_compiled=not cfg.attention.enforce_eager,
        )
    )
    attention = (
        serve.deployment(AttentionServer)
        .options(
            name=ATTENTION_DEPLOYMENT,
            num_replicas=cfg.attention.num_ranks,
            graceful_shutdown_timeout_s=cfg.autoscale.drain_timeout_s + _TEARDOWN_S,
            health_check_period_s=_HEALTH_CHECK_PERIOD_S,
            max_ongoing_requests=cfg.attention.max_num_seqs,
            **_member_placement(cfg.platform, cfg.attention.bundle_resources, cfg.attention.placement),
        )
        .bind(
            cfg.model, cfg.attention, cfg.connector, cfg.gate_placement, coordinator, cfg.autoscale, cfg.observability
        )
    )
    ingress = serve.deployment(Ingress).options(
        name="ingress",
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options=_ingress_actor_options(cfg.ingress.placement),
    )
    return ingress.bind(attention, coordinator, ffn, cfg.attention, cfg.ffn, cfg.ingress, cfg.autoscale, access)


def _ingress_actor_options(placement: IngressPlacement) -> dict[str, object]:
    """Ray actor options of an ingress replica: no CPU (it only forwards requests),
    and with `placement: head` a share of `HEAD_NODE_RESOURCE`, so that Ray runs it on
    the head node."""
    if placement == "head":
        return {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: _HEAD_NODE_SHARE}}
    return {"num_cpus": 0}


def _member_placement(platform: Platform, amount: float, placement: PoolPlacement) -> dict[str, object]:
    """Serve options that put each replica of a pool in its own one-bundle placement
    group: `amount` of the platform's resource plus `placement`'s custom resources,
    on nodes carrying `placement.node_labels`; the actor claims that whole bundle."""
    actor = dict(actor_resources(platform, amount))
    if placement.resources:
        actor["resources"] = {**actor.get("resources", {}), **placement.resources}
    options: dict[str, object] = {
        "ray_actor_options": actor,
        "placement_group_bundles": [{resource_key(platform): amount, **placement.resources}],
        "placement_group_strategy": "STRICT_PACK",
    }
    if placement.node_labels:
        options["placement_group_bundle_label_selector"] = [dict(placement.node_labels)]
    return options


def _load_policy(path: str) -> AutoscalePolicy:
    try:
        return load_policy(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"autoscale.policy: {e}") from e
