"""What every AFD attention-role model shares: the layer body around `remote_ffn`,
the causal-LM plumbing, and the attention-role weight filter."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from vllm.model_executor.models.utils import AutoWeightsLoader
from vllm.sequence import IntermediateTensors

from afd_ray.attention.ffn_op import remote_ffn
from afd_ray.weights import Role, role_of

__all__ = ["AFDCausalLM", "AFDDecoderLayer", "attention_weights"]


def attention_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The attention-role `(name, tensor)` pairs of a checkpoint stream (`role_of`)."""
    return ((name, tensor) for name, tensor in weights if role_of(name) is Role.ATTENTION)


class AFDDecoderLayer(nn.Module):
    """A decoder layer whose FFN half runs on the FFN pool.

    Subclasses build `self_attn`, `input_layernorm`, `post_attention_layernorm` (vLLM
    fused-residual RMSNorms) and set `layer_idx`; `self_attn(positions=, hidden_states=)`
    maps `[T, H] -> [T, H]`.
    """

    layer_idx: int

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
        return remote_ffn(hidden_states, self.layer_idx), residual


class AFDCausalLM(nn.Module):
    """vLLM causal-LM plumbing over `self.model` (embeddings, layers, norm), `self.lm_head`
    and `self.logits_processor`, loading attention-role tensors only."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load attention-role tensors only; FFN-role tensors are skipped unread."""
        return AutoWeightsLoader(self).load_weights(attention_weights(weights))
