"""`model`: which checkpoint both roles serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import Field, PrivateAttr, model_validator

from afd_ray.config.base import DType, Section

__all__ = ["EMBEDDED_MODELS", "FP8_CAPABILITY", "Fp8Checkpoint", "ModelConfig", "fp8_checkpoint"]

FP8_CAPABILITY = (8, 9)
"""Least CUDA compute capability with FP8 tensor cores (Ada, Hopper and later). Here,
not in `afd_ray.layers.fp8` (which re-exports it), so that `afd-ray check` and
`afd-ray --help` do not import torch and transformers for it (4 s of `--help`)."""

EMBEDDED_MODELS = ("smollm2", "smollm2-moe")


class Fp8Checkpoint(NamedTuple):
    """How an FP8 checkpoint's linear weights are scaled (its config.json
    `quantization_config`, read as vLLM 0.26's `Fp8Config.from_config` reads it).

    Each FP8 weight `W [N, K]` (float8_e4m3fn) comes with a float32 scale, and
    `W.float() * scale` is the weight it stands for:
    - `block_shape` `(bn, bk)` (`weight_block_size`, DeepSeek-V3 and Qwen3-FP8 ship
      `[128, 128]`): `weight_scale_inv` `[ceil(N / bn), ceil(K / bk)]`, one per block;
    - `block_shape` None: `weight_scale`, one scalar per tensor.
    Activations are quantized dynamically (`activation_scheme: dynamic`).
    """

    block_shape: tuple[int, int] | None

    @property
    def scale_name(self) -> str:
        """The checkpoint suffix of a weight's scale: `weight_scale_inv` (block) or `weight_scale`."""
        return "weight_scale_inv" if self.block_shape else "weight_scale"


def fp8_checkpoint(quantization_config: object, source: str) -> Fp8Checkpoint | None:
    """The FP8 scheme of a checkpoint's `quantization_config` (None: none given).

    Raises:
        ValueError: naming `model.source`: a quant method other than `fp8`, static
            activation scales, or a `weight_block_size` that is not two positive ints.
    """
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) else None
    if method != "fp8":
        raise ValueError(
            f"model.source: {source!r} is a quantized checkpoint (config.json quantization_config, quant_method "
            f"{method!r}); afd_ray serves FP8 checkpoints (quant_method 'fp8') only: serve its bf16/fp16 "
            "checkpoint, optionally with model.quantization: fp8"
        )
    scheme = quantization_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"model.source: {source!r} is an FP8 checkpoint with activation_scheme {scheme!r}; afd_ray's FFN role "
            "runs dynamic activation scales only (activation_scheme 'dynamic')"
        )
    block = quantization_config.get("weight_block_size")
    if block is None:
        return Fp8Checkpoint(None)
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ValueError(
            f"model.source: {source!r}: quantization_config.weight_block_size {block!r} is not two positive ints"
        )
    return Fp8Checkpoint((block[0], block[1]))


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
    the A2F/F2A wire stay in `dtype`. None: `dtype`, or the checkpoint's own FP8
    (`fp8_checkpoint`): an FP8 checkpoint (config.json `quantization_config` with
    `quant_method: fp8`, dynamic activations, block or per-tensor scales) is served as
    it is, on the same platforms, with this field unset; any other `quant_method` is
    refused (`source`)."""

    _fp8_checkpoint: Fp8Checkpoint | None = PrivateAttr(None)

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
            self._fp8_checkpoint = fp8_checkpoint(quantized, self.source)
        if self._fp8_checkpoint is not None and self.quantization is not None:
            raise ValueError(
                f"model.quantization: {self.quantization} with {self.source!r}, already an FP8 checkpoint "
                "(config.json quantization_config): leave model.quantization unset, the checkpoint's scales are used"
            )
        if self._fp8_checkpoint is not None and self.load_format == "dummy":
            raise ValueError(
                f"model.load_format: dummy with {self.source!r}, an FP8 checkpoint: dummy weights are drawn in "
                "`dtype`; drop quantization_config from a copy of its config.json and set model.quantization: fp8"
            )
        return self

    @property
    def checkpoint_fp8(self) -> Fp8Checkpoint | None:
        """The FP8 scheme of the checkpoint (`fp8_checkpoint`); None for a model-dtype one."""
        return self._fp8_checkpoint

    @property
    def fp8(self) -> bool:
        """Either side runs FP8 weights: `quantization: fp8`, or an FP8 checkpoint."""
        return self.quantization is not None or self._fp8_checkpoint is not None

    @property
    def name(self) -> str:
        """The id that `/v1/models` lists and requests must use."""
        return self.served_name or self.source
