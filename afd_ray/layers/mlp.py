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

    `act_in_float32`: how `act(gate) * up` is rounded in a low-precision dtype, as the
    vLLM engine the FFN role stands in for computes it. True: in float32, rounded
    once to the model dtype (a torch.compile'd engine: inductor fuses vLLM's native
    `SiluAndMul`, also inside the fused-MoE op, `CustomOp.maybe_compile`). False:
    `act(gate)` rounded first, then the product (an eager engine: vLLM's CUDA
    `silu_and_mul` kernel returns the activation in the model dtype; eager torch
    does the same). Equal in float32.

    Raises:
        KeyError: `hidden_act` is not a transformers activation name.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        dtype: torch.dtype,
        act_in_float32: bool = False,
    ) -> None:
        super().__init__()
        self.act_in_float32 = act_in_float32
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(hidden), self.up_proj(hidden)  # [T, I] each
        if self.act_in_float32:
            return self.down_proj((self.act_fn(gate.float()) * up.float()).to(hidden.dtype))
        return self.down_proj(self.act_fn(gate) * up)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Destination tensor of each checkpoint name under the MLP's prefix."""
        return dict(self.named_parameters())
