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

FP8 checkpoints (config.json `quantization_config`, `afd_ray.config.model.Fp8Checkpoint`):
`Fp8Experts.empty` makes the FP8 weights and the checkpoint's scales the loader reads
into (`checkpoint_tensors`), as vLLM 0.26's `Fp8MoEMethod.create_weights` lays them
out: block scales (`weight_scale_inv`, `block_shape` `(bn, bk)`) `[S, 2I/bn, H/bk]`
and `[S, H/bn, I/bk]`, the kernel then quantizing activations per token and group of
`bk` (`fp8_w8a8_moe_quant_config(block_shape=...)`); or per-tensor scales
(`weight_scale`), whose two `w13` shard scales are merged into their max with the
weights requantized, as `Fp8MoEMethod.process_weights_after_loading` does
(`finish_loading`). The FP8 linears of the shared experts and dense MLPs are
dequantized to the model dtype at load (`dequantize_fp8`, `afd_ray.weights`): they
run in the model dtype, a rounding difference from vLLM, which runs them in FP8.

vLLM is imported on first use only. The FP8-checkpoint path has not run on a GPU yet.
"""

from __future__ import annotations

import torch
from torch import nn

from afd_ray.config.model import FP8_CAPABILITY, Fp8Checkpoint
from afd_ray.layers.experts import ExpertSlots, Experts, SlotTables

__all__ = ["FP8_CAPABILITY", "FP8_DTYPE", "Fp8Experts", "check_fp8_device", "dequantize_fp8", "quantize_experts"]

FP8_DTYPE = torch.float8_e4m3fn
"""vLLM's FP8 dtype on CUDA (`current_platform.fp8_dtype()`), and FP8 checkpoints'."""
_FP8 = FP8_DTYPE
_FP8_MAX = torch.finfo(_FP8).max
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


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None) -> torch.Tensor:
    """The float32 weight an FP8 weight stands for: `weight.float() * scale`, with
    `scale` one per `block_shape` block (`[ceil(N / bn), ceil(K / bk)]` for a weight
    `[..., N, K]`, the last block of a row or column cut short) or one per tensor
    (`block_shape` None; `[]` or `[1]`)."""
    if block_shape is None:
        return weight.float() * scale.float().reshape(-1)[0]
    rows, cols = weight.shape[-2:]
    full = scale.float().repeat_interleave(block_shape[0], -2).repeat_interleave(block_shape[1], -1)
    return weight.float() * full[..., :rows, :cols]


class Fp8Experts(nn.Module):
    """The routed experts of one MoE layer in this EP rank's slots, in FP8: made by
    `quantize_experts` from an `Experts` (dynamic, `model.quantization: fp8`), or
    `empty` to be loaded from an FP8 checkpoint.

    It stands where `Experts` stands (`MoE.experts`), with the same `slots`, `owned`,
    `intermediate_size`, `forward`, `checkpoint_tensors` and `copy_replicas`, and
    adds `fused`.

    Parameters (`requires_grad=False`; S = `len(slots.experts)`):
        gate_up: `[S, 2I, H]` float8_e4m3fn, rows `[:I]` gate, `[I:]` up (vLLM's `w13`).
        gate_up_scale: float32; per tensor `[S]`: the dequantized `w13` of slot s is
            `gate_up[s] * gate_up_scale[s]`; per block `(bn, bk)` (`block_shape`)
            `[S, 2I/bn, H/bk]` (`dequantize_fp8`).
        down: `[S, H, I]` float8_e4m3fn (vLLM's `w2`).
        down_scale: float32, `[S]` or `[S, H/bn, I/bk]`.
        shard_scale: per-tensor FP8 checkpoints only: `[S, 2]` float32, the
            checkpoint's gate and up scales, both the slot's `gate_up_scale` once
            `finish_loading` ran.
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
        checkpoint: Fp8Checkpoint | None = None,
    ) -> None:
        super().__init__()
        self.slots = slots
        self.owned = slots.experts
        """Logical expert of each local slot (`ExpertSlots.experts`)."""
        self.intermediate_size = down.shape[-1]
        self.hidden_act = hidden_act
        self.dtype = dtype
        """Model dtype: of the hidden states, and of a dynamic stack's `checkpoint_tensors`."""
        self.checkpoint = checkpoint
        """The FP8 checkpoint's scheme these experts are loaded from; None: quantized at load."""
        self.block_shape = None if checkpoint is None else checkpoint.block_shape
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.gate_up_scale = nn.Parameter(gate_up_scale, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.down_scale = nn.Parameter(down_scale, requires_grad=False)
        self.shard_scale: nn.Parameter | None = None
        if checkpoint is not None and checkpoint.block_shape is None:
            shard = torch.empty((len(self.owned), 2), dtype=torch.float32, device=down.device)
            self.shard_scale = nn.Parameter(shard, requires_grad=False)
        self._tables = SlotTables(slots)

    @classmethod
    def empty(
        cls,
        slots: ExpertSlots,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        dtype: torch.dtype,
        checkpoint: Fp8Checkpoint,
    ) -> Fp8Experts:
        """Uninitialized FP8 experts laid out for `checkpoint`'s weights and scales, on
        torch's current device (meta inside `FFNStack`).

        Raises:
            ValueError: a block size that does not divide `intermediate_size`, or
                whose `bk` does not divide `hidden_size` (vLLM's block kernels need
                whole blocks there).
        """
        count, inter, hidden = len(slots.experts), intermediate_size, hidden_size
        if checkpoint.block_shape is None:
            up_scale, down_scale = (count,), (count,)
        else:
            bn, bk = checkpoint.block_shape
            if inter % bn or inter % bk or hidden_size % bk:
                raise ValueError(
                    f"FP8 checkpoint: weight_block_size {[bn, bk]} must divide the experts' intermediate size "
                    f"{inter} (both) and the hidden size {hidden} (the second), as vLLM's block FP8 MoE needs"
                )
            up_scale, down_scale = (count, 2 * inter // bn, hidden // bk), (count, -(-hidden // bn), inter // bk)
        return cls(
            slots,
            hidden_act,
            dtype,
            torch.empty((count, 2 * inter, hidden), dtype=_FP8),
            torch.empty(up_scale, dtype=torch.float32),
            torch.empty((count, hidden, inter), dtype=_FP8),
            torch.empty(down_scale, dtype=torch.float32),
            checkpoint,
        )

    def fused(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`sum_j weights[t, j] * expert[ids[t, j]](hidden[t])` when this rank holds
        every expert in order (`owned == (0, ..., E-1)`), with vLLM's FP8 `fused_experts`.

        Args:
            hidden: `[T, H]` CUDA, model dtype; quantized in the kernel, per tensor, or
                per token and group of `bk` (`block_shape`).
            ids: `[T, k]` int64 or int32 expert ids in `[0, E)`.
            weights: `[T, k]` float32 routing weights.

        Returns:
            `[T, H]` model dtype (the kernel sums a token's k rows in that dtype).

        Raises:
            ValueError: `hidden` is not on a CUDA device.
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
        either way). The per-tensor activation scales are the amax of all N rows.

        Raises:
            ValueError: `rows` is not on a CUDA device.
        """
        num_slots = len(self.owned)
        table, replicas = self._tables.on(expert_ids.device)
        row = torch.arange(expert_ids.shape[0], device=expert_ids.device)  # [N]
        local = table[expert_ids, row % replicas[expert_ids]]  # [N] local slot, S: elsewhere
        here = local < num_slots  # [N]
        slot = torch.where(here, local, row % num_slots)  # [N] in [0, S)
        weights = torch.where(here, weights.to(torch.float32), 0.0)  # [N]
        return self._kernel(rows, slot.unsqueeze(1), weights.unsqueeze(1))

    def _kernel(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if not hidden.is_cuda:
            raise ValueError(f"FP8 experts run on CUDA only (vLLM's FP8 fused MoE), not {hidden.device}")
        from vllm.model_executor.layers.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        block = None if self.block_shape is None else list(self.block_shape)
        quant = fp8_w8a8_moe_quant_config(w1_scale=self.gate_up_scale, w2_scale=self.down_scale, block_shape=block)
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
            dequantize_fp8(self.gate_up[local], self.gate_up_scale[local], self.block_shape),
            dequantize_fp8(self.down[local], self.down_scale[local], self.block_shape),
        )

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Each owned expert's checkpoint tensors by FFN block name, from its first
        local slot (`Experts.checkpoint_tensors`).

        Loaded from an FP8 checkpoint: views of the FP8 weights and of their scales,
        under the checkpoint's names (`experts.{e}.gate_proj.weight`,
        `experts.{e}.gate_proj.weight_scale_inv` or `.weight_scale`, ...), which the
        loader fills (and an FFN resize's `reuse` copies). Quantized at load: the
        weights dequantized to the model dtype, copies, not views: they are read (a
        resize's `reuse`, whose new stack quantizes them again), never loaded into."""
        inter = self.intermediate_size
        tensors = {}
        for local, expert in enumerate(self.owned):
            if f"experts.{expert}.{_PROJ[0]}.weight" in tensors:
                continue
            if self.checkpoint is None:
                gate_up, down = self.dequantized(local)
                values = (gate_up[:inter].to(self.dtype), gate_up[inter:].to(self.dtype), down.to(self.dtype))
                tensors.update({f"experts.{expert}.{p}.weight": v for p, v in zip(_PROJ, values, strict=True)})
                continue
            weights = (self.gate_up[local, :inter], self.gate_up[local, inter:], self.down[local])
            if self.shard_scale is not None:
                scales = (self.shard_scale[local, 0], self.shard_scale[local, 1], self.down_scale[local])
            else:
                rows = self.gate_up_scale.shape[1] // 2
                scales = (self.gate_up_scale[local, :rows], self.gate_up_scale[local, rows:], self.down_scale[local])
            for proj, weight, scale in zip(_PROJ, weights, scales, strict=True):
                tensors[f"experts.{expert}.{proj}.weight"] = weight
                tensors[f"experts.{expert}.{proj}.{self.checkpoint.scale_name}"] = scale
        return tensors

    def finish_loading(self) -> None:
        """After the checkpoint's tensors are loaded: per-tensor scales get one `w13`
        scale per expert, the max of its gate and up scales, each half requantized to
        it (vLLM's `process_fp8_weight_tensor_strategy_moe`, in torch); then the
        replicas are copied (`copy_replicas`). Block scales need nothing more."""
        with torch.no_grad():
            if self.shard_scale is not None:
                inter = self.intermediate_size
                merged = self.shard_scale.amax(dim=1)  # [S]
                for local in range(len(self.owned)):
                    for half, scale in zip((slice(0, inter), slice(inter, None)), self.shard_scale[local], strict=True):
                        if bool(scale == merged[local]):  # the larger scale (or a resize's copy): as it is
                            continue
                        dequantized = self.gate_up[local, half].float() * scale
                        rescaled = (dequantized / merged[local]).clamp(-_FP8_MAX, _FP8_MAX)
                        self.gate_up[local, half] = rescaled.to(_FP8)
                self.gate_up_scale.copy_(merged)
                self.shard_scale.copy_(merged.unsqueeze(1).expand(-1, 2))
        self.copy_replicas()

    def copy_replicas(self) -> None:
        """Copy each expert's first local slot (weights and scales) into its other local slots."""
        tensors = [
            t for t in (self.gate_up, self.gate_up_scale, self.down, self.down_scale, self.shard_scale) if t is not None
        ]
        first: dict[int, int] = {}
        with torch.no_grad():
            for slot, expert in enumerate(self.owned):
                if expert not in first:
                    first[expert] = slot
                    continue
                for tensor in tensors:
                    tensor[slot].copy_(tensor[first[expert]])


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
