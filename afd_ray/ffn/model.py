"""The FFN half of a decoder-only model: per layer, what follows the post-attention norm.

Pure model code: no processes, no communication. The runtime feeds it `[T, H]`
hidden states one layer at a time. A layer is a dense `GatedMLP` or an `MoE`; with
expert parallelism each EP rank builds the stack with only its own routed experts.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from afd_ray.ffn.placement import owned_experts
from afd_ray.layers.family import ffn_layout
from afd_ray.layers.mlp import GatedMLP
from afd_ray.layers.moe import MoE
from afd_ray.weights import ffn_layer_params

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
            the routed experts `placement.owned_experts(E, ep_size, ep_rank)`.
        gate_on_attention: the gate placement (docs/models.md).
        attention_compiled: the attention engines run torch.compile (else eager);
            the blocks compute as vLLM does in that mode: the dense MLPs' and shared
            experts' activation rounding (`GatedMLP.act_in_float32`), and an MoE
            layer's output as its parts or their sum (`MoEShape.split_output`).

    Raises:
        ValueError: unsupported architecture or routing settings, a bad EP rank, or
            `gate_on_attention` for a model without MoE layers.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype | None = None,
        ep_rank: int = 0,
        ep_size: int = 1,
        gate_on_attention: bool = False,
        attention_compiled: bool = False,
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
        layers: list[nn.Module] = []
        for i in self.layer_ids:
            if i in layout.moe_layers:
                owned = owned_experts(layout.moe.routing.num_experts, ep_size, ep_rank)
                moe = (layout.moe, owned, layout.hidden_size, layout.hidden_act, layout.mlp_bias, dtype)
                layers.append(
                    MoE(
                        *moe,
                        with_gate=not gate_on_attention,
                        act_in_float32=attention_compiled,
                        split_output=layout.moe.split_output(attention_compiled),
                    )
                )
            else:
                layers.append(GatedMLP(*dense))
        self.layers = nn.ModuleList(layers)
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

    def checkpoint_tensors(self) -> dict[tuple[int, str], torch.Tensor]:
        """Destination tensor of each checkpoint tensor this stack loads, keyed by
        `(layer, name within the FFN block)` (`afd_ray.weights.ffn_block_name`)."""
        return {
            (layer, name): t
            for layer, block in zip(self.layer_ids, self.layers, strict=True)
            for name, t in block.checkpoint_tensors().items()
        }


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

    `random_weights`: read nothing but `config.json` and fill every tensor as vLLM's
    `load_format="dummy"` fills its counterpart (`dummy_fill`), so that benchmark-sized
    models run without their weights (`ModelConfig.load_format`) and compute what a
    plain vLLM engine with dummy weights computes. `loaded_bytes` stays 0.

    Raises:
        ValueError: unsupported architecture, bad EP rank, or a missing/unexpected
            FFN tensor.
        ImportError: `random_weights` without vLLM installed.
    """
    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        stack = FFNStack(config, dtype, ep_rank, ep_size, gate_on_attention, attention_compiled)
    stack.to_empty(device=device)
    if random_weights:
        dummy_fill(stack)
        return stack.eval()
    targets = stack.checkpoint_tensors()
    owned = {e for block in stack.moe_blocks for e in block.experts.owned}
    unexpected = []
    with torch.no_grad():
        if reuse is not None:
            held = reuse.checkpoint_tensors()
            for key in [k for k, t in targets.items() if k in held and held[k].shape == t.shape]:
                targets.pop(key).copy_(held[key])
            owned -= {e for block in reuse.moe_blocks for e in block.experts.owned}
        params = (
            []
            if not targets
            else ffn_layer_params(checkpoint, config.num_hidden_layers, owned, gate_on_attention, stack.moe_layers)
        )
        for layer, name, tensor in params:
            if reuse is not None and (layer, name) not in targets:
                continue  # copied from `reuse`
            target = targets.pop((layer, name), None)
            if target is None or target.shape != tensor.shape:
                unexpected.append(f"layers.{layer}.mlp.{name} {list(tensor.shape)}")
                continue
            target.copy_(tensor if name.endswith(_KEEP_FLOAT32) else tensor.to(dtype))
            stack.loaded_bytes += target.numel() * target.element_size()
    if targets or unexpected:
        missing = [f"layers.{layer}.mlp.{name}" for layer, name in targets]
        raise ValueError(f"FFN weights of {checkpoint}: missing {missing}, unexpected {unexpected}")
    return stack.eval()
