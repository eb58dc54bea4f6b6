"""FP8 routed experts (`model.quantization: fp8`) with vLLM's FP8 fused MoE kernels (CUDA).

What vLLM does for `quantization="fp8"` on a bfloat16/float16 checkpoint, the FFN role
does for the routed experts it owns: at load, each expert's `w13` `[2I, H]` and `w2`
`[H, I]` are quantized to `float8_e4m3fn` with one float32 scale per expert and
projection (`ops.scaled_fp8_quant`, dynamic per-tensor: scale = amax / 448), as vLLM's
`Fp8PerTensorOnlineMoEMethod.process_weights_after_loading` (vLLM 0.26 and 0.32); each
step quantizes the activations per tensor, dynamically, inside vLLM's `fused_experts`
(`fp8_w8a8_moe_quant_config`: `use_fp8_w8a8`, no activation scales), the Triton
kernels of vLLM's `TRITON` FP8 MoE backend. Hidden states in and out stay in the model
dtype, so the A2F/F2A wire does too. The router gate, the shared experts and dense
MLPs stay in the model dtype (vLLM runs its shared experts' and dense MLPs' linear
layers in FP8 too: a difference in rounding, not in bytes read per step, which are
mostly the routed experts').

FP8 checkpoints (a `quantization_config` in config.json) are refused by the config
(`afd_ray.config.model.ModelConfig`), so every FP8 expert here comes from a
model-dtype one.

vLLM is imported on first use only. Has not run on a GPU yet.
"""

from __future__ import annotations

import torch
from torch import nn

from afd_ray.layers.experts import ExpertSlots, Experts

__all__ = ["FP8_CAPABILITY", "Fp8Experts", "check_fp8_device", "quantize_experts"]

FP8_CAPABILITY = (8, 9)
"""Least CUDA compute capability with FP8 tensor cores (Ada, Hopper and later)."""
_FP8 = torch.float8_e4m3fn
"""vLLM's FP8 dtype on CUDA (`current_platform.fp8_dtype()`)."""
_PROJ = ("gate_proj", "up_proj", "down_proj")


def check_fp8_device(device: torch.device) -> None:
    """Raise unless `device` is a CUDA GPU with FP8 kernels (`FP8_CAPABILITY`).

    Raises:
        ValueError: naming `model.quantization`, the device and its capability.
    """
    least = ".".join(map(str, FP8_CAPABILITY))
    if device.type != "cuda":
        raise ValueError(f"model.quantization: fp8 needs a CUDA GPU of compute capability >= {least}, not {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"model.quantization: fp8 needs compute capability >= {least}; {name} ({device}) has "
            f"{'.'.join(map(str, capability))}"
        )


class Fp8Experts(nn.Module):
    """The routed experts of one MoE layer in this EP rank's slots, in FP8 (built by
    `quantize_experts` from an `Experts`).

    It stands where `Experts` stands (`MoE.experts`), with the same `slots`, `owned`,
    `intermediate_size`, `forward` and `checkpoint_tensors`, and adds `fused`.

    Parameters (`requires_grad=False`; S = `len(slots.experts)`):
        gate_up: `[S, 2I, H]` float8_e4m3fn, rows `[:I]` gate, `[I:]` up (vLLM's `w13`).
        gate_up_scale: `[S]` float32: the dequantized `w13` of slot s is
            `gate_up[s] * gate_up_scale[s]`.
        down: `[S, H, I]` float8_e4m3fn (vLLM's `w2`).
        down_scale: `[S]` float32.
    """

    def __init__(
        self,
        slots: ExpertSlots,
        hidden_act: str,
        dtype: torch.dtype,
        gate_up: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down: torch.Tensor,
        down_scale: torch.Tensor,
    ) -> None:
        super().__init__()
        self.slots = slots
        self.owned = slots.experts
        """Logical expert of each local slot (`ExpertSlots.experts`)."""
        self.intermediate_size = down.shape[-1]
        self.hidden_act = hidden_act
        self.dtype = dtype
        """Model dtype: of the hidden states, and of `checkpoint_tensors`."""
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.gate_up_scale = nn.Parameter(gate_up_scale, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.down_scale = nn.Parameter(down_scale, requires_grad=False)
        device = down.device
        self.register_buffer("slot_table", torch.tensor(slots.table(), dtype=torch.int64, device=device), False)
        """`[E, R]` int64 `ExpertSlots.table()`: the local slot of replica j of expert e, S where elsewhere."""
        self.register_buffer("replicas", torch.tensor(slots.replicas, dtype=torch.int64, device=device), False)
        """`[E]` int64 `ExpertSlots.replicas`."""

    def fused(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`sum_j weights[t, j] * expert[ids[t, j]](hidden[t])` when this rank holds
        every expert in order (`owned == (0, ..., E-1)`), with vLLM's FP8 `fused_experts`.

        Args:
            hidden: `[T, H]` CUDA, model dtype; quantized per tensor in the kernel.
            ids: `[T, k]` int64 or int32 expert ids in `[0, E)`.
            weights: `[T, k]` float32 routing weights.

        Returns:
            `[T, H]` model dtype (the kernel sums a token's k rows in that dtype).
        """
        return self._kernel(hidden, ids, weights)

    def forward(self, rows: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`Experts.forward`'s contract in FP8: rows `[N, H]` model dtype, one per
        (token, expert), `expert_ids` `[N]` int64 logical ids, `weights` `[N]` float32
        -> `[N, H]` model dtype, `weights[n] * expert[expert_ids[n]](rows[n])`, or 0
        where this rank does not compute row n (`ExpertSlots`: replica
        `n % replicas[e]` of e computes it).

        vLLM's FP8 `fused_experts` with k = 1 over the local slot of each row. A row
        computed elsewhere runs on local slot `n % S` with weight 0, not through
        vLLM's `expert_map`: the kernel leaves the gated activations of rows it skips
        uninitialized, and their per-tensor FP8 scale is the amax over all rows, so
        a skipped row could spoil it. So every rank computes all N rows (P times the
        GEMM work of its own rows; at decode sizes the step reads the weights once
        either way). The activation scales are the amax of all N rows.
        """
        num_slots = len(self.owned)
        row = torch.arange(expert_ids.shape[0], device=expert_ids.device)  # [N]
        local = self.slot_table[expert_ids, row % self.replicas[expert_ids]]  # [N] local slot, S: elsewhere
        here = local < num_slots  # [N]
        slot = torch.where(here, local, row % num_slots)  # [N] in [0, S)
        weights = torch.where(here, weights.to(torch.float32), 0.0)  # [N]
        return self._kernel(rows, slot.unsqueeze(1), weights.unsqueeze(1))

    def _kernel(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from vllm.model_executor.layers.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        quant = fp8_w8a8_moe_quant_config(w1_scale=self.gate_up_scale, w2_scale=self.down_scale)
        return fused_experts(
            hidden.contiguous(),
            self.gate_up,
            self.down,
            weights.to(torch.float32),
            ids.to(torch.int32),
            activation=MoEActivation(self.hidden_act),
            quant_config=quant,
        )

    def dequantized(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `local`'s `(w13 [2I, H], w2 [H, I])` float32, dequantized."""
        return (
            self.gate_up[local].float() * self.gate_up_scale[local],
            self.down[local].float() * self.down_scale[local],
        )

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Each owned expert's checkpoint tensor dequantized to the model dtype, by FFN
        block name, from its first local slot (`Experts.checkpoint_tensors`). Copies,
        not views: they are read (an FFN resize's `reuse`, whose new stack quantizes
        them again), never loaded into."""
        inter = self.intermediate_size
        tensors = {}
        for local, expert in enumerate(self.owned):
            if f"experts.{expert}.{_PROJ[0]}.weight" in tensors:
                continue
            gate_up, down = self.dequantized(local)
            for proj, value in zip(_PROJ, (gate_up[:inter], gate_up[inter:], down), strict=True):
                tensors[f"experts.{expert}.{proj}.weight"] = value.to(self.dtype)
        return tensors


def quantize_experts(experts: Experts, hidden_act: str) -> Fp8Experts:
    """`experts` (model dtype, CUDA) quantized to FP8 per expert and projection, as
    vLLM's `Fp8PerTensorOnlineMoEMethod` does (`ops.scaled_fp8_quant`, dynamic
    per-tensor scale amax / 448). Replicas of an expert (EPLB) are quantized alike.

    Raises:
        ValueError: `experts` is not on a GPU with FP8 kernels (`check_fp8_device`).
    """
    from vllm import _custom_ops as ops

    check_fp8_device(experts.down.device)
    count = experts.down.shape[0]
    device = experts.down.device
    gate_up = torch.empty_like(experts.gate_up, dtype=_FP8)
    down = torch.empty_like(experts.down, dtype=_FP8)
    gate_up_scale = torch.empty(count, dtype=torch.float32, device=device)
    down_scale = torch.empty(count, dtype=torch.float32, device=device)
    with torch.no_grad():
        for local in range(count):
            gate_up[local], gate_up_scale[local] = ops.scaled_fp8_quant(experts.gate_up[local])
            down[local], down_scale[local] = ops.scaled_fp8_quant(experts.down[local])
    return Fp8Experts(experts.slots, hidden_act, experts.down.dtype, gate_up, gate_up_scale, down, down_scale)
