"""The FFN half of a decoder-only model: per layer, what follows the post-attention norm.

Pure model code: no processes, no communication. The runtime feeds it `[T, H]`
hidden states one layer at a time. A layer is a dense `GatedMLP` or an `MoE`; with
expert parallelism each EP rank builds the stack with only its own routed experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from afd_ray.config.model import Fp8Checkpoint, fp8_checkpoint
from afd_ray.eplb.slots import slots_of
from afd_ray.eplb.policy import LayerPlacement
from afd_ray.eplb.contiguous import owned_experts
from afd_ray.layers.experts import ExpertSlots
from afd_ray.layers.family import ffn_layout
from afd_ray.layers.fp8 import FP8_DTYPE, Fp8Experts, check_fp8_device, quantize_experts
from afd_ray.layers.mlp import GatedMLP
from afd_ray.layers.moe import MoE
from afd_ray.weights import dequantized_linears, expert_of, ffn_layer_params

__all__ = ["FFNStack", "dummy_fill", "load_ffn_stack"]

_KEEP_FLOAT32 = "e_score_correction_bias"
"""Checkpoint tensors loaded without rounding to the model dtype (transformers keeps
them in float32 too: `_keep_in_fp32_modules_strict`)."""


class FFNStack(nn.Module):
    """The FFN blocks the FFN role serves, in decoder order: `layers[i]` maps
    `[T, H] -> [T, H]` for decoder layer `layer_ids[i]` (an MoE layer that splits its
    output: `[T, P, H]`, `MoE.output`).

    With `gate_on_ffn` that is every decoder layer (`layer_ids[i] == i`). With
    `gate_on_attention` it is the MoE layers only, without their gate: the dense
    MLPs and the gates stay on the attention role.

    Args:
        config: the checkpoint's transformers config (`model_type` one of
            `afd_ray.layers.family.MODEL_FAMILIES`).
        dtype: model dtype of the parameters; None = torch's default dtype.
        ep_rank, ep_size: this rank's place in the EP group; MoE layers hold only
            the routed experts `placement.owned_experts(E, ep_size, ep_rank)`, or
            the slots `placements` gives this rank.
        gate_on_attention: the gate placement (docs/models.md).
        attention_compiled: the attention engines run torch.compile (else eager);
            the blocks compute as vLLM does in that mode: the dense MLPs' and shared
            experts' activation rounding (`GatedMLP.act_in_float32`), and an MoE
            layer's output as its parts or their sum (`MoEShape.split_output`).
        placements: EPLB: the expert placement of each MoE layer, in layer order
            (`afd_ray.eplb.policy`); None: contiguous blocks.
        checkpoint_fp8: the routed experts are `Fp8Experts.empty` laid out for this
            FP8 checkpoint's weights and scales (`ModelConfig.checkpoint_fp8`); None:
            `Experts` in `dtype`.

    Raises:
        ValueError: unsupported architecture or routing settings, a bad EP rank, or
            `gate_on_attention` for a model without MoE layers, or `placements` that
            do not fit the model's MoE layers, experts or `ep_size`, or an FP8 block
            size that does not fit the experts (`Fp8Experts.empty`).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype | None = None,
        ep_rank: int = 0,
        ep_size: int = 1,
        gate_on_attention: bool = False,
        attention_compiled: bool = False,
        placements: Sequence[LayerPlacement] | None = None,
        checkpoint_fp8: Fp8Checkpoint | None = None,
    ) -> None:
        super().__init__()
        layout = ffn_layout(config)
        if gate_on_attention and not layout.moe_layers:
            raise ValueError("gate_placement: gate_on_attention needs an MoE model; this one is dense")
        dtype = dtype or torch.get_default_dtype()
        self.hidden_size = layout.hidden_size
        self.moe_layers = layout.moe_layers
        self.gate_on_attention = gate_on_attention
        self.layer_ids = sorted(layout.moe_layers) if gate_on_attention else list(range(layout.num_layers))
        dense = (
            layout.hidden_size,
            layout.intermediate_size,
            layout.hidden_act,
            layout.mlp_bias,
            dtype,
            attention_compiled,
        )
        num_experts = layout.moe.routing.num_experts if layout.moe is not None else 0
        slots = _moe_slots(num_experts, sorted(layout.moe_layers), ep_rank, ep_size, placements)
        layers: list[nn.Module] = []
        for i in self.layer_ids:
            if i in layout.moe_layers:
                moe = (layout.moe, slots[i], layout.hidden_size, layout.hidden_act, layout.mlp_bias, dtype)
                block = MoE(
                    *moe,
                    with_gate=not gate_on_attention,
                    act_in_float32=attention_compiled,
                    split_output=layout.moe.split_output(attention_compiled),
                )
                if checkpoint_fp8 is not None:
                    inter = layout.moe.intermediate_size
                    block.experts = Fp8Experts.empty(
                        slots[i], layout.hidden_size, inter, layout.hidden_act, dtype, checkpoint_fp8
                    )
                layers.append(block)
            else:
                layers.append(GatedMLP(*dense))
        self.layers = nn.ModuleList(layers)
        moe_ids = iter(range(len(layers)))
        self.moe_index = tuple(next(moe_ids) if isinstance(block, MoE) else None for block in layers)
        """For each of `layers`: its index among the MoE layers (None: a dense layer)."""
        self.loaded_bytes = 0
        """Bytes of parameters `load_ffn_stack` read from the checkpoint into this stack."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_blocks(self) -> list[MoE]:
        """The MoE blocks of `layers`, in order (empty for a dense model)."""
        return [block for block in self.layers if isinstance(block, MoE)]

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """FFN block `layers[layer]` (decoder layer `layer_ids[layer]`): hidden `[T, H]`
        -> `[T, H]` (`[T, P, H]`: `MoE.output`), same dtype.

        Raises:
            RuntimeError: `layer` is an MoE layer and this stack holds an EP shard
                (drive its `route`/`experts`/`shared` parts instead).
        """
        return self.layers[layer](hidden)

    def held_experts(self) -> dict[int, frozenset[int]]:
        """The logical experts each MoE layer holds, by decoder layer id."""
        return {
            layer: frozenset(block.experts.owned)
            for layer, block in zip(self.layer_ids, self.layers, strict=True)
            if isinstance(block, MoE)
        }

    def checkpoint_tensors(self) -> dict[tuple[int, str], torch.Tensor]:
        """Destination tensor of each checkpoint tensor this stack loads, keyed by
        `(layer, name within the FFN block)` (`afd_ray.weights.ffn_block_name`)."""
        return {
            (layer, name): t
            for layer, block in zip(self.layer_ids, self.layers, strict=True)
            for name, t in block.checkpoint_tensors().items()
        }


def _moe_slots(
    num_experts: int,
    moe_layers: list[int],
    ep_rank: int,
    ep_size: int,
    placements: Sequence[LayerPlacement] | None,
) -> dict[int, ExpertSlots]:
    """This EP rank's expert slots of each MoE layer (decoder layer id -> slots)."""
    if placements is None:
        if not moe_layers:
            return {}
        block = ExpertSlots.block(owned_experts(num_experts, ep_size, ep_rank), num_experts)
        return dict.fromkeys(moe_layers, block)
    if len(placements) != len(moe_layers):
        raise ValueError(f"placements: {len(placements)} given for {len(moe_layers)} MoE layers")
    for placement in placements:
        if placement.num_experts != num_experts or placement.ep_size != ep_size:
            raise ValueError(
                f"placements: a placement of {placement.num_experts} experts on {placement.ep_size} ranks "
                f"for {num_experts} experts on {ep_size} EP ranks"
            )
    return {layer: slots_of(placement, ep_rank) for layer, placement in zip(moe_layers, placements, strict=True)}


def dummy_fill(stack: FFNStack) -> None:
    """Fill every parameter and buffer of `stack` in place with the values vLLM's
    `load_format="dummy"` gives the vLLM parameter it stands for, so that with dummy
    weights on both roles the FFN role computes what a plain vLLM engine with dummy
    weights computes: the same routing, hence the same expert weights read per step.

    vLLM's `initialize_single_dummy_weight` (vLLM 0.26 and 0.32) draws each floating
    tensor uniform in [-1e-3, 1e-3] from a generator on the tensor's device seeded 1234,
    so the values depend only on the tensor's element count, dtype and device type.
    Tensors laid out as vLLM's are filled by that function directly: the router
    weight `[E, H]` and `e_score_correction_bias` `[E]`, the routed experts `[E_local,
    2I, H]` (`w13`) and `[E_local, H, I]` (`w2`), a dense MLP's or the shared experts'
    `down_proj`. A `GatedMLP`'s `gate_proj` and `up_proj` `[I, H]` are the two halves of
    vLLM's merged `gate_up_proj` `[2I, H]` (rows `[:I]` gate), drawn as one tensor. An
    EP shard draws its own `[E_local, ...]` experts, as a vLLM EP rank does.

    Raises:
        ImportError: vLLM is not installed.
    """
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    merged: set[int] = set()
    with torch.no_grad():
        for mlp in (m for m in stack.modules() if isinstance(m, GatedMLP)):
            for kind in ("weight", "bias"):
                gate, up = getattr(mlp.gate_proj, kind), getattr(mlp.up_proj, kind)
                if gate is None:
                    continue
                both = torch.empty((2 * gate.shape[0], *gate.shape[1:]), dtype=gate.dtype, device=gate.device)
                initialize_single_dummy_weight(both)
                gate.copy_(both[: gate.shape[0]])
                up.copy_(both[gate.shape[0] :])
                merged.update((id(gate), id(up)))
        for tensor in stack.state_dict(keep_vars=True).values():
            if id(tensor) not in merged:
                initialize_single_dummy_weight(tensor)


def load_ffn_stack(
    checkpoint: Path,
    dtype: torch.dtype,
    device: torch.device,
    ep_rank: int = 0,
    ep_size: int = 1,
    gate_on_attention: bool = False,
    reuse: FFNStack | None = None,
    random_weights: bool = False,
    attention_compiled: bool = False,
    placements: Sequence[LayerPlacement] | None = None,
    quantization: Literal["fp8"] | None = None,
) -> FFNStack:
    """Build the FFN stack of `checkpoint` with only FFN-role tensors loaded.

    Parameters are created on the meta device, allocated on `device` uninitialized,
    then filled from the checkpoint, so no memory is spent on throwaway random init;
    an EP shard reads and allocates only its own routed experts. Tensors are rounded
    to `dtype` (a router gate with float32 logits keeps float32, `RoutingSpec`) except
    `e_score_correction_bias`, loaded as float32. `attention_compiled`: see `FFNStack`.

    `reuse`: a stack of the same checkpoint, dtype and gate placement (another EP
    shard: an FFN resize). Every tensor it holds is copied from it instead of read from
    the checkpoint, so only newly owned routed experts are read (the new stack's
    `loaded_bytes`).

    `placements`: the EPLB placement of each MoE layer (`FFNStack`); a replicated
    expert is read once and copied into its other local slots (`Experts.copy_replicas`).
    With `reuse`, an expert of a layer is copied from `reuse`'s same layer if it holds it.

    `random_weights`: read nothing but `config.json` and fill every tensor as vLLM's
    `load_format="dummy"` fills its counterpart (`dummy_fill`), so that benchmark-sized
    models run without their weights (`ModelConfig.load_format`) and compute what a
    plain vLLM engine with dummy weights computes. `loaded_bytes` stays 0.

    `quantization` (`ModelConfig.quantization`): `fp8` quantizes the routed experts to
    FP8 once loaded (`afd_ray.layers.fp8.quantize_experts`, vLLM's dynamic FP8 MoE);
    the rest stays in `dtype`.

    An FP8 checkpoint (config.json `quantization_config`, `ModelConfig.checkpoint_fp8`):
    the routed experts this rank holds are read in FP8 with their scales, block or
    per tensor (`Fp8Experts.empty`, `Fp8Experts.finish_loading`); the shared experts'
    and dense MLPs' FP8 linears are dequantized to `dtype` (`dequantized_linears`).
    This loads on any device; the experts run on CUDA only. `loaded_bytes` counts the
    FP8 bytes and scales of the experts, the dense tensors in `dtype`.

    Raises:
        ValueError: unsupported architecture, bad EP rank, or a missing/unexpected
            FFN tensor (an expert weight not in FP8 included); `fp8` on a device
            without FP8 kernels (`check_fp8_device`); a `quantization_config` that is
            not FP8 (`fp8_checkpoint`), or `fp8` or `random_weights` with an FP8
            checkpoint.
        ImportError: `random_weights` or `fp8` without vLLM installed.
    """
    config = AutoConfig.from_pretrained(checkpoint)
    scheme = fp8_checkpoint(getattr(config, "quantization_config", None), str(checkpoint))
    if scheme is not None and (quantization is not None or random_weights):
        raise ValueError(f"{checkpoint} is an FP8 checkpoint: neither quantization nor random weights apply")
    with torch.device("meta"):
        stack = FFNStack(config, dtype, ep_rank, ep_size, gate_on_attention, attention_compiled, placements, scheme)
    stack.to_empty(device=device)
    if quantization is not None:
        check_fp8_device(device)
    if random_weights:
        dummy_fill(stack)
        _copy_replicas(stack)
        return _quantized(stack.eval(), quantization)
    targets = stack.checkpoint_tensors()
    unexpected = []
    with torch.no_grad():
        if reuse is not None:
            held = reuse.checkpoint_tensors()
            for key in [k for k, t in targets.items() if k in held and held[k].shape == t.shape]:
                targets.pop(key).copy_(held[key])
        wanted = {expert_of(f"model.layers.{layer}.mlp.{name}") for layer, name in targets} - {None}
        params = (
            []
            if not targets
            else ffn_layer_params(checkpoint, config.num_hidden_layers, wanted, gate_on_attention, stack.moe_layers)
        )
        if scheme is not None:
            params = dequantized_linears(params, scheme.block_shape, scheme.scale_name)
        held_by_layer = stack.held_experts()
        for layer, name, tensor in params:
            expert = expert_of(f"model.layers.{layer}.mlp.{name}")
            elsewhere = layer in held_by_layer and expert is not None and expert not in held_by_layer[layer]
            if (layer, name) not in targets and (reuse is not None or elsewhere):
                continue  # copied from `reuse`, or an expert this layer does not hold (EPLB)
            target = targets.pop((layer, name), None)
            if target is None or not _fits(target, tensor):
                unexpected.append(f"layers.{layer}.mlp.{name} {list(tensor.shape)} {tensor.dtype}")
                continue
            as_is = (
                name.endswith(_KEEP_FLOAT32)
                or target.dtype == FP8_DTYPE
                or (scheme is not None and name.endswith(scheme.scale_name))
            )
            target.copy_(tensor.reshape(target.shape) if as_is else tensor.to(dtype))
            stack.loaded_bytes += target.numel() * target.element_size()
    if targets or unexpected:
        missing = [f"layers.{layer}.mlp.{name}" for layer, name in targets]
        raise ValueError(f"FFN weights of {checkpoint}: missing {missing}, unexpected {unexpected}")
    _copy_replicas(stack)
    return _quantized(stack.eval(), quantization)


def _fits(target: torch.Tensor, tensor: torch.Tensor) -> bool:
    """A checkpoint tensor fits its destination: the same shape (a scalar scale `[]`
    and `[1]` alike), and an FP8 destination takes FP8 only."""
    same = target.shape == tensor.shape or target.numel() == tensor.numel() == 1
    return same and (target.dtype != FP8_DTYPE or tensor.dtype == FP8_DTYPE)


def _copy_replicas(stack: FFNStack) -> None:
    """Fill each MoE layer's replica slots; FP8 checkpoint experts finish loading
    (`Fp8Experts.finish_loading`: per-tensor scales merged, then the replicas)."""
    for block in stack.moe_blocks:
        if isinstance(block.experts, Fp8Experts):
            block.experts.finish_loading()
        else:
            block.experts.copy_replicas()


def _quantized(stack: FFNStack, quantization: Literal["fp8"] | None) -> FFNStack:
    """`stack` with its routed experts in FP8 when `quantization` is `fp8`, one layer
    at a time (each layer's model-dtype experts are freed as its FP8 ones are made)."""
    if quantization == "fp8":
        for block in stack.moe_blocks:
            block.experts = quantize_experts(block.experts, block.hidden_act)
    return stack
