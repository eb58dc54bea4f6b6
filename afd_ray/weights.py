"""Which role owns which checkpoint tensor, and loading one role's tensors.

This is the only place that decides weight ownership (DESIGN §2): the attention role
loads embeddings, norms, attention and the LM head; the FFN role loads everything
under a decoder layer's `mlp.`: the dense MLP, or the MoE's router gate
(`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`), routed experts
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) and shared experts
(`mlp.shared_experts.*`). Both read the same checkpoint folder and filter by name.

Checkpoints on disk name every routed expert separately (what transformers 5.19's
`save_pretrained` writes for Qwen3-MoE and DeepSeek-V2/V3, although its modules hold
fused `[E, 2I, H]` tensors), so an EP rank reads only the experts it owns.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from enum import Enum
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["Role", "expert_of", "ffn_layer_params", "role_of"]

_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")
_EXPERT = re.compile(r"^experts\.(\d+)\.")


class Role(Enum):
    """The two halves of a disaggregated decoder layer."""

    ATTENTION = "attention"
    FFN = "ffn"


def role_of(name: str) -> Role:
    """Role that owns checkpoint tensor `name` (Hugging Face naming): FFN for
    `model.layers.{i}.mlp.*` (dense MLP, gate, routed and shared experts)."""
    return Role.FFN if _MLP.match(name) else Role.ATTENTION


def expert_of(name: str) -> int | None:
    """Routed expert index of checkpoint tensor `name`
    (`model.layers.{i}.mlp.experts.{e}.*` -> e), or None for any other tensor
    (gate, shared experts, dense MLP, attention)."""
    match = _MLP.match(name)
    expert = _EXPERT.match(match.group(2)) if match else None
    return int(expert.group(1)) if expert else None


def ffn_layer_params(
    checkpoint: Path, num_layers: int | None = None, experts: Container[int] | None = None
) -> Iterator[tuple[int, str, torch.Tensor]]:
    """Yield `(layer, name within the layer's MLP, tensor)` for FFN-role tensors.

    Reads `*.safetensors` in `checkpoint` lazily: attention-role tensors, layers at
    or past `num_layers` (e.g. DeepSeek-V3's multi-token-prediction layer
    `model.layers.61`) and routed experts not in `experts` are never materialized.

    Args:
        num_layers: keep layers `[0, num_layers)`; None keeps all.
        experts: routed expert indices to keep; None keeps all. Gate, shared
            experts and dense MLPs are always kept.

    Raises:
        FileNotFoundError: no safetensors file in `checkpoint`.
    """
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                match = _MLP.match(name)
                if match is None:
                    continue
                layer = int(match.group(1))
                expert = expert_of(name)
                if (num_layers is None or layer < num_layers) and (
                    experts is None or expert is None or expert in experts
                ):
                    yield layer, match.group(2), f.get_tensor(name)
