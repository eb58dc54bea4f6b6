"""AFD Llama for vLLM: attention, norms, embeddings and LM head; no MLP.

Each decoder layer computes `post_attention_layernorm(attn(x) + residual)` and hands it
to `ffn_op.remote_ffn`, which returns what the layer's MLP would have. The class
creates no MLP modules and loads no MLP weights (see `afd_ray.weights.role_of`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.llama import LlamaAttention, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index
from vllm.sequence import IntermediateTensors

from afd_ray.attention.ffn_op import begin_ffn_step
from afd_ray.attention.model_state import AFDModelState
from afd_ray.attention.models.base import AFDDecoderLayer, attention_weights

__all__ = ["AFDLlamaForCausalLM"]


class AFDLlamaDecoderLayer(AFDDecoderLayer):
    """vLLM's Llama decoder layer with the MLP replaced by the remote FFN hook."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.layer_idx = extract_layer_index(prefix)
        attention_bias = getattr(config, "attention_bias", False) or getattr(config, "bias", False)
        self.self_attn = LlamaAttention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            quant_config=vllm_config.quant_config,
            bias=getattr(config, "qkv_bias", attention_bias),
            bias_o_proj=attention_bias,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._build_ffn_half(vllm_config)


class AFDLlamaForCausalLM(LlamaForCausalLM):
    """Attention role of a Llama-family checkpoint (`architectures: [AFDLlamaForCausalLM]`)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=AFDLlamaDecoderLayer)

    @staticmethod
    def get_model_state_cls() -> type[AFDModelState]:
        """vLLM's per-model runner state (model runner V2): announces whole-step graph replays."""
        return AFDModelState

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        begin_ffn_step(positions.shape[-1])  # positions: [T]
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load attention-role tensors only; FFN-role tensors are skipped unread."""
        return super().load_weights(attention_weights(weights, self.config))
