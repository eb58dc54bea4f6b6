"""`model`: which checkpoint both roles serve."""

from __future__ import annotations

import json
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
    """`fp8` (CUDA, compute capability >= 8.9; refused elsewhere before deploy), dynamic
    from a bf16/fp16 checkpoint: the attention engine takes vLLM's `quantization="fp8"`,
    and the FFN role quantizes its routed experts to FP8 at load and runs vLLM's FP8
    fused MoE kernels (`afd_ray.layers.fp8`); the gate, shared experts, dense MLPs and
    the A2F/F2A wire stay in `dtype`. Not yet run on a GPU. None: `dtype`. A
    checkpoint with a `quantization_config` (FP8 or other) is refused (`source`)."""

    @model_validator(mode="after")
    def _source_exists(self) -> ModelConfig:
        if self.source not in EMBEDDED_MODELS and not (Path(self.source) / "config.json").is_file():
            raise ValueError(
                f"model.source: {self.source!r} is neither an embedded model "
                f"{EMBEDDED_MODELS} nor a folder with a config.json"
            )
        if self.source not in EMBEDDED_MODELS:
            config = Path(self.source) / "config.json"
            try:
                quantized = json.loads(config.read_text()).get("quantization_config")
            except (json.JSONDecodeError, AttributeError) as e:
                raise ValueError(f"model.source: {config} is not a JSON mapping: {e}") from e
            if quantized is not None:
                method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
                raise ValueError(
                    f"model.source: {self.source!r} is a quantized checkpoint (config.json quantization_config, "
                    f"quant_method {method!r}); afd_ray's FFN role loads model-dtype experts only: serve the "
                    "bf16/fp16 checkpoint with model.quantization: fp8"
                )
        return self

    @property
    def name(self) -> str:
        """The id that `/v1/models` lists and requests must use."""
        return self.served_name or self.source
