"""The hooks model code calls: `begin_ffn_step` at the start of a forward pass, and
`afd_ray::remote_ffn` / `afd_ray::remote_moe` at each FFN boundary.

The FFN ops are opaque custom ops, so torch.compile traces around them (their fake
returns `empty_like`) and the A2F/F2A I/O never enters a Dynamo graph.
`begin_ffn_step` is a plain call from the causal-LM `forward`, outside vLLM's
compiled decoder stack, so it runs on every forward pass.
"""

from __future__ import annotations

import torch

from afd_ray.attention.ffn_client import ffn_client

__all__ = ["begin_ffn_step", "remote_ffn", "remote_moe"]


def begin_ffn_step(num_tokens: int) -> None:
    """Announce a forward pass of `num_tokens` rows to the FFN peer (its STEP
    header); call once per forward pass, before the first decoder layer."""
    ffn_client().begin_step(num_tokens)


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
