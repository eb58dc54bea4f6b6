"""The gated MLP: a dense FFN layer, and the shared experts of an MoE layer."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`: hidden `[T, H]` -> `[T, H]`, same dtype.

    Parameter names match the checkpoint (`gate_proj`, `up_proj`, `down_proj`, each
    `.weight` and, with `bias`, `.bias`), as in transformers' `LlamaMLP`.

    Raises:
        KeyError: `hidden_act` is not a transformers activation name.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden)) * self.up_proj(hidden))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Destination tensor of each checkpoint name under the MLP's prefix."""
        return dict(self.named_parameters())
