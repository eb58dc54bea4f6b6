"""Typed placement: custom resources and node labels per pool reach each member's
bundle; reserved resource names are refused naming the field; the ingress replicas
claim Ray's head-node resource unless `ingress.placement` is `any`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ray._common.constants import HEAD_NODE_RESOURCE_NAME

from afd_ray.config import AFDConfig
from afd_ray.serve.app import HEAD_NODE_RESOURCE, _member_placement, build_app


def test_custom_resources_and_labels_are_carried_into_the_bundle() -> None:
    cfg = AFDConfig.model_validate(
        {"ffn": {"bundle_resources": 0.5, "placement": {"resources": {"ffn_node": 1}, "node_labels": {"pool": "ffn"}}}}
    )
    options = _member_placement(cfg.platform, cfg.ffn.bundle_resources, cfg.ffn.placement)
    assert options["placement_group_bundles"] == [{"CPU": 0.5, "ffn_node": 1.0}]
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "resources": {"ffn_node": 1.0}}  # the whole bundle
    assert options["placement_group_bundle_label_selector"] == [{"pool": "ffn"}]
    plain = _member_placement(cfg.platform, 1.0, cfg.attention.placement)
    assert plain["placement_group_bundles"] == [{"CPU": 1.0}] and "placement_group_bundle_label_selector" not in plain


@pytest.mark.parametrize(
    ("resources", "message"), [({"CPU": 1}, "'CPU' is set by bundle_resources"), ({"ffn_node": 0}, "must be > 0")]
)
def test_reserved_or_empty_resources_are_refused(resources: dict[str, float], message: str) -> None:
    with pytest.raises(ValidationError, match=rf"ffn.placement.resources\n.*{message}"):
        AFDConfig.model_validate({"ffn": {"placement": {"resources": resources}}})


def test_the_ingress_runs_on_the_head_node_unless_placed_anywhere() -> None:
    """By default each ingress replica claims a share of the resource only Ray's head
    node has (where HAProxy and the Serve controller run); `any` claims none."""
    assert HEAD_NODE_RESOURCE == HEAD_NODE_RESOURCE_NAME  # Ray's name, checked on every Ray upgrade
    head = build_app({})._bound_deployment
    assert head.name == "ingress"
    assert head.ray_actor_options == {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}}
    anywhere = build_app({"ingress": {"placement": "any"}})._bound_deployment
    assert anywhere.ray_actor_options == {"num_cpus": 0}
