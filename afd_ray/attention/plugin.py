"""vLLM plugin (entry point `vllm.general_plugins`): registers the AFD model classes.

vLLM runs general plugins in every process it starts (API, EngineCore, workers), so
the out-of-tree architectures resolve in the worker that builds the model.
"""

from __future__ import annotations

__all__ = ["AFD_ARCHITECTURES", "register"]

AFD_ARCHITECTURES = {
    "LlamaForCausalLM": "afd_ray.attention.models.llama:AFDLlamaForCausalLM",
}
"""Checkpoint architecture -> AFD attention-role class (lazy import path)."""


def register() -> None:
    """Register every AFD architecture with vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    for arch, path in AFD_ARCHITECTURES.items():
        name = "AFD" + arch
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, path)
