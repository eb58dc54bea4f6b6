"""What each supported model family's config says about its FFN layers.

The only place that reads family-specific config fields for the FFN role. Layer
placement and routing follow transformers 5.19 (`modeling_llama.py`,
`modeling_mixtral.py`, `modeling_qwen3_moe.py`, `modeling_deepseek_v2.py`,
`modeling_deepseek_v3.py`) and vLLM 0.32 (`models/mixtral.py`, `models/qwen3_moe.py`,
`models/deepseek_v2.py`); where the two differ, the note says which one is followed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from afd_ray.ffn.routing import RoutingSpec

__all__ = ["FFNLayout", "MoEShape", "SUPPORTED_MODEL_TYPES", "ffn_layout"]

SUPPORTED_MODEL_TYPES = ("llama", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MoEShape:
    """Sizes of an MoE layer's experts."""

    routing: RoutingSpec
    intermediate_size: int
    """Width of one routed expert (`moe_intermediate_size`)."""
    shared_intermediate_size: int
    """Width of the shared experts fused into one MLP (`moe_intermediate_size *
    n_shared_experts`); 0 = none."""

    def split_output(self, compiled: bool) -> bool:
        """Whether the FFN role returns this layer's output as its parts (F2A `[T, P,
        H]`, `output_parts`) instead of their sum (`[T, H]`), for attention engines
        that run torch.compile (`compiled`) or eager.

        Why: vLLM's MoE layer (`MoERunner.forward`, 0.26 and 0.32) returns the routed
        experts' output and the shared experts' output from its opaque fused-MoE op,
        each in the model dtype, then computes `routed * routed_scaling_factor +
        shared` as elementwise torch ops. Compiled, inductor fuses them into the next
        layer's residual add and RMSNorm, so that sum is never rounded to the model
        dtype; eager, every op rounds. A compiled AFD attention engine gets the same
        kernel by doing these ops itself after the FFN boundary
        (`afd_ray.attention.models.base.combine_moe_parts`). Only layers with such ops
        split: with shared experts or a routed scaling factor other than 1.
        """
        return compiled and (self.shared_intermediate_size > 0 or self.routing.scaling_factor != 1.0)

    @property
    def output_parts(self) -> int:
        """P of a split output `[T, P, H]`: the routed experts' output (routing
        weights not yet scaled), then, if the layer has them, the shared experts'."""
        return 2 if self.shared_intermediate_size else 1

    def routing_of(self, split_output: bool) -> RoutingSpec:
        """The routing that yields the routed part: with a split output the weights
        are not scaled (the attention side scales the output, as vLLM does)."""
        return replace(self.routing, scaling_factor=1.0) if split_output else self.routing


@dataclass(frozen=True)
class FFNLayout:
    """The FFN blocks of every decoder layer of one checkpoint."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    """Width of the dense MLP layers."""
    hidden_act: str
    mlp_bias: bool
    """Whether dense MLPs and shared experts have biases (routed experts never do)."""
    moe_layers: frozenset[int]
    """Layers whose FFN is an MoE; the others are dense MLPs."""
    moe: MoEShape | None
    """Sizes of the MoE layers; None for a dense model."""


def ffn_layout(config: PretrainedConfig) -> FFNLayout:
    """The FFN layout of a transformers config.

    Raises:
        ValueError: unsupported `model_type`, or routing settings this family's
            reference code does not define (see `RoutingSpec` for the checks).
    """
    kind = config.model_type
    layers = range(config.num_hidden_layers)
    if kind == "llama":
        moe_layers, moe = frozenset(), None
    elif kind == "mixtral":
        # MixtralDecoderLayer: every layer is a sparse MoE of `intermediate_size` experts.
        moe_layers = frozenset(layers)
        moe = MoEShape(_mixtral_routing(config), config.intermediate_size, 0)
    elif kind == "qwen3_moe":
        # Qwen3MoeDecoderLayer: MoE unless listed in mlp_only_layers, every decoder_sparse_step.
        moe_layers = frozenset(
            i
            for i in layers
            if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
        )
        moe = MoEShape(_qwen3_routing(config), config.moe_intermediate_size, 0) if moe_layers else None
    elif kind in ("deepseek_v2", "deepseek_v3"):
        # vLLM DeepseekV2DecoderLayer; transformers ignores moe_layer_freq (1 in every released config).
        freq = getattr(config, "moe_layer_freq", 1)
        moe_layers = frozenset(i for i in layers if i >= config.first_k_dense_replace and i % freq == 0)
        routing = _deepseek_v2_routing(config) if kind == "deepseek_v2" else _deepseek_v3_routing(config)
        shared = config.moe_intermediate_size * (config.n_shared_experts or 0)
        moe = MoEShape(routing, config.moe_intermediate_size, shared) if moe_layers else None
    else:
        raise ValueError(
            f"model.source: FFN role does not support model_type {kind!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    return FFNLayout(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        moe_layers=moe_layers,
        moe=moe,
    )


def _mixtral_routing(config: PretrainedConfig) -> RoutingSpec:
    """MixtralTopKRouter: softmax top-k, always renormalized, gate in the model dtype."""
    return RoutingSpec(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        scoring="softmax",
        num_groups=1,
        top_groups=1,
        group_score="max",
        correction_bias=False,
        renormalize=True,
        scaling_factor=1.0,
        float32_logits=False,
    )


def _qwen3_routing(config: PretrainedConfig) -> RoutingSpec:
    """Qwen3MoeTopKRouter: softmax top-k, gate in the model dtype."""
    return RoutingSpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        scoring="softmax",
        num_groups=1,
        top_groups=1,
        group_score="max",
        correction_bias=False,
        renormalize=config.norm_topk_prob,
        scaling_factor=1.0,
        float32_logits=False,
    )


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
