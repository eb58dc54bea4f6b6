"""`model`: which checkpoint both roles serve."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from afd_ray.config.base import DType, Section

__all__ = ["EMBEDDED_MODELS", "ModelConfig"]

EMBEDDED_MODELS = ("smollm2", "smollm2-moe")


class ModelConfig(Section):
    """Which checkpoint to serve, shared by both roles."""

    source: str = "smollm2"
    """An embedded model name (`smollm2`, or its Mixtral upcycling `smollm2-moe`) or a
    path to a Hugging Face checkpoint folder (config.json + safetensors + tokenizer)."""

    served_name: str | None = None
    """The model id clients put in `"model"`; defaults to `source`."""

    dtype: DType = "float32"
    """Parameter and activation dtype on both roles."""

    max_model_len: int = Field(2048, ge=16)
    """Context length in tokens (prompt + completion)."""

    load_format: Literal["auto", "dummy"] = "auto"
    """`auto`: both roles read their weights from the checkpoint's safetensors.
    `dummy`: neither reads any; every weight is random (vLLM's `load_format="dummy"`
    on the attention role, the same values on the FFN role: `afd_ray.ffn.model.dummy_fill`),
    so a folder with a `config.json` and a tokenizer is enough: for benchmarks of model
    shapes whose weights are not at hand. Outputs are then meaningless text, the same as
    plain vLLM's with `load_format="dummy"`."""

    quantization: Literal["fp8"] | None = None
    """`fp8` (CUDA, compute capability >= 8.9; refused elsewhere before deploy): the
    attention engine takes vLLM's `quantization="fp8"` (dynamic, from a bf16/fp16
    checkpoint). Not done yet (issue 35): the FFN role's FP8 experts; its experts stay
    in `dtype`, and no GPU run has checked this setting. None: the checkpoint's own
    `quantization_config` if it has one, else `dtype`."""

    @model_validator(mode="after")
    def _source_exists(self) -> ModelConfig:
        if self.source not in EMBEDDED_MODELS and not (Path(self.source) / "config.json").is_file():
            raise ValueError(
                f"model.source: {self.source!r} is neither an embedded model "
                f"{EMBEDDED_MODELS} nor a folder with a config.json"
            )
        return self

    @property
    def name(self) -> str:
        """The id that `/v1/models` lists and requests must use."""
        return self.served_name or self.source
