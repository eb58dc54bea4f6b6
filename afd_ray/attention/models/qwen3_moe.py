"""AFD Qwen3-MoE for vLLM: attention (q/k norm), norms, embeddings and LM head; no MoE.

Each decoder layer computes `post_attention_layernorm(attn(x) + residual)` and hands it
to `ffn_op.remote_ffn`, which returns what the layer's sparse MoE block (or dense MLP,
for `mlp_only_layers`) would have. The class builds no gate, no experts and no
expert-parallel state, and loads no `mlp.*` tensors (see `afd_ray.weights.role_of`).

vLLM's `Qwen3MoeForCausalLM` is not a base class here: its `__init__` requires at least
one `Qwen3MoeSparseMoeBlock` (it raises otherwise) and it implements `MixtureOfExperts`,
which makes the engine treat the model as holding experts (EPLB metadata, expert maps).
`Qwen3MoeModel` (embeddings, layers, norm, weight loading) and `Qwen3MoeAttention` are
reused as they are.
"""

from __future__ import annotations


from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeModel
from vllm.model_executor.models.utils import extract_layer_index, maybe_prefix

from afd_ray.attention.models.base import AFDCausalLM, AFDDecoderLayer

__all__ = ["AFDQwen3MoeForCausalLM"]


class AFDQwen3MoeDecoderLayer(AFDDecoderLayer):
    """vLLM's Qwen3-MoE decoder layer with the MoE/MLP replaced by the remote FFN hook."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.layer_idx = extract_layer_index(prefix)
        self.self_attn = Qwen3MoeAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters=config.rope_parameters,
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=getattr(config, "attention_bias", False),
            head_dim=getattr(config, "head_dim", None),
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.self_attn",
            dual_chunk_attention_config=getattr(config, "dual_chunk_attention_config", None),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._build_ffn_half(vllm_config)


class AFDQwen3MoeForCausalLM(AFDCausalLM, SupportsPP):
    """Attention role of a Qwen3-MoE checkpoint (`architectures: [AFDQwen3MoeForCausalLM]`)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = Qwen3MoeModel(
            vllm_config=vllm_config,
            prefix=maybe_prefix(prefix, "model"),
            decoder_layer_type=AFDQwen3MoeDecoderLayer,
        )
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
