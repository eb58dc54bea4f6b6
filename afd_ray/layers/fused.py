"""The routed experts of a whole MoE layer with vLLM's fused MoE kernels (CUDA).

vLLM's `fused_experts` (Triton: `moe_align_block_size`, then one grouped GEMM per
projection over expert-sorted rows, the gated activation and the weighted sum of the
k rows of each token) is what plain vLLM runs for unquantized MoE layers, so the FFN
role computes with the same kernels as the colocated engine. It runs no host
synchronization, so it can be captured in a CUDA graph (`afd_ray.ffn.graphs`).

vLLM is imported on first use only: CPU FFN workers never load it, and on CPU
`Experts.forward` (torch grouped GEMMs) computes the layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["fused_experts_applies", "fused_moe"]

_ACTIVATIONS = ("silu", "gelu")
"""transformers `hidden_act` names that vLLM's `MoEActivation` has under the same name
(gated: `act(gate) * up`)."""
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _kernel() -> Callable[..., torch.Tensor] | None:
    """vLLM's `fused_experts`, or None where vLLM or its Triton kernels are missing."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return None
    return fused_experts if HAS_TRITON else None


def fused_experts_applies(hidden: torch.Tensor, hidden_act: str) -> bool:
    """Whether `fused_moe` can compute the routed experts of `hidden` `[T, H]`: a CUDA
    tensor of float32/float16/bfloat16, a gated SiLU or GELU MLP, and vLLM's fused MoE
    kernels importable."""
    return hidden.is_cuda and hidden.dtype in _DTYPES and hidden_act in _ACTIVATIONS and _kernel() is not None


def fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    hidden_act: str,
) -> torch.Tensor:
    """`sum_j weights[t, j] * expert[ids[t, j]](hidden[t])` for every token t.

    Args:
        hidden: `[T, H]` CUDA, model dtype.
        gate_up: `[E, 2I, H]` model dtype, rows `[:I]` gate, `[I:]` up (vLLM's `w13`).
        down: `[E, H, I]` model dtype (vLLM's `w2`).
        ids: `[T, k]` int64 or int32 global expert ids in `[0, E)`.
        weights: `[T, k]` float32 routing weights.
        hidden_act: `silu` or `gelu` (`fused_experts_applies`).

    Returns:
        `[T, H]` in the dtype of `hidden`.

    Raises:
        NotImplementedError: vLLM's fused MoE kernels are not available here.
    """
    kernel = _kernel()
    if kernel is None:
        raise NotImplementedError("vLLM's fused MoE kernels (Triton) are not available")
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return kernel(
        hidden,
        gate_up,
        down,
        weights.to(torch.float32),
        ids.to(torch.int32),
        activation=MoEActivation(hidden_act),
    )
