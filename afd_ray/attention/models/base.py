"""What every AFD attention-role model shares: the layer body around the FFN boundary,
the causal-LM plumbing, and the attention-role weight filter.

Gate placement reaches model code as one config attribute, `afd_gate_on_attention`
(set through vLLM's `hf_overrides`). With it, MoE layers route on the attention side
and call `remote_moe` with the top-k ids and weights, and dense MLP layers run
locally; otherwise every layer calls `remote_ffn`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import AutoWeightsLoader
from vllm.sequence import IntermediateTensors

from afd_ray.attention.ffn_op import begin_ffn_step, remote_ffn, remote_moe
from afd_ray.ffn.family import ffn_layout
from afd_ray.ffn.mlp import GatedMLP
from afd_ray.ffn.routing import Router
from afd_ray.weights import Role, ffn_block_prefix, role_of

__all__ = ["GATE_ON_ATTENTION", "AFDCausalLM", "AFDDecoderLayer", "attention_weights"]

GATE_ON_ATTENTION = "afd_gate_on_attention"
"""Config attribute (via `hf_overrides`) that selects `gate_on_attention`."""


def _gate_on_attention(config: PretrainedConfig) -> bool:
    return bool(getattr(config, GATE_ON_ATTENTION, False))


def attention_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The attention-role `(name, tensor)` pairs of a checkpoint stream (`role_of`
    under the model's gate placement)."""
    on_attention = _gate_on_attention(config)
    moe_layers = ffn_layout(config).moe_layers if on_attention else frozenset()
    return ((n, t) for n, t in weights if role_of(n, on_attention, moe_layers) is Role.ATTENTION)


class _AttentionGate(nn.Module):
    """An MoE layer's router on the attention side, named like the checkpoint's
    `<block>.gate.*`."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.gate = router


class AFDDecoderLayer(nn.Module):
    """A decoder layer whose FFN half runs on the FFN pool.

    Subclasses build `self_attn`, `input_layernorm`, `post_attention_layernorm` (vLLM
    fused-residual RMSNorms), set `layer_idx` and call `_build_ffn_half`;
    `self_attn(positions=, hidden_states=)` maps `[T, H] -> [T, H]`.
    """

    layer_idx: int

    def _build_ffn_half(self, vllm_config: VllmConfig) -> None:
        """With `gate_on_attention`: this layer's router (MoE layer) or dense MLP, under
        the checkpoint's FFN block name (`mlp` / `block_sparse_moe`)."""
        config = vllm_config.model_config.hf_config
        self._local_block: str | None = None
        if not _gate_on_attention(config):
            return
        layout = ffn_layout(config)
        dtype = vllm_config.model_config.dtype
        if self.layer_idx in layout.moe_layers:
            block: nn.Module = _AttentionGate(Router(layout.moe.routing, layout.hidden_size, dtype))
        else:
            block = GatedMLP(layout.hidden_size, layout.intermediate_size, layout.hidden_act, layout.mlp_bias, dtype)
        self._local_block = ffn_block_prefix(config.model_type)
        setattr(self, self._local_block, block)

    def _ffn(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's FFN of post-attention-norm `hidden` `[T, H]` -> `[T, H]`."""
        if self._local_block is None:
            return remote_ffn(hidden, self.layer_idx)
        block = getattr(self, self._local_block)
        if isinstance(block, GatedMLP):
            return block(hidden)
        routing = block.gate(hidden)  # ids [T, k] int64, weights [T, k] float32
        return remote_moe(hidden, routing.ids, routing.weights, self.layer_idx)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states, residual: `[T, H]` -> (FFN output `[T, H]`, residual `[T, H]`)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self._ffn(hidden_states), residual


class AFDCausalLM(nn.Module):
    """vLLM causal-LM plumbing over `self.model` (embeddings, layers, norm), `self.lm_head`,
    `self.logits_processor` and `self.config`, loading attention-role tensors only."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        begin_ffn_step(positions.shape[-1])  # positions: [T] ([3, T] with M-RoPE)
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load attention-role tensors only; FFN-role tensors are skipped unread."""
        return AutoWeightsLoader(self).load_weights(attention_weights(weights, self.config))
