"""The config tree (`afd_ray.config`) without a cluster: every shipped deployment
validates, and bad values are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from afd_ray.config import AFDConfig

DEPLOYMENTS = Path(__file__).parents[1] / "deployments"


def _field(error: ValidationError) -> str:
    (only,) = error.errors()
    return ".".join(str(part) for part in only["loc"])


@pytest.mark.parametrize("path", sorted(DEPLOYMENTS.glob("afd*.yaml")), ids=lambda p: p.name)
def test_every_deployment_validates(path: Path) -> None:
    for app in yaml.safe_load(path.read_text())["applications"]:
        AFDConfig.model_validate(app["args"])


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"ffn": {"ubatches": True}}, "ffn.ubatches"),
        ({"ffn": {"ubatches": "2"}}, "ffn.ubatches"),
        ({"ffn": {"ubatches": 2.0}}, "ffn.ubatches"),
        ({"attention": {"num_ranks": "1"}}, "attention.num_ranks"),
        ({"attention": {"enforce_eager": "false"}}, "attention.enforce_eager"),
        ({"observability": {"metrics": 0}}, "observability.metrics"),
        ({"connector": {"timeout_s": "120"}}, "connector.timeout_s"),
        ({"ingress": {"max_kv_cache_usage": True}}, "ingress.max_kv_cache_usage"),
    ],
    ids=["bool-int", "str-int", "float-int", "str-ranks", "str-flag", "int-flag", "str-float", "bool-float"],
)
def test_values_of_another_type_are_refused_not_converted(args: dict[str, object], field: str) -> None:
    """`ffn.ubatches: true` used to become 1 and `"2"` 2 (a fresh user's report)."""
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate(args)
    assert _field(error.value) == field
    assert field in str(error.value)


def test_an_integer_stays_valid_where_a_float_is_expected() -> None:
    cfg = AFDConfig.model_validate({"ffn": {"bundle_resources": 1, "placement": {"resources": {"ffn_node": 1}}}})
    assert cfg.ffn.bundle_resources == 1.0 and cfg.ffn.placement.resources == {"ffn_node": 1.0}
