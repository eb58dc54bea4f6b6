"""The FFN half of a decoder-only model: per layer, what follows the post-attention norm.

Pure model code: no processes, no communication. The runtime feeds it `[T, H]`
hidden states one layer at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from afd_ray.weights import ffn_layer_params

__all__ = ["FFNStack", "load_ffn_stack"]


class FFNStack(nn.Module):
    """Every decoder layer's FFN block (`layers[i]` maps `[T, H] -> [T, H]`)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.model_type != "llama":
            raise ValueError(f"model.source: FFN role does not support model_type {config.model_type!r}")
        self.hidden_size: int = config.hidden_size
        self.layers = nn.ModuleList(LlamaMLP(config) for _ in range(config.num_hidden_layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """FFN of decoder layer `layer`: hidden `[T, H]` -> `[T, H]`, same dtype."""
        return self.layers[layer](hidden)


def load_ffn_stack(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> FFNStack:
    """Build the FFN stack of `checkpoint` with only FFN-role tensors loaded.

    Parameters are created on the meta device and assigned from the checkpoint, so no
    memory is spent on throwaway random init.

    Raises:
        ValueError: unsupported architecture, or a missing/unexpected FFN tensor.
    """
    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        stack = FFNStack(config)
    state = {
        f"layers.{layer}.{name}": tensor.to(device=device, dtype=dtype)
        for layer, name, tensor in ffn_layer_params(checkpoint)
    }
    missing, unexpected = stack.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"FFN weights of {checkpoint}: missing {missing}, unexpected {unexpected}")
    return stack.eval()
