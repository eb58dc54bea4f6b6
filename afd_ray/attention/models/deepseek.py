"""AFD DeepSeek-V2/V3 for vLLM: MLA attention, norms, embeddings and LM head; no MoE.

Every decoder layer, the `first_k_dense_replace` dense ones included, computes
`post_attention_layernorm(attn(x) + residual)` and hands it to `ffn_op.remote_ffn`,
which returns what the layer's MoE block (gate, routed experts times
`routed_scaling_factor`, plus shared experts) or dense MLP would have. The class
builds no gate, experts or expert-parallel state, and loads no `mlp.*` tensors (see
`afd_ray.weights.role_of`).

From vLLM's `deepseek_v2.py` only the attention modules are reused
(`DeepseekV2MLAAttention`, or `DeepseekV2Attention` when MLA is off). Its
`DeepseekV2Model` hard-codes `DeepseekV2DecoderLayer`, which builds `DeepseekV2MoE`
(`FusedMoEFactory`, EP group) for MoE layers, and its `load_weights` is built around the
fused-MoE expert mapping; `DeepseekV2ForCausalLM` implements `MixtureOfExperts`. So
the model body and a small attention-only loader live here.

Not supported (the constructor says so): DeepSeek-V3.2 sparse attention (`index_topk`,
needs the indexer's top-k buffer) and `llama_4_scaling` configs.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader, maybe_remap_kv_scale_name
from vllm.model_executor.models.deepseek_v2 import DeepseekV2Attention, DeepseekV2MLAAttention
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    get_spec_layer_idx_from_weight_name,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

from afd_ray.attention.models.base import AFDCausalLM, AFDDecoderLayer

__all__ = ["AFDDeepseekV2ForCausalLM", "AFDDeepseekV3ForCausalLM"]

_STACKED = (
    # (vLLM parameter, checkpoint name, shard): MLA with a q LoRA fuses the two
    # down-projections of the layer input into one GEMM.
    ("fused_qkv_a_proj", "q_a_proj", 0),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
)


class AFDDeepseekV2DecoderLayer(AFDDecoderLayer):
    """vLLM's DeepSeek-V2/V3 decoder layer with the MoE/MLP replaced by the remote FFN hook."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.layer_idx = extract_layer_index(prefix)
        attn_cls = DeepseekV2MLAAttention if vllm_config.model_config.use_mla else DeepseekV2Attention
        self.self_attn = attn_cls(
            vllm_config=vllm_config,
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=getattr(config, "q_lora_rank", None),
            kv_lora_rank=config.kv_lora_rank,
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.self_attn",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.routed_scaling_factor: float = getattr(config, "routed_scaling_factor", 1.0)
        self._build_ffn_half(vllm_config)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states, residual: `[T, H]` -> (FFN output `[T, H]`, residual `[T, H]`)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, None)
        fp16 = hidden_states.dtype == torch.float16
        if fp16:
            # vLLM's FP16 overflow guard: the residual stream is carried divided by
            # `routed_scaling_factor` (RMSNorm's output is unchanged by the scale).
            hidden_states *= 1.0 / self.routed_scaling_factor
            if self.layer_idx == 0:
                residual *= 1.0 / self.routed_scaling_factor
        out, residual = self._post_attention(hidden_states, residual)  # [T, H] each
        if fp16 and self._moe_parts is None:
            # The FFN returns the true block output; vLLM's FP16 path (DeepseekV2MoE,
            # DeepseekV2MLP) returns it divided by the factor, to match the residual.
            # A split MoE output is already combined as vLLM's (`combine_moe_parts`).
            out = out * (1.0 / self.routed_scaling_factor)
        return out, residual


# Explicit dims: this module's annotations are strings (`from __future__ import
# annotations`), which the decorator cannot read. The token dimension is dynamic.
@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class AFDDeepseekV2Model(nn.Module):
    """Embeddings, AFD decoder layers and the final norm (pipeline-parallel aware)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        if hasattr(config, "index_topk"):
            raise ValueError("model.source: DeepSeek-V3.2 sparse attention (index_topk) has no AFD class yet")
        if getattr(config, "llama_4_scaling", None) is not None:
            raise ValueError("model.source: DeepSeek configs with llama_4_scaling have no AFD class yet")
        self.config = config
        pp = get_pp_group()
        self.embed_tokens = (
            VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.embed_tokens",
            )
            if pp.is_first_rank
            else PPMissingLayer()
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AFDDeepseekV2DecoderLayer(vllm_config, prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load this model's tensors (names relative to `model.`); returns those loaded.

        The caller has already dropped FFN-role tensors. Multi-token-prediction layers
        (`layers.{num_hidden_layers + i}`) belong to the draft model and are skipped.
        """
        # Buffers too: with gate_on_attention, DeepSeek-V3's router keeps its
        # `e_score_correction_bias` as a buffer.
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded: set[str] = set()
        for name, weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if get_spec_layer_idx_from_weight_name(self.config, f"model.{name}") is not None:
                continue
            for param_name, ckpt_name, shard in _STACKED:
                fused = name.replace(ckpt_name, param_name)
                if ckpt_name in name and fused in params:
                    if not is_pp_missing_parameter(fused, self):
                        params[fused].weight_loader(params[fused], weight, shard)
                        loaded.add(fused)
                    break
            else:
                if name.endswith(".bias") and name not in params:
                    continue  # GPTQ checkpoints ship biases the layers do not have
                name = maybe_remap_kv_scale_name(name, params)
                if name is None or is_pp_missing_parameter(name, self):
                    continue
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
                loaded.add(name)
        return loaded


class AFDDeepseekV2ForCausalLM(AFDCausalLM, SupportsPP):
    """Attention role of a DeepSeek-V2 checkpoint (`architectures: [AFDDeepseekV2ForCausalLM]`)."""

    packed_modules_mapping = {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = AFDDeepseekV2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = (
            ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            if get_pp_group().is_last_rank
            else PPMissingLayer()
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM):
    """Attention role of a DeepSeek-V3 checkpoint: the same model body as V2 (the
    differences, q LoRA and sigmoid routing, are in the config and on the FFN side)."""
