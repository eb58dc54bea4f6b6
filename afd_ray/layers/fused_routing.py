"""MoE routing with vLLM's fused top-k kernels (CUDA): the kernels plain vLLM's router runs.

vLLM picks its router by the layer's routing (`create_fused_moe_router`, 0.26 and 0.32):
- softmax, no groups, no correction bias (Qwen3-MoE, Mixtral): `FusedTopKRouter`, one
  `topk_softmax` kernel (softmax in float32, top-k, optional renormalization);
- sigmoid with `e_score_correction_bias` and groups (DeepSeek-V3): `GroupedTopKRouter`,
  which runs the fused `grouped_topk` kernel (`VLLM_USE_FUSED_MOE_GROUPED_TOPK`, on by
  default) when groups and k are at most 32;
- DeepSeek-V2's softmax `grouped_topk` without a bias runs as torch operations in vLLM
  too (`Router` computes it the same way), so it has no fused kernel here.

`fused_routing` returns None where none applies (not CUDA, another routing, vLLM or its
CUDA kernels missing, or under torch.compile, as in the attention role's compiled model
with `gate_on_attention`, where Inductor fuses the torch operations instead): the caller
then computes the routing with torch. vLLM is imported
on first use only, so CPU workers never load it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from afd_ray.layers.spec import RoutingSpec

__all__ = ["fused_routing"]

_MAX_FUSED_GROUPED = 32
"""vLLM's bound on groups and k for its fused grouped top-k kernel (`grouped_topk`)."""


@functools.cache
def _kernels() -> tuple[Callable[..., tuple[torch.Tensor, ...]], Callable[..., tuple[torch.Tensor, ...]]] | None:
    """vLLM's `fused_topk` and `fused_grouped_topk`, or None where vLLM or its CUDA
    kernels (`vllm._moe_C`) are missing."""
    try:
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
        from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import fused_grouped_topk

        torch.ops._moe_C.topk_softmax  # noqa: B018 (raises where the CUDA kernels are not built)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return fused_topk, fused_grouped_topk


def _kind(spec: RoutingSpec) -> str | None:
    """Which fused kernel computes `spec`'s routing: `topk_softmax`, `grouped_topk` or None."""
    if spec.scoring == "softmax" and spec.num_groups == 1 and not spec.correction_bias and spec.float32_scores:
        return "topk_softmax"
    if (
        spec.scoring == "sigmoid"
        and spec.correction_bias
        and spec.group_score == "top2_sum"
        and spec.num_groups <= _MAX_FUSED_GROUPED
        and spec.top_k <= _MAX_FUSED_GROUPED
    ):
        return "grouped_topk"
    return None


def fused_routing(
    spec: RoutingSpec,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-k experts and weights of `logits` with vLLM's fused kernel, or None.

    Args:
        spec: the layer's routing.
        hidden: `[T, H]` the rows routed (only its device and T are read).
        logits: `[T, E]` gate logits, float32 or the model dtype.
        correction_bias: `[E]` float32 `e_score_correction_bias` (DeepSeek-V3), or None.

    Returns:
        ids `[T, k]` int64 and weights `[T, k]` float32 (renormalized if
        `spec.renormalize`, times `spec.scaling_factor`), as `Router`'s torch path
        computes them up to the float32 rounding of the sum; None where no fused kernel
        applies (`hidden` not on CUDA, a routing without one, vLLM missing, under
        torch.compile).
    """
    kind = _kind(spec)
    applies = kind is not None and hidden.is_cuda and not torch.compiler.is_compiling()
    kernels = _kernels() if applies else None
    if kernels is None:
        return None
    fused_topk, fused_grouped_topk = kernels
    if kind == "topk_softmax":
        weights, ids, _ = fused_topk(hidden, logits, spec.top_k, spec.renormalize)
        if spec.scaling_factor != 1.0:
            weights = weights * spec.scaling_factor
    else:
        weights, ids = fused_grouped_topk(
            hidden,
            logits,
            spec.top_k,
            spec.renormalize,
            correction_bias,
            num_expert_group=spec.num_groups,
            topk_group=spec.top_groups,
            scoring_func="sigmoid",
            routed_scaling_factor=spec.scaling_factor,
        )
    return ids.long(), weights.float()
