"""The base of every config section and the literal types the sections share."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["CudaGraphMode", "DType", "GatePlacement", "IngressPlacement", "Section", "nearest_field_hint"]

GatePlacement = Literal["gate_on_ffn", "gate_on_attention"]
DType = Literal["float32", "bfloat16", "float16"]
IngressPlacement = Literal["head", "any"]
"""`IngressConfig.placement`."""
CudaGraphMode = Literal["piecewise", "full_decode"]
"""`AttentionPoolConfig.cudagraph_mode` (`afd_ray.attention.engine.afd_compilation_config`)."""


class Section(BaseModel):
    # strict: no coercion of other types; allow_inf_nan=False: an infinite duration
    # or size is refused here, not when a replica computes with it
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


def nearest_field_hint(model: type[BaseModel], loc: Sequence[int | str]) -> str:
    """For an unknown key at `loc` (a pydantic `extra_forbidden` error's location below
    `model`): `"; did you mean 'x'?"` naming the closest field of the section that holds
    it (difflib), or "" when no field is close or the section is not found."""
    section: type[BaseModel] | None = model
    for part in loc[:-1]:
        field = section.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return ""
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        section = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if section is None:
            return ""
    near = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=1)
    return f"; did you mean {near[0]!r}?" if near else ""
