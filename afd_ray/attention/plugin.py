"""vLLM plugin (entry point `vllm.general_plugins`): registers the AFD model classes.

vLLM runs general plugins in every process it starts (API, EngineCore, workers), so
the out-of-tree architectures resolve in the worker that builds the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from afd_ray.layers.family import MODEL_FAMILIES

__all__ = ["AFD_ARCHITECTURES", "afd_architecture", "register"]

AFD_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {family.architecture: family.attention_class for family in MODEL_FAMILIES.values()}
)
"""Checkpoint architecture -> AFD attention-role class (lazy import path), from the
family registry (`afd_ray.layers.family.MODEL_FAMILIES`)."""


def afd_architecture(checkpoint: Path) -> str:
    """The registered AFD architecture name for the checkpoint in `checkpoint`.

    Raises:
        ValueError: the checkpoint's architecture has no AFD class; the message names
            `model.source` and lists the supported ones.
    """
    config = AutoConfig.from_pretrained(checkpoint)
    # A config without `architectures` (e.g. converted from GGUF) means the causal-LM
    # class of its model_type, as transformers and vLLM read it.
    architectures = config.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)]
    for arch in architectures:
        if arch in AFD_ARCHITECTURES:
            return "AFD" + arch
    raise ValueError(
        f"model.source: architecture {architectures} of {checkpoint} has no AFD model "
        f"class; supported: {sorted(AFD_ARCHITECTURES)}"
    )


def register() -> None:
    """Register every AFD architecture with vLLM's model registry and apply the vLLM
    workarounds of `afd_ray.compat` (idempotent)."""
    from vllm import ModelRegistry

    from afd_ray.compat import apply_vllm_workarounds

    apply_vllm_workarounds()

    for arch, path in AFD_ARCHITECTURES.items():
        name = "AFD" + arch
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, path)
