"""Which role owns which checkpoint tensor, and loading one role's tensors.

This is the only place that decides weight ownership (docs/models.md, gate placement): the attention role
loads embeddings, norms, attention and the LM head; the FFN role loads everything
under a decoder layer's FFN block, `mlp.` (Llama, Qwen3-MoE, DeepSeek) or
`block_sparse_moe.` (Mixtral): the dense MLP, or the MoE's router gate
(`gate.weight`, `gate.e_score_correction_bias`), routed experts
(`experts.{e}.{gate,up,down}_proj.weight`, Mixtral's `experts.{e}.{w1,w3,w2}.weight`)
and shared experts (`shared_experts.*`). Both read the same checkpoint folder and
filter by name.

The FFN role sees every family under one naming, the FFN block name: the block prefix
is dropped and Mixtral's expert projections are renamed by `_EXPERT_PROJ`.

Checkpoints on disk name every routed expert separately (what transformers 5.19's
`save_pretrained` writes for Qwen3-MoE, DeepSeek-V2/V3 and Mixtral, although its
modules hold fused `[E, 2I, H]` tensors), so an EP rank reads only the experts it owns.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Iterator
from enum import Enum
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = [
    "Role",
    "dequantized_linears",
    "expert_of",
    "ffn_block_name",
    "ffn_block_prefix",
    "ffn_layer_params",
    "resident_bytes",
    "role_of",
]

_FFN = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)$")
"""A decoder layer's FFN block: `mlp.` (Llama, Qwen3-MoE, DeepSeek) or
`block_sparse_moe.` (Mixtral)."""
_EXPERT = re.compile(r"^experts\.(\d+)\.")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Mixtral's routed-expert projections -> the gated-MLP names the FFN role uses."""
_RENAMED_PROJ = re.compile(r"^(experts\.\d+\.)(" + "|".join(_EXPERT_PROJ) + r")\.")


class Role(Enum):
    """The two halves of a disaggregated decoder layer."""

    ATTENTION = "attention"
    FFN = "ffn"


def ffn_block_prefix(model_type: str) -> str:
    """The checkpoint's name of a decoder layer's FFN block: `block_sparse_moe`
    (Mixtral) or `mlp` (the others)."""
    return "block_sparse_moe" if model_type == "mixtral" else "mlp"


def role_of(name: str, gate_on_attention: bool = False, moe_layers: Container[int] = ()) -> Role:
    """Role that owns checkpoint tensor `name` (Hugging Face naming).

    With `gate_on_ffn` (default): FFN for `model.layers.{i}.mlp.*` and
    `model.layers.{i}.block_sparse_moe.*` (dense MLP, gate, routed and shared
    experts). With `gate_on_attention` the router gate and the dense MLPs of layers
    not in `moe_layers` stay with the attention role (docs/models.md, gate placement).
    """
    block = ffn_block_name(name)
    if block is None:
        return Role.ATTENTION
    layer, inner = block
    if gate_on_attention and (layer not in moe_layers or inner.startswith("gate.")):
        return Role.ATTENTION
    return Role.FFN


def ffn_block_name(name: str) -> tuple[int, str] | None:
    """`(layer, name within the FFN block)` of an FFN-role checkpoint tensor, or None
    for an attention-role one.

    The name within the block is the same for every family:
    `model.layers.3.block_sparse_moe.experts.5.w1.weight` (Mixtral) and
    `model.layers.3.mlp.experts.5.gate_proj.weight` both give
    `(3, "experts.5.gate_proj.weight")`.
    """
    match = _FFN.match(name)
    if match is None:
        return None
    inner = _RENAMED_PROJ.sub(lambda m: f"{m.group(1)}{_EXPERT_PROJ[m.group(2)]}.", match.group(2))
    return int(match.group(1)), inner


def expert_of(name: str) -> int | None:
    """Routed expert index of checkpoint tensor `name`
    (`model.layers.{i}.{mlp,block_sparse_moe}.experts.{e}.*` -> e), or None for any
    other tensor (gate, shared experts, dense MLP, attention)."""
    block = ffn_block_name(name)
    expert = _EXPERT.match(block[1]) if block else None
    return int(expert.group(1)) if expert else None


def ffn_layer_params(
    checkpoint: Path,
    num_layers: int | None = None,
    experts: Container[int] | None = None,
    gate_on_attention: bool = False,
    moe_layers: Container[int] = (),
) -> Iterator[tuple[int, str, torch.Tensor]]:
    """Yield `(layer, name within the FFN block, tensor)` for FFN-role tensors
    (`ffn_block_name`: the same names for every family).

    Reads `*.safetensors` in `checkpoint` lazily: attention-role tensors, layers at
    or past `num_layers` (e.g. DeepSeek-V3's multi-token-prediction layer
    `model.layers.61`) and routed experts not in `experts` are never materialized.

    Args:
        num_layers: keep layers `[0, num_layers)`; None keeps all.
        experts: routed expert indices to keep; None keeps all. Gate, shared
            experts and dense MLPs are kept when they have the FFN role.
        gate_on_attention, moe_layers: the gate placement, as in `role_of`.

    Raises:
        FileNotFoundError: no safetensors file in `checkpoint`.
    """
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                block = ffn_block_name(name)
                if block is None or role_of(name, gate_on_attention, moe_layers) is not Role.FFN:
                    continue
                layer, inner = block
                expert = expert_of(name)
                if (num_layers is None or layer < num_layers) and (
                    experts is None or expert is None or expert in experts
                ):
                    yield layer, inner, f.get_tensor(name)


def dequantized_linears(
    params: Iterable[tuple[int, str, torch.Tensor]], block_shape: tuple[int, int] | None, scale_name: str
) -> Iterator[tuple[int, str, torch.Tensor]]:
    """`params` (`ffn_layer_params` of an FP8 checkpoint) with the FP8 linears of the
    shared experts and dense MLPs dequantized: each float8 `....weight` and its
    `....{scale_name}` (`weight_scale_inv` per block of `block_shape`, `weight_scale`
    per tensor; `afd_ray.config.model.Fp8Checkpoint`) become one float32 `....weight`
    (`afd_ray.layers.fp8.dequantize_fp8`), yielded once both were read. Routed
    experts' tensors (loaded in FP8 as they are) and tensors without a scale (the
    router gate, layers the checkpoint left unquantized) pass unchanged.

    Raises:
        ValueError: an FP8 weight without its scale, or a scale without its weight.
    """
    from afd_ray.layers.fp8 import FP8_DTYPE, dequantize_fp8

    suffix = f".{scale_name}"
    pending: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}  # by weight name: the first of the pair read
    for layer, name, tensor in params:
        if _EXPERT.match(name) or not (name.endswith(suffix) or tensor.dtype == FP8_DTYPE):
            yield layer, name, tensor
            continue
        weight_name = name.removesuffix(suffix) + ".weight" if name.endswith(suffix) else name
        first = pending.pop((layer, weight_name), None)
        if first is None:
            pending[(layer, weight_name)] = (name, tensor)
            continue
        weight, scale = (first[1], tensor) if name.endswith(suffix) else (tensor, first[1])
        yield layer, weight_name, dequantize_fp8(weight, scale, block_shape)
    if pending:
        names = sorted(f"layers.{layer}.mlp.{name}" for (layer, _), (name, _) in pending.items())
        raise ValueError(f"FP8 checkpoint: weights without their {scale_name}, or the reverse: {names}")


def resident_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Resident parameter bytes of `model`, keyed by parameter name with the layer
    indices left out (e.g. `model.layers.self_attn.qkv_proj.weight`, summed over the
    layers): what one role holds, to show that no tensor is resident in both."""
    totals: dict[str, int] = {}
    for name, param in model.named_parameters():
        key = ".".join(part for part in name.split(".") if not part.isdigit())
        totals[key] = totals.get(key, 0) + param.numel() * param.element_size()
    return totals
