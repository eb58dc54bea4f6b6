"""`afd_ray::remote_ffn`: the one hook model code calls at the FFN boundary.

An opaque custom op, so torch.compile traces around it (its fake returns `empty_like`)
and the A2F/F2A I/O never enters a Dynamo graph.
"""

from __future__ import annotations

import torch

from afd_ray.attention.ffn_client import ffn_client

__all__ = ["remote_ffn", "remote_moe"]


@torch.library.custom_op("afd_ray::remote_ffn", mutates_args=())
def remote_ffn(hidden: torch.Tensor, layer: int) -> torch.Tensor:
    """FFN of decoder layer `layer`, computed by the FFN pool.

    Args:
        hidden: post-attention-norm hidden states `[T, H]`, model dtype.
        layer: decoder layer index.

    Returns:
        `[T, H]`, same dtype and device: what the layer's MLP/MoE would return.
    """
    return ffn_client().exchange(hidden, layer)


@remote_ffn.register_fake
def _(hidden: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(hidden)


@torch.library.custom_op("afd_ray::remote_moe", mutates_args=())
def remote_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int) -> torch.Tensor:
    """MoE of decoder layer `layer` routed on the attention side (`gate_on_attention`).

    Args:
        hidden: post-attention-norm hidden states `[T, H]`, model dtype.
        topk_ids: chosen experts `[T, k]` int64.
        topk_weights: their routing weights `[T, k]` float32.
        layer: decoder layer index.

    Returns:
        `[T, H]`, same dtype and device: routed (and shared) experts' output.
    """
    return ffn_client().exchange(hidden, layer, (topk_ids, topk_weights))


@remote_moe.register_fake
def _(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(hidden)
