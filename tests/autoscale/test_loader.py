"""Loading the policy YAML: every bad field named by its dotted path, the shipped
policy valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from afd_ray.autoscale.loader import load_policy

POLICY = Path(__file__).parents[2] / "deployments" / "autoscale.yaml"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention": {"scale_out_delay_s": 5}}, "attention.scale_out_delay_s"),
        ({"ffn": {"min_ranks": 3, "max_ranks": 2}}, "min_ranks (3) must not exceed max_ranks (2)"),
        ({"attention": {"scale_in_cooldown_s": -1}}, "attention.scale_in_cooldown_s"),
        (
            {"ffn": {"signals": {"ffn_busy_fraction": {"scale_out": 1.5, "scale_in": 0.3}}}},
            "ffn.signals.ffn_busy_fraction.scale_out",
        ),
        (
            {"attention": {"signals": {"ttft_p90_s": {"scale_out": 1.0, "scale_in": 2.0}}}},
            "attention.signals.ttft_p90_s",
        ),
        (
            {"attention": {"signals": {"kv_usage": {"scale_out": 0.9, "scale_in": 0.1}}}},
            "attention.signals.kv_usage",
        ),
        ({"ffn": {"min_ranks": "2"}}, "ffn.min_ranks"),
        ({"attention": {"step": True}}, "attention.step"),
        ({"attention": {"scale_in_after_s": "30"}}, "attention.scale_in_after_s"),
    ],
    ids=[
        "unknown-key",
        "min-above-max",
        "negative-cooldown",
        "threshold-out-of-range",
        "band-inverted",
        "unknown-signal",
        "string-count",
        "bool-step",
        "string-duration",
    ],
)
def test_bad_policy_yaml_names_the_field(tmp_path: Path, change: dict[str, dict[str, object]], field: str) -> None:
    policy = yaml.safe_load(POLICY.read_text())
    for pool, section in change.items():
        policy[pool] = _merge(policy[pool], section)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    with pytest.raises(ValueError, match="policy.yaml") as error:
        load_policy(path)
    assert field in str(error.value)
    assert str(error.value).count(";") == 0  # exactly one problem reported


def _merge(base: dict[str, object], change: dict[str, object]) -> dict[str, object]:
    out = dict(base)
    for key, value in change.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_shipped_policy_is_valid() -> None:
    policy = load_policy(POLICY)
    assert (policy.attention.min_ranks, policy.attention.max_ranks) == (1, 2)
    assert (policy.ffn.min_ranks, policy.ffn.max_ranks) == (1, 2)
