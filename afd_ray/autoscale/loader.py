"""Loading an autoscaling policy: YAML (or JSON) text or file to a validated
`AutoscalePolicy`, every error naming the file and the bad field's dotted path."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from afd_ray.autoscale.schema import AutoscalePolicy

__all__ = ["PolicyError", "load_policy", "parse_policy"]


class PolicyError(ValueError):
    """A policy document that is not YAML or does not fit `AutoscalePolicy`."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields
        """Dotted paths of the bad fields (e.g. `attention.min_ranks`); empty when the
        text is not YAML."""


def parse_policy(text: str, source: str = "policy") -> AutoscalePolicy:
    """Validate a policy given as YAML (or JSON) text, e.g. the body of `POST
    /afd/autoscale/policy`.

    Raises:
        PolicyError: as `load_policy`'s, the message starting with `source`.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PolicyError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        raise PolicyError(
            f"{source}: expected a YAML mapping with an `attention` and/or an `ffn` section "
            f"(e.g. deployments/autoscale.yaml), got {got}"
        )
    try:
        return AutoscalePolicy.model_validate(data)
    except ValidationError as e:
        fields = tuple(_field(err["loc"]) for err in e.errors())
        problems = "; ".join(
            f"{field}: {err['msg'].removeprefix('Value error, ')}"
            for field, err in zip(fields, e.errors(), strict=True)
        )
        raise PolicyError(f"{source}: {problems}", fields) from e


def load_policy(path: str | Path) -> AutoscalePolicy:
    """Read and validate a policy YAML file.

    Raises:
        PolicyError: (a `ValueError`) the file is not UTF-8 YAML, or does not fit `AutoscalePolicy`;
            the message names the file and each bad field as a dotted path, e.g.
            `autoscale.yaml: attention.scale_in_cooldown_s: Input should be greater
            than or equal to 0`. Cross-field errors name both fields, e.g.
            `attention: min_ranks (3) must not exceed max_ranks (2)`.
        OSError: the file cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode()
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); a policy is a YAML file") from e
    return parse_policy(text, str(path))


def _field(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a dotted field path (`attention.min_ranks`)."""
    return ".".join(str(part) for part in loc) or "<root>"
