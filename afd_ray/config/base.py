"""The base of every config section and the literal types the sections share."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["CudaGraphMode", "DType", "GatePlacement", "IngressPlacement", "Section"]

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
