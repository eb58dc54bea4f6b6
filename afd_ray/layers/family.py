"""The supported model families: the one registry, and what each family's config says
about its FFN layers.

`MODEL_FAMILIES` (at the end) maps a checkpoint's `model_type` to its `ModelFamily`:
the vLLM architecture the attention role serves it as, the AFD attention class, the
tiny test checkpoint builder and the FFN layout reader. Adding a family is adding an
entry there. The attention class and the tiny builder are lazy `module:attr` paths,
so this module imports neither `afd_ray.attention` nor `afd_ray.models`, nor torch.

The only place that reads family-specific config fields for the FFN role. Layer
placement and routing follow transformers 5.19 (`modeling_llama.py`,
`modeling_mixtral.py`, `modeling_qwen3_moe.py`, `modeling_deepseek_v2.py`,
`modeling_deepseek_v3.py`) and vLLM 0.32 (`models/mixtral.py`, `models/qwen3_moe.py`,
`models/deepseek_v2.py`); where the two differ, the note says which one is followed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from afd_ray.layers.spec import FFNLayout, MoEShape, RoutingSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["MODEL_FAMILIES", "ModelFamily", "ffn_layout"]


@dataclass(frozen=True)
class ModelFamily:
    """One supported model family: what each role runs for its checkpoints."""

    architecture: str
    """The transformers causal-LM class (`config.architectures`); vLLM knows the AFD
    attention class as `"AFD" + architecture` (`afd_ray.attention.plugin`)."""
    attention_class: str
    """The attention role's vLLM model class, `module:attr` (imported by vLLM)."""
    tiny_config: str | None
    """The tiny test checkpoint's config builder, `module:attr` of a function
    `(cuda_mla_heads: bool) -> PretrainedConfig` (`afd_ray.models.tiny`); None: the
    family has no tiny checkpoint."""
    layout: Callable[[PretrainedConfig], FFNLayout]
    """Reads the FFN layout from a config of this family (raises ValueError for
    routing settings the family's reference code does not define)."""


def ffn_layout(config: PretrainedConfig) -> FFNLayout:
    """The FFN layout of a transformers config.

    Raises:
        ValueError: unsupported `model_type` (the message names `model.source`), or
            routing settings this family's reference code does not define (see
            `RoutingSpec` for the checks).
    """
    family = MODEL_FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(
            f"model.source: FFN role does not support model_type {config.model_type!r}; "
            f"supported: {tuple(MODEL_FAMILIES)}"
        )
    return family.layout(config)


def _layout(config: PretrainedConfig, moe_layers: frozenset[int], moe: MoEShape | None) -> FFNLayout:
    return FFNLayout(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        moe_layers=moe_layers,
        moe=moe,
    )


def _llama(config: PretrainedConfig) -> FFNLayout:
    """LlamaDecoderLayer: every layer a dense MLP."""
    return _layout(config, frozenset(), None)


def _mixtral(config: PretrainedConfig) -> FFNLayout:
    """MixtralDecoderLayer: every layer is a sparse MoE of `intermediate_size` experts."""
    moe = MoEShape(_mixtral_routing(config), config.intermediate_size, 0)
    return _layout(config, frozenset(range(config.num_hidden_layers)), moe)


def _qwen3_moe(config: PretrainedConfig) -> FFNLayout:
    """Qwen3MoeDecoderLayer: MoE unless listed in mlp_only_layers, every decoder_sparse_step."""
    moe_layers = frozenset(
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    )
    moe = MoEShape(_qwen3_routing(config), config.moe_intermediate_size, 0) if moe_layers else None
    return _layout(config, moe_layers, moe)


def _deepseek_v2(config: PretrainedConfig) -> FFNLayout:
    return _deepseek(config, _deepseek_v2_routing(config))


def _deepseek_v3(config: PretrainedConfig) -> FFNLayout:
    return _deepseek(config, _deepseek_v3_routing(config))


def _deepseek(config: PretrainedConfig, routing: RoutingSpec) -> FFNLayout:
    """vLLM DeepseekV2DecoderLayer (V2 and V3): dense below `first_k_dense_replace`,
    then MoE every `moe_layer_freq` layers (transformers ignores moe_layer_freq, 1 in
    every released config), shared experts fused into one MLP."""
    freq = getattr(config, "moe_layer_freq", 1)
    moe_layers = frozenset(
        i for i in range(config.num_hidden_layers) if i >= config.first_k_dense_replace and i % freq == 0
    )
    shared = config.moe_intermediate_size * (config.n_shared_experts or 0)
    moe = MoEShape(routing, config.moe_intermediate_size, shared) if moe_layers else None
    return _layout(config, moe_layers, moe)


def _softmax_routing(num_experts: int, top_k: int, renormalize: bool) -> RoutingSpec:
    """Softmax top-k over all experts, gate in the model dtype (Mixtral's and Qwen3-MoE's routers)."""
    return RoutingSpec(
        num_experts=num_experts,
        top_k=top_k,
        scoring="softmax",
        num_groups=1,
        top_groups=1,
        group_score="max",
        correction_bias=False,
        renormalize=renormalize,
        scaling_factor=1.0,
        float32_logits=False,
    )


def _mixtral_routing(config: PretrainedConfig) -> RoutingSpec:
    """MixtralTopKRouter: always renormalized."""
    return _softmax_routing(config.num_local_experts, config.num_experts_per_tok, renormalize=True)


def _qwen3_routing(config: PretrainedConfig) -> RoutingSpec:
    """Qwen3MoeTopKRouter: renormalized when `norm_topk_prob`."""
    return _softmax_routing(config.num_experts, config.num_experts_per_tok, renormalize=config.norm_topk_prob)


def _deepseek_v2_routing(config: PretrainedConfig) -> RoutingSpec:
    """DeepseekV2TopkRouter: softmax; `group_limited_greedy` keeps the `topk_group`
    groups of highest max score. Scores in the logits' dtype, as vLLM computes them
    (`RoutingSpec.float32_scores`; transformers takes the softmax in float32).

    `norm_topk_prob=True` renormalizes before scaling, as vLLM does (transformers
    ignores it for V2; every released V2 config has it False). Gate logits:
    `_gate_logits_in_float32`.
    """
    method = config.topk_method
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2: unsupported topk_method {method!r}")
    if getattr(config, "scoring_func", "softmax") != "softmax":
        raise ValueError(f"deepseek_v2: unsupported scoring_func {config.scoring_func!r}")
    grouped = method == "group_limited_greedy"
    return RoutingSpec(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        scoring="softmax",
        num_groups=config.n_group if grouped else 1,
        top_groups=config.topk_group if grouped else 1,
        group_score="max",
        correction_bias=False,
        renormalize=bool(config.norm_topk_prob),
        scaling_factor=config.routed_scaling_factor,
        float32_logits=_gate_logits_in_float32(config),
        float32_scores=False,  # vLLM's grouped_topk: softmax in the logits' dtype
    )


def _deepseek_v3_routing(config: PretrainedConfig) -> RoutingSpec:
    """DeepseekV3TopkRouter (`noaux_tc`): float32 sigmoid, `e_score_correction_bias`
    for selection, groups ranked by the sum of their top-2 biased scores. Gate logits:
    `_gate_logits_in_float32`."""
    method = getattr(config, "topk_method", "noaux_tc")
    scoring = getattr(config, "scoring_func", "sigmoid")
    if (method, scoring) != ("noaux_tc", "sigmoid"):
        raise ValueError(f"deepseek_v3: unsupported topk_method/scoring_func {method!r}/{scoring!r}")
    return RoutingSpec(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        scoring="sigmoid",
        num_groups=config.n_group,
        top_groups=config.topk_group,
        group_score="top2_sum",
        correction_bias=True,
        renormalize=bool(config.norm_topk_prob),
        scaling_factor=config.routed_scaling_factor,
        float32_logits=_gate_logits_in_float32(config),
    )


def _gate_logits_in_float32(config: PretrainedConfig) -> bool:
    """Whether a DeepSeek gate computes its logits in float32: only where the config
    asks for it (`moe_router_dtype: float32`), as vLLM's `DeepseekV2MoE` does (its
    `GateLinear` gets `out_dtype` from `_get_moe_router_dtype`, vLLM 0.26 and 0.32);
    otherwise in the model dtype. transformers computes them in float32 always, but
    the reference of the disaggregated model is the engine it replaces: in bfloat16
    the rounding of the logits alone moved a tiny DeepSeek-V3's top-k choice and its
    greedy tokens against plain vLLM (H200, 2026-12-02: 82 of 96 positions equal)."""
    return getattr(config, "moe_router_dtype", None) == "float32"


MODEL_FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {
        "llama": ModelFamily(
            "LlamaForCausalLM",
            "afd_ray.attention.models.llama:AFDLlamaForCausalLM",
            "afd_ray.models.tiny:llama_config",
            _llama,
        ),
        "mixtral": ModelFamily(
            "MixtralForCausalLM",
            "afd_ray.attention.models.mixtral:AFDMixtralForCausalLM",
            None,  # tested with the embedded `smollm2-moe` (afd_ray.models.embedded)
            _mixtral,
        ),
        "qwen3_moe": ModelFamily(
            "Qwen3MoeForCausalLM",
            "afd_ray.attention.models.qwen3_moe:AFDQwen3MoeForCausalLM",
            "afd_ray.models.tiny:qwen3_moe_config",
            _qwen3_moe,
        ),
        "deepseek_v2": ModelFamily(
            "DeepseekV2ForCausalLM",
            "afd_ray.attention.models.deepseek:AFDDeepseekV2ForCausalLM",
            "afd_ray.models.tiny:deepseek_v2_config",
            _deepseek_v2,
        ),
        "deepseek_v3": ModelFamily(
            "DeepseekV3ForCausalLM",
            "afd_ray.attention.models.deepseek:AFDDeepseekV3ForCausalLM",
            "afd_ray.models.tiny:deepseek_v3_config",
            _deepseek_v3,
        ),
    }
)
"""`model_type` -> its family: the one list of supported families."""
