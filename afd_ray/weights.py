"""Which role owns which checkpoint tensor, and loading one role's tensors.

This is the only place that decides weight ownership (DESIGN §2): the attention role
loads embeddings, norms, attention and the LM head; the FFN role loads the MLP of
every decoder layer. Both read the same checkpoint folder and filter by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["Role", "ffn_layer_params", "role_of"]

_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")


class Role(Enum):
    """The two halves of a disaggregated decoder layer."""

    ATTENTION = "attention"
    FFN = "ffn"


def role_of(name: str) -> Role:
    """Role that owns checkpoint tensor `name` (Hugging Face naming)."""
    return Role.FFN if _MLP.match(name) else Role.ATTENTION


def ffn_layer_params(checkpoint: Path) -> Iterator[tuple[int, str, torch.Tensor]]:
    """Yield `(layer, name within the layer's MLP, tensor)` for every FFN-role tensor.

    Reads `*.safetensors` in `checkpoint` lazily; attention-role tensors are never
    materialized.

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
                if match:
                    yield int(match.group(1)), match.group(2), f.get_tensor(name)
