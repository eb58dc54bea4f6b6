"""vLLM plugin (entry point `vllm.general_plugins`): registers the AFD model classes.

vLLM runs general plugins in every process it starts (API, EngineCore, workers), so
the out-of-tree architectures resolve in the worker that builds the model.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["AFD_ARCHITECTURES", "afd_architecture", "register"]

AFD_ARCHITECTURES = {
    "LlamaForCausalLM": "afd_ray.attention.models.llama:AFDLlamaForCausalLM",
    "MixtralForCausalLM": "afd_ray.attention.models.mixtral:AFDMixtralForCausalLM",
    "Qwen3MoeForCausalLM": "afd_ray.attention.models.qwen3_moe:AFDQwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "afd_ray.attention.models.deepseek:AFDDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "afd_ray.attention.models.deepseek:AFDDeepseekV3ForCausalLM",
}
"""Checkpoint architecture -> AFD attention-role class (lazy import path)."""


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
